"""The trainers' options, each declared once (docs/math.md §3, §4, §6, §7, §8).

Every option is a pydantic field with its type, default, help, allowed values or bounds, and its resume policy
(``resume``: ``fixed`` = refused on resume, with the reason; ``applied`` = applied from the resumed step and
printed; ``free`` = bookkeeping, no message). Validation, ``--help``, the resume policy
(``run_folder.resume_changes``) and the options tables of docs/training.md (``options_markdown``; a test compares
them) are generated from these declarations. YAML files and ``--key value`` overrides are read by
``load_config``: argparse splits the command line, YAML turns each value into its type, pydantic validates.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "CommonOptions",
    "RCMConfig",
    "QADConfig",
    "load_config",
    "format_help",
    "options_markdown",
    "noise_seeding_of",
    "resume_policy",
]

_SHAPES = "the checkpoint's weights and optimizer states have the old shapes"
_STREAM = "every batch, noise draw and alternation step is a function of it and of the step already reached"
_START = "it acts only at the start of a run (already done)"
_CALIB = "the activation ranges are calibrated at these times"


def opt(default, help: str, *, group: str, resume: str = "applied", why: str = "", **bounds):
    """One option: ``default``, one-line ``help``, its ``group`` in ``--help``, and its resume policy (``fixed``
    needs ``why``); ``bounds`` are pydantic's (``ge``, ``gt``, ``le``, ``lt``)."""
    assert resume in ("fixed", "applied", "free") and (resume != "fixed" or why), help
    extra = {"group": group, "resume": resume, "why": why}
    if isinstance(default, (list, dict)):
        return Field(default_factory=lambda d=default: type(d)(d), description=help, json_schema_extra=extra, **bounds)
    return Field(default=default, description=help, json_schema_extra=extra, **bounds)


def _again(cls, name: str, default):
    """``cls``'s option ``name`` with another default (the subclass shares its help, bounds and resume policy)."""
    f = cls.model_fields[name]
    kw = dict(f.json_schema_extra)
    bounds = {k: getattr(m, k) for m in f.metadata for k in ("ge", "gt", "le", "lt") if hasattr(m, k)}
    return opt(default, f.description, group=kw["group"], resume=kw["resume"], why=kw["why"], **bounds)


POS = dict(gt=0, allow_inf_nan=False)  # a positive finite number
DTYPE = Literal["float32", "bfloat16", "float16"]


class CommonOptions(BaseModel):
    """Options both trainers read with the same meaning."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False, protected_namespaces=())
    script: ClassVar[str] = ""

    # model
    pretrained: str = opt("", "diffusers pipeline directory or hub id holding the teacher transformer", group="model")
    transformer_subfolder: str = opt(
        "transformer",
        "subfolder of the transformer to distill (Wan2.2 A14B: 'transformer' "
        "= high-noise expert, 'transformer_2' = low-noise expert)",
        group="model",
        resume="fixed",
        why="the checkpoint belongs to the other expert",
    )
    weight_dtype: DTYPE = opt("float32", "dtype of the frozen base weights", group="model", resume="fixed", why=_SHAPES)
    mixed_precision: Literal["no", "bf16", "fp16"] = opt("no", "accelerate mixed precision", group="model")
    flux_guidance: float = opt(
        3.5, "Flux-dev guidance-embedding value (ignored when the transformer has no guidance embedding)", group="model"
    )
    lora_rank: int = opt(32, "LoRA rank of the trained adapter", group="model", resume="fixed", why=_SHAPES, ge=1)
    lora_alpha: float = opt(
        0.0,
        "LoRA alpha (0 = equal to rank)",
        group="model",
        resume="fixed",
        why="the trained adapter was scaled by the old alpha",
        ge=0,
    )
    lora_target_modules: list[str] = opt(
        [],
        "module names to adapt ([] = family default, rcm_diffusers.distill.adapters.DEFAULT_LORA_TARGETS)",
        group="model",
        resume="fixed",
        why=_SHAPES,
    )
    time_input: Literal["bf16", "float"] = opt(
        "bf16",
        "time the networks see: 'bf16' = (1000 r) rounded to bfloat16 as "
        "the official rCM code trains and samples; 'float' = exact. Sample the "
        "student with RCMScheduler(time_input=...) set the same",
        group="model",
        resume="fixed",
        why="the networks were trained at the old time input",
    )
    # data
    data_dir: str = opt(
        "",
        "latent dataset directory (rcm_diffusers.distill.data; make one with training/prepare_data.py)",
        group="data",
    )
    check_data_values: bool = opt(
        True,
        "before the run folder is touched, read every value of the datasets once and "
        "refuse NaN / inf (the processes share the read; its cost: docs/training.md)",
        group="data",
        resume="free",
        strict=True,
    )
    # optimisation
    lr: float = opt(
        1e-4,
        "learning rate of the trained weights (LoRA needs larger rates than a full fine-tune)",
        group="optimisation",
        **POS,
    )
    weight_decay: float = opt(0.01, "AdamW weight decay", group="optimisation", ge=0)
    adam_betas: list[float] = opt([0.0, 0.999], "AdamW betas: two numbers in [0, 1)", group="optimisation")
    adam_eps: float = opt(1e-8, "AdamW eps", group="optimisation", **POS)
    lr_warmup_steps: int = opt(
        100, "linear learning-rate warm-up (in each optimizer's own steps)", group="optimisation", ge=0
    )
    max_grad_norm: float = opt(
        1.0, "gradient clipping norm (0 = off, as the official rCM grad_clip False)", group="optimisation", ge=0
    )
    ema_rate: float = opt(
        0.10,
        "power-EMA rate s of the trained weights (0 = off; switching it on or off is refused "
        "on resume); exports an EMA variant in ema/",
        group="optimisation",
        ge=0,
        lt=1,
    )
    batch_size: int = opt(
        1, "samples per process and iteration", group="optimisation", resume="fixed", why=_STREAM, ge=1
    )
    gradient_accumulation_steps: int = opt(
        1,
        "micro-batches of batch_size per process and optimizer step: the same "
        "samples, noise and loss as one batch of batch_size x this (needs "
        "noise_seeding sample, which auto picks)",
        group="optimisation",
        resume="fixed",
        why=_STREAM,
        ge=1,
    )
    noise_seeding: Literal["auto", "rank", "sample"] = opt(
        "auto",
        "'rank' = one generator per (seed, step, rank) for the process's whole batch; 'sample' = one per "
        "(seed, step, global sample position), so a sample's noise does not depend on the split into processes or "
        "micro-batches; 'auto' = sample with gradient accumulation, else rank",
        group="optimisation",
        resume="fixed",
        why=_STREAM,
    )
    max_steps: int = opt(
        1000,
        "total iterations (may be raised on resume, not lowered below the checkpoint's step)",
        group="optimisation",
        resume="free",
        ge=1,
    )
    seed: int = opt(
        0,
        "base seed; every random draw is a function of (seed, step, rank)",
        group="optimisation",
        resume="fixed",
        why=_STREAM,
    )
    # outputs and guards
    output_dir: str = opt(
        "outputs/rcm",
        "run directory: checkpoints/, metrics.jsonl, env.json, final.json, the exports",
        group="outputs",
        resume="free",
    )
    resume: str = opt(
        "",
        "'' = fresh (output_dir must be empty), 'latest' = newest intact checkpoint in output_dir "
        "(fresh if none), or a checkpoint path",
        group="outputs",
        resume="free",
    )
    overwrite: bool = opt(
        False,
        "delete the previous run's files in output_dir (checkpoints, metrics, exports) and "
        "start again; with --resume PATH: delete the checkpoints after PATH",
        group="outputs",
        resume="free",
        strict=True,
    )
    checkpoint_every: int = opt(
        500,
        "save a checkpoint (safetensors + JSON, docs/training.md) every N iterations (0 = only at the end)",
        group="outputs",
        resume="free",
        ge=0,
    )
    checkpoints_total_limit: int = opt(3, "keep this many checkpoints (0 = all)", group="outputs", resume="free", ge=0)
    log_every: int = opt(1, "write metrics every N iterations", group="outputs", resume="free", ge=1)
    report_to: Literal["none", "tensorboard", "wandb", "all"] = opt(
        "none", "accelerate tracker", group="outputs", resume="free"
    )
    skip_nonfinite: bool = opt(
        True,
        "skip the optimizer step when the gradient norm is not finite (reported, counted in metrics and final.json)",
        group="outputs",
        strict=True,
    )
    max_skipped_fraction: float = opt(
        0.05,
        "fail the run once more than this fraction of max_steps was skipped (non-finite gradients)",
        group="outputs",
        resume="free",
        ge=0,
        le=1,
    )
    progress: bool = opt(True, "tqdm progress bar on the main process", group="outputs", resume="free", strict=True)

    def __init__(self, **values):
        """Validate ``values``; a bad one raises ``ValueError`` with one line: ``config option KEY = VALUE: why``."""
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise ValueError(_message(type(self), e)) from None

    # ------------------------------------------------------------------ value forms
    @field_validator("*", mode="before")
    @classmethod
    def _forms(cls, value, info):
        """Numbers are not booleans, a lone value of a list option is a one-entry list, ``mid_t`` takes its JSON
        form."""
        if info.field_name == "mid_t":
            return _normal_mid_t(value)
        ann = cls.model_fields[info.field_name].annotation
        if ann in (int, float) and isinstance(value, bool):
            raise ValueError("expects a number, got a boolean")
        if (
            (ann is list or getattr(ann, "__origin__", None) is list)
            and value is not None
            and not isinstance(value, list)
        ):
            return [value]
        if ann is str and value is None:
            return ""
        return value

    @field_validator("adam_betas")
    @classmethod
    def _betas(cls, v):
        if len(v) != 2 or not all(0 <= b < 1 for b in v):
            raise ValueError("two numbers in [0, 1)")
        return v

    @model_validator(mode="after")
    def _common(self):
        if self.gradient_accumulation_steps > 1 and self.noise_seeding == "rank":
            _bad(
                self,
                "noise_seeding",
                "with gradient_accumulation_steps > 1 each micro-batch must draw its samples' "
                "own noise: use sample (or auto)",
            )
        return self

    def validate(self):
        """The settings a run needs beyond valid values (a teacher and a dataset); returns ``self``."""
        if not self.pretrained:
            _bad(self, "pretrained", "set the teacher pipeline directory or hub id")
        if not self.data_dir:
            _bad(self, "data_dir", "set a latent dataset directory (see rcm_diffusers.distill.data)")
        return self

    @classmethod
    def from_yaml(cls, path: str | None = None, **overrides):
        """A validated config from a YAML file (or none) and keyword overrides
        (``RCMConfig.from_yaml("c.yaml", lr=1e-4)``)."""
        values = _read_yaml(path)
        values.update(overrides)
        return _build(cls, values).validate()


def _bad(cfg, key: str, why: str):
    raise ValueError(f"config option {key} = {getattr(cfg, key)!r}: {why}")


class RCMConfig(CommonOptions):
    """All options of the rCM trainer (``training/rcm.py``); names follow docs/math.md."""

    script: ClassVar[str] = "training/rcm.py"

    # model (docs/math.md §1, §6)
    experts: Literal["auto", "both", "one"] = opt(
        "auto",
        "Wan 2.2 two-expert pipelines (transformer_2 + boundary_ratio): 'both' = distil both experts in one run, "
        "each call routed to the expert that owns its time (docs/math.md §6.1); 'one' = only transformer_subfolder; "
        "'auto' = both when the pipeline has two experts",
        group="model",
        resume="fixed",
        why="the checkpoint holds adapters of the old set of experts",
    )
    boundary_ratio: float = opt(
        0.0,
        "two experts: RF time r of the switch, transformer for 1000 r >= 1000 "
        "boundary_ratio (0 = the pipeline's boundary_ratio)",
        group="model",
        resume="fixed",
        why="each expert was trained on the old side of the switch",
        ge=0,
        lt=1,
    )
    expert_sampling: Literal["balanced", "natural"] = opt(
        "balanced",
        "two experts, sCM times: 'balanced' = each sample's expert is the high-noise one with probability "
        "high_noise_share and its time is drawn from p_G restricted to that expert; 'natural' = p_G as is (the "
        "high-noise expert then gets only P(sigma >= b / (1 - b)) of the samples)",
        group="objective",
    )
    high_noise_share: float = opt(
        0.5,
        "two experts, expert_sampling balanced: fraction of sCM samples given to the high-noise expert",
        group="objective",
        gt=0,
        lt=1,
    )
    boundary_weight: float = opt(
        1.0,
        "two experts: weight of the boundary term, which pulls the high-noise expert's "
        "student onto the low-noise one's at the switch time (docs/math.md §6.1); 0 = off",
        group="objective",
        ge=0,
        allow_inf_nan=False,
    )
    mode: Literal["shared", "full"] = opt(
        "shared",
        "'shared' = one frozen base + peft adapters 'student' and 'fake' "
        "(docs/math.md §6); 'full' = full fine-tune copies",
        group="model",
        resume="fixed",
        why=_SHAPES,
    )
    fake_lora_rank: int = opt(
        0, "LoRA rank of the fake-score adapter (0 = lora_rank)", group="model", resume="fixed", why=_SHAPES, ge=0
    )
    gradient_checkpointing: bool = opt(
        False,
        "checkpoint transformer blocks in the grad passes (JVP passes run under no_grad without it)",
        group="model",
        strict=True,
    )
    checkpointing_policy: Literal["full", "selective"] = opt(
        "full",
        "with gradient_checkpointing: 'full' = keep each block's inputs, recompute the whole block in the "
        "backward; 'selective' = also keep the outputs of the matrix products and attention kernels, recompute the "
        "rest (norms, RoPE, modulation, GELU, residual adds, LoRA up-projections): more memory than full, less "
        "recompute (the official rCM mm_only mode)",
        group="model",
    )
    # training on one card (rcm_diffusers.distill.lowmem; docs/training.md, "Training on one card")
    base_dtype: Literal["weight_dtype", "fp8", "int8"] = opt(
        "weight_dtype",
        "format of the frozen base's Linear weights inside the transformer blocks, dequantized to "
        "weight_dtype in each call: 'weight_dtype' = as loaded; "
        "'fp8' = FP8 E4M3 with one scale per row and 128 inputs; "
        "'int8' = INT8 with one scale per output channel. Norms, biases, modulation, embeddings, the head and the LoRA "
        "adapters keep their dtypes",
        group="memory",
        resume="fixed",
        why="the adapters were trained on the old base's weights",
    )
    base_weights: str = opt(
        "",
        "a safetensors file whose Wan block Linear weights are already quantized (ComfyUI's fp8_scaled or plain "
        "float8_e4m3fn files, original or diffusers key names; a QAD export's fp8 or int8 layers): they are held "
        "as stored, with their scales, never as a weight_dtype copy; every other tensor of the file loads in "
        "weight_dtype over the teacher folder's ('' = none). base_dtype weight_dtype keeps the file's format; "
        "another base_dtype must be the file's (refused otherwise). One network (not two experts)",
        group="memory",
        resume="fixed",
        why="the adapters were trained on that file's weights",
    )
    blocks_to_swap: int = opt(
        0,
        "frozen Linear weights of this many transformer blocks per network (the last ones) "
        "live in host memory (pinned on CUDA) and are copied to the device just before each "
        "use, the next block prefetched; LoRA weights stay on the device",
        group="memory",
        ge=0,
    )
    activation_offload: bool = opt(
        False,
        "with gradient_checkpointing: the checkpointed block inputs wait for the "
        "backward in host memory (pinned on CUDA) instead of the device",
        group="memory",
        strict=True,
    )
    device_memory_gb: float = opt(
        0.0,
        "card memory (GB, 1e9 bytes) the start-up check plans for: it prints the "
        "predicted peak and refuses a setting that cannot fit, naming the cheapest that "
        "would (0 = the card's own; on a machine without a GPU the check only prints)",
        group="memory",
        resume="free",
        ge=0,
        allow_inf_nan=False,
    )
    # data (docs/math.md §8)
    regression_data_dir: str = opt(
        "",
        "ODE pairs for regression_weight: a latent dataset whose 'latents' are teacher "
        "ODE samples and whose 'noise' is the noise each started from (training/"
        "prepare_data.py --synthetic writes one)",
        group="data",
    )
    # objective (docs/math.md §3, §4)
    guidance_scale: float = opt(
        5.0,
        "CFG scale s of the teacher, F_u + s (F_c - F_u) (1 = no guidance): the official rCM teacher_guidance",
        group="objective",
        ge=0,
    )
    P_mean: float = opt(-0.8, "p_G: mean of ln sigma", group="objective")
    P_std: float = opt(1.6, "p_G: std of ln sigma", group="objective", **POS)
    video_noise_multiplier: float = opt(
        0.0, "multiply p_G's sigma by this (0 = sqrt(latent frames) for video, 1 for images)", group="objective", ge=0
    )
    p_D_shift: float = opt(5.0, "p_D: flow shift s of r = s u / (1 + (s-1) u)", group="objective", **POS)
    tangent_warmup: int = opt(
        1000,
        "iterations of the tangent warm-up r = min(1, step / tangent_warmup); DMD starts after it",
        group="objective",
        resume="fixed",
        why=_STREAM,
        ge=0,
    )
    fd_type: Literal[0, 1, 2] = opt(
        0,
        "sCM derivative: 0 exact JVP, 1 JVP in x + finite difference in t, 2 finite difference (no JVP)",
        group="objective",
    )
    fd_h: float = opt(1e-4, "finite-difference step h (fd_type 1, 2)", group="objective", **POS)
    use_dmd: bool = opt(
        True,
        "train a fake score and add the DMD term (false = sCM only)",
        group="objective",
        resume="fixed",
        why="the fake score network and its optimizer",
        strict=True,
    )
    dmd_weight: float = opt(
        0.01,
        "weight of L_DMD in L = scm_weight L_sCM + dmd_weight L_DMD (official rCM: 1 with scm_weight 100)",
        group="objective",
        ge=0,
    )
    scm_weight: float = opt(
        1.0,
        "weight of the consistency term L_sCM, or L_dCM with cm_type dcm (0 = DMD only, no JVP; official rCM: 100)",
        group="objective",
        ge=0,
    )
    regression_weight: float = opt(
        0.0,
        "weight of the ODE-pair regression of the one-step student, "
        "||x0_theta(noise, pi/2) - x_teacher||^2 (docs/math.md §4.7); needs "
        "regression_data_dir; 0 = off",
        group="objective",
        ge=0,
        allow_inf_nan=False,
    )
    regression_warmup: int = opt(
        0,
        "iterations at the start of the run that train the student on the ODE-pair regression alone (no "
        "consistency term, DMD or fake score; docs/math.md §4.7); the tangent warm-up and the alternation start "
        "after them; counted in max_steps; needs regression_weight > 0",
        group="objective",
        resume="fixed",
        why=_STREAM,
        ge=0,
    )
    loss_reduction: Literal["mean", "sum"] = opt(
        "mean", "batch reduction of the per-sample losses: 'mean' or 'sum' (official rCM)", group="objective"
    )
    cm_type: Literal["scm", "dcm"] = opt(
        "scm",
        "consistency term: 'scm' = continuous-time sCM (JVP tangent, fd_type) | "
        "'dcm' = discrete-time CM on the teacher's guided Euler steps, no JVP "
        "(docs/math.md §4.6)",
        group="objective",
    )
    dcm_total_steps: int = opt(
        48, "cm_type dcm: uniform steps in u of the grid before the shift (official 48)", group="objective", ge=2
    )
    dcm_skipping_interval_steps: int = opt(
        1,
        "cm_type dcm: grid steps between t_0 and t_N, i.e. teacher Euler steps per sample (official 1)",
        group="objective",
        ge=1,
    )
    dcm_timestep_shift: float = opt(5.0, "cm_type dcm: flow shift s of the grid (official 5)", group="objective", **POS)
    dmd_fix_timesteps: bool = opt(
        False,
        "backward simulation (DMD term and fake score) on the fixed angles "
        "backward_timesteps instead of p_D draws (docs/math.md §4.2)",
        group="objective",
        strict=True,
    )
    backward_timesteps: list[float] = opt(
        [1.5, 1.4, 1.0],
        "dmd_fix_timesteps: intermediate TrigFlow angles after pi/2, n steps use the first n - 1 (official default)",
        group="objective",
    )
    student_update_freq: int = opt(
        5,
        "after warm-up, the student trains every this many iterations, the fake score otherwise",
        group="objective",
        resume="fixed",
        why=_STREAM,
        ge=1,
    )
    max_simulation_steps: int = opt(
        4,
        "backward simulation uses n = student_eff % this + 1 student steps",
        group="objective",
        resume="fixed",
        why=_STREAM,
        ge=1,
    )
    # optimisation (docs/math.md §4.4, §4.5)
    fake_lr: float = opt(2e-5, "fake-score learning rate", group="optimisation", **POS)
    lr_decay: Literal["none", "cosine", "linear"] = opt(
        "none",
        "after the warm-up: 'none' = constant (official rCM), 'cosine' or 'linear' = decay to lr_final_ratio x "
        "lr at the current launch's max_steps",
        group="optimisation",
    )
    lr_final_ratio: float = opt(
        0.0,
        "with lr_decay cosine/linear: the last step's rate as a fraction of lr / fake_lr",
        group="optimisation",
        ge=0,
        le=1,
    )
    lr_decay_fraction: float = opt(
        1.0,
        "with lr_decay cosine/linear: the decay spans this last fraction of each optimizer's steps after the warm-up",
        group="optimisation",
        gt=0,
        le=1,
    )
    context_parallel_size: int = opt(
        1,
        "Wan: processes that run one sample together (Ulysses: video tokens split, "
        "all-to-all around self-attention); data parallelism runs across the world_size "
        "/ this groups",
        group="optimisation",
        ge=1,
    )
    # outputs and guards
    sample_every: int = opt(
        0, "write a student sample grid every N iterations (0 = off)", group="outputs", resume="free", ge=0
    )
    sample_steps: list[int] = opt(
        [1, 2, 4], "RCMScheduler step counts of the sample grid", group="outputs", resume="free"
    )
    sigma_max: float = opt(
        80.0, "sigma_max of the student sampler (80 T2V, 200 Wan I2V); written into scheduler/", group="outputs", **POS
    )
    mid_t: Any = opt(
        [],
        "intermediate TrigFlow angles of the student sampler, strictly decreasing below "
        "arctan(sigma_max); n steps use the first n - 1 ([] = docs/math.md §2.1). Or per step count: "
        "{2: [1.0], 4: [1.5, 1.4, 0.8]} (YAML) or '2: 1.0; 4: 1.5, 1.4, 0.8'; written into scheduler/",
        group="outputs",
    )
    spike_factor: float = opt(
        5.0, "grad-norm spike: norm > factor x running median ...", group="outputs", resume="free", **POS
    )
    spike_patience: int = opt(
        3, "... for this many consecutive steps of one network dumps spikes.jsonl", group="outputs", resume="free", ge=1
    )

    @model_validator(mode="after")
    def _rcm(self):
        if self.checkpointing_policy != "full" and not self.gradient_checkpointing:
            _bad(self, "checkpointing_policy", "applies with gradient_checkpointing true; set it too")
        if self.activation_offload and not self.gradient_checkpointing:
            _bad(
                self,
                "activation_offload",
                "keeps the checkpointed block inputs on the host: set gradient_checkpointing true too",
            )
        if self.mode == "full":
            for key in ("base_dtype", "base_weights", "blocks_to_swap", "activation_offload"):
                if getattr(self, key) != type(self).model_fields[key].default:
                    _bad(self, key, "applies to the frozen base of mode shared; mode full trains every weight")
        if self.dcm_skipping_interval_steps >= self.dcm_total_steps:
            _bad(
                self,
                "dcm_skipping_interval_steps",
                f"must lie in [1, dcm_total_steps - 1 = {self.dcm_total_steps - 1}]",
            )
        if self.dmd_fix_timesteps:
            bt = self.backward_timesteps
            if any(not 0 < a < math.pi / 2 for a in bt) or any(a <= b for a, b in zip(bt, bt[1:])):
                _bad(self, "backward_timesteps", "TrigFlow angles strictly decreasing, strictly inside (0, pi/2)")
            if len(bt) < self.max_simulation_steps - 1:
                _bad(
                    self,
                    "backward_timesteps",
                    f"max_simulation_steps {self.max_simulation_steps} needs at least "
                    f"{self.max_simulation_steps - 1} angles",
                )
        if self.regression_weight > 0 and not self.regression_data_dir:
            _bad(
                self,
                "regression_data_dir",
                "regression_weight > 0 needs ODE pairs: a dataset from training/prepare_data.py --synthetic",
            )
        if self.regression_warmup > 0 and self.regression_weight <= 0:
            _bad(self, "regression_warmup", "a regression warm-up needs the regression term: regression_weight > 0")
        if self.scm_weight == 0 and not self.use_dmd:
            _bad(self, "scm_weight", "sCM off and DMD off leaves nothing to train")
        if self.scm_weight == 0 and self.tangent_warmup > 0:
            _bad(
                self,
                "tangent_warmup",
                "with scm_weight 0 (DMD only) the warm-up iterations train nothing; set tangent_warmup 0",
            )
        if self.context_parallel_size > 1 and self.sample_every:
            _bad(
                self,
                "sample_every",
                "sample grids run on the main process alone, a context-parallel model needs its "
                "whole group: use sample_every 0 with context_parallel_size > 1",
            )
        _check_mid_t(self, self.sample_steps, "sample_steps")
        return self


class QADConfig(CommonOptions):
    """All options of the QAD trainer (``training/qad.py``, quantization-aware distillation, docs/math.md §7)."""

    script: ClassVar[str] = "training/qad.py"

    teacher_lora: str = opt(
        "",
        "'' = the base model is the teacher; else an rCM student LoRA (training/rcm.py output "
        "dir or .safetensors) fused into it",
        group="model",
    )
    # shared options with QAD's own defaults
    lr: float = _again(CommonOptions, "lr", 1e-5)
    weight_decay: float = _again(CommonOptions, "weight_decay", 0.0)
    adam_betas: list[float] = _again(CommonOptions, "adam_betas", [0.9, 0.999])
    lr_warmup_steps: int = _again(CommonOptions, "lr_warmup_steps", 0)
    ema_rate: float = _again(CommonOptions, "ema_rate", 0.0)
    output_dir: str = _again(CommonOptions, "output_dir", "outputs/qad")
    # quantization (docs/math.md §7)
    format: str = opt(
        "nvfp4",
        "weight format: nvfp4 | mxfp4 | fp8_e4m3 | int8",
        group="quantization",
        resume="fixed",
        why="the student was trained through the old quantizer",
    )
    act_format: str = opt(
        "",
        "target fake: activation format ('' = weight-only); static per-tensor range calibrated on calibration_batches",
        group="quantization",
        resume="fixed",
        why="the activation quantizer",
    )
    target: Literal["auto", "comfyui", "fake"] = opt(
        "auto",
        "arithmetic trained: comfyui = what ComfyUI runs for the format on a GPU with kernels for it (nvfp4 "
        "W+A, fp8 W+A with calibrated input_scale, int8 W8A8 per-row dynamic) | fake = format / act_format as given | "
        "auto = comfyui when the export layout is comfyui, else fake",
        group="quantization",
        resume="fixed",
        why="the student was trained through the old runtime arithmetic",
    )
    act_scale: Literal["static", "dynamic"] = opt(
        "static",
        "target comfyui, nvfp4: static = calibrated input_scale (exported) | dynamic = per-call amax, "
        "ComfyUI's mode without input_scale (fp8 is always static, int8 always dynamic per row)",
        group="quantization",
        resume="fixed",
        why="the activation quantizer",
    )
    per_channel: bool = opt(
        False,
        "fp8_e4m3: per-output-channel weight scales (no ComfyUI field; export refuses it)",
        group="quantization",
        resume="fixed",
        why="the quantizer's scales",
        strict=True,
    )
    calibration_batches: int = opt(
        4,
        "batches run to calibrate activation ranges (act_format only)",
        group="quantization",
        resume="fixed",
        why="the activation ranges are recalibrated identically on resume",
        ge=1,
    )
    exclude: list[str] = opt(
        [],
        "extra fnmatch patterns of Linear names kept in high precision (added to "
        "rcm_diffusers.quant.modules.DEFAULT_EXCLUDE)",
        group="quantization",
        resume="fixed",
        why="which layers are quantized",
    )
    overrides: list[str] = opt(
        [],
        "'pattern=format' entries, first match wins ('pattern=none' keeps a layer unquantized)",
        group="quantization",
        resume="fixed",
        why="which layers are quantized",
    )
    scope: Literal["all", "lora"] = opt(
        "all",
        "'all' = every student weight trains (fake-quantized); 'lora' = frozen quantized base + bf16 LoRA",
        group="quantization",
        resume="fixed",
        why=_SHAPES,
    )
    # objective (docs/math.md §7): L = alpha L_FM + (1 - alpha) L_distill
    alpha: float = opt(
        0.1,
        "weight of flow matching on real data; 1 - alpha weighs distillation of the guided teacher velocity",
        group="objective",
        ge=0,
        le=1,
    )
    guidance: list = opt(
        [[0.0, 2.0], [0.5, 5.0], [1.0, 4.0]],
        "teacher CFG schedule s(r): piecewise-linear [[r, s], ...] knots (a single number = constant; 1 = no CFG)",
        group="objective",
    )
    r_source: Literal["shifted", "rcm"] = opt(
        "shifted",
        "training times: 'shifted' = shifted uniform r (shift); 'rcm' = the rCM student's rcm_steps sampling times",
        group="objective",
        resume="fixed",
        why=_CALIB,
    )
    shift: float = opt(
        3.0,
        "flow shift s of r = s u / (1 + (s - 1) u) (r_source shifted)",
        group="objective",
        resume="fixed",
        why=_CALIB,
        **POS,
    )
    rcm_steps: int = opt(
        4,
        "number of RCMScheduler steps whose times r is drawn from (r_source rcm)",
        group="objective",
        resume="fixed",
        why=_CALIB,
        ge=1,
    )
    sigma_max: float = opt(
        80.0,
        "RCMScheduler sigma_max of those times (r_source rcm)",
        group="objective",
        resume="fixed",
        why=_CALIB,
        **POS,
    )
    mid_t: Any = opt(
        [],
        "RCMScheduler intermediate TrigFlow angles ([] = docs/math.md §2.1 default; r_source rcm); a "
        "list, or per step count as the rCM trainer's mid_t",
        group="objective",
        resume="fixed",
        why=_CALIB,
    )
    # block-wise warm start (docs/math.md §7)
    warm_start_batches: int = opt(
        0,
        "batches of block-wise warm start before end-to-end QAD (0 = off)",
        group="warm start",
        resume="fixed",
        why=_START,
        ge=0,
    )
    warm_start_steps_per_batch: int = opt(
        1, "optimizer steps per block and warm-start batch", group="warm start", resume="fixed", why=_START, ge=1
    )
    warm_start_lr: float = opt(1e-4, "warm-start learning rate", group="warm start", resume="fixed", why=_START, **POS)
    # outputs
    export_delta: bool = opt(
        True,
        "scope all: also export the bf16 full-weight delta student - teacher (ComfyUI LoRA layout, .diff/.diff_b)",
        group="outputs",
        strict=True,
    )
    eval_batches: int = opt(
        2,
        "fixed-seed batches of the distillation-loss probe logged before/after warm start and at the end",
        group="outputs",
        resume="free",
        ge=0,
    )
    export_layout: Literal["auto", "comfyui", "diffusers"] = opt(
        "auto",
        "quantized checkpoint layout: auto (comfyui for Wan, diffusers for Flux) | comfyui | diffusers",
        group="outputs",
        resume="free",
    )

    def guidance_knots(self) -> list:
        """``guidance`` as ``[(r, s), ...]`` knots (a bare number or ``[s]`` = constant ``s``)."""
        g = self.guidance
        if len(g) == 1 and isinstance(g[0], (int, float)):
            return [(0.0, float(g[0]))]
        return [tuple(k) for k in g]

    def quant_overrides(self) -> dict:
        """``overrides`` as ``{pattern: format or None}``."""
        out = {}
        for e in self.overrides:
            pat, sep, fmt = str(e).rpartition("=")
            if not sep or not pat:
                raise ValueError(f"config option overrides entry {e!r}: use 'pattern=format' or 'pattern=none'")
            out[pat] = None if fmt.lower() == "none" else fmt
        return out

    @model_validator(mode="after")
    def _qad(self):
        from ..quant.formats import COMFY_ACT, check_format
        from .qad import GuidanceSchedule

        for key in ("format", "act_format"):
            if getattr(self, key) or key == "format":
                try:
                    check_format(getattr(self, key))
                except ValueError as e:
                    _bad(self, key, str(e))
        try:
            for f in self.quant_overrides().values():
                if f is not None:
                    check_format(f)
        except ValueError as e:
            _bad(self, "overrides", str(e))
        try:
            GuidanceSchedule(self.guidance_knots())
        except (ValueError, TypeError) as e:
            _bad(self, "guidance", f"{e} (use [[r, s], ...] or one number)")
        if self.per_channel and self.format != "fp8_e4m3":
            _bad(self, "per_channel", "only fp8_e4m3 has a per-channel option (int8 is always per-channel)")
        if self.target == "comfyui":
            if self.format not in COMFY_ACT:
                _bad(
                    self,
                    "format",
                    f"target comfyui: ComfyUI has no layout for it (use {', '.join(COMFY_ACT)}, or target fake)",
                )
            if self.act_format and self.act_format != self.format:
                _bad(
                    self,
                    "act_format",
                    f"target comfyui quantizes activations as the weight format ({self.format}); leave it ''",
                )
            if self.format == "fp8_e4m3" and self.act_scale == "dynamic":
                _bad(
                    self, "act_scale", "target comfyui, fp8: ComfyUI without input_scale casts at scale 1.0; use static"
                )
            if self.per_channel:
                _bad(self, "per_channel", "target comfyui: per-channel FP8 has no ComfyUI field")
        _check_mid_t(self, [self.rcm_steps] if self.r_source == "rcm" else [], "rcm_steps")
        return self

    def resolved_target(self, arch: str) -> str:
        """``target`` with ``auto`` resolved: ``comfyui`` when the export layout is comfyui (Wan under
        ``export_layout auto``) and the format has a ComfyUI layout, else ``fake``."""
        if self.target != "auto":
            return self.target
        from ..quant.formats import COMFY_ACT

        layout = self.export_layout if self.export_layout != "auto" else ("comfyui" if arch == "wan" else "diffusers")
        ok = self.format in COMFY_ACT and not self.per_channel and self.act_format in ("", self.format)
        return "comfyui" if layout == "comfyui" and ok else "fake"


# ----------------------------------------------------------------------------- mid_t


def _normal_mid_t(value):
    """``mid_t`` in the JSON form ``RCMScheduler`` registers (a list of floats, or ``{"2": [...], ...}``), so that it
    compares equal to the one read back from a checkpoint; as given when it does not read (the check says why)."""
    from ..sampling import mid_t_as_config

    if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        value = yaml.safe_load(value)
    try:
        return mid_t_as_config(value)
    except (TypeError, ValueError):
        return value


def _check_mid_t(cfg, steps, steps_key: str) -> None:
    """Every angle of ``cfg.mid_t`` (flat or per step count) against ``cfg.sigma_max``, and each step count the run
    samples (``steps``, named ``steps_key``) served by it (docs/math.md §2.1). Empty ``mid_t`` = the default angles."""
    if not cfg.mid_t:
        return
    from ..sampling import rcm_angles, validate_mid_t

    try:
        validate_mid_t(cfg.mid_t, cfg.sigma_max)
    except (TypeError, ValueError) as e:
        _bad(cfg, "mid_t", str(e))
    for n in steps:
        try:
            rcm_angles(n, cfg.sigma_max, cfg.mid_t)
        except (TypeError, ValueError) as e:
            _bad(cfg, "mid_t", f"{steps_key} {n}: {e}")


def noise_seeding_of(cfg) -> str:
    """``cfg.noise_seeding`` with ``auto`` resolved: ``sample`` with gradient accumulation, else ``rank``."""
    if cfg.noise_seeding != "auto":
        return cfg.noise_seeding
    return "sample" if cfg.gradient_accumulation_steps > 1 else "rank"


# ----------------------------------------------------------------------------- building, errors, help, docs

_PHRASES = {
    "int_type": "expects an integer",
    "int_parsing": "expects an integer",
    "int_from_float": "expects an integer",
    "float_type": "expects a number",
    "float_parsing": "expects a number",
    "bool_type": "expects true/false",
    "list_type": "expects a list",
    "finite_number": "must be a finite number",
}


def _message(cls, err: ValidationError) -> str:
    """pydantic's first error as ``config option KEY = VALUE: why`` (one line)."""
    errors = err.errors(include_url=False)
    extra = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
    if extra:
        return f"unknown config option(s) {extra}; see --help"
    e = errors[0]
    loc = [p for p in e.get("loc", ()) if isinstance(p, str)]
    ctx = e.get("ctx", {})
    if not loc:  # a model validator's own ValueError carries the whole line
        return str(ctx.get("error", e["msg"]))
    key, kind = loc[0], e["type"]
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        why = _range_phrase(cls.model_fields[key])
    elif kind == "literal_error":
        why = f"use {ctx.get('expected', '')}"
    elif kind == "value_error":
        why = str(ctx.get("error", e["msg"]))
    else:
        why = _PHRASES.get(kind, e["msg"])
    return f"config option {key} = {e.get('input')!r}: {why}"


def _range_phrase(field) -> str:
    b = {k: getattr(m, k) for m in field.metadata for k in ("ge", "gt", "le", "lt") if getattr(m, k, None) is not None}
    if ("ge" in b or "gt" in b) and ("le" in b or "lt" in b):
        lo = f"[{b['ge']}" if "ge" in b else f"({b['gt']}"
        hi = f"{b['le']}]" if "le" in b else f"{b['lt']})"
        return f"must lie in {lo}, {hi}"
    if b.get("gt") == 0:
        return "must be a positive finite number"
    return f"must be >= {b['ge']}" if "ge" in b else f"must be > {b['gt']}" if "gt" in b else "out of range"


def _build(cls, values: dict):
    return cls(**values)


def _read_yaml(path: str | None) -> dict:
    if not path:
        return {}
    with open(path) as fh:
        values = yaml.safe_load(fh) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: a config file is a YAML mapping of option: value")
    return values


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, raised to the caller (load_config_or_exit prints it once)
        raise ValueError(message.replace("unrecognized arguments", "unknown config option(s)") + "; see --help")


def _parser(cls) -> argparse.ArgumentParser:
    p = _Parser(prog=f"accelerate launch {cls.script}", add_help=False, allow_abbrev=False)
    p.add_argument("--config")
    for name in cls.model_fields:
        p.add_argument(f"--{name}", dest=name, default=argparse.SUPPRESS)
    return p


def load_config(argv: list[str] | None = None, default_config: str | None = None, config_cls=None):
    """A validated ``config_cls`` (default ``RCMConfig``) from ``--config FILE`` (else ``default_config``) and
    ``--key value`` / ``--key=value`` overrides (later wins; ``--key-name`` = ``--key_name``). Each command-line value
    is read as YAML (``3e-5``, ``true``, ``[0.0, 0.99]``) except for text options. Raises ``ValueError`` (one line)."""
    cls = config_cls or RCMConfig
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(format_help(cls))
        raise SystemExit(0)
    argv = [
        a.split("=", 1)[0].replace("-", "_").replace("__", "--", 1) + a[len(a.split("=", 1)[0]) :]
        if a.startswith("--")
        else a
        for a in argv
    ]
    args = vars(_parser(cls).parse_args(argv))
    values = _read_yaml(args.pop("config", None) or default_config)
    unknown = sorted(set(values) - set(cls.model_fields))
    if unknown:
        raise ValueError(f"unknown config option(s) {unknown}; see --help")
    for k, v in args.items():
        ann = cls.model_fields[k].annotation
        values[k] = v if ann is str or k == "mid_t" else yaml.safe_load(v)
    return _build(cls, values).validate()


def _groups(cls) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, f in cls.model_fields.items():
        out.setdefault(f.json_schema_extra["group"], []).append(name)
    return out


def _default(f):
    return f.default_factory() if f.default_factory is not None else f.default


def _choices(f) -> str:
    """`` [a | b]`` for an option with a fixed set of values, else ``""``."""
    choices = getattr(f.annotation, "__args__", ()) if getattr(f.annotation, "__origin__", None) is Literal else ()
    return f" [{' | '.join(map(str, choices))}]" if choices else ""


def format_help(config_cls=None) -> str:
    """``--help``: one line per option of ``config_cls`` (default ``RCMConfig``), grouped:
    ``--name (default): meaning``."""
    cls = config_cls or RCMConfig
    lines = [
        f"usage: accelerate launch {cls.script} [--config FILE.yaml] [--key value ...]",
        "",
        "Options (YAML keys or --key value; later wins; docs/training.md lists which may change on resume):",
    ]
    for group, names in _groups(cls).items():
        lines.append(f"\n {group}:")
        for n in names:
            f = cls.model_fields[n]
            lines.append(f"  --{n} ({_default(f)!r}){_choices(f)}: {f.description}")
    return "\n".join(lines)


def resume_policy(config_cls) -> dict[str, tuple[str, str]]:
    """``{option: (policy, why)}`` with policy ``fixed`` | ``applied`` | ``free`` (see the module docstring)."""
    return {n: (f.json_schema_extra["resume"], f.json_schema_extra["why"]) for n, f in config_cls.model_fields.items()}


def options_markdown() -> str:
    """The options tables of docs/training.md: common options (both defaults), then rCM's and QAD's own."""

    def cell(v):
        return "`" + repr(v).replace("|", "\\|") + "`"

    def on_resume(f):
        x = f.json_schema_extra
        return {"fixed": f"refused ({x['why']})", "applied": "applied, printed", "free": "free"}[x["resume"]]

    def esc(f):
        return (f.description + _choices(f)).replace("|", "\\|")

    out = [
        "### Options of both trainers",
        "",
        "| option | rCM default | QAD default | meaning | on resume |",
        "|---|---|---|---|---|",
    ]
    for n, f in CommonOptions.model_fields.items():
        q = QADConfig.model_fields[n]
        out.append(f"| `{n}` | {cell(_default(f))} | {cell(_default(q))} | {esc(f)} | {on_resume(f)} |")
    for cls, title in ((RCMConfig, "rCM (`training/rcm.py`)"), (QADConfig, "QAD (`training/qad.py`)")):
        out += [
            "",
            f"### Options of {title} only",
            "",
            "| option | default | meaning | on resume |",
            "|---|---|---|---|",
        ]
        for n, f in cls.model_fields.items():
            if n not in CommonOptions.model_fields:
                out.append(f"| `{n}` | {cell(_default(f))} | {esc(f)} | {on_resume(f)} |")
    return "\n".join(out) + "\n"


OPTIONS_BEGIN, OPTIONS_END = "<!-- options: begin (generated) -->", "<!-- options: end -->"


def write_options_into(path: str) -> bool:
    """Replace the text between the option markers of ``path`` (docs/training.md) with ``options_markdown()``;
    returns whether the file changed."""
    with open(path) as f:
        text = f.read()
    head, rest = text.split(OPTIONS_BEGIN, 1)
    _, tail = rest.split(OPTIONS_END, 1)
    new = f"{head}{OPTIONS_BEGIN}\n{options_markdown()}{OPTIONS_END}{tail}"
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    return new != text


if __name__ == "__main__":  # python -m rcm_diffusers.distill.config [--write docs/training.md]: the options tables
    if sys.argv[1:2] == ["--write"]:
        print("updated" if write_options_into(sys.argv[2]) else "unchanged", sys.argv[2])
    else:
        print(options_markdown(), end="")
