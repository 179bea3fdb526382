"""Training configuration: a YAML file plus ``--key value`` overrides, validated (SPEC §3, §4, §6, §8).

``python training/rcm.py --help`` prints every option with its default and meaning.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import yaml

__all__ = ["RCMConfig", "load_config", "format_help"]


def opt(default, help: str, **kw):
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class RCMConfig:
    """All knobs of ``training/rcm.py``; names follow SPEC.md."""

    # model (SPEC §1, §6)
    pretrained: str = opt("", "diffusers pipeline directory or hub id holding the teacher transformer")
    transformer_subfolder: str = opt("transformer", "subfolder of the transformer to distill (Wan2.2 A14B: 'transformer' = high-noise expert, 'transformer_2' = low-noise expert)")
    pipeline_class: str = opt("auto", "diffusers pipeline class used to save/load the LoRA and for sample grids ('auto' = from model_index.json)")
    weight_dtype: str = opt("float32", "dtype of the frozen base weights: float32 | bfloat16")
    mixed_precision: str = opt("no", "accelerate mixed precision: no | bf16 | fp16")
    mode: str = opt("shared", "'shared' = one frozen base + peft adapters 'student' and 'fake' (SPEC §6); 'full' = full fine-tune copies")
    lora_rank: int = opt(32, "LoRA rank of the student adapter")
    lora_alpha: float = opt(0.0, "LoRA alpha (0 = equal to rank)")
    fake_lora_rank: int = opt(0, "LoRA rank of the fake-score adapter (0 = lora_rank)")
    lora_target_modules: list = opt([], "module names to adapt ([] = family default, see rcm_diffusers.adapters.DEFAULT_LORA_TARGETS)")
    gradient_checkpointing: bool = opt(False, "checkpoint transformer blocks in the grad passes (JVP passes run under no_grad without it)")
    flux_guidance: float = opt(3.5, "Flux-dev guidance-embedding value (ignored when the transformer has no guidance embedding)")
    # data (SPEC §8)
    data_dir: str = opt("", "directory in the rcm latent format (rcm_diffusers.data; make one with training/prepare_data.py)")
    synthetic: bool = opt(False, "replace the dataset's latents by teacher samples (TrigFlow Euler + CFG) generated at start")
    synthetic_steps: int = opt(100, "teacher Euler steps for --synthetic")
    synthetic_shift: float = opt(3.0, "flow shift of the teacher grid for --synthetic")
    # objective (SPEC §3, §4)
    guidance_scale: float = opt(6.0, "standard CFG scale s of the teacher, F_u + s (F_c - F_u); the reference's g = s - 1 (g = 5 -> s = 6)")
    P_mean: float = opt(-0.8, "p_G: mean of ln sigma")
    P_std: float = opt(1.6, "p_G: std of ln sigma")
    video_noise_multiplier: float = opt(0.0, "multiply p_G's sigma by this (0 = sqrt(latent frames) for video, 1 for images)")
    p_D_shift: float = opt(5.0, "p_D: flow shift s of r = s u / (1 + (s-1) u)")
    tangent_warmup: int = opt(1000, "iterations of the tangent warm-up r = min(1, step / tangent_warmup); DMD starts after it")
    fd_type: int = opt(0, "sCM derivative: 0 exact JVP, 1 JVP in x + finite difference in t, 2 finite difference (no JVP)")
    fd_h: float = opt(1e-4, "finite-difference step h (fd_type 1, 2)")
    use_dmd: bool = opt(True, "train a fake score and add the DMD term (False = sCM only)")
    dmd_weight: float = opt(0.01, "lambda in L = L_sCM + lambda L_DMD")
    scm_weight: float = opt(1.0, "weight of L_sCM (0 = DMD only)")
    student_update_freq: int = opt(5, "after warm-up, the student trains every this many iterations, the fake score otherwise")
    max_simulation_steps: int = opt(4, "backward simulation uses n = student_eff % this + 1 student steps")
    # optimisation (SPEC §4.4, §4.5)
    lr: float = opt(1e-4, "student learning rate (LoRA needs larger rates than the full fine-tune 2e-6)")
    fake_lr: float = opt(2e-5, "fake-score learning rate")
    weight_decay: float = opt(0.01, "AdamW weight decay")
    adam_betas: list = opt([0.0, 0.999], "AdamW betas")
    adam_eps: float = opt(1e-8, "AdamW eps")
    lr_warmup_steps: int = opt(100, "linear learning-rate warm-up (in each optimizer's own steps)")
    max_grad_norm: float = opt(1.0, "gradient clipping norm (0 = off)")
    ema_rate: float = opt(0.10, "power-EMA rate s (0 = no EMA)")
    batch_size: int = opt(1, "samples per process and iteration")
    max_steps: int = opt(1000, "total iterations (student + fake-score steps)")
    seed: int = opt(0, "base seed; every random draw is a function of (seed, step, rank)")
    # outputs and guards
    output_dir: str = opt("outputs/rcm", "run directory: checkpoints/, metrics.jsonl, env.json, the LoRA")
    resume: str = opt("", "'' = fresh, 'latest' = newest checkpoint in output_dir (fresh if none), or a checkpoint path")
    checkpoint_every: int = opt(500, "save an accelerate checkpoint every N iterations (0 = only at the end)")
    checkpoints_total_limit: int = opt(3, "keep this many checkpoints (0 = all)")
    log_every: int = opt(1, "write metrics every N iterations")
    report_to: str = opt("none", "accelerate tracker: none | tensorboard | wandb | all")
    sample_every: int = opt(0, "write a student sample grid every N iterations (0 = off)")
    sample_steps: list = opt([1, 2, 4], "RCMScheduler step counts of the sample grid")
    sigma_max: float = opt(80.0, "sigma_max of the student sampler (80 T2V, 200 Wan I2V)")
    spike_factor: float = opt(5.0, "grad-norm spike: norm > factor x running median ...")
    spike_patience: int = opt(3, "... for this many consecutive steps of one network dumps spikes.jsonl")
    skip_nonfinite: bool = opt(True, "skip the optimizer step when the gradient norm is not finite (counted in metrics)")
    exit_after_step: int = opt(-1, "testing: hard-exit (os._exit) right after this iteration, as if killed")
    progress: bool = opt(True, "tqdm progress bar on the main process")

    def validate(self) -> "RCMConfig":
        """Raise ``ValueError`` with the offending option on an invalid setting."""
        def bad(key, why):
            raise ValueError(f"config option {key} = {getattr(self, key)!r}: {why}")

        if not self.pretrained:
            bad("pretrained", "set the teacher pipeline directory or hub id")
        if not self.data_dir:
            bad("data_dir", "set a latent dataset directory (see rcm_diffusers.data)")
        if self.mode not in ("shared", "full"):
            bad("mode", "use 'shared' or 'full'")
        if self.fd_type not in (0, 1, 2):
            bad("fd_type", "use 0, 1 or 2")
        if self.weight_dtype not in ("float32", "bfloat16", "float16"):
            bad("weight_dtype", "use float32, bfloat16 or float16")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            bad("mixed_precision", "use no, bf16 or fp16")
        for k in ("lora_rank", "batch_size", "max_steps", "student_update_freq", "max_simulation_steps", "log_every"):
            if getattr(self, k) < 1:
                bad(k, "must be >= 1")
        for k in ("tangent_warmup", "checkpoint_every", "lr_warmup_steps", "sample_every"):
            if getattr(self, k) < 0:
                bad(k, "must be >= 0")
        for k in ("lr", "fake_lr", "P_std", "p_D_shift", "fd_h", "sigma_max"):
            if not (getattr(self, k) > 0 and math.isfinite(getattr(self, k))):
                bad(k, "must be a positive finite number")
        if not 0 <= self.ema_rate < 1:
            bad("ema_rate", "must lie in [0, 1)")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            bad("adam_betas", "two numbers in [0, 1)")
        if self.guidance_scale < 0:
            bad("guidance_scale", "must be >= 0 (1 = no guidance)")
        if self.scm_weight == 0 and not self.use_dmd:
            bad("scm_weight", "sCM off and DMD off leaves nothing to train")
        return self


def _fields():
    return {f.name: f for f in dataclasses.fields(RCMConfig)}


def _coerce(name: str, value: Any):
    f = _fields()[name]
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(value, str) and not isinstance(default, str):
        value = yaml.safe_load(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"option {name} expects true/false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"option {name} expects an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, str):  # YAML 1.1 reads '3e-5' (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"option {name} expects a number, got {value!r}")
        return float(value)
    if isinstance(default, list):
        if not isinstance(value, list):
            value = [value]
        return value
    if value is None:
        return ""
    return str(value)


def format_help() -> str:
    """One line per option: ``--name (default): meaning``."""
    lines = ["usage: accelerate launch training/rcm.py [--config FILE.yaml] [--key value ...]", "",
             "Options (YAML keys or --key value; later wins):"]
    for name, f in _fields().items():
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  --{name} ({default!r}): {f.metadata['help']}")
    return "\n".join(lines)


def load_config(argv: list[str] | None = None, default_config: str | None = None) -> RCMConfig:
    """Build the config from ``--config FILE`` (else ``default_config``) and ``--key value`` overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(format_help())
        raise SystemExit(0)
    values: dict[str, Any] = {}
    path = default_config
    overrides = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if not a.startswith("--"):
            raise ValueError(f"unexpected argument {a!r}; options are --key value (see --help)")
        key, _, val = a[2:].partition("=")
        key = key.replace("-", "_")
        if not _:
            if i + 1 >= len(argv):
                raise ValueError(f"option --{key} needs a value")
            val = argv[i + 1]
            i += 1
        i += 1
        if key == "config":
            path = val
        else:
            overrides.append((key, val))
    if path:
        with open(path) as fh:
            values.update(yaml.safe_load(fh) or {})
    fields = _fields()
    for k, v in overrides:
        values[k] = v
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown config option(s) {unknown}; see --help")
    return RCMConfig(**{k: _coerce(k, v) for k, v in values.items()}).validate()
