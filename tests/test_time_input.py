"""The network's time input (``rcm_diffusers.models.network_timestep``): exact float or rounded to
bfloat16 as the official rCM code feeds it.

Reference: NVlabs/rcm ``rcm/inference/wan2pt1_t2v_rcm_infer.py`` (sampling loop: the network gets
``(t_cur * 1000).to(bfloat16)``) and ``rcm/models/t2v_model_distill_rcm.py`` ``denoise`` /
``student_F_withT`` (training: ``c_noise = 1000 r`` cast to the bf16 tensor kwargs, its JVP tangent too).
"""

import pytest
import torch

from rcm_diffusers.models import network_timestep, velocity_fn
from rcm_diffusers.sampling import rcm_rf_times


def test_official_4step_times_round_to_the_official_values():
    r = torch.tensor(rcm_rf_times(4, sigma_max=80.0)[:-1], dtype=torch.float64)
    ts = network_timestep(r, 1000.0, "bf16")
    assert ts.tolist() == [988.0, 932.0, 852.0, 608.0]  # the values the official sampler feeds
    exact = network_timestep(r, 1000.0, "float")
    torch.testing.assert_close(exact, r * 1000, rtol=0, atol=0)
    assert ts.dtype == torch.float64


def test_rounding_is_a_cast_under_jvp_and_bad_mode_refused():
    r = torch.tensor([0.3, 0.7], dtype=torch.float32)
    out, tangent = torch.func.jvp(lambda x: network_timestep(x, 1000.0, "bf16"), (r,), (torch.ones_like(r),))
    assert out.tolist() == [300.0, 700.0]
    # the tangent 1000 passes through the same bf16 cast (1000 is exact in bf16)
    assert tangent.tolist() == [1000.0, 1000.0]
    with pytest.raises(ValueError, match="time_input"):
        network_timestep(r, 1000.0, "fp16")


def test_velocity_fn_feeds_the_rounded_timestep_to_wan():
    from tests.tiny import tiny_wan_transformer

    tr = tiny_wan_transformer()
    seen = []
    tr.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"].clone()), with_kwargs=True)
    x = torch.randn(1, tr.config.in_channels, 1, 4, 4)
    emb = torch.randn(1, 8, tr.config.text_dim)
    r = torch.tensor([0.9337809], dtype=torch.float64)
    velocity_fn(tr, "bf16")(x, r, encoder_hidden_states=emb)
    velocity_fn(tr, "float")(x, r, encoder_hidden_states=emb)
    assert seen[0].item() == 932.0
    assert abs(seen[1].item() - 933.7809) < 1e-9
    with pytest.raises(ValueError, match="time_input"):
        velocity_fn(tr, "half")


def test_flux_rounds_1000r_like_the_scheduler():
    """Flux takes r (x1000 inside): bf16 rounds 1000 r, the value RCMScheduler hands it through FluxPipeline."""
    r = torch.tensor([0.98765432, 0.6089], dtype=torch.float32)
    ts = network_timestep(r, 1.0, "bf16")
    sched_ts = (r.double() * 1000).to(torch.bfloat16).float()  # RCMScheduler.timesteps
    torch.testing.assert_close(ts, sched_ts / 1000, rtol=0, atol=0)  # FluxPipeline passes timesteps / 1000


def _recorded_times(transformer):
    seen = []
    h = transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.append(float((a[1] if len(a) > 1 else kw["timestep"])[0])), with_kwargs=True
    )
    return seen, h


@pytest.mark.parametrize("time_input", ["bf16", "float"])
def test_package_samplers_feed_the_trained_time(time_input):
    """digits.sample_student and trainer.sample_student: the network sees the time it was trained with."""
    from rcm_diffusers import digits as D
    from rcm_diffusers.distill.adapters import Networks
    from rcm_diffusers.distill.previews import sample_student
    from rcm_diffusers.sampling import rcm_rf_times
    from tests.tiny import tiny_wan_transformer

    r = rcm_rf_times(4, 80.0)[:-1]
    expect = network_timestep(torch.tensor(r), 1000.0, time_input).tolist()
    tr = D.build_teacher()
    emb = D.init_class_embeddings().detach()
    seen, h = _recorded_times(tr)
    D.sample_student(tr, emb, torch.arange(3), steps=4, seed=0, time_input=time_input)
    h.remove()
    assert seen == pytest.approx(expect, rel=0, abs=1e-4)

    wan = tiny_wan_transformer()
    nets, _ = Networks.build(wan, "shared", with_fake=False, lora_rank=4, time_input=time_input)
    seen, h = _recorded_times(wan)
    cond = {"encoder_hidden_states": torch.randn(1, 8, wan.config.text_dim)}
    sample_student(nets, cond, (1, wan.config.in_channels, 1, 4, 4), 4, 80.0, torch.Generator().manual_seed(0), "cpu")
    h.remove()
    assert seen == pytest.approx(expect, rel=0, abs=1e-4)


def test_comfy_sample_rcm_feeds_rounded_time_and_matches_the_scheduler():
    """comfy.sample_rcm(time_input="bf16"): the denoiser is called at bf16(1000 r)/1000 and the samples equal
    RCMScheduler(time_input="bf16") on the same velocity model and noise (float64 arithmetic, round-off only)."""
    from rcm_diffusers import RCMScheduler, comfy

    def v_model(x, t1000):  # a smooth nonlinear velocity of the latents and the time the network sees
        return torch.sin(x) * (t1000 / 1000.0) + 0.1 * x

    seen = []

    def denoiser(x, sigma, **kw):  # ComfyUI CONST model: x0 = x - sigma v(x, 1000 sigma)
        seen.append(float(sigma[0]))
        return x - sigma.reshape(-1, 1, 1, 1) * v_model(x, 1000 * sigma.reshape(-1, 1, 1, 1))

    g = torch.Generator().manual_seed(0)
    noise = torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64)
    fresh = [torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    for ode in (False, True):
        seen.clear()
        it = iter(fresh)
        sch = RCMScheduler(stochastic=not ode)
        sch.set_timesteps(4)
        x0_in = sch.scale_initial_noise(noise)
        out = comfy.sample_rcm(
            denoiser,
            x0_in.clone(),
            torch.from_numpy(sch.rf_times),
            disable=True,
            stochastic=not ode,
            noise_sampler=lambda a, b: next(it),
            time_input="bf16",
        )
        assert [1000 * s for s in seen] == pytest.approx([988.0, 932.0, 852.0, 608.0], abs=1e-9)
        it = iter(fresh)
        x = x0_in.clone()
        for k, ts in enumerate(sch.timesteps):
            v = v_model(x, ts.double())
            x = sch.step(v, ts, x).prev_sample if ode or k == 3 else _step_with_noise(sch, v, ts, x, next(it))
        torch.testing.assert_close(out, x, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="time_input"):
        comfy.sample_rcm(denoiser, noise, torch.from_numpy(sch.rf_times), disable=True, time_input="fp16")


def _step_with_noise(sch, v, ts, x, noise):
    """One RCMScheduler step whose fresh noise is ``noise`` (the comfy sampler's noise_sampler draw)."""
    sch._fresh_noise = lambda sample, generator: noise
    return sch.step(v, ts, x).prev_sample
