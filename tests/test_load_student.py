"""Loading a trained student the way a diffusers user does: ``load_rcm_lora(pipe, OUT)`` brings the LoRA and the
scheduler the trainer wrote next to it (``OUT/scheduler``, ``OUT/ema/scheduler``); ``RCMScheduler.from_lora``."""

import logging
import shutil
from types import SimpleNamespace

import pytest
import torch
from tiny import tiny_wan_pipeline, tiny_wan_transformer, wan_embeds, wan_scheduler_config

from rcm_diffusers import RCMScheduler
from rcm_diffusers.lora.pipeline import WEIGHT_NAME, load_rcm_lora

TRAINED = {"rcm_sigma_max": 5000.0, "mid_t": [0.8, 0.5, 0.25], "time_input": "float"}  # not the from_config defaults
WAN_KW = dict(height=16, width=16, num_frames=5, guidance_scale=1.0, output_type="latent")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder written by the trainer's own ``export_student`` (LoRA, ``ema/``, both ``scheduler/``) for a tiny
    Wan student with random non-zero LoRA weights."""
    from diffusers import WanPipeline

    from rcm_diffusers.distill.adapters import add_rcm_adapters, lora_parameters
    from rcm_diffusers.distill.export import export_student

    out = tmp_path_factory.mktemp("export") / "run"
    tr = tiny_wan_transformer()
    add_rcm_adapters(tr, rank=4, alpha=None, with_fake=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lora_parameters(tr, "student").values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    shadow = {n: p.detach() * 0.5 for n, p in lora_parameters(tr, "student").items()}
    cfg = SimpleNamespace(
        sigma_max=TRAINED["rcm_sigma_max"],
        mid_t=TRAINED["mid_t"],
        time_input=TRAINED["time_input"],
        output_dir=str(out),
        mode="shared",
    )
    export_student(WanPipeline, cfg, tr, SimpleNamespace(shadow=shadow))
    return out


def _settings(sched):
    return {k: (list(v) if k == "mid_t" else v) for k, v in sched.config.items() if k in TRAINED}


def _sample(pipe, steps):
    with torch.no_grad():
        return pipe(
            prompt_embeds=wan_embeds(2), num_inference_steps=steps, generator=torch.Generator().manual_seed(3), **WAN_KW
        ).frames


def test_load_rcm_lora_sets_the_exported_scheduler(run_dir, caplog):
    """The call sets ``pipe.scheduler`` to the exported config (sigma_max, mid_t, time_input), keeps the pipeline's
    own keys (Wan's ``flow_shift``, so swapping back is lossless), logs which settings it took; the EMA folder uses
    its own ``ema/scheduler``; ``scheduler=False`` leaves the scheduler alone."""
    exported = RCMScheduler.from_pretrained(str(run_dir), subfolder="scheduler")
    assert _settings(exported) == TRAINED
    pipe = tiny_wan_pipeline()
    stock = type(pipe.scheduler)
    with caplog.at_level(logging.INFO, logger="rcm_diffusers"):
        files = load_rcm_lora(pipe, str(run_dir))
    assert set(files) == {"transformer"}
    assert isinstance(pipe.scheduler, RCMScheduler) and _settings(pipe.scheduler) == TRAINED
    assert pipe.scheduler.config.flow_shift == 3.0
    assert stock.from_config(pipe.scheduler.config).config.flow_shift == 3.0
    assert (
        f"RCMScheduler from {run_dir / 'scheduler'}: sigma_max 5000, mid_t [0.8, 0.5, 0.25], time_input float"
        in caplog.text
    )

    ema = tiny_wan_pipeline()
    with caplog.at_level(logging.INFO, logger="rcm_diffusers"):
        load_rcm_lora(ema, str(run_dir / "ema"))
    assert _settings(ema.scheduler) == TRAINED and f"from {run_dir / 'ema' / 'scheduler'}:" in caplog.text

    kept = tiny_wan_pipeline()
    load_rcm_lora(kept, str(run_dir), scheduler=False)
    assert type(kept.scheduler) is stock


def test_loaded_scheduler_samples_like_the_manual_from_pretrained(run_dir):
    """1, 2 and 4 steps through the stock WanPipeline: ``load_rcm_lora`` equals ``load_lora_weights`` +
    ``RCMScheduler.from_pretrained(OUT, subfolder="scheduler")`` bit for bit, and differs from the README's old
    ``from_config`` line (the defaults the student was not trained for)."""
    ours = tiny_wan_pipeline()
    load_rcm_lora(ours, str(run_dir))
    manual = tiny_wan_pipeline()
    manual.load_lora_weights(str(run_dir), adapter_name="rcm")
    exported = RCMScheduler.from_pretrained(str(run_dir), subfolder="scheduler")
    defaults = RCMScheduler.from_config(wan_scheduler_config())
    for steps in (1, 2, 4):
        manual.scheduler = exported
        a = _sample(ours, steps)
        assert torch.equal(a, _sample(manual, steps)), steps
        manual.scheduler = defaults
        assert (_sample(manual, steps) - a).abs().max() > 1e-3, steps


def test_without_a_scheduler_folder_it_falls_back_with_a_message(run_dir, tmp_path):
    """A LoRA from elsewhere (no ``scheduler/``): ``from_config`` defaults and a warning naming them. An ``ema/``
    copied without its own ``scheduler/`` takes the run's; a LoRA file path, the folder it lies in."""
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(run_dir / WEIGHT_NAME, bare / WEIGHT_NAME)
    pipe = tiny_wan_pipeline()
    with pytest.warns(
        UserWarning,
        match=r"no RCMScheduler config .* using RCMScheduler.from_config defaults "
        r"\(sigma_max 80, mid_t \[1.5, 1.4, 1.0\], time_input bf16\)",
    ):
        load_rcm_lora(pipe, str(bare))
    assert pipe.scheduler.config.rcm_sigma_max == 80.0 and pipe.scheduler.config.time_input == "bf16"

    run = tmp_path / "run"
    (run / "ema").mkdir(parents=True)
    shutil.copytree(run_dir / "scheduler", run / "scheduler")
    shutil.copy(run_dir / "ema" / WEIGHT_NAME, run / "ema" / WEIGHT_NAME)
    assert _settings(RCMScheduler.from_lora(str(run / "ema"))) == TRAINED
    assert _settings(RCMScheduler.from_lora(str(run_dir / WEIGHT_NAME))) == TRAINED
    # explicit keyword arguments still win over the exported config
    assert RCMScheduler.from_lora(str(run_dir), stochastic=False).config.stochastic is False
    assert RCMScheduler.from_lora(str(run_dir), sigma_max=200.0).sigma_max == 200.0


def test_per_step_mid_t_of_the_trainer_config_reaches_the_user(tmp_path):
    """A run configured with ``mid_t`` per step count (the command-line string) writes ``OUT/scheduler`` and
    ``OUT/ema/scheduler`` holding the mapping; ``load_rcm_lora(pipe, OUT)`` gives a scheduler whose 2- and 4-step
    grids use their own entries (2 steps: 1.0, not the 4-step list's 1.5)."""
    import math

    import numpy as np
    from diffusers import WanPipeline

    from rcm_diffusers.distill.adapters import add_rcm_adapters, lora_parameters
    from rcm_diffusers.distill.config import load_config
    from rcm_diffusers.distill.export import export_student

    out = tmp_path / "run"
    cfg = load_config(
        [
            "--pretrained",
            "p",
            "--data_dir",
            "d",
            "--output_dir",
            str(out),
            "--sigma_max",
            "200",
            "--mid_t",
            "2: 1.0; 4: 1.5, 1.4, 0.8",
        ]
    )
    tr = tiny_wan_transformer()
    add_rcm_adapters(tr, rank=4, alpha=None, with_fake=False)
    export_student(
        WanPipeline, cfg, tr, SimpleNamespace(shadow={n: p.detach() for n, p in lora_parameters(tr, "student").items()})
    )

    def rf(angles):
        t = np.array([math.atan(200.0), *angles, 0.0])
        return np.append((np.sin(t) / (np.sin(t) + np.cos(t)))[:-1], 0.0)

    for d in (out, out / "ema"):
        pipe = tiny_wan_pipeline()
        load_rcm_lora(pipe, str(d))
        s = pipe.scheduler
        assert s.config.mid_t == {"2": [1.0], "4": [1.5, 1.4, 0.8]} and s.sigma_max == 200.0, d
        for steps, angles in {2: [1.0], 3: [1.5, 1.4], 4: [1.5, 1.4, 0.8]}.items():
            s.set_timesteps(steps)
            assert np.array_equal(s.rf_times, rf(angles)), (d, steps)
