"""Official parity: RCMScheduler inside diffusers pipelines equals the official rCM sampling loop; the dCM step and the
fixed-angle backward simulation equal the official training step (section at the end).

The reference below is our own re-implementation of the loop in NVlabs/rcm
``rcm/inference/wan2pt1_t2v_rcm_infer.py`` (``__main__``: TrigFlow angles ``[atan(sigma_max), *mid_t, 0]``
mapped to RF times, ``x = r_0 noise`` in float64, the network fed ``(t_cur.float() * ones * 1000)`` cast to
bfloat16, stochastic update ``(1 - t_next)(x - t_cur v) + t_next randn(generator)``) and of the two-expert
loop in ``rcm/inference/wan2pt2_i2v_rcm_infer.py`` (``--ode``: ``x - (t_cur - t_next) v``; the low-noise
expert from the first ``t_cur < boundary`` on, compared on the float64 RF time). The official script runs
the network in bfloat16; here the tiny network runs in float32 in both loops, so the only differences
left are the float32 storage of the pipeline's latents between steps (round-off ~1e-7 of values ~1).
"""

import math

import pytest
import torch
from tiny import tiny_wan_i2v_pipeline, tiny_wan_pipeline, wan_embeds

from rcm_diffusers import RCMScheduler

WAN_KW = dict(height=16, width=16, num_frames=5, output_type="latent")
SHAPE = (2, 4, 2, 2, 2)  # two samples, Wan latents [B, C, T, H, W] of a 5-frame 16x16 video


def official_loop(net, noise, generator, sigma_max, num_steps, ode=False, low_net=None, boundary=None):
    """The official rCM sampling loop (see module docstring); ``net(x, timesteps_B) -> v``."""
    mid_t = [1.5, 1.4, 1.0][: num_steps - 1]
    t_steps = torch.tensor([math.atan(sigma_max), *mid_t, 0], dtype=torch.float64)
    t_steps = torch.sin(t_steps) / (torch.cos(t_steps) + torch.sin(t_steps))
    x = noise.to(torch.float64) * t_steps[0]
    ones = torch.ones(x.size(0), 1, dtype=x.dtype)
    switched = False
    for t_cur, t_next in zip(t_steps[:-1], t_steps[1:]):
        if low_net is not None and t_cur.item() < boundary and not switched:
            net, switched = low_net, True
        timesteps_b_t = (t_cur.float() * ones * 1000).to(torch.bfloat16)
        v = net(x.to(torch.float32), timesteps_b_t[:, 0].to(torch.float32)).to(torch.float64)
        if ode:
            x = x - (t_cur - t_next) * v
        else:
            x = (1 - t_next) * (x - t_cur * v) + t_next * torch.randn(
                *x.shape, dtype=torch.float32, generator=generator
            )
    return x.float()


def _pipe_run(pipe, sigma_max, n, ode, time_input="bf16", **call):
    g = torch.Generator().manual_seed(2024)
    noise = torch.randn(*SHAPE, generator=g, dtype=torch.float32)
    pipe.scheduler = RCMScheduler.from_config(
        pipe.scheduler.config, sigma_max=sigma_max, stochastic=not ode, time_input=time_input
    )
    pipe.scheduler.set_timesteps(n)
    pipe.scheduler.set_generator(g)  # the official loop draws the fresh noise from the initial-noise generator
    latents = pipe.scheduler.scale_initial_noise(noise)
    with torch.no_grad():
        out = pipe(num_inference_steps=n, guidance_scale=1.0, latents=latents, **WAN_KW, **call).frames
    return out, noise


def _official_ref(noise, sigma_max, n, ode, net, **kw):
    g = torch.Generator().manual_seed(2024)
    torch.randn(*SHAPE, generator=g, dtype=torch.float32)  # the initial noise, as the official script draws it
    with torch.no_grad():
        return official_loop(net, noise, g, sigma_max, n, ode, **kw)


@pytest.mark.parametrize("sigma_max", [80.0, 200.0])
@pytest.mark.parametrize("ode", [False, True], ids=["stochastic", "ode"])
def test_wan_pipeline_equals_official_loop(sigma_max, ode):
    pipe = tiny_wan_pipeline()
    embeds = wan_embeds(batch=2)

    def net(x, ts):
        return pipe.transformer(hidden_states=x, timestep=ts, encoder_hidden_states=embeds, return_dict=False)[0]

    for n in (1, 2, 3, 4):
        out, noise = _pipe_run(pipe, sigma_max, n, ode, prompt_embeds=embeds)
        ref = _official_ref(noise, sigma_max, n, ode, net)
        err = (out - ref).abs().max().item()
        assert err <= 1e-6, (n, err)
        if n == 4:
            # the exact float time input is measurably off the official trajectory (so the check above can fail)
            out_f, _ = _pipe_run(pipe, sigma_max, n, ode, time_input="float", prompt_embeds=embeds)
            assert (out_f - ref).abs().max().item() > 1e-3


@pytest.mark.parametrize("ode", [False, True], ids=["stochastic", "ode"])
def test_wan22_two_expert_pipeline_equals_official_loop(ode):
    """Wan 2.2 I2V, boundary 0.9, sigma_max 200: the pipeline's switch on the rounded timesteps picks the same
    expert as the official switch on the float64 RF times, and the samples agree."""
    import numpy as np
    from PIL import Image

    pipe = tiny_wan_i2v_pipeline(two_experts=True)
    embeds = wan_embeds(batch=2)
    image = Image.fromarray((np.random.default_rng(0).random((16, 16, 3)) * 255).astype("uint8"))
    cond = {}

    def grab(module, args, kwargs):
        cond.setdefault("c", kwargs["hidden_states"][:, 4:].clone())  # mask + first-frame latents the pipeline adds

    h = pipe.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    for n in (1, 2, 3, 4):
        out, noise = _pipe_run(pipe, 200.0, n, ode, prompt_embeds=embeds, image=image)

        def make(tr):
            return lambda x, ts: tr(
                hidden_states=torch.cat([x, cond["c"]], 1), timestep=ts, encoder_hidden_states=embeds, return_dict=False
            )[0]

        ref = _official_ref(
            noise, 200.0, n, ode, make(pipe.transformer), low_net=make(pipe.transformer_2), boundary=0.9
        )
        err = (out - ref).abs().max().item()
        assert err <= 1e-6, (n, err)
    h.remove()


@pytest.mark.parametrize("sigma_max", [80.0, 120.0, 200.0])
@pytest.mark.parametrize("boundary", [0.875, 0.9])
def test_rounded_timesteps_pick_the_official_expert(sigma_max, boundary):
    """diffusers switches on ``timestep >= boundary_ratio * 1000`` (rounded times), the official code on the
    float64 RF time ``r >= boundary``: the same expert for every default grid of 1-4 steps."""
    for n in (1, 2, 3, 4):
        s = RCMScheduler(sigma_max=sigma_max)
        s.set_timesteps(n)
        diffusers_high = (s.timesteps >= boundary * 1000).tolist()
        official_high = [not (r < boundary) for r in s.rf_times[:-1]]
        assert diffusers_high == official_high, (n, s.timesteps.tolist())


# ----------------------------------------------------------------------------- training: dCM and fixed-angle DMD
#
# The references below are written from the official training step, NVlabs/rcm ``rcm/models/t2v_model_distill_rcm.py``:
# ``denoise`` (``RectifiedFlow_TrigFlowWrapper`` in ``rcm/utils/denoiser_scaling.py``:
# c_skip = c_in = 1 / (cos t + sin t), c_out = -sin t / (cos t + sin t), c_noise = 1000 sin t / (cos t + sin t);
# x0 = c_skip x + c_out net(c_in x, c_noise), F = (cos t x - x0) / sin t), ``_student_dcm_step``
# (grid ``s_k = 1 - (u + k du)``, ``du = 1 / dcm_total_steps``, ``u ~ U[0, 1 - dcm_skipping_interval_steps du)``,
# ``shift_rf_time`` / ``rf_to_trig_time`` of ``rcm/utils/timestep_utils.py``, guided teacher Euler steps, target = the
# student's x0 at the last angle without gradient, per-sample ``loss_scale * sum (x0_pred - x0_target)^2``, summed
# over the batch by the official trainer) and ``backward_simulation`` with ``dmd_fix_timesteps`` (angles
# ``[pi/2, *backward_timesteps[:n - 1], 0]``, the student's x0 re-noised with fresh noise between calls, gradient on
# the last call only). Everything runs in float64 on tiny Wan transformers.

F64 = torch.float64


def _tiny_wan64(seed):
    from train_helpers import tiny_wan_transformer

    m = tiny_wan_transformer().double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=F64))
    return m


def _official_denoise(net, x, t, ehs):
    """``(x0, F)`` of the official ``denoise`` for a per-sample angle ``t`` ``[B]``."""
    tb = t.reshape(-1, 1, 1, 1, 1)
    c, s = torch.cos(tb), torch.sin(tb)
    c_skip, c_out, c_in = 1 / (c + s), -s / (c + s), 1 / (c + s)
    c_noise = (torch.sin(t) / (torch.cos(t) + torch.sin(t))) * 1000.0
    out = net(hidden_states=x * c_in, timestep=c_noise, encoder_hidden_states=ehs, return_dict=False)[0]
    x0 = c_skip * x + c_out * out
    return x0, (c * x - x0) / s


def _official_dcm_loss(student, teacher, x0, eps, u, ehs_c, ehs_u, total, skip, shift, guidance, loss_scale):
    du = 1.0 / total
    trig = []
    for k in range(skip + 1):
        s_k = 1.0 - (u + k * du)
        rf = shift * s_k / (1 + (shift - 1) * s_k) if shift > 0 else s_k
        rf = rf.clamp(min=0.0, max=1.0 - torch.finfo(rf.dtype).eps)
        trig.append(torch.arctan(rf / (1 - rf)))
    t0 = trig[0].reshape(-1, 1, 1, 1, 1)
    xt = torch.cos(t0) * x0 + torch.sin(t0) * eps
    x0_pred, _ = _official_denoise(student, xt, trig[0], ehs_c)
    with torch.no_grad():
        xk = xt
        for k in range(skip):
            F_c = _official_denoise(teacher, xk, trig[k], ehs_c)[1]
            F_u = _official_denoise(teacher, xk, trig[k], ehs_u)[1]
            xk = xk - (trig[k] - trig[k + 1]).reshape(-1, 1, 1, 1, 1) * (F_u + guidance * (F_c - F_u))
        target = _official_denoise(student, xk, trig[skip], ehs_c)[0]
    return (loss_scale * ((x0_pred - target) ** 2).sum(dim=(1, 2, 3, 4))).sum()


@pytest.mark.parametrize(
    "total,skip,shift,guidance", [(48, 1, 5.0, 5.0), (8, 3, 3.0, 2.5)], ids=["official-defaults", "skip3"]
)
def test_dcm_loss_and_gradients_equal_the_official_step(total, skip, shift, guidance):
    """``trainer.student_step`` with ``cm_type dcm`` (full mode, float64, ``loss_reduction sum``, ``scm_weight`` = the
    official ``loss_scale`` 100): the back-propagated loss and the student's gradients equal the official dCM step's on
    the same ``eps`` and ``u`` (drawn in the trainer's order: ``eps``, then ``u``)."""
    from types import SimpleNamespace

    from rcm_diffusers.distill import terms as T
    from rcm_diffusers.distill.adapters import Networks
    from rcm_diffusers.distill.alternation import StepPlan

    nets, trainable = Networks.build(_tiny_wan64(1), "full", with_fake=False, time_input="float")
    with torch.no_grad():  # the student starts off the teacher, so the teacher's steps and the student's target differ
        for p in trainable["student"].parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=F64))
    cfg = SimpleNamespace(
        cm_type="dcm",
        scm_weight=100.0,
        dmd_weight=0.0,
        dcm_total_steps=total,
        dcm_skipping_interval_steps=skip,
        dcm_timestep_shift=shift,
        guidance_scale=guidance,
        loss_reduction="sum",
    )
    g = torch.Generator().manual_seed(7)
    x0 = torch.randn(3, 4, 1, 4, 4, generator=g, dtype=F64)
    ehs_c, ehs_u = torch.randn(3, 3, 16, generator=g, dtype=F64), torch.zeros(3, 3, 16, dtype=F64)
    losses = []

    def backward(loss, last):
        losses.append(loss.detach())
        loss.backward()

    logs = T.student_step(
        nets,
        x0,
        {"encoder_hidden_states": ehs_c},
        {"encoder_hidden_states": ehs_u},
        StepPlan(i=0, student=True, student_eff=0, fake_eff=0, dmd=False, n_sim=1),
        cfg,
        torch.Generator().manual_seed(11),
        backward,
    )
    ours = {n: p.grad.clone() for n, p in trainable["student"].named_parameters()}

    g = torch.Generator().manual_seed(11)
    eps = torch.randn(x0.shape, generator=g, dtype=F64)
    u = torch.rand(3, generator=g, dtype=F64) * (1.0 - skip / total)
    student = trainable["student"]
    student.zero_grad(set_to_none=True)
    ref = _official_dcm_loss(
        student, nets.modules["teacher"], x0, eps, u.reshape(-1), ehs_c, ehs_u, total, skip, shift, guidance, 100.0
    )
    ref.backward()
    assert len(losses) == 1 and "loss_dcm" in logs and "loss_scm" not in logs
    ref = ref.detach()
    rel = abs(float(losses[0]) - float(ref)) / float(ref)
    assert rel < 1e-10, (float(losses[0]), float(ref))
    gmax = max(
        float((ours[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30))
        for n, p in student.named_parameters()
        if p.grad is not None and p.grad.abs().max() > 0
    )
    assert gmax < 1e-8, gmax
    assert sum(p.grad.abs().sum() for p in student.parameters() if p.grad is not None) > 0
    # the check can fail: another shift changes the loss
    student.zero_grad(set_to_none=True)
    other = _official_dcm_loss(
        student, nets.modules["teacher"], x0, eps, u, ehs_c, ehs_u, total, skip, shift + 1, guidance, 100.0
    )
    assert abs(float(other.detach()) - float(ref)) / float(ref) > 1e-4
    print(f"dCM parity total={total} skip={skip}: loss rel err {rel:.2e}, grad max rel err {gmax:.2e}")


def _official_fixed_backward_simulation(student, shape, n, backward_timesteps, ehs, generator):
    x = torch.randn(shape, generator=generator, dtype=F64)
    B = shape[0]
    t_traj = [torch.full((B,), math.pi / 2, dtype=F64)] + [
        torch.full((B,), float(a), dtype=F64) for a in backward_timesteps[: n - 1]
    ]
    t_traj.append(0 * t_traj[-1])
    for step, (t_cur, t_next) in enumerate(zip(t_traj[:-1], t_traj[1:])):
        with torch.enable_grad() if step == n - 1 else torch.no_grad():
            x = _official_denoise(student, x, t_cur, ehs)[0]
        if step < n - 1:
            tn = t_next.reshape(-1, 1, 1, 1, 1)
            x = torch.cos(tn) * x + torch.sin(tn) * torch.randn(shape, generator=generator, dtype=F64)
    return x, torch.stack(t_traj[:-1])


def test_fixed_angle_backward_simulation_follows_the_official_trajectory():
    """``losses.backward_simulation`` with ``fixed_angles`` (what ``dmd_fix_timesteps`` passes) equals the official
    trajectory for n = 1..4 on the same noise; the gradient reaches the student through the last call only."""
    from types import SimpleNamespace

    from rcm_diffusers.distill import losses as L
    from rcm_diffusers.distill import terms as T
    from rcm_diffusers.distill.adapters import Networks

    nets, trainable = Networks.build(_tiny_wan64(3), "full", with_fake=False, time_input="float")
    ehs = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0), dtype=F64)
    bt = T.backward_angles(SimpleNamespace(dmd_fix_timesteps=True, backward_timesteps=[1.5, 1.4, 1.0]))
    assert T.backward_angles(SimpleNamespace(dmd_fix_timesteps=False, backward_timesteps=[1.5, 1.4, 1.0])) is None
    shape = (2, 4, 1, 4, 4)
    errs = []
    for n in (1, 2, 3, 4):
        G, angles = L.backward_simulation(
            nets.x0_fn("student", {"encoder_hidden_states": ehs}),
            shape,
            n,
            generator=torch.Generator().manual_seed(n),
            fixed_angles=bt,
        )
        ref, ref_angles = _official_fixed_backward_simulation(
            trainable["student"], shape, n, bt, ehs, torch.Generator().manual_seed(n)
        )
        assert torch.equal(angles, ref_angles)
        errs.append(float((G - ref).detach().abs().max()))
        assert errs[-1] < 1e-12, (n, errs[-1])
        assert G.requires_grad
        # drawn angles (dmd_fix_timesteps false) give another trajectory from n = 2 on
        if n > 1:
            G_drawn, a = L.backward_simulation(
                nets.x0_fn("student", {"encoder_hidden_states": ehs}),
                shape,
                n,
                generator=torch.Generator().manual_seed(n),
            )
            assert not torch.equal(a, ref_angles) and (G_drawn - ref).detach().abs().max() > 1e-3
    print(f"fixed-angle backward simulation parity: max abs err {max(errs):.2e}")
