"""RCMScheduler in every stock flow-matching pipeline of diffusers (tiny random models, tests/flow_models.py).

For each pipeline, 1 to 4 steps: the grid every scheduler of the pipeline ends up with is ``rcm_rf_times(n)``, the
transformer sees ``bf16(1000 r_i)`` in the pipeline's own time convention, the output is finite and not constant,
the pipeline's form of its default grid is pinned (what it hands ``set_timesteps``), ``mu`` is accepted and ignored,
and with a generator list sample ``i`` depends on generator ``i`` only.
"""

import functools
import inspect
import math

import diffusers
import numpy as np
import pytest
import torch
from flow_models import CASES, case
from packaging.version import Version

from rcm_diffusers import RCMScheduler
from rcm_diffusers.sampling import DEFAULT_MID_T, rcm_rf_times


def _mochi_schedule(n):
    from diffusers.pipelines.mochi.pipeline_mochi import linear_quadratic_schedule

    return linear_quadratic_schedule(n, 0.025)


def _stable_audio3_schedule(n):
    """Stable Audio 3's log-SNR schedule at the pipeline's default log-SNR range (a list; its first time is 1)."""
    from diffusers.pipelines.stable_audio_3.pipeline_stable_audio_3 import logsnr_sigma_schedule

    params = inspect.signature(diffusers.StableAudio3Pipeline.__call__).parameters
    return logsnr_sigma_schedule(n, params["logsnr_min"].default, params["logsnr_max"].default)


GRID_FORMS = {
    # set_timesteps(num_inference_steps)
    "steps": None,
    # sigmas=np.linspace(1, 1/n, n): float64, bit-equal to k/n only for n = 1, 2, 4, 8, ...
    "np.linspace(1, 1/n, n)": lambda n: {"sigmas": np.linspace(1.0, 1 / n, n)},
    # sigmas=np.linspace(1, 0, n+1)[:-1]
    "np.linspace(1, 0, n+1)[:-1]": lambda n: {"sigmas": np.linspace(1.0, 0.0, n + 1)[:-1]},
    # sigmas=torch.linspace(1, 1/n, n).tolist(): float32 values
    "torch.linspace(1, 1/n, n).tolist()": lambda n: {"sigmas": torch.linspace(1.0, 1 / n, n).tolist()},
    # Mochi's linear-quadratic schedule (threshold 0.025), as np.array
    "mochi linear-quadratic": lambda n: {"sigmas": np.array(_mochi_schedule(n))},
    # Stable Audio 3's log-SNR schedule, as a list
    "stable audio 3 log-SNR": lambda n: {"sigmas": _stable_audio3_schedule(n)},
    # timesteps=int(linspace(1000, 1, n)) and sigmas=timesteps/1000, both at once
    "timesteps=int(linspace(1000, 1, n)), sigmas=timesteps/1000": lambda n: {
        "timesteps": np.linspace(1000, 1.0, n).astype(np.int64).astype(np.float32),
        "sigmas": np.linspace(1000, 1.0, n).astype(np.int64).astype(np.float32) / 1000,
    },
    # sigmas=torch.linspace(1, 0, n+1)[:-1]: a float32 tensor
    "float32 tensor torch.linspace(1, 0, n+1)[:-1]": lambda n: {"sigmas": torch.linspace(1.0, 0.0, n + 1)[:-1]},
    # timesteps=int(linspace(1000, 1, n+1)[:-1]) and sigmas=timesteps/1000, both at once (float32)
    "timesteps=int(linspace(1000, 1, n+1)[:-1]), sigmas=timesteps/1000": lambda n: {
        "timesteps": np.linspace(1000, 1.0, n + 1)[:-1].astype(np.int64).astype(np.float32),
        "sigmas": np.linspace(1000, 1.0, n + 1)[:-1].astype(np.int64).astype(np.float32) / 1000,
    },
    # Bria's training sigmas: linspace(1, 1000, 1000)[::-1] / 1000 (float32) at indices int(linspace(0, 999, n))
    "bria training sigmas": lambda n: {
        "sigmas": (np.linspace(1, 1000, 1000, dtype=np.float32)[::-1] / 1000)[[int(i) for i in np.linspace(0, 999, n)]]
    },
}

# pipeline -> (its default-grid form, or {first diffusers version: form}; whether it passes mu; the time the
# transformer gets from timestep = 1000 r)
TABLE = {
    "Wan 2.1": ("steps", False, "t"),
    "Wan 2.2": ("steps", False, "t"),
    "FLUX.1": ("np.linspace(1, 1/n, n)", True, "t/1000"),
    "FLUX.2": ("np.linspace(1, 1/n, n)", True, "t/1000"),
    "Qwen-Image": ("np.linspace(1, 1/n, n)", True, "t/1000"),
    "Z-Image": ({"0.37": "steps", "0.39": "torch.linspace(1, 1/n, n).tolist()"}, True, "(1000-t)/1000"),
    "SD3": ("steps", False, "t"),
    "Chroma": ("np.linspace(1, 1/n, n)", True, "t/1000"),
    "CogView4": ("timesteps=int(linspace(1000, 1, n)), sigmas=timesteps/1000", True, "t"),
    "SkyReels V2": ("steps", False, "t"),
    "SanaVideo": ("steps", False, "t"),
    "HunyuanVideo-1.5": ("np.linspace(1, 0, n+1)[:-1]", False, "t"),
    "LTX-2": ("np.linspace(1, 1/n, n)", True, "t"),
    "HiDream": ("steps", True, "t"),
    "FLUX.2 [klein]": ("np.linspace(1, 1/n, n)", True, "t/1000"),
    "AuraFlow": ("steps", False, "t/1000"),
    "Lumina 2": ("np.linspace(1, 1/n, n)", True, "(1000-t)/1000"),
    "HunyuanVideo": ("np.linspace(1, 0, n+1)[:-1]", False, "t"),
    "LTX-Video": ("np.linspace(1, 1/n, n)", True, "t"),
    # Mochi passes its own linear-quadratic schedule: not a default form, so its times are used as given
    "Mochi": ("mochi linear-quadratic", False, "t"),
    "Krea 2": ("np.linspace(1, 1/n, n)", True, "t/1000"),
    "LongCat-Image": ("np.linspace(1, 1/n, n)", True, "t/1000"),
    "Ovis-Image": ("np.linspace(1, 1/n, n)", True, "t/1000"),
    "NucleusMoE-Image": ("np.linspace(1, 1/n, n)", True, "t/1000"),
    "ERNIE-Image": ("float32 tensor torch.linspace(1, 0, n+1)[:-1]", False, "t"),
    "HunyuanImage-2.1": ("np.linspace(1, 0, n+1)[:-1]", False, "t"),
    "Kandinsky 5 T2I": ("steps", False, "t"),
    "Kandinsky 5 T2V": ("steps", False, "t"),
    "Lumina-Next": ("steps", False, "(1000-t)/1000"),
    "PRX": ("steps", False, "t/1000"),
    "Sana PAG": ("steps", False, "t"),
    # not a FlowMatchEulerDiscreteScheduler: Bria takes the "training sigmas" branch, int(linspace(0, 999, n)) indices
    "Bria": ("bria training sigmas", False, "t"),
    "GLM-Image": ("timesteps=int(linspace(1000, 1, n+1)[:-1]), sigmas=timesteps/1000", True, "t-1"),
    "Qwen-Image 2.1": ("np.linspace(1, 1/n, n)", True, "t/1000"),
    "SD3 PAG": ("steps", False, "t"),
    # predicts the clean image; the pipeline turns it into a velocity, (x - x0) / max(r, 0.05)
    "PRX pixel": ("steps", False, "t/1000"),
    # mu=1 only for a FlowMatchEulerDiscreteScheduler
    "EasyAnimate": ("steps", False, "t"),
    # its own log-SNR schedule, used as given from 2 steps; its 1-step schedule is [1.0], the 1-step default form;
    # num_train_timesteps=1: the timesteps are bf16(r)
    "Stable Audio 3": ("stable audio 3 log-SNR", False, "t"),
}
#: pipelines whose default times are not one of the recognised forms: the grid is theirs, not rCM's
#: (steps tested, the RF times used for n steps, final 0 included)
OWN_GRID = {
    # the schedule divides by n // 2: no 1 step
    "Mochi": ((2, 3, 4), lambda n: np.append(_mochi_schedule(n), 0.0)),
    "Stable Audio 3": (
        (1, 2, 3, 4),
        lambda n: rcm_rf_times(1, 80.0, DEFAULT_MID_T) if n == 1 else np.append(_stable_audio3_schedule(n), 0.0),
    ),
}
TIME_SEEN = {
    "t": lambda t: t,
    "t/1000": lambda t: t / 1000,
    "(1000-t)/1000": lambda t: (1000 - t) / 1000,
    "t-1": lambda t: t - 1,
}


def _form(entry):
    """The form for the installed diffusers: the entry of the latest version not above it."""
    if isinstance(entry, str):
        return entry
    installed = Version(diffusers.__version__).release[:2]
    return [
        form for v, form in sorted(entry.items(), key=lambda kv: Version(kv[0])) if Version(v).release <= installed
    ][-1]


def _available(name):
    c = case(name)
    return pytest.param(name, marks=pytest.mark.skipif(not c.available, reason=f"diffusers without {c.pipeline}"))


NAMES = [_available(c.name) for c in CASES]


def test_table_covers_every_case():
    assert sorted(TABLE) == sorted(c.name for c in CASES)


def _spy(scheduler, calls):
    """Record every ``set_timesteps`` call (args, kwargs, the grid it made); survives ``copy.deepcopy`` (LTX-2 copies
    the scheduler for its audio latents), whose copy records into the same list."""
    stock = type(scheduler).set_timesteps

    @functools.wraps(stock)  # pipelines inspect the signature for `sigmas` / `timesteps`
    def set_timesteps(self, *args, **kwargs):
        stock(self, *args, **kwargs)
        calls.append((args, kwargs, self.rf_times.copy()))

    scheduler.set_timesteps = set_timesteps.__get__(scheduler)


def _time_recorder(pipe, c, seen):
    def hook(_module, args, kwargs):
        t = kwargs.get(c.t_arg) if isinstance(c.t_arg, str) else args[c.t_arg]
        seen.append(float(t.reshape(-1)[0]))

    return [
        m.register_forward_pre_hook(hook, with_kwargs=True)
        for m in (getattr(pipe, "transformer", None), getattr(pipe, "transformer_2", None))
        if m is not None
    ]


def _call(pipe, c, batch=None, **kw):
    """The pipeline's call with the case's arguments (for ``batch`` samples); those this diffusers version's pipeline
    lacks are left out."""
    params = inspect.signature(type(pipe).__call__).parameters
    base = c.kwargs() if batch is None else c.batch_kwargs(batch)
    args = {k: v for k, v in {**base, **kw}.items() if k in params}
    return getattr(pipe(**args), c.out)


def _bf16_timesteps(r, num_train_timesteps=1000):
    return [
        float(torch.tensor(float(np.float32(x)) * num_train_timesteps, dtype=torch.float32).to(torch.bfloat16))
        for x in r
    ]


def _assert_form(form, call, n):
    args, kwargs, _ = call
    if GRID_FORMS[form] is None:
        assert (args[:1] == (n,) or kwargs.get("num_inference_steps") == n) and "sigmas" not in kwargs, call
        return
    for key, want in GRID_FORMS[form](n).items():
        got = kwargs[key]
        assert type(got) is type(want), (key, type(got), type(want))
        assert np.array_equal(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)), (key, got, want)


@pytest.mark.parametrize("name", NAMES)
def test_rcm_grid_in_stock_pipeline(name):
    c = case(name)
    form, passes_mu, time_seen = TABLE[name]
    form = _form(form)
    pipe = c.build()
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config)
    calls, seen = [], []
    _spy(pipe.scheduler, calls)
    hooks = _time_recorder(pipe, c, seen)
    for n in OWN_GRID[name][0] if name in OWN_GRID else (1, 2, 3, 4):
        calls.clear(), seen.clear()
        out = _call(pipe, c, num_inference_steps=n, generator=torch.Generator().manual_seed(n))
        grid = rcm_rf_times(n, 80.0, DEFAULT_MID_T) if name not in OWN_GRID else OWN_GRID[name][1](n)
        assert calls and all(np.array_equal(rf, grid) for *_, rf in calls), (n, calls)
        _assert_form(form, calls[0], n)
        assert ("mu" in calls[0][1]) == passes_mu  # passed by the pipeline, and the grid above ignores it
        want = [TIME_SEEN[time_seen](t) for t in _bf16_timesteps(grid[:-1], pipe.scheduler.config.num_train_timesteps)]
        assert seen == pytest.approx(want, rel=1e-6, abs=1e-6), (n, seen, want)
        out = out[0] if isinstance(out, (list, tuple)) else out
        assert torch.isfinite(out).all() and out.std() > 1e-3
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("name", NAMES)
def test_generator_list_sample_i_depends_only_on_generator_i(name):
    c = case(name)
    pipe = c.build()
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config)

    def run(seeds):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        out = _call(pipe, c, batch=len(seeds), num_inference_steps=2, generator=gens)
        return out if isinstance(out, torch.Tensor) else torch.stack(list(out))

    a, b = run([0, 1]), run([0, 5])
    # float32 round-off of O(1) latents over 2 steps; another generator changes a sample by O(1)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-5)
    assert (a[1] - b[1]).abs().max() > 0.1


def test_mu_is_accepted_and_ignored():
    for mu in (None, 0.0, 1.3, math.log(3.0)):
        s = RCMScheduler()
        s.set_timesteps(3, mu=mu)
        assert np.array_equal(s.rf_times, rcm_rf_times(3))


# ----------------------------------------------------------------------------- the default-grid forms, 1 to 8 steps


DEFAULT_FORMS = {
    "np.linspace(1, 1/n, n)": lambda n: dict(sigmas=np.linspace(1.0, 1 / n, n)),
    "np.linspace(1, 0, n+1)[:-1]": lambda n: dict(sigmas=np.linspace(1.0, 0.0, n + 1)[:-1]),
    "np.linspace(1, 0, n+1) with its 0": lambda n: dict(sigmas=np.linspace(1.0, 0.0, n + 1)),
    "torch.linspace(1, 1/n, n).tolist()": lambda n: dict(sigmas=torch.linspace(1.0, 1 / n, n).tolist()),
    "float32 tensor torch.linspace(1, 0, n+1)[:-1]": lambda n: dict(sigmas=torch.linspace(1.0, 0.0, n + 1)[:-1]),
    "timesteps=np.linspace(1000, 1, n)": lambda n: dict(timesteps=np.linspace(1000.0, 1.0, n)),
    "CogView4 timesteps + sigmas": lambda n: dict(
        timesteps=np.linspace(1000, 1.0, n).astype(np.int64).astype(np.float32),
        sigmas=np.linspace(1000, 1.0, n).astype(np.int64).astype(np.float32) / 1000,
    ),
    "GLM-Image timesteps + sigmas": GRID_FORMS["timesteps=int(linspace(1000, 1, n+1)[:-1]), sigmas=timesteps/1000"],
    "GLM-Image timesteps alone": lambda n: dict(timesteps=np.linspace(1000, 1.0, n + 1)[:-1]),
    "Bria training sigmas": GRID_FORMS["bria training sigmas"],
}


@pytest.mark.parametrize("form", list(DEFAULT_FORMS))
def test_every_default_form_reads_as_n_steps_of_the_rcm_grid(form):
    """1 to 8 steps (a mid_t of 7 angles): each form, bit-equal to k/n or not, gives the rCM grid; so do the teacher
    schedulers their own grid."""
    from rcm_diffusers import TrigFlowEulerScheduler

    mid_t = [1.5, 1.45, 1.4, 1.3, 1.2, 1.0, 0.8]
    for n in range(1, 9):
        s = RCMScheduler(mid_t=mid_t)
        s.set_timesteps(**DEFAULT_FORMS[form](n), mu=0.7)
        assert np.array_equal(s.rf_times, rcm_rf_times(n, 80.0, mid_t)), (form, n)
        teacher, ref = TrigFlowEulerScheduler(), TrigFlowEulerScheduler()
        teacher.set_timesteps(**DEFAULT_FORMS[form](n))
        ref.set_timesteps(n)
        assert np.array_equal(teacher.rf_times, ref.rf_times), (form, n)


def test_explicit_times_stay_explicit():
    """Times that are not a default form are used as given: user grids, a uniform grid that does not start at 1,
    times just off a default form, CogView4 with the user's sigmas (its timesteps then the default ones) or the user's
    timesteps."""
    for kw, want in [
        (dict(sigmas=[0.9, 0.6, 0.3]), [0.9, 0.6, 0.3]),
        (dict(sigmas=np.linspace(0.99, 0.33, 3)), [0.99, 0.66, 0.33]),
        (dict(sigmas=[1.0, 0.5 + 1e-3]), [1.0, 0.501]),  # 1e-3 off the 2-step default: explicit
        (dict(sigmas=[1.0, 0.667, 0.335]), [1.0, 0.667, 0.335]),  # 1e-3 off GLM-Image's 3-step default: explicit
        (
            dict(timesteps=np.linspace(1000, 1.0, 3).astype(np.int64).astype(np.float32), sigmas=[0.9, 0.6, 0.3]),
            [0.9, 0.6, 0.3],
        ),
        (
            dict(timesteps=np.array([900.0, 600.0, 300.0]), sigmas=np.array([900.0, 600.0, 300.0]) / 1000),
            [0.9, 0.6, 0.3],
        ),
    ]:
        s = RCMScheduler(time_input="float")
        s.set_timesteps(**kw)
        np.testing.assert_allclose(s.rf_times, [*want, 0.0], rtol=0, atol=1e-12)


def test_disagreeing_sigmas_and_timesteps_are_refused():
    with pytest.raises(ValueError, match=r"sigmas \(RF times\) and timesteps disagree"):
        RCMScheduler().set_timesteps(sigmas=[0.9, 0.6], timesteps=[700.0, 300.0])


# ----------------------------------------------------------------------------- coverage of diffusers' pipelines

_I2I = "img2img variant of {}: the same grid code, then `strength` cuts it (a tail of the rCM grid)"
_INPAINT = "inpainting variant of {}: the same grid code, with a mask"
_CONTROL = "control variant of {}: the same grid code plus a control image / ControlNet"
_EDIT = "image-conditioned variant of {}: the same grid code plus reference-image latents"

#: every FlowMatch pipeline of diffusers that is no case of the table above, and why
NOT_COVERED = {
    # text-to-X pipelines the table does not run
    "AceStepPipeline": "text-to-music: no prompt_embeds (needs its Qwen3 text encoder, tokenizer and audio tokenizer); "
    "passes its own shifted schedule as sigmas to a num_train_timesteps=1 scheduler",
    "BriaFibo2Pipeline": "text-to-image with FLUX's np.linspace(1, 1/n, n) and mu: no tiny case yet",
    "BriaFiboPipeline": "no prompt_embeds: needs its SmolLM3 text encoder and tokenizer",
    "Cosmos2TextToImagePipeline": "EDM pipeline: passes the Karras ramp linspace(0, 1, n) as sigmas and reads "
    "scheduler.sigmas as EDM sigmas (latents x sigma_max 80); RCMScheduler's sigmas are RF times (it refuses the "
    "increasing ramp)",
    "DreamLitePipeline": "a UNet pipeline without prompt_embeds: needs its text encoder, tokenizer and processor",
    "DreamLiteMobilePipeline": "distilled DreamLitePipeline: a UNet pipeline without prompt_embeds",
    "Ideogram4Pipeline": "no prompt_embeds (needs its text encoder and tokenizer); passes its own logit-normal "
    "sigmas: the rCM grid would not be used",
    "LongCatAudioDiTPipeline": "text-to-audio without prompt_embeds: needs its UMT5 text encoder and tokenizer (and "
    "reads the audio VAE's config)",
    "OmniGenPipeline": "no prompt_embeds: its processor tokenizes the prompt (needs the OmniGen tokenizer)",
    # image / video / audio conditioned variants
    "BriaFiboEditPipeline": _EDIT.format("BriaFiboPipeline") + "; no prompt_embeds either",
    "ChromaImg2ImgPipeline": _I2I.format("ChromaPipeline"),
    "ChromaInpaintPipeline": _INPAINT.format("ChromaPipeline"),
    "ChronoEditPipeline": "image-to-video edit on Wan (set_timesteps(n) as WanPipeline) with an image encoder",
    "CogView4ControlPipeline": _CONTROL.format("CogView4Pipeline"),
    "Cosmos2VideoToWorldPipeline": "video-to-world variant of the EDM Cosmos2TextToImagePipeline (Karras ramp sigmas)",
    "EasyAnimateControlPipeline": _CONTROL.format("EasyAnimatePipeline"),
    "EasyAnimateInpaintPipeline": _INPAINT.format("EasyAnimatePipeline"),
    "Flux2KleinInpaintPipeline": _INPAINT.format("Flux2KleinPipeline"),
    "Flux2KleinKVPipeline": _EDIT.format("Flux2KleinPipeline") + ", KV-cached",
    "FluxControlImg2ImgPipeline": _I2I.format("FluxPipeline") + ", with a control image",
    "FluxControlInpaintPipeline": _INPAINT.format("FluxPipeline") + ", with a control image",
    "FluxControlNetImg2ImgPipeline": _I2I.format("FluxPipeline") + ", with a ControlNet",
    "FluxControlNetInpaintPipeline": _INPAINT.format("FluxPipeline") + ", with a ControlNet",
    "FluxControlNetPipeline": _CONTROL.format("FluxPipeline"),
    "FluxControlPipeline": _CONTROL.format("FluxPipeline"),
    "FluxFillPipeline": _INPAINT.format("FluxPipeline"),
    "FluxImg2ImgPipeline": _I2I.format("FluxPipeline"),
    "FluxInpaintPipeline": _INPAINT.format("FluxPipeline"),
    "FluxKontextInpaintPipeline": _INPAINT.format("FluxKontextPipeline"),
    "FluxKontextPipeline": _EDIT.format("FluxPipeline"),
    "HunyuanImageRefinerPipeline": "refiner of HunyuanImagePipeline's images: the same np.linspace(1, 0, n+1)[:-1] "
    "grid, conditioned on the image",
    "HunyuanSkyreelsImageToVideoPipeline": "image-to-video variant of HunyuanVideoPipeline: the same grid code",
    "HunyuanVideo15ImageToVideoPipeline": "image-to-video variant of HunyuanVideo15Pipeline: the same grid code",
    "HunyuanVideoFramepackPipeline": "image-to-video (needs an image and its image encoder), in sections of frames: "
    "HunyuanVideoPipeline's np.linspace(1, 0, n+1)[:-1] grid with mu",
    "HunyuanVideoImageToVideoPipeline": "image-to-video variant of HunyuanVideoPipeline: the same grid code",
    "JoyImageEditPipeline": "image edit: needs the image and its vision-language processor",
    "JoyImageEditPlusPipeline": "multi-image edit variant of JoyImageEditPipeline",
    "Kandinsky5I2IPipeline": "image-to-image variant of Kandinsky5T2IPipeline: the same set_timesteps(n)",
    "Kandinsky5I2VPipeline": "image-to-video variant of Kandinsky5T2VPipeline: the same set_timesteps(n)",
    "Kandinsky6SRPipeline": "video super-resolution: needs a video and a latent upscaler",
    "Kandinsky6TI2VAPipeline": "text/image-to-video-and-audio (video and audio latents, audio VAE, vocoder): no tiny "
    "case yet",
    "LTX2ConditionPipeline": "conditioned variant of LTX2Pipeline (frame conditions): the same grid code",
    "LTX2DFRPipeline": "one denoise pass over sigmas given by the caller (no grid of its own)",
    "LTX2HDRPipeline": "reference-video variant of LTX2Pipeline: the same grid code",
    "LTX2ImageToVideoPipeline": "image-to-video variant of LTX2Pipeline: the same grid code",
    "LTX2InContextPipeline": "in-context (reference video) variant of LTX2Pipeline: the same grid code",
    "LTXConditionPipeline": "conditioned variant of LTXPipeline (image / video conditions, strength)",
    "LTXI2VLongMultiPromptPipeline": "long image-to-video in windows, without prompt_embeds (needs its text encoder)",
    "LTXImageToVideoPipeline": "image-to-video variant of LTXPipeline: the same grid code",
    "LongCatImageEditPipeline": _EDIT.format("LongCatImagePipeline"),
    "LucyEditPipeline": "video-to-video edit on Wan (set_timesteps(n) as WanPipeline): needs the input video",
    "QwenImageControlNetInpaintPipeline": _INPAINT.format("QwenImagePipeline") + ", with a ControlNet",
    "QwenImageControlNetPipeline": _CONTROL.format("QwenImagePipeline"),
    "QwenImageEditInpaintPipeline": _INPAINT.format("QwenImageEditPipeline"),
    "QwenImageEditPipeline": _EDIT.format("QwenImagePipeline"),
    "QwenImageEditPlusPipeline": _EDIT.format("QwenImagePipeline") + ", several images",
    "QwenImageImg2ImgPipeline": _I2I.format("QwenImagePipeline"),
    "QwenImageInpaintPipeline": _INPAINT.format("QwenImagePipeline"),
    "QwenImageLayeredPipeline": "image decomposition into layers: needs the input image",
    "SanaImageToVideoPipeline": "image-to-video variant of SanaVideoPipeline",
    "SanaWMPipeline": "camera-controlled image-to-video: needs an image and camera poses",
    "StableAudio3AudioToAudioPipeline": "audio-to-audio variant of StableAudio3Pipeline (its own log-SNR sigmas)",
    "StableAudio3InpaintPipeline": "inpainting variant of StableAudio3Pipeline (its own log-SNR sigmas)",
    "StableDiffusion3ControlNetInpaintingPipeline": _INPAINT.format("StableDiffusion3Pipeline") + ", with a ControlNet",
    "StableDiffusion3ControlNetPipeline": _CONTROL.format("StableDiffusion3Pipeline"),
    "StableDiffusion3Img2ImgPipeline": _I2I.format("StableDiffusion3Pipeline"),
    "StableDiffusion3InpaintPipeline": _INPAINT.format("StableDiffusion3Pipeline"),
    "StableDiffusion3PAGImg2ImgPipeline": _I2I.format("StableDiffusion3PAGPipeline"),
    "VisualClozeGenerationPipeline": "in-context generation from example images (needs the images)",
    "VisualClozePipeline": "VisualClozeGenerationPipeline followed by an upsampling pass",
    "WanImageToVideoPipeline": "image-to-video variant of WanPipeline: tested with tiny Wan 2.1 / 2.2 I2V in "
    "tests/test_pipelines.py",
    "WanVACEPipeline": _CONTROL.format("WanPipeline") + " (VACE video / mask / reference images)",
    "WanVideoToVideoPipeline": _I2I.format("WanPipeline") + " (input video)",
    "ZImageControlNetInpaintPipeline": _INPAINT.format("ZImagePipeline") + ", with a ControlNet",
    "ZImageControlNetPipeline": _CONTROL.format("ZImagePipeline"),
    "ZImageImg2ImgPipeline": _I2I.format("ZImagePipeline"),
    "ZImageInpaintPipeline": _INPAINT.format("ZImagePipeline"),
    "ZImageOmniPipeline": _EDIT.format("ZImagePipeline") + " (SigLIP image features)",
}


def flow_match_pipelines() -> set[str]:
    """Every pipeline class of the installed diffusers whose ``scheduler`` argument is annotated with a FlowMatch
    scheduler (those whose module fails to import are left out)."""
    names = set()
    for name in dir(diffusers):
        if "Pipeline" not in name:
            continue
        try:
            cls = getattr(diffusers, name)
        except (ImportError, RuntimeError):
            continue
        if not inspect.isclass(cls):
            continue
        param = inspect.signature(cls.__init__).parameters.get("scheduler")
        if param is not None and "FlowMatch" in str(param.annotation):
            names.add(name)
    return names


#: the diffusers release NOT_COVERED was classified on
CLASSIFIED_ON = "0.42.1"


def _importable(name: str) -> bool:
    try:
        return getattr(diffusers, name, None) is not None
    except (ImportError, RuntimeError):
        return False


def _alias_of(cls, case_cls) -> bool:
    return cls is not case_cls and issubclass(cls, case_cls) and cls.__call__ is case_cls.__call__


def test_every_flow_match_pipeline_is_a_case_or_not_covered_with_a_reason():
    """A pipeline of a newer diffusers fails here until it is a case of the table or in NOT_COVERED."""
    found = flow_match_pipelines()
    cases = {c.pipeline for c in CASES}
    case_classes = [getattr(diffusers, n) for n in cases if _importable(n)]
    # a subclass of a case that keeps its __call__ (older releases' aliases, e.g. Lumina2Text2ImgPipeline) is that case
    aliases = {n for n in found if any(_alias_of(getattr(diffusers, n), c) for c in case_classes)}
    assert sorted(found - cases - aliases - set(NOT_COVERED)) == []  # unclassified pipelines
    assert sorted(set(NOT_COVERED) & cases) == []  # both a case and "not covered"
    assert all(len(reason) > 20 for reason in NOT_COVERED.values())
    if Version(diffusers.__version__) >= Version(CLASSIFIED_ON):  # older releases lack the newer pipelines
        assert len(found) >= 100  # the enumeration itself works (diffusers 0.42.1: 113)
        assert sorted(set(NOT_COVERED) - found) == []  # stale entries (renamed or removed pipelines)


def test_not_covered_reasons_hold():
    """The checkable parts of the reasons, against the installed pipelines' code."""
    for name, reason in NOT_COVERED.items():
        if not _importable(name):  # a pipeline of a newer diffusers than the installed one
            continue
        params = inspect.signature(getattr(diffusers, name).__call__).parameters
        if "no prompt_embeds" in reason or "without prompt_embeds" in reason:
            assert "prompt_embeds" not in params, name
        if "strength" in reason:
            assert "strength" in params, name
        if reason.startswith("inpainting variant"):
            assert any("mask" in p and "prompt" not in p for p in params), name
    if _importable("Cosmos2TextToImagePipeline"):
        src = inspect.getsource(diffusers.Cosmos2TextToImagePipeline.__call__)
        assert "sigmas = torch.linspace(0, 1, num_inference_steps" in src
    with pytest.raises(ValueError, match=r"sigmas must lie in \(0, 1\]"):  # the Karras ramp is refused, not run
        RCMScheduler().set_timesteps(sigmas=torch.linspace(0, 1, 3, dtype=torch.float64))
    for name in filter(_importable, ("Ideogram4Pipeline", "AceStepPipeline")):  # own schedules, not a default form
        src = inspect.getsource(getattr(diffusers, name).__call__)
        assert "np.linspace(1.0, 1 / num_inference_steps" not in src and "set_timesteps(num_inference_steps" not in src
