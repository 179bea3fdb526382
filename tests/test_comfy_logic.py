"""Logic of the ComfyUI nodes (rcm_diffusers.comfy), without ComfyUI: docs/math.md §2.1/§2.2 numbers."""

import math
import os
import re
import sys

import numpy as np
import pytest
import torch

from rcm_diffusers import comfy

SPEC_4STEP = [0.98765, 0.93378, 0.85289, 0.60898, 0.0]


# ----------------------------------------------------------------------------- sigmas


def test_rcm_sigmas_equal_spec_numbers():
    s = comfy.rcm_sigmas(4)
    assert s.dtype == torch.float32 and s.shape == (5,)
    np.testing.assert_allclose(s.numpy(), SPEC_4STEP, atol=1e-5, rtol=0)
    assert abs(float(s[0]) - 80 / 81) < 1e-7


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_rcm_sigmas_fewer_steps_are_prefixes_plus_zero(steps):
    s = comfy.rcm_sigmas(steps).numpy()
    np.testing.assert_allclose(s[:-1], SPEC_4STEP[:steps], atol=1e-5, rtol=0)
    assert s[-1] == 0.0 and len(s) == steps + 1


def test_rcm_sigmas_i2v_sigma_max_and_custom_mid_t():
    s = comfy.rcm_sigmas(2, sigma_max=200, mid_t="[1.2]").numpy()
    r1 = math.sin(1.2) / (math.sin(1.2) + math.cos(1.2))
    np.testing.assert_allclose(s, [200 / 201, r1, 0.0], atol=1e-7, rtol=0)
    # numbers as well as text; spaces, semicolons and brackets as separators
    assert comfy.parse_mid_t("1.5 1.4; 1.0") == (1.5, 1.4, 1.0)
    assert comfy.parse_mid_t([1.5, 1.4]) == (1.5, 1.4)
    assert comfy.parse_mid_t(" ") == ()
    np.testing.assert_allclose(comfy.rcm_sigmas(1, mid_t="").numpy(), [80 / 81, 0.0], atol=1e-7)


PER_STEP = "2: 1.0; 4: 1.5, 1.4, 0.8"


def test_rcm_sigmas_per_step_count_mid_t():
    """``"2: 1.0; 4: 1.5, 1.4, 0.8"``: n steps take the entry for n, else the next larger one cut to n - 1 angles.
    The 2-step grid must use 1.0 (not the 4-step entry's 1.5); expected angles written out by hand."""
    expected = {
        1: [math.atan(80.0)],
        2: [math.atan(80.0), 1.0],
        3: [math.atan(80.0), 1.5, 1.4],
        4: [math.atan(80.0), 1.5, 1.4, 0.8],
    }
    for steps, angles in expected.items():
        ref = [math.sin(t) / (math.sin(t) + math.cos(t)) for t in angles] + [0.0]
        np.testing.assert_allclose(comfy.rcm_sigmas(steps, 80.0, PER_STEP).numpy(), ref, atol=1e-7, rtol=0)
    assert not np.allclose(
        comfy.rcm_sigmas(2, 80.0, PER_STEP).numpy(), comfy.rcm_sigmas(2, 80.0, "1.5, 1.4, 0.8").numpy()
    )
    # spaces as separators inside an entry (as in the flat form), a trailing semicolon, a mapping
    assert comfy.parse_mid_t("2: 1.0; 4: 1.5 1.4 0.8;") == {2: (1.0,), 4: (1.5, 1.4, 0.8)}
    assert comfy.parse_mid_t({"4": [1.5, 1.4, 0.8], 2: [1.0]}) == {2: (1.0,), 4: (1.5, 1.4, 0.8)}
    assert comfy.check_rcm_sigmas_widgets(4, 80.0, PER_STEP) is None


@pytest.mark.parametrize(
    "text, match",
    [
        ("2: 1.0; 4: 1.5, abc, 0.8", r"^mid_t: cannot read \['abc'\] as numbers"),
        ("2: 1.0; 4: 1.4, 1.5, 0.8", r"^mid_t: angles must strictly decrease .*\(the entry for 4 steps\)"),
        ("2: 2.0", r"^mid_t: angles \[2.0\] \(the entry for 2 steps\) are outside"),
        ("2: 1.0; 1.4", r"^mid_t: entry '1.4' of '2: 1.0; 1.4' has no step count"),
        ("1: 1.0", r"^mid_t key '1' is not a step count"),
        ("x: 1.0", r"^mid_t key 'x' is not a step count"),
        ("4: 1.5, 1.4", r"^mid_t entry for 4 steps has 2 angle\(s\) \[1.5, 1.4\]; 4 steps need at least 3"),
        ("2: 1.0; 2: 0.9", r"^mid_t gives angles for 2 steps twice"),
    ],
)
def test_per_step_mid_t_errors_are_one_line(text, match):
    with pytest.raises(ValueError, match=match) as e:
        comfy.parse_mid_t(text)
    assert "\n" not in str(e.value)
    assert comfy.check_rcm_sigmas_widgets(2, 80.0, text) == str(e.value)


def test_rcm_sigmas_per_step_out_of_range_names_the_step_counts():
    with pytest.raises(
        ValueError,
        match=r"^steps=5 is out of range: with mid_t='2: 1.0; 4: 1.5, 1.4, 0.8' the rCM "
        r"sampler takes 1..4 steps \(angles for 2, 4 steps.*add an entry for 5 steps",
    ):
        comfy.rcm_sigmas(5, 80.0, PER_STEP)
    with pytest.raises(ValueError, match=r"in the mid_t entry for 4 steps \(arctan\(sigma_max=10.0\)"):
        comfy.rcm_sigmas(4, 10.0, PER_STEP)
    comfy.rcm_sigmas(2, 10.0, PER_STEP)  # arctan(10) = 1.471 is above the 2-step entry's 1.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(steps=0), "steps=0 is out of range.*1..4"),
        (dict(steps=5), "steps=5 is out of range.*add intermediate angles"),
        (dict(steps=2.5), "steps must be a whole number"),
        (dict(steps="4.5"), "steps must be a whole number"),
        (dict(steps="four"), "steps must be a whole number"),
        (dict(steps=True), "steps must be a whole number"),
        (dict(steps="5"), "steps=5 is out of range"),
        (dict(steps=3, mid_t="1.5, abc"), r"cannot read \['abc'\]"),
        (dict(steps=3, mid_t="1.0, 1.4"), "strictly decrease"),
        (dict(steps=2, mid_t="1.4, 1.4"), "strictly decrease"),
        (dict(steps=2, mid_t="2.0"), r"outside \(0, 1.57080\)"),
        (dict(steps=2, mid_t="0"), "outside"),
        (dict(steps=2, mid_t="nan"), "cannot read"),
        (dict(steps=4, sigma_max=10), r"arctan\(sigma_max=10.0\)"),  # atan(10)=1.4711 < 1.5
        (dict(steps=2, sigma_max=-1), "sigma_max must be > 0"),
    ],
)
def test_rcm_sigmas_bad_input_says_what_to_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        comfy.rcm_sigmas(**kwargs)


def test_rcm_sigmas_accepts_whole_numbers_as_text():
    """Issue 17 item 7: ``rcm_sigmas("4")`` said "steps=4 is out of range 1..4"."""
    for steps in ("4", " 4 ", 4.0, np.int64(4)):
        np.testing.assert_allclose(comfy.rcm_sigmas(steps).numpy(), SPEC_4STEP, atol=1e-5, rtol=0)


def test_check_rcm_sigmas_widgets_names_the_widget():
    assert comfy.check_rcm_sigmas_widgets(4, 80.0, "1.5, 1.4, 1.0") is None
    assert "steps=6" in comfy.check_rcm_sigmas_widgets(6, 80.0, "1.5, 1.4, 1.0")
    assert "mid_t" in comfy.check_rcm_sigmas_widgets(4, 80.0, "1.5, x")
    assert "sigma_max must be > 0" in comfy.check_rcm_sigmas_widgets(4, 0.0, "1.5, 1.4, 1.0")


def test_teacher_sigmas_linear_shift_starts_at_r_max():
    s = comfy.teacher_sigmas(10, sigma_max=5000, spacing="linear", shift=5.0).numpy().astype(np.float64)
    r_max = 5000 / 5001
    u_max = r_max / (5 - 4 * r_max)
    u = np.linspace(u_max, 0, 11)
    ref = 5 * u / (1 + 4 * u)
    np.testing.assert_allclose(s, ref, atol=1e-7, rtol=0)
    assert abs(s[0] - r_max) < 1e-7 and s[-1] == 0


def test_teacher_sigmas_karras_and_exponential():
    k = comfy.teacher_sigmas(5, sigma_max=5000, spacing="karras", rho=7, sigma_min=0.002).numpy().astype(np.float64)
    i = np.arange(5) / 4
    sig = (5000 ** (1 / 7) + i * (0.002 ** (1 / 7) - 5000 ** (1 / 7))) ** 7
    np.testing.assert_allclose(k, np.append(sig / (1 + sig), 0), rtol=1e-6, atol=1e-9)
    e = comfy.teacher_sigmas(5, spacing="exponential", sigma_min=0.002).numpy().astype(np.float64)
    sig = np.exp(np.log(5000) + i * (np.log(0.002) - np.log(5000)))
    np.testing.assert_allclose(e, np.append(sig / (1 + sig), 0), rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="choose one of"):
        comfy.teacher_sigmas(5, spacing="cosine")


# ----------------------------------------------------------------------------- sampler


class AffineDenoiser:
    """x0 = a(sigma) x + b(sigma) c: a denoiser with a known output, records its calls."""

    def __init__(self, c):
        self.c = c
        self.calls = []

    def __call__(self, x, sigma, **kw):
        self.calls.append((float(sigma[0]), kw))
        s = sigma.reshape(-1, *([1] * (x.ndim - 1))).to(x.dtype)
        return (0.5 - 0.3 * s) * x + (1.0 + s) * self.c.to(x.dtype)


def reference_loop(x, c, r, noises, stochastic):
    """docs/math.md §2.1 in float64, velocity form: v = (x - x0)/r, x0 = x - r v."""
    x = x.double()
    for i in range(len(r) - 1):
        x0 = (0.5 - 0.3 * r[i]) * x + (1.0 + r[i]) * c.double()
        v = (x - x0) / r[i]
        if stochastic:
            noise = noises[i].double() if r[i + 1] > 0 else 0.0  # no draw for the final step to r = 0
            x = (1 - r[i + 1]) * (x - r[i] * v) + r[i + 1] * noise
        else:
            x = x - (r[i] - r[i + 1]) * v
    return x


class ListNoise:
    def __init__(self, noises):
        self.noises, self.i = noises, 0

    def __call__(self, sigma, sigma_next):
        n = self.noises[self.i]
        self.i += 1
        return n


@pytest.mark.parametrize("stochastic", [True, False])
def test_sample_rcm_matches_float64_spec_loop(stochastic):
    g = torch.Generator().manual_seed(0)
    shape = (2, 4, 3, 8, 8)
    c = torch.randn(shape, generator=g)
    noises = [torch.randn(shape, generator=g) for _ in range(3)]
    sigmas = comfy.rcm_sigmas(4)
    r = sigmas.double().numpy()
    x = float(r[0]) * torch.randn(shape, generator=g)
    model = AffineDenoiser(c)
    seen = []
    out = comfy.sample_rcm(
        model,
        x,
        sigmas,
        extra_args={"cond": 1},
        disable=True,
        stochastic=stochastic,
        noise_sampler=ListNoise(noises),
        callback=lambda d: seen.append((d["i"], d["denoised"])),
    )
    ref = reference_loop(x, c, r, noises, stochastic)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    # the model saw the docs/math.md §2.1 RF times and the extra args; the callback got i and x0 for previews
    np.testing.assert_allclose([s for s, _ in model.calls], SPEC_4STEP[:4], atol=1e-5)
    assert all(kw == {"cond": 1} for _, kw in model.calls)
    assert [i for i, _ in seen] == [0, 1, 2, 3]
    # the last step returns the model's x0 exactly
    torch.testing.assert_close(seen[-1][1], out, atol=0, rtol=0)
    # stochastic and deterministic really differ
    other = comfy.sample_rcm(
        AffineDenoiser(c), x, sigmas, disable=True, stochastic=not stochastic, noise_sampler=ListNoise(noises)
    )
    assert (other - out).abs().max() > 1e-2


def test_sample_rcm_seed_reproduces_and_matches_generator_stream():
    c = torch.zeros(1, 2, 4, 4)
    x = torch.zeros(1, 2, 4, 4)
    sigmas = comfy.rcm_sigmas(2)
    a = comfy.sample_rcm(AffineDenoiser(c), x, sigmas, extra_args={"seed": 7}, disable=True)
    b = comfy.sample_rcm(AffineDenoiser(c), x, sigmas, extra_args={"seed": 7}, disable=True)
    d = comfy.sample_rcm(AffineDenoiser(c), x, sigmas, extra_args={"seed": 8}, disable=True)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert (a - d).abs().max() > 1e-3
    # x = 0, c = 0: step 0 gives x0 = 0, x1 = r1 * n1 with n1 the first draw of the re-noising stream,
    # then the last step returns x0 = (0.5 - 0.3 r1) x1. Without ComfyUI that stream follows current
    # ComfyUI's default_noise_sampler on CPU: a generator seeded with seed + 1 (comfy/k_diffusion/sampling.py).
    n1 = torch.randn(x.size(), generator=torch.Generator().manual_seed(8))
    r1 = float(sigmas[1])
    torch.testing.assert_close(a, (0.5 - 0.3 * r1) * r1 * n1, atol=1e-6, rtol=0)


def test_fresh_noise_is_not_the_initial_noise_again():
    """Issue 18: with ``seed`` the first re-noising draw equalled ComfyUI's initial noise (``randn`` from ``seed``)."""
    x = torch.zeros(1, 2, 4, 4)
    initial = torch.randn(x.size(), generator=torch.manual_seed(7))  # what ComfyUI's RandomNoise(7) draws on CPU
    first = comfy.seeded_noise_sampler(x, 7)(None, None)
    assert (first - initial).abs().max() > 0.1
    torch.testing.assert_close(first, torch.randn(x.size(), generator=torch.Generator().manual_seed(8)), atol=0, rtol=0)


def test_seeded_noise_sampler_uses_comfyuis_own_when_loaded(monkeypatch):
    """Inside ComfyUI the noise comes from ``comfy.k_diffusion.sampling.default_noise_sampler`` itself."""
    import types

    calls = []

    def default_noise_sampler(x, seed=None):
        calls.append(seed)
        return lambda sigma, sigma_next: torch.full_like(x, 3.0)

    fake = types.ModuleType("comfy.k_diffusion.sampling")
    fake.default_noise_sampler = default_noise_sampler
    monkeypatch.setitem(sys.modules, "comfy.k_diffusion.sampling", fake)
    x = torch.zeros(1, 2, 4, 4)
    out = comfy.sample_rcm(
        AffineDenoiser(torch.zeros_like(x)), x, comfy.rcm_sigmas(2), extra_args={"seed": 5}, disable=True
    )
    assert calls == [5]
    r1 = float(comfy.rcm_sigmas(2)[1])
    torch.testing.assert_close(out, torch.full_like(x, (0.5 - 0.3 * r1) * r1 * 3.0), atol=1e-6, rtol=0)


def test_sample_rcm_rejects_non_rf_sigmas():
    x = torch.zeros(1, 2, 4, 4)
    with pytest.raises(ValueError, match="not RF times"):
        comfy.sample_rcm(AffineDenoiser(x), x, torch.tensor([14.6, 2.0, 0.0]), disable=True)
    with pytest.raises(ValueError, match="strictly decreasing"):
        comfy.sample_rcm(AffineDenoiser(x), x, torch.tensor([0.5, 0.9, 0.0]), disable=True)


def test_rcm_sampler_node_time_input_widget_reaches_sample_rcm(monkeypatch):
    """The RCMSampler node's ``time_input`` widget (default bf16, as RCMScheduler and the official sampler) goes to
    ``sample_rcm`` through the KSAMPLER's extra options: bf16 calls the model at bf16(1000 r)/1000, float at r."""
    import types

    from comfy_nodes.nodes import RCM_SAMPLER

    (widget,) = [i for i in RCM_SAMPLER.inputs if i.name == "time_input"]
    assert widget.kind == "COMBO" and widget.choices() == ["bf16", "float"] and widget.extra["default"] == "bf16"
    # optional: an API prompt written before the widget existed still validates, and runs with bf16
    assert widget.optional and "training/rcm.py" in widget.extra["tooltip"] and "lcm" in widget.extra["tooltip"]
    assert [i.name for i in RCM_SAMPLER.inputs] == ["stochastic", "time_input"]  # widgets_values order

    class KSAMPLER:  # comfy.samplers.KSAMPLER: sample() calls sampler_function(..., **extra_options)
        def __init__(self, sampler_function, extra_options=None):
            self.sampler_function, self.extra_options = sampler_function, extra_options or {}

    fake = types.ModuleType("comfy.samplers")
    fake.KSAMPLER = KSAMPLER
    package = types.ModuleType("comfy")
    package.samplers = fake
    monkeypatch.setitem(sys.modules, "comfy", package)
    monkeypatch.setitem(sys.modules, "comfy.samplers", fake)

    g = torch.Generator().manual_seed(0)
    shape = (1, 2, 4, 4)
    c, x = torch.randn(shape, generator=g), 0.98765 * torch.randn(shape, generator=g)
    sigmas = comfy.rcm_sigmas(4)
    runs = {}
    for kwargs in ({}, {"time_input": "bf16"}, {"time_input": "float"}):
        (sampler,) = RCM_SAMPLER.execute(stochastic=True, **kwargs)
        assert sampler.sampler_function is comfy.sample_rcm
        assert sampler.extra_options == {"stochastic": True, "time_input": kwargs.get("time_input", "bf16")}
        model = AffineDenoiser(c)
        out = sampler.sampler_function(
            model, x, sigmas, extra_args={"seed": 3}, callback=None, disable=True, **sampler.extra_options
        )
        runs[kwargs.get("time_input", "default")] = (out, [s for s, _ in model.calls])
    bf16_times = [988.0e-3, 932.0e-3, 852.0e-3, 608.0e-3]  # bf16(1000 r) of docs/math.md §2.1's 4-step times
    assert runs["bf16"][1] == pytest.approx(bf16_times, abs=1e-7) and runs["default"][1] == runs["bf16"][1]
    np.testing.assert_allclose(runs["float"][1], SPEC_4STEP[:4], atol=1e-5)
    torch.testing.assert_close(runs["default"][0], runs["bf16"][0], atol=0, rtol=0)
    # the same as sample_rcm called directly, and float really differs
    direct = comfy.sample_rcm(AffineDenoiser(c), x, sigmas, extra_args={"seed": 3}, disable=True, time_input="bf16")
    torch.testing.assert_close(runs["bf16"][0], direct, atol=0, rtol=0)
    assert (runs["bf16"][0] - runs["float"][0]).abs().max() > 1e-4
    (ode,) = RCM_SAMPLER.execute(stochastic=False, time_input="float")
    assert ode.extra_options == {"stochastic": False, "time_input": "float"}
    with pytest.raises(ValueError, match=r"rCM Sampler: time_input='fp16'; use one of \['bf16', 'float'\]"):
        RCM_SAMPLER.execute(stochastic=True, time_input="fp16")


# ----------------------------------------------------------------------------- expert split


def test_split_sigmas_at_boundary_and_chaining_equals_one_run():
    sigmas = comfy.rcm_sigmas(4)
    high, low = comfy.split_sigmas_at_boundary(sigmas, 0.9)
    np.testing.assert_allclose(high.numpy(), SPEC_4STEP[:3], atol=1e-5)
    np.testing.assert_allclose(low.numpy(), SPEC_4STEP[2:], atol=1e-5)
    high7, low7 = comfy.split_sigmas_at_boundary(sigmas, 0.7)
    assert len(high7) == 4 and len(low7) == 2
    # two chained samplers over the halves equal one sampler over the whole schedule
    g = torch.Generator().manual_seed(1)
    c = torch.randn(1, 4, 2, 4, 4, generator=g)
    noises = [torch.randn(1, 4, 2, 4, 4, generator=g) for _ in range(3)]
    x = 0.98765 * torch.randn(1, 4, 2, 4, 4, generator=g)
    full = comfy.sample_rcm(AffineDenoiser(c), x, sigmas, disable=True, noise_sampler=ListNoise(noises))
    ns = ListNoise(noises)
    mid = comfy.sample_rcm(AffineDenoiser(c), x, high, disable=True, noise_sampler=ns)
    out = comfy.sample_rcm(AffineDenoiser(c), mid, low, disable=True, noise_sampler=ns)
    torch.testing.assert_close(out, full, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "steps, boundary, match",
    [
        (4, 0.99, "high-noise expert gets no step"),
        (1, 0.9, "low-noise expert gets no step"),
        (4, 0.5, "low-noise expert gets no step"),
        (4, 1.5, r"must lie in \(0, 1\)"),
    ],
)
def test_split_sigmas_bad_boundary(steps, boundary, match):
    with pytest.raises(ValueError, match=match):
        comfy.split_sigmas_at_boundary(comfy.rcm_sigmas(steps), boundary)


# ----------------------------------------------------------------------------- model checks


def test_flow_model_check_and_arch():
    class CONST:
        pass

    class ModelSamplingDiscreteFlow:
        pass

    class FlowSampling(ModelSamplingDiscreteFlow, CONST):
        pass

    class EPS:
        pass

    class ModelSamplingDiscrete(EPS):
        pass

    comfy.check_flow_model_sampling(FlowSampling())
    with pytest.raises(ValueError, match="not as a rectified-flow"):
        comfy.check_flow_model_sampling(ModelSamplingDiscrete())

    class WAN21:
        pass

    class WAN22(WAN21):
        pass

    class Flux:
        pass

    class SDXL:
        pass

    class Flux2(Flux):  # ComfyUI's FLUX.2 subclasses its Flux
        pass

    class Chroma(Flux):
        pass

    class QwenImage:
        pass

    class HunyuanVideo:
        pass

    class HunyuanVideo15(HunyuanVideo):
        pass

    class HunyuanVideo15_SR_Distilled(HunyuanVideo15):
        pass

    assert comfy.model_arch(WAN22()) == "wan" and comfy.model_arch(Flux()) == "flux"
    assert comfy.model_arch(Chroma()) == "flux" and comfy.model_arch(Flux2()) == "flux2"
    assert comfy.model_arch(QwenImage()) == "qwen_image"
    assert comfy.model_arch(HunyuanVideo15()) == comfy.model_arch(HunyuanVideo15_SR_Distilled()) == "hunyuan_video15"
    for other in (SDXL(), HunyuanVideo()):  # HunyuanVideo 1.0: no rCM LoRA family
        with pytest.raises(
            ValueError,
            match=f"supports Wan, Flux, FLUX.2, Qwen-Image and HunyuanVideo-1.5 models; "
            f"this model is {type(other).__name__}",
        ):
            comfy.model_arch(other)


# ----------------------------------------------------------------------------- LoRA glue


def _wan_diffusers_lora(rank=2, dim=8):
    g = torch.Generator().manual_seed(3)
    sd = {}
    for name in ("attn1.to_q", "attn2.to_out.0", "ffn.net.0.proj"):
        sd[f"transformer.blocks.0.{name}.lora_A.weight"] = torch.randn(rank, dim, generator=g)
        sd[f"transformer.blocks.0.{name}.lora_B.weight"] = torch.randn(dim, rank, generator=g)
    return sd


def test_load_lora_file_diffusers_and_comfy_layouts(tmp_path):
    from rcm_diffusers.lora.io import save_lora

    sd = _wan_diffusers_lora()
    sd["transformer.blocks.0.attn1.to_q.alpha"] = torch.tensor(1.0)  # alpha != rank: kept in the header
    for fmt in ("diffusers", "comfyui"):
        save_lora(tmp_path / f"{fmt}.safetensors", sd, arch="wan", format=fmt)
        out = comfy.load_lora_file(str(tmp_path / f"{fmt}.safetensors"), "wan")
        lora = {k: v for k, v in out.items() if not k.endswith(".alpha")}
        assert set(lora) == {
            f"diffusion_model.blocks.0.{t}.{s}.weight"
            for t in ("self_attn.q", "cross_attn.o", "ffn.0")
            for s in ("lora_down", "lora_up")
        }, fmt
        torch.testing.assert_close(
            out["diffusion_model.blocks.0.self_attn.q.lora_down.weight"],
            sd["transformer.blocks.0.attn1.to_q.lora_A.weight"],
            atol=0,
            rtol=0,
        )
        assert float(out["diffusion_model.blocks.0.self_attn.q.alpha"]) == 1.0, fmt
    key_map = {
        "diffusion_model.blocks.0.self_attn.q": "diffusion_model.blocks.0.self_attn.q.weight",
        "diffusion_model.blocks.0.ffn.0": "diffusion_model.blocks.0.ffn.0.weight",
    }
    assert comfy.lora_targets_missing(out, key_map) == ["blocks.0.cross_attn.o"]


def test_load_lora_file_wrong_architecture_and_bad_files(tmp_path):
    from safetensors.torch import save_file

    flux = {
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 8),
        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(8, 2),
    }
    save_file(flux, tmp_path / "flux.safetensors")
    with pytest.raises(ValueError, match="this LoRA is for Flux but the model is Wan"):
        comfy.load_lora_file(str(tmp_path / "flux.safetensors"), "wan")
    save_file({"text_model.encoder.layers.0.q.lora_A.weight": torch.zeros(2, 8)}, tmp_path / "clip.safetensors")
    with pytest.raises(ValueError, match="not a LoRA of a family this loader takes"):
        comfy.load_lora_file(str(tmp_path / "clip.safetensors"), "wan")
    with pytest.raises(FileNotFoundError, match="models/loras"):
        comfy.load_lora_file(str(tmp_path / "nope.safetensors"), "wan")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read LoRA file"):
        comfy.load_lora_file(str(bad), "wan")


def _pairs(targets, rank=2, dim=8, out=None, seed=4):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for t in targets:
        sd[f"transformer.{t}.lora_A.weight"] = torch.randn(rank, dim, generator=g)
        sd[f"transformer.{t}.lora_B.weight"] = torch.randn(out or dim, rank, generator=g)
    return sd


FAMILY_LORAS = {  # the trainer's diffusers names of each family (a few modules each)
    "flux": ["transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.proj_mlp"],
    "flux2": ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.ff.linear_in"],
    "qwen_image": ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.img_mlp.net.0.proj"],
    "hunyuan_video15": [
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.0.attn.to_k",
        "transformer_blocks.0.attn.to_v",
        "context_embedder.token_refiner.refiner_blocks.0.ff.net.2",
    ],
}


def test_load_lora_file_new_families_and_cross_family_refusals(tmp_path):
    import json

    from safetensors.torch import save_file

    files = {}
    for fam, targets in FAMILY_LORAS.items():
        files[fam] = str(tmp_path / f"{fam}.safetensors")
        header = {"lora_adapter_metadata": json.dumps({"r": 2, "lora_alpha": 4.0})}
        save_file(_pairs(targets), files[fam], header)
    flux2 = comfy.load_lora_file(files["flux2"], "flux2")  # diffusers names ComfyUI's Flux map takes, plus .alpha
    assert set(flux2) == {
        f"transformer.{t}.{s}" for t in FAMILY_LORAS["flux2"] for s in ("lora_A.weight", "lora_B.weight", "alpha")
    }
    assert float(flux2["transformer.transformer_blocks.0.ff.linear_in.alpha"]) == 4.0
    qwen = comfy.load_lora_file(files["qwen_image"], "qwen_image")
    assert len(qwen) == 6 and float(qwen["transformer.transformer_blocks.0.attn.to_q.alpha"]) == 4.0
    hy = comfy.load_lora_file(files["hunyuan_video15"], "hunyuan_video15")
    assert set(hy) == {
        f"diffusion_model.{t}.{s}"
        for t in ("double_blocks.0.img_attn.qkv", "txt_in.individual_token_refiner.blocks.0.mlp.2")
        for s in ("lora_A.weight", "lora_B.weight", "alpha")
    }
    A, B = (
        hy["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"],
        hy["diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight"],
    )
    assert (
        A.shape == (6, 8)
        and B.shape == (24, 6)
        and float(hy["diffusion_model.double_blocks.0.img_attn.qkv.alpha"]) == 12.0
    )
    src = _pairs(FAMILY_LORAS["hunyuan_video15"])
    k = "transformer.transformer_blocks.0.attn.to_k"
    torch.testing.assert_close(B[8:16] @ A, src[f"{k}.lora_B.weight"] @ src[f"{k}.lora_A.weight"], rtol=1e-6, atol=1e-6)

    names = {
        "wan": "Wan",
        "flux": "Flux",
        "flux2": "FLUX.2",
        "qwen_image": "Qwen-Image",
        "hunyuan_video15": "HunyuanVideo-1.5",
    }
    for lora_fam in FAMILY_LORAS:
        for model_fam in names:
            if lora_fam == model_fam:
                continue
            want = f"this LoRA is for {re.escape(names[lora_fam])} but the model is {re.escape(names[model_fam])}; "
            with pytest.raises(ValueError, match=want) as e:
                comfy.load_lora_file(files[lora_fam], model_fam)
            assert "\n" not in str(e.value) and str(tmp_path) not in str(e.value)  # one line; the node names the file


def test_lora_key_map_problems():
    key_map = {  # as comfy.lora.model_lora_keys_unet gives it: a weight, or a row slice of a fused one
        "diffusion_model.double_blocks.0.img_attn.qkv": "diffusion_model.double_blocks.0.img_attn.qkv.weight",
        "transformer.transformer_blocks.0.attn.to_k": (
            "diffusion_model.double_blocks.0.img_attn.qkv.weight",
            (0, 8, 8),
        ),
    }
    shapes = {"double_blocks.0.img_attn.qkv.weight": (24, 8)}
    g = torch.Generator().manual_seed(0)
    ok = {
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.randn(6, 8, generator=g),
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": torch.randn(24, 6, generator=g),
        "diffusion_model.double_blocks.0.img_attn.qkv.alpha": torch.tensor(6.0),
        "transformer.transformer_blocks.0.attn.to_k.lora_A.weight": torch.randn(2, 8, generator=g),
        "transformer.transformer_blocks.0.attn.to_k.lora_B.weight": torch.randn(8, 2, generator=g),
    }
    assert comfy.lora_key_map_problems(ok, key_map, shapes) == []
    bad = dict(ok)
    bad["transformer.transformer_blocks.0.attn.to_k.lora_B.weight"] = torch.zeros(24, 2)  # the whole weight's rows
    bad["transformer.transformer_blocks.9.attn.to_q.lora_A.weight"] = torch.zeros(2, 8)
    bad["diffusion_model.double_blocks.0.img_attn.qkv.diff"] = torch.zeros(24, 8)
    assert comfy.lora_key_map_problems(bad, key_map, shapes) == [
        "diffusion_model.double_blocks.0.img_attn.qkv.diff: not a lora_A/lora_B factor or alpha",
        "transformer.transformer_blocks.0.attn.to_k: LoRA delta (24, 8) vs rows 8:16 of weight (24, 8)",
        "transformer.transformer_blocks.9.attn.to_q: no weight of this model",
    ]
    del (
        bad["transformer.transformer_blocks.9.attn.to_q.lora_A.weight"],
        bad["diffusion_model.double_blocks.0.img_attn.qkv.diff"],
    )
    bad["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"] = torch.zeros(6, 16)  # another model width
    assert comfy.lora_key_map_problems(bad, key_map, shapes)[0] == (
        "diffusion_model.double_blocks.0.img_attn.qkv: LoRA delta (24, 16) vs weight (24, 8)"
    )


def test_split_parameter_patches():
    patches = {
        "diffusion_model.blocks.0.self_attn.q.weight": 1,
        "diffusion_model.blocks.0.ffn.0.bias": 2,
        "diffusion_model.blocks.0.modulation": 3,
        "diffusion_model.head.modulation": 4,
    }
    module, raw = comfy.split_parameter_patches(patches)
    assert set(module) == {"diffusion_model.blocks.0.self_attn.q.weight", "diffusion_model.blocks.0.ffn.0.bias"}
    assert raw == {"diffusion_model.blocks.0.modulation": 3, "diffusion_model.head.modulation": 4}


# ----------------------------------------------------------------------------- bad inputs: one clear line each


class NaNAt:
    """A denoiser whose x0 turns NaN (or inf) from call ``at`` on."""

    def __init__(self, at, value=float("nan")):
        self.at, self.value, self.calls = at, value, 0

    def __call__(self, x, sigma, **kw):
        self.calls += 1
        return torch.full_like(x, self.value) if self.calls > self.at else 0.5 * x


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("time_input", ["float", "bf16"])
def test_sample_rcm_refuses_a_nan_model_output(value, time_input):
    """A NaN/inf x0 stopped the run at once, naming the step (the diffusers schedulers' rule), not a NaN latent."""
    x = torch.ones(1, 2, 4, 4)
    model = NaNAt(1, value)
    with pytest.raises(
        ValueError,
        match=r"^rCM Sampler: the model output holds NaN or inf at step 1 \(sigma=0.93378\); "
        r"check the model and its inputs\.$",
    ):
        comfy.sample_rcm(
            model,
            x,
            comfy.rcm_sigmas(4),
            disable=True,
            time_input=time_input,
            noise_sampler=lambda a, b: torch.zeros_like(x),
        )
    assert model.calls == 2  # stopped at the first bad step


@pytest.mark.parametrize("bad", ["maybe", "false", 1, 0, None, 0.5])
def test_stochastic_must_be_a_bool(bad):
    from comfy_nodes.nodes import _rcm_sampler_options

    x = torch.zeros(1, 2, 4, 4)
    line = rf"^rCM Sampler: stochastic must be true or false, got {re.escape(repr(bad))}\.$"
    with pytest.raises(ValueError, match=line):
        _rcm_sampler_options(bad)
    with pytest.raises(ValueError, match=line):
        comfy.sample_rcm(AffineDenoiser(x), x, comfy.rcm_sigmas(2), disable=True, stochastic=bad)
    assert _rcm_sampler_options(np.bool_(False)) == {"stochastic": False, "time_input": "bf16"}


@pytest.mark.parametrize(
    "sigmas, boundary, match",
    [
        (None, 0.9, r"^rCM Expert Split: sigmas must be SIGMAS \(connect rCM Sigmas\), got NoneType\.$"),
        ("0.9, 0", 0.9, r"^rCM Expert Split: sigmas must be SIGMAS \(connect rCM Sigmas\), got str\.$"),
        ("ok", None, r"^rCM Expert Split: boundary must be a number in \(0, 1\), got None\.$"),
        ("ok", "0.9", r"^rCM Expert Split: boundary must be a number in \(0, 1\), got '0.9'\.$"),
        ("ok", float("nan"), r"^rCM Expert Split: boundary must be a number in \(0, 1\), got nan\.$"),
    ],
)
def test_expert_split_bad_input_is_one_clear_line(sigmas, boundary, match):
    from comfy_nodes.nodes import EXPERT_SPLIT

    sigmas = comfy.rcm_sigmas(4) if sigmas == "ok" else sigmas
    with pytest.raises(ValueError, match=match):
        EXPERT_SPLIT.execute(sigmas=sigmas, boundary=boundary)


class FolderPaths:
    """ComfyUI's folder_paths for one loras folder: get_full_path resolves any name, as ComfyUI's does for a raw
    path."""

    def __init__(self, root, names):
        self.root, self.names, self.full_path_calls = root, names, []

    def get_filename_list(self, folder):
        assert folder == "loras"
        return list(self.names)

    def get_full_path(self, folder, name):
        self.full_path_calls.append(name)
        path = os.path.join(self.root, name)
        return path if os.path.isfile(path) else None


def test_lora_name_outside_comfyuis_list_is_refused(tmp_path):
    """Only names ComfyUI lists reach the file system; ``../../x`` or a stale name is one line, never opened as a
    path."""
    (tmp_path / "loras").mkdir()
    (tmp_path / "loras" / "rcm.safetensors").write_bytes(b"")
    (tmp_path / "x").write_bytes(b"")  # exists, but outside models/loras
    fp = FolderPaths(str(tmp_path / "loras"), ["rcm.safetensors", "gone.safetensors"])
    assert comfy.resolve_lora_name("rcm.safetensors", fp) == str(tmp_path / "loras" / "rcm.safetensors")
    for name in ("../x", str(tmp_path / "x"), "gone.safetensors", None, ["rcm.safetensors"]):
        with pytest.raises(
            ValueError,
            match=rf"^rCM LoRA Loader: lora_name={re.escape(repr(name))} is not in ComfyUI's "
            r"loras list \(2 file\(s\)\); put the file in models/loras, refresh and "
            r"pick it from the list\.$",
        ):
            comfy.resolve_lora_name(name, fp)
    assert fp.full_path_calls == ["rcm.safetensors", "gone.safetensors"]  # unlisted names never looked up


# ----------------------------------------------------------------------------- LoRA on quantized models


def _tiny_wan(ffn_dim):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=1,
        attention_head_dim=64,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=32,
        ffn_dim=ffn_dim,
        num_layers=1,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
    ).eval()


def _roundup(n, m):
    return -(-n // m) * m


def _as_comfyui_holds_it(path, logical):
    """The diffusion model ComfyUI builds from an export (``comfy/ops.py`` mixed_precision_ops): each quantized Linear
    keeps its storage tensor as ``weight`` (what ``state_dict()`` returns: NVFP4 packed uint8, padded) plus its scales,
    and records ``_orig_shape = (out_features, in_features)`` from the architecture (``logical``: the plain model's
    shapes, not the file's header)."""
    import json

    from safetensors import safe_open

    root = torch.nn.Module()
    with safe_open(str(path), "pt") as f:
        layers = json.loads(f.metadata()["_quantization_metadata"])["layers"]
        for key in f.keys():
            owner, _, leaf = key.rpartition(".")
            mod = root
            for part in owner.split("."):
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(f.get_tensor(key), requires_grad=False))
            if owner in layers and leaf == "weight":
                mod._orig_shape = logical[key]
    return root, layers


def _as_mxfp8(root, layers):
    """The same model as ComfyUI holds an MXFP8 file: float8 storage padded to multiples of 32 (comfy-kitchen
    ``TensorCoreMXFP8Layout.get_padded_shape``); our exporter writes no MXFP8, so the storage is made here."""
    for name in layers:
        mod = root.get_submodule(name)
        n, k = mod._orig_shape
        mod.weight = torch.nn.Parameter(
            torch.zeros(_roundup(n, 32), _roundup(k, 32), dtype=torch.float8_e4m3fn), requires_grad=False
        )
    return root


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3", "int8", "mxfp8"])
def test_lora_is_checked_against_the_logical_shape_of_quantized_layers(tmp_path, fmt):
    """RCMLoraLoader compared a LoRA with the packed storage of NVFP4 layers ("LoRA delta (200, 64) vs weight
    (208, 32)") and refused every LoRA; it now checks the logical [N, K] of every layout ComfyUI reads."""
    from rcm_diffusers.lora import keys as lora_keys
    from rcm_diffusers.lora.io import save_lora
    from rcm_diffusers.quant.export import export_quantized
    from rcm_diffusers.quant.modules import quantize_transformer

    plain = _tiny_wan(ffn_dim=200)  # 200: NVFP4 pads N to 208 and MXFP8 to 224, so storage and logical shapes differ
    logical = {k: tuple(v.shape) for k, v in lora_keys.to_original(plain.state_dict(), arch="wan", prefix="").items()}
    model = _tiny_wan(ffn_dim=200)
    quantize_transformer(model, "fp8_e4m3" if fmt == "mxfp8" else fmt, target="fake")
    export_quantized(model, tmp_path / "q.safetensors", layout="comfyui", check_comfyui=False)
    dm, layers = _as_comfyui_holds_it(tmp_path / "q.safetensors", logical)
    if fmt == "mxfp8":
        dm = _as_mxfp8(dm, layers)
    assert {"blocks.0.self_attn.q", "blocks.0.ffn.0", "blocks.0.ffn.2"} <= set(layers)

    g = torch.Generator().manual_seed(0)
    lora = {}
    for target, (n, k) in {"attn1.to_q": (64, 64), "ffn.net.0.proj": (200, 64), "ffn.net.2": (64, 200)}.items():
        lora[f"transformer.blocks.0.{target}.lora_A.weight"] = torch.randn(4, k, generator=g)
        lora[f"transformer.blocks.0.{target}.lora_B.weight"] = torch.randn(n, 4, generator=g)
    save_lora(tmp_path / "lora.safetensors", lora, arch="wan", format="comfyui")
    sd = comfy.load_lora_file(str(tmp_path / "lora.safetensors"), "wan")

    shapes = comfy.model_weight_shapes(dm)
    assert shapes["blocks.0.ffn.0.weight"] == (200, 64) and shapes["blocks.0.ffn.2.weight"] == (64, 200)
    storage = {"nvfp4": (208, 32), "fp8_e4m3": (200, 64), "int8": (200, 64), "mxfp8": (224, 64)}[fmt]
    assert tuple(dm.state_dict()["blocks.0.ffn.0.weight"].shape) == storage
    comfy.check_lora_against_model(sd, dm)  # fits: no error
    if storage != (200, 64):  # the storage shape is what the loader used to compare with
        with pytest.raises(ValueError, match=re.escape(f"LoRA delta (200, 64) vs weight {storage}")):
            lora_keys.check_against_model(sd, dm.state_dict())
    # a LoRA of another model size is still refused, with the logical shape
    wrong = dict(
        sd,
        **{
            "diffusion_model.blocks.0.ffn.0.lora_down.weight": torch.zeros(4, 48),
            "diffusion_model.blocks.0.ffn.0.lora_up.weight": torch.zeros(200, 4),
        },
    )
    with pytest.raises(ValueError, match=re.escape("blocks.0.ffn.0: LoRA delta (200, 48) vs weight (200, 64)")):
        comfy.check_lora_against_model(wrong, dm)


# ----------------------------------------------------------------------------- LoRA variant (Wan I2V vs T2V)


def test_wan_lora_variant_from_keys_and_metadata():
    t2v_keys = ["diffusion_model.blocks.0.self_attn.q.lora_down.weight"]
    assert comfy.wan_lora_variant(t2v_keys) == (None, "")
    variant, why = comfy.wan_lora_variant(
        t2v_keys
        + [
            "diffusion_model.blocks.0.cross_attn.k_img.lora_down.weight",
            "diffusion_model.blocks.0.cross_attn.v_img.lora_down.weight",
        ]
    )
    assert variant == "i2v" and "blocks.0.cross_attn.k_img" in why and ", ..." in why
    assert comfy.wan_lora_variant(["transformer.blocks.0.attn2.add_k_proj.lora_A.weight"])[0] == "i2v"
    assert comfy.wan_lora_variant(["diffusion_model.img_emb.proj.1.diff"])[0] == "i2v"
    assert comfy.wan_lora_variant(t2v_keys, {"ss_base_model_version": "wan2.2_i2v_a14b"}) == (
        "i2v",
        "its metadata says ss_base_model_version='wan2.2_i2v_a14b'",
    )
    assert comfy.wan_lora_variant(t2v_keys, {"rcm_lora": '{"base_model": "Wan-AI/Wan2.1-T2V-1.3B"}'})[0] == "t2v"
    # metadata naming both (or neither) decides nothing
    assert comfy.wan_lora_variant(t2v_keys, {"a": "Wan2.1-T2V", "b": "Wan2.1-I2V"}) == (None, "")
    assert comfy.wan_lora_variant(t2v_keys, {"format": "pt"}) == (None, "")


def test_i2v_lora_on_a_t2v_model_warns(tmp_path):
    """A Wan 2.2 I2V LoRA has the T2V shapes: it applied silently; the loader now says so (and not for a match)."""
    from safetensors.torch import save_file

    from comfy_nodes.nodes import _wan_variant_warning

    def wan(in_channels):
        m = torch.nn.Module()
        m.patch_embedding = torch.nn.Conv3d(in_channels, 8, (1, 2, 2))
        return m

    lora = {
        "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.zeros(2, 8),
        "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.zeros(8, 2),
    }
    save_file(lora, tmp_path / "i2v.safetensors", metadata={"ss_base_model_version": "wan2.2_i2v_a14b"})
    save_file(lora, tmp_path / "plain.safetensors")
    assert comfy.wan_model_variant(wan(16)) == "t2v" and comfy.wan_model_variant(wan(36)) == "i2v"
    assert comfy.wan_model_variant(wan(48)) is None
    msg = _wan_variant_warning(str(tmp_path / "i2v.safetensors"), "i2v.safetensors", wan(16))
    assert msg == (
        "rCM LoRA Loader, lora_name='i2v.safetensors': this LoRA was made for Wan I2V (its metadata says "
        "ss_base_model_version='wan2.2_i2v_a14b') but the model is Wan T2V; the shapes fit, so it is "
        "applied, but pick a T2V LoRA unless this is intended."
    )
    assert _wan_variant_warning(str(tmp_path / "i2v.safetensors"), "i2v.safetensors", wan(36)) is None
    assert _wan_variant_warning(str(tmp_path / "plain.safetensors"), "plain.safetensors", wan(16)) is None


def test_t2v_lora_on_an_i2v_model_says_an_i2v_lora():
    """The article fits the variant: "pick an I2V LoRA" (the article used to be "a" whatever the variant)."""
    import tempfile

    from safetensors.torch import save_file

    from comfy_nodes.nodes import _wan_variant_warning

    m = torch.nn.Module()
    m.patch_embedding = torch.nn.Conv3d(36, 8, (1, 2, 2))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t2v.safetensors")
        save_file(
            {"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.zeros(2, 8)},
            path,
            metadata={"ss_base_model_version": "wan2.1_t2v_14b"},
        )
        msg = _wan_variant_warning(path, "t2v.safetensors", m)
    assert msg.endswith(
        "but the model is Wan I2V; the shapes fit, so it is applied, but pick an I2V LoRA unless this is intended."
    ), msg


class WAN21:  # a ComfyUI Wan BaseModel as rcm_diffusers.comfy.model_arch sees it (by class name)
    def __init__(self, in_channels):
        self.diffusion_model = torch.nn.Module()
        self.diffusion_model.patch_embedding = torch.nn.Conv3d(in_channels, 8, (1, 2, 2))
        block = torch.nn.Module()
        block.self_attn = torch.nn.Module()
        block.self_attn.q = torch.nn.Linear(8, 8)
        self.diffusion_model.blocks = torch.nn.ModuleList([block])


@pytest.fixture
def comfyui_stand_ins(tmp_path, monkeypatch):
    """folder_paths, comfy.lora / comfy.utils and the server module as the loader node uses them (no ComfyUI): the loras
    folder holds an I2V-tagged Wan LoRA, an untagged one and a Flux one; the server records progress texts."""
    import types

    from safetensors.torch import save_file

    loras = tmp_path / "loras"
    loras.mkdir()
    wan = {
        "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.zeros(2, 8),
        "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.zeros(8, 2),
    }
    save_file(wan, loras / "i2v.safetensors", metadata={"ss_base_model_version": "wan2.2_i2v_a14b"})
    save_file(wan, loras / "plain.safetensors")
    save_file(
        {
            "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 8),
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(8, 2),
        },
        loras / "flux.safetensors",
    )
    save_file(
        {
            "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.zeros(2, 24),
            "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.zeros(24, 2),
        },
        loras / "wide.safetensors",
    )
    folder_paths = FolderPaths(
        str(loras), ["i2v.safetensors", "plain.safetensors", "flux.safetensors", "wide.safetensors"]
    )
    lora = types.ModuleType("comfy.lora")
    lora.model_lora_keys_unet = lambda model, key_map: {
        "diffusion_model.blocks.0.self_attn.q": "diffusion_model.blocks.0.self_attn.q.weight"
    }
    lora.load_lora = lambda sd, key_map: {}  # no patch: the loader returns the model it was given
    package = types.ModuleType("comfy")
    package.lora, package.utils = lora, types.ModuleType("comfy.utils")
    sent = []
    server = types.ModuleType("server")
    server.PromptServer = types.SimpleNamespace(
        instance=types.SimpleNamespace(send_progress_text=lambda text, node_id: sent.append((text, node_id)))
    )
    for name, module in (
        ("folder_paths", folder_paths),
        ("comfy", package),
        ("comfy.lora", lora),
        ("comfy.utils", package.utils),
        ("server", server),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(model=types.SimpleNamespace(model=WAN21(16)), sent=sent)


def test_variant_warning_is_shown_on_the_loader_node(comfyui_stand_ins, caplog):
    """An I2V LoRA on a T2V model: the warning went to the server log only; the node now also shows it (ComfyUI's
    progress text on the node) and returns it as its UI text output, next to the unchanged MODEL output."""
    import logging

    from comfy_nodes.nodes import LORA_LOADER
    from comfy_nodes.schema import legacy_nodes

    cls = legacy_nodes([LORA_LOADER])[0]["RCMLoraLoader"]
    assert cls.INPUT_TYPES()["hidden"] == {"unique_id": "UNIQUE_ID"}  # the node id the text is shown on
    model = comfyui_stand_ins.model
    warning = (
        "rCM LoRA Loader, lora_name='i2v.safetensors': this LoRA was made for Wan I2V (its metadata says "
        "ss_base_model_version='wan2.2_i2v_a14b') but the model is Wan T2V; the shapes fit, so it is applied, "
        "but pick a T2V LoRA unless this is intended."
    )
    with caplog.at_level(logging.WARNING):
        out = getattr(cls(), cls.FUNCTION)(model=model, lora_name="i2v.safetensors", strength_model=1.0, unique_id="7")
    assert out == {"ui": {"text": [warning]}, "result": (model,)}
    assert comfyui_stand_ins.sent == [(warning, "7")]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [warning]  # the log, as before
    # a LoRA that fits the variant: the plain output, nothing shown
    assert getattr(cls(), cls.FUNCTION)(
        model=model, lora_name="plain.safetensors", strength_model=1.0, unique_id="7"
    ) == (model,)
    assert comfyui_stand_ins.sent == [(warning, "7")]


def test_loader_errors_name_the_file_once_with_one_advice(comfyui_stand_ins):
    """A Flux LoRA on a Wan model said the file name twice and two pieces of advice ("...: flux.safetensors: this LoRA
    is for Flux ...; load a Wan LoRA (or connect a Flux model). Pick a LoRA made for this model."): now one sentence."""
    from comfy_nodes.nodes import LORA_LOADER

    model = comfyui_stand_ins.model
    with pytest.raises(ValueError) as e:
        LORA_LOADER.execute(model=model, lora_name="flux.safetensors", strength_model=1.0)
    assert str(e.value) == (
        "rCM LoRA Loader, lora_name='flux.safetensors': this LoRA is for Flux but the model is Wan; "
        "pick a Wan LoRA or connect a Flux model."
    )
    with pytest.raises(ValueError) as e:
        LORA_LOADER.execute(model=model, lora_name="wide.safetensors", strength_model=1.0)
    msg = str(e.value)
    assert msg.startswith("rCM LoRA Loader, lora_name='wide.safetensors': 1 LoRA key(s) do not match the model: ")
    assert msg.endswith("; pick a LoRA made for this model size and variant.") and msg.count("wide.safetensors") == 1
    assert msg.lower().count("pick") == 1 and "\n" not in msg


def test_stochastic_is_documented_as_comfyui_delivers_it():
    """ComfyUI converts a BOOLEAN widget's value with bool() before any node code sees it (execution.validate_inputs),
    so the node cannot refuse an API prompt's "false" (it arrives as True): the docs no longer say it refuses a
    non-bool stochastic, and say what ComfyUI does instead; the widget stays a BOOLEAN (saved workflows keep
    loading)."""
    from comfy_nodes.nodes import RCM_SAMPLER, _rcm_sampler_options

    (widget,) = [i for i in RCM_SAMPLER.inputs if i.name == "stochastic"]
    assert widget.kind == "BOOLEAN" and widget.extra["default"] is True
    assert _rcm_sampler_options(bool("false")) == {"stochastic": True, "time_input": "bf16"}  # what the node receives
    with open(os.path.join(REPO, "docs", "comfyui.md")) as f:
        doc = " ".join(f.read().split())
    assert "refuses a `stochastic`" not in doc
    assert "ComfyUI turns the value of `stochastic` into a bool with Python's `bool()`" in doc
    assert "JSON true or false" in widget.extra["tooltip"]


# ----------------------------------------------------------------------------- node declarations


def test_every_input_and_output_of_every_node_has_a_tooltip():
    from comfy_nodes.nodes import NODES

    assert len(NODES) == 5
    missing = [f"{n.node_id}.{i.name}" for n in NODES for i in n.inputs if not i.extra.get("tooltip")]
    missing += [f"{n.node_id} output {o.name or o.kind}" for n in NODES for o in n.outputs if not o.tooltip]
    assert missing == []


def test_widget_ranges_refuse_what_the_node_refuses():
    """Each numeric widget's range excludes the values its node refuses (so the editor refuses them first), and the
    range's ends are values the node takes."""
    from comfy_nodes.nodes import EXPERT_SPLIT, RCM_SIGMAS

    w = {i.name: i.extra for i in RCM_SIGMAS.inputs}
    for sigma_max in (0.0, -1.0):
        assert sigma_max < w["sigma_max"]["min"]
        with pytest.raises(ValueError, match="sigma_max must be > 0"):
            comfy.rcm_sigmas(1, sigma_max, "")
    comfy.rcm_sigmas(1, w["sigma_max"]["min"], "")  # the smallest widget value runs (one step, no angle)
    comfy.rcm_sigmas(w["steps"]["min"], 80.0)
    assert w["steps"]["min"] == 1 and w["steps"]["max"] == 8
    comfy.rcm_sigmas(8, 5000.0, "1.5, 1.4, 1.3, 1.2, 1.1, 1.0, 0.9")  # steps max with 7 angles
    b = next(i.extra for i in EXPERT_SPLIT.inputs if i.name == "boundary")
    assert 0 < b["min"] and b["max"] < 1
    for boundary in (0.0, 1.0):
        with pytest.raises(ValueError, match=r"must lie in \(0, 1\)"):
            comfy.split_sigmas_at_boundary(comfy.rcm_sigmas(4), boundary)


def test_a_bad_rcm_sigmas_value_is_one_error_naming_it():
    """ComfyUI reports a failed validate once for each input the function takes: a bad mid_t was reported three
    times, the first flagging steps. The check now takes mid_t alone; a combination that does not fit is one line
    when the node runs."""
    import inspect

    from comfy_nodes.nodes import RCM_SIGMAS

    assert inspect.getfullargspec(RCM_SIGMAS.validate).args == ["cls", "mid_t"]
    assert RCM_SIGMAS.validate(None, mid_t="1.5, 1.4, 1.0") is True
    assert RCM_SIGMAS.validate(None, mid_t=None) is True
    assert RCM_SIGMAS.validate(None, mid_t="1.5, x") == (
        "rCM Sigmas: mid_t: cannot read ['x'] as numbers in '1.5, x'; write the intermediate TrigFlow angles as "
        "decreasing numbers separated by commas, e.g. '1.5, 1.4, 1.0' (or per step count, '2: 1.0; 4: 1.5, 1.4, 0.8')."
    )
    # the per-step-count form: read when queued, a bad entry is one line naming it
    assert RCM_SIGMAS.validate(None, mid_t="2: 1.0; 4: 1.5, 1.4, 0.8") is True
    bad = RCM_SIGMAS.validate(None, mid_t="2: 1.0; 4: 1.4, 1.5, 0.8")
    assert bad.startswith("rCM Sigmas: mid_t: angles must strictly decrease") and "entry for 4 steps" in bad
    assert "\n" not in bad
    with pytest.raises(
        ValueError,
        match=r"^rCM Sigmas: steps=5 is out of range: with mid_t='2: 1.0; 4: 1.5, 1.4, 0.8' "
        r"the rCM sampler takes 1..4 steps \(angles for 2, 4 steps",
    ):
        RCM_SIGMAS.execute(steps=5, sigma_max=80.0, mid_t="2: 1.0; 4: 1.5, 1.4, 0.8")
    with pytest.raises(ValueError, match=r"^rCM Sigmas: steps=6 is out of range: with mid_t=\[1.5, 1.4, 1.0\]"):
        RCM_SIGMAS.execute(steps=6, sigma_max=80.0, mid_t="1.5, 1.4, 1.0")
    with pytest.raises(ValueError, match=r"^rCM Sigmas: .*arctan\(sigma_max=2.0\)"):
        RCM_SIGMAS.execute(steps=4, sigma_max=2.0, mid_t="1.5, 1.4, 1.0")


# ----------------------------------------------------------------------------- the pack as ComfyUI loads it

REPO = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))

_LOAD_AS_COMFYUI_DOES = r"""
import importlib.abc, importlib.util, json, os, sys

class Block(importlib.abc.MetaPathFinder):  # what a ComfyUI environment need not have
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("diffusers", "transformers", "peft", "accelerate", "comfy_api", "comfy"):
            raise ImportError(f"blocked: {name}")

sys.meta_path.insert(0, Block())
repo = sys.argv[1]
# ComfyUI's custom-node loader: the folder's __init__.py under the folder's name
spec = importlib.util.spec_from_file_location("rcm-diffusers", os.path.join(repo, "__init__.py"))
pack = importlib.util.module_from_spec(spec)
sys.modules["rcm-diffusers"] = pack
spec.loader.exec_module(pack)
m = pack.NODE_CLASS_MAPPINGS
sig = m["RCMSigmas"]
(sigmas,) = getattr(sig(), sig.FUNCTION)(steps=4, sigma_max=80.0, mid_t="1.5, 1.4, 1.0")
print(json.dumps({
    "entrypoint": hasattr(pack, "comfy_entrypoint"),
    "nodes": sorted(m), "names": pack.NODE_DISPLAY_NAME_MAPPINGS,
    "sigmas": sigmas.tolist(), "input_types": sig.INPUT_TYPES(),
    "return_types": {k: list(v.RETURN_TYPES) for k, v in m.items()},
    "sampler_input_types": m["RCMSampler"].INPUT_TYPES(),
    "validate_ok": sig.VALIDATE_INPUTS(mid_t="1.5, 1.4, 1.0"),
    "validate_bad": sig.VALIDATE_INPUTS(mid_t="1.5, 1.4.0"),
    "validate_linked": sig.VALIDATE_INPUTS(mid_t=None),
    "validate_args": __import__("inspect").getfullargspec(sig.VALIDATE_INPUTS).args,
    "output_tooltips": {k: list(v.OUTPUT_TOOLTIPS) for k, v in m.items()},
    "heavy": sorted(k for k in sys.modules if k.split(".")[0] in ("diffusers", "transformers", "peft", "accelerate")),
    "rcm_from": os.path.dirname(sys.modules["rcm_diffusers"].__file__),
}))
"""


def test_pack_loads_from_the_repository_root_with_the_legacy_api_and_comfyuis_own_packages_only():
    """A clone in custom_nodes/ loads through the root __init__.py; without comfy_api.latest it exports the
    legacy mapping only (ComfyUI prefers that when both exist), built from the same declarations; and it
    imports nothing beyond ComfyUI's own requirements (no diffusers/transformers/peft/accelerate)."""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_AS_COMFYUI_DOES, REPO],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["entrypoint"] is False and r["heavy"] == []
    assert r["rcm_from"] == os.path.join(REPO, "rcm_diffusers")
    assert r["nodes"] == ["RCMExpertSplit", "RCMLoraLoader", "RCMSampler", "RCMSigmas", "TrigFlowTeacherSigmas"]
    assert r["names"]["RCMSigmas"] == "rCM Sigmas"
    np.testing.assert_allclose(r["sigmas"], SPEC_4STEP, atol=1e-5, rtol=0)
    steps = r["input_types"]["required"]["steps"]
    assert steps[0] == "INT" and steps[1]["default"] == 4 and steps[1]["min"] == 1
    assert r["input_types"]["optional"]["model"][0] == "MODEL"
    assert r["return_types"]["RCMExpertSplit"] == ["SIGMAS", "SIGMAS"] and r["return_types"]["RCMSampler"] == [
        "SAMPLER"
    ]
    assert r["validate_ok"] is True and r["validate_linked"] is True
    sampler = r["sampler_input_types"]
    assert list(sampler["required"]) == ["stochastic"] and list(sampler["optional"]) == ["time_input"]
    assert (
        sampler["optional"]["time_input"][0] == ["bf16", "float"]
        and sampler["optional"]["time_input"][1]["default"] == "bf16"
    )
    assert r["validate_bad"].startswith("rCM Sigmas: mid_t: cannot read ['1.4.0'] as numbers")
    # ComfyUI reports a failed validate once per argument: mid_t only, so a bad mid_t is one error naming mid_t
    assert r["validate_args"] == ["cls", "mid_t"]
    assert all(t and all(t) for t in r["output_tooltips"].values()), r["output_tooltips"]


def test_setuptools_ships_only_the_rcm_diffusers_package():
    """The root __init__.py (ComfyUI entry) and comfy_nodes/ are not part of the Python package."""
    import tomllib
    from setuptools import find_packages

    with open(f"{REPO}/pyproject.toml", "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    found = find_packages(where=REPO, include=include)
    assert "rcm_diffusers" in found and all(p.split(".")[0] == "rcm_diffusers" for p in found), found


def test_comfy_registry_fields():
    """pyproject.toml carries what the Comfy Registry's pyproject specification requires (docs.comfy.org,
    registry/specifications): a node id, a semver version, [project.urls] Repository, PublisherId, DisplayName, a
    square icon of at most 400x400 given as a URL (its raw form in the repository), requires-comfyui."""
    import re

    import tomllib
    from PIL import Image

    with open(f"{REPO}/pyproject.toml", "rb") as f:
        conf = tomllib.load(f)
    project, comfy_conf = conf["project"], conf["tool"]["comfy"]
    name = project["name"]
    assert len(name) < 100 and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*([-_.][A-Za-z0-9]+)*", name), name
    assert "comfyui" not in name.lower()
    assert re.fullmatch(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)", project["version"]), project["version"]
    assert project["description"] and set(project["license"]) <= {"text", "file"}
    repo_url = project["urls"]["Repository"]
    m = re.fullmatch(r"https://github\.com/([\w.-]+)/([\w.-]+)", repo_url)
    assert m, repo_url
    assert comfy_conf["PublisherId"] and comfy_conf["DisplayName"]
    icon = comfy_conf["Icon"]
    prefix = f"https://raw.githubusercontent.com/{m[1]}/{m[2]}/main/"
    assert icon.startswith(prefix), icon
    path = os.path.join(REPO, icon[len(prefix) :])
    with Image.open(path) as im:
        assert im.format == "PNG" and im.width == im.height <= 400, (im.format, im.size)
    # the ComfyUI version the tests/comfyui suite runs against, and no older one
    assert comfy_conf["requires-comfyui"] == ">=0.29.0"
    assert comfy_conf["includes"] == []
