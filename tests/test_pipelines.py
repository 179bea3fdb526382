"""The schedulers inside stock diffusers pipelines (tiny random Wan 2.1/2.2 and Flux, no downloads)."""

import json
import math

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image
from tiny import flux_embeds, tiny_flux_pipeline, tiny_wan_i2v_pipeline, tiny_wan_pipeline, wan_embeds

from rcm_diffusers import RCMScheduler, TrigFlowEulerScheduler, TrigFlowUniPCScheduler

SPEC_RF_4 = [0.98765, 0.93378, 0.85289, 0.60898]
WAN_KW = dict(height=16, width=16, num_frames=5, output_type="latent")


class CallRecorder:
    """Forward pre-hook that records the transformer's inputs."""

    def __init__(self, module):
        self.calls = []
        self.handle = module.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.calls.append({k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()})

    def remove(self):
        self.handle.remove()


def _rf(t):
    return math.sin(t) / (math.sin(t) + math.cos(t))


def test_wan_official_sampler_exact():
    """4 steps, guidance 1, time_input="float": 4 calls at 1000*r_i, first input r_0*noise, output = float64
    docs/math.md §2.1 loop. (The default bf16 time input against the official loop: tests/test_official_parity.py.)"""
    pipe = tiny_wan_pipeline()
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config, time_input="float")
    pipe.scheduler.set_generator(torch.Generator().manual_seed(7))
    noise = torch.randn(1, 4, 2, 2, 2, generator=torch.Generator().manual_seed(3))
    embeds = wan_embeds()
    rec = CallRecorder(pipe.transformer)
    out = pipe(
        prompt_embeds=embeds,
        num_inference_steps=4,
        guidance_scale=1.0,
        latents=pipe.scheduler.scale_initial_noise(noise),
        **WAN_KW,
    ).frames
    rec.remove()
    assert len(rec.calls) == 4
    seen_t = torch.stack([c["timestep"][0] for c in rec.calls]).double()
    assert torch.allclose(seen_t, 1000 * torch.tensor(SPEC_RF_4, dtype=torch.float64), atol=1e-2)
    r = [_rf(a) for a in [math.atan(80.0), 1.5, 1.4, 1.0]] + [0.0]
    assert torch.allclose(rec.calls[0]["hidden_states"].double(), r[0] * noise.double(), atol=1e-7)

    # plain float64 loop of docs/math.md §2.1 with the same transformer, noise and fresh-noise generator
    g = torch.Generator().manual_seed(7)
    x = r[0] * noise.double()
    with torch.no_grad():
        for i in range(4):
            v = pipe.transformer(
                hidden_states=x.float(),
                timestep=torch.tensor([1000 * r[i]]),
                encoder_hidden_states=embeds,
                return_dict=False,
            )[0].double()
            x0 = x - r[i] * v
            if r[i + 1] > 0:
                x = (1 - r[i + 1]) * x0 + r[i + 1] * torch.randn(x.shape, generator=g, dtype=torch.float32).double()
            else:
                x = x0
    assert torch.allclose(out.double(), x, atol=1e-5, rtol=1e-5)


def test_wan_seed_reproduces_sample():
    pipe = tiny_wan_pipeline()
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config)
    embeds = wan_embeds()

    def run(seed):
        return pipe(
            prompt_embeds=embeds,
            num_inference_steps=4,
            guidance_scale=1.0,
            generator=torch.Generator().manual_seed(seed),
            **WAN_KW,
        ).frames

    a, b, c = run(0), run(0), run(1)
    # same seed, same sample (float32 round-off allowed: no bit-tight comparison of two model runs)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert not torch.allclose(a, c)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_wan_rcm_step_counts_and_decode(n):
    pipe = tiny_wan_pipeline()
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config, stochastic=(n % 2 == 0))
    rec = CallRecorder(pipe.transformer)
    video = pipe(
        prompt_embeds=wan_embeds(),
        num_inference_steps=n,
        guidance_scale=1.0,
        height=16,
        width=16,
        num_frames=5,
        output_type="np",
    ).frames
    assert len(rec.calls) == n
    assert video.shape == (1, 5, 16, 16, 3) and np.isfinite(video).all()


def test_wan_rcm_with_cfg_calls_twice_per_step():
    pipe = tiny_wan_pipeline()
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config)
    rec = CallRecorder(pipe.transformer)
    pipe(
        prompt_embeds=wan_embeds(),
        negative_prompt_embeds=wan_embeds(seed=9),
        num_inference_steps=2,
        guidance_scale=3.0,
        **WAN_KW,
    )
    assert len(rec.calls) == 4


def test_wan_pipeline_bad_step_count_is_clear():
    pipe = tiny_wan_pipeline()
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config)
    with pytest.raises(ValueError, match="num_inference_steps=4"):
        pipe(prompt_embeds=wan_embeds(), guidance_scale=1.0, **WAN_KW)  # the pipeline's default is 50 steps


def _image():
    return Image.fromarray((np.random.default_rng(0).random((16, 16, 3)) * 255).astype("uint8"))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_wan21_i2v_rcm(n):
    pipe = tiny_wan_i2v_pipeline()
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config, sigma_max=200.0)
    rec = CallRecorder(pipe.transformer)
    out = pipe(image=_image(), prompt_embeds=wan_embeds(), num_inference_steps=n, guidance_scale=1.0, **WAN_KW).frames
    assert len(rec.calls) == n and torch.isfinite(out).all()
    assert rec.calls[0]["encoder_hidden_states_image"] is not None
    assert float(rec.calls[0]["timestep"][0]) == 996.0  # bf16(1000 * 200/201 = 995.02)


def test_wan22_two_experts_boundary_switch():
    pipe = tiny_wan_i2v_pipeline(two_experts=True)
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config, sigma_max=200.0)
    high, low = CallRecorder(pipe.transformer), CallRecorder(pipe.transformer_2)
    pipe(image=_image(), prompt_embeds=wan_embeds(), num_inference_steps=4, guidance_scale=1.0, **WAN_KW)
    # RF times 0.995, 0.934 >= boundary 0.9 -> high-noise expert; 0.853, 0.609 -> low-noise expert (bf16-rounded)
    assert [float(c["timestep"][0]) for c in high.calls] == [996.0, 932.0]
    assert [float(c["timestep"][0]) for c in low.calls] == [852.0, 608.0]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_flux_rcm(n):
    pipe = tiny_flux_pipeline()
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config)
    rec = CallRecorder(pipe.transformer)
    pe, pp = flux_embeds()
    img = pipe(
        prompt_embeds=pe,
        pooled_prompt_embeds=pp,
        num_inference_steps=n,
        height=16,
        width=16,
        guidance_scale=1.0,
        output_type="np",
    ).images
    assert len(rec.calls) == n and np.isfinite(img).all() and img.shape == (1, 16, 16, 3)
    # FluxPipeline divides timesteps by 1000: the transformer sees bf16(1000 r) / 1000 (time_input "bf16")
    expected = [
        float(torch.tensor(1000 * _rf(a)).to(torch.bfloat16)) / 1000 for a in [math.atan(80.0), 1.5, 1.4, 1.0][:n]
    ]
    assert [float(c["timestep"][0]) for c in rec.calls] == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("cls", [TrigFlowEulerScheduler, TrigFlowUniPCScheduler])
def test_teacher_schedulers_in_pipelines(cls):
    pipe = tiny_wan_pipeline()
    pipe.scheduler = cls.from_config(pipe.scheduler.config)
    rec = CallRecorder(pipe.transformer)
    out = pipe(
        prompt_embeds=wan_embeds(),
        negative_prompt_embeds=wan_embeds(seed=9),
        num_inference_steps=4,
        guidance_scale=5.0,
        **WAN_KW,
    ).frames
    assert len(rec.calls) == 8 and torch.isfinite(out).all()
    assert float(rec.calls[0]["timestep"][0]) == pytest.approx(1000 * 5000 / 5001, abs=1e-2)

    fpipe = tiny_flux_pipeline()
    fpipe.scheduler = cls.from_config(fpipe.scheduler.config)
    frec = CallRecorder(fpipe.transformer)
    pe, pp = flux_embeds()
    img = fpipe(
        prompt_embeds=pe, pooled_prompt_embeds=pp, num_inference_steps=3, height=16, width=16, output_type="np"
    ).images
    assert len(frec.calls) == 3 and np.isfinite(img).all()
    assert float(frec.calls[0]["timestep"][0]) == pytest.approx(5000 / 5001, abs=1e-5)


def test_pipeline_save_load_names_rcm_diffusers(tmp_path):
    pipe = tiny_wan_pipeline()
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config, sigma_max=200.0, mid_t=[1.3, 0.9])
    pipe.save_pretrained(tmp_path / "p")
    index = json.loads((tmp_path / "p" / "model_index.json").read_text())
    assert index["scheduler"] == ["rcm_diffusers", "RCMScheduler"]
    loaded = DiffusionPipeline.from_pretrained(tmp_path / "p", text_encoder=None, tokenizer=None)
    assert isinstance(loaded.scheduler, RCMScheduler)
    assert loaded.scheduler.sigma_max == 200.0 and list(loaded.scheduler.config.mid_t) == [1.3, 0.9]
    assert loaded.scheduler.config.flow_shift == 3.0
    out = loaded(prompt_embeds=wan_embeds(), num_inference_steps=3, guidance_scale=1.0, **WAN_KW).frames
    assert torch.isfinite(out).all()

    plain = tiny_wan_pipeline()
    plain.save_pretrained(tmp_path / "q")
    swapped = DiffusionPipeline.from_pretrained(
        tmp_path / "q", scheduler=RCMScheduler(sigma_max=120.0), text_encoder=None, tokenizer=None
    )
    assert isinstance(swapped.scheduler, RCMScheduler) and swapped.scheduler.sigma_max == 120.0
    swapped.scheduler.set_timesteps(2)
    assert swapped.scheduler.rf_times[0] == pytest.approx(120 / 121, abs=1e-12)


# ----------------------------------------------------------------------------- generator lists

# float32 round-off of O(1) latents over <= 4 steps; a broken per-sample contract changes samples by O(1)
PER_SAMPLE_ATOL = 1e-5


def _wan_batch(pipe, gens, **kw):
    return pipe(prompt_embeds=wan_embeds(), num_inference_steps=4, generator=gens, **WAN_KW, **kw).frames


@pytest.mark.parametrize(
    "layout",
    [
        dict(num_videos_per_prompt=2, guidance_scale=1.0),
        dict(num_videos_per_prompt=2, guidance_scale=3.0, negative_prompt_embeds=wan_embeds(seed=9)),
    ],
    ids=["per-prompt", "cfg"],
)
@pytest.mark.parametrize("stochastic", [True, False])
def test_wan_sample_i_depends_only_on_generator_i(layout, stochastic):
    pipe = tiny_wan_pipeline()
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config, stochastic=stochastic)

    def g(seed):
        return torch.Generator().manual_seed(seed)

    a = _wan_batch(pipe, [g(0), g(1)], **layout)
    b = _wan_batch(pipe, [g(0), g(5)], **layout)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=PER_SAMPLE_ATOL)
    assert (a[1] - b[1]).abs().max() > 0.1
    # sample 0 of the batch is the single-sample run with generator 0
    single_layout = {**layout, "num_videos_per_prompt": 1}
    single = _wan_batch(pipe, [g(0)], **single_layout)
    torch.testing.assert_close(a[0], single[0], rtol=0, atol=PER_SAMPLE_ATOL)
    # one generator for the batch: same seed, same samples
    torch.testing.assert_close(_wan_batch(pipe, g(3), **layout), _wan_batch(pipe, g(3), **layout), rtol=0, atol=1e-6)


def test_flux_sample_i_depends_only_on_generator_i():
    pipe = tiny_flux_pipeline()
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config)
    pe, pp = flux_embeds()

    def run(seeds):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return pipe(
            prompt_embeds=pe,
            pooled_prompt_embeds=pp,
            num_inference_steps=4,
            height=16,
            width=16,
            guidance_scale=1.0,
            num_images_per_prompt=len(seeds),
            generator=gens,
            output_type="latent",
        ).images

    a, b, single = run([0, 1]), run([0, 5]), run([0])
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=PER_SAMPLE_ATOL)
    torch.testing.assert_close(a[0], single[0], rtol=0, atol=PER_SAMPLE_ATOL)
    assert (a[1] - b[1]).abs().max() > 0.1


# ----------------------------------------------------------------------------- step times reach the transformer
# (item 4)


@pytest.mark.parametrize("cls", [RCMScheduler, TrigFlowEulerScheduler, TrigFlowUniPCScheduler])
def test_flux_per_call_sigmas_reach_the_transformer(cls):
    pipe = tiny_flux_pipeline()
    pipe.scheduler = cls.from_config(pipe.scheduler.config)
    pe, pp = flux_embeds()
    rec = CallRecorder(pipe.transformer)
    pipe(
        prompt_embeds=pe,
        pooled_prompt_embeds=pp,
        sigmas=[0.9, 0.6, 0.3],
        height=16,
        width=16,
        guidance_scale=1.0,
        output_type="latent",
    )
    # 900, 600, 300 are exact in bf16, so every time_input gives the given RF times
    assert [float(c["timestep"][0]) for c in rec.calls] == pytest.approx([0.9, 0.6, 0.3], abs=1e-6)


def test_wan_config_times_reach_the_transformer():
    """Explicit RF times through the config (Wan pipelines call set_timesteps(n) themselves)."""
    from rcm_diffusers.sampling import rcm_config_for_rf_times

    times = [0.95, 0.8, 0.5]
    for pipe, kw in ((tiny_wan_pipeline(), {}), (tiny_wan_i2v_pipeline(), {"image": _image()})):
        pipe.scheduler = RCMScheduler.from_config(
            pipe.scheduler.config, time_input="float", **rcm_config_for_rf_times(times)
        )
        rec = CallRecorder(pipe.transformer)
        pipe(prompt_embeds=wan_embeds(), num_inference_steps=3, guidance_scale=1.0, **WAN_KW, **kw)
        assert [float(c["timestep"][0]) for c in rec.calls] == pytest.approx([950.0, 800.0, 500.0], abs=1e-3)
    # two experts: mid_t in the config, each expert gets its side of the boundary (0.9)
    pipe = tiny_wan_i2v_pipeline(two_experts=True)
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config, sigma_max=200.0, mid_t=[1.3, 0.9])
    high, low = CallRecorder(pipe.transformer), CallRecorder(pipe.transformer_2)
    pipe(image=_image(), prompt_embeds=wan_embeds(), num_inference_steps=3, guidance_scale=1.0, **WAN_KW)
    expect = [float(torch.tensor(1000 * _rf(a)).to(torch.bfloat16)) for a in (math.atan(200.0), 1.3, 0.9)]
    assert [float(c["timestep"][0]) for c in high.calls] == expect[:1]
    assert [float(c["timestep"][0]) for c in low.calls] == expect[1:]


def test_set_timesteps_before_a_pipeline_call_is_refused():
    """pipe.scheduler.set_timesteps(sigmas=...) would be overwritten by the pipeline's own call: refused."""
    pipe = tiny_wan_pipeline()
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config)
    pipe.scheduler.set_timesteps(sigmas=[0.9, 0.5])
    with pytest.raises(ValueError, match="replaced before any step"):
        pipe(prompt_embeds=wan_embeds(), num_inference_steps=2, guidance_scale=1.0, **WAN_KW)


def test_from_pretrained_needs_import_rcm_diffusers(tmp_path):
    """README's sequence: a saved pipeline naming rcm_diffusers loads once ``import rcm_diffusers`` ran."""
    import subprocess
    import sys
    import textwrap

    pipe = tiny_wan_pipeline()
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config)
    pipe.save_pretrained(tmp_path / "p")
    script = textwrap.dedent(f"""
        from diffusers import DiffusionPipeline
        try:
            DiffusionPipeline.from_pretrained({str(tmp_path / "p")!r}, text_encoder=None, tokenizer=None)
            print("LOADED-WITHOUT-IMPORT")
        except Exception as e:
            print("REFUSED-WITHOUT-IMPORT", type(e).__name__)
        import rcm_diffusers
        p = DiffusionPipeline.from_pretrained({str(tmp_path / "p")!r}, text_encoder=None, tokenizer=None)
        print("LOADED", type(p.scheduler).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert "LOADED RCMScheduler" in out.stdout, out.stderr[-2000:]
    # from 0.42 diffusers will not import a library because a repository names it; before, it imported it itself
    import diffusers
    from packaging.version import Version

    before = "REFUSED-WITHOUT-IMPORT" if Version(diffusers.__version__) >= Version("0.42") else "LOADED-WITHOUT-IMPORT"
    assert before in out.stdout, out.stdout
