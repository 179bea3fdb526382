"""Official-timestep parity: RCMScheduler inside diffusers pipelines equals the official rCM sampling loop.

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

from rcm_diffusers import RCMScheduler

from tiny import tiny_wan_i2v_pipeline, tiny_wan_pipeline, wan_embeds

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
            x = (1 - t_next) * (x - t_cur * v) + t_next * torch.randn(*x.shape, dtype=torch.float32, generator=generator)
    return x.float()


def _pipe_run(pipe, sigma_max, n, ode, time_input="bf16", **call):
    g = torch.Generator().manual_seed(2024)
    noise = torch.randn(*SHAPE, generator=g, dtype=torch.float32)
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config, sigma_max=sigma_max, stochastic=not ode, time_input=time_input)
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
    from PIL import Image
    import numpy as np

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
            return lambda x, ts: tr(hidden_states=torch.cat([x, cond["c"]], 1), timestep=ts, encoder_hidden_states=embeds,
                                    return_dict=False)[0]

        ref = _official_ref(noise, 200.0, n, ode, make(pipe.transformer), low_net=make(pipe.transformer_2), boundary=0.9)
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
