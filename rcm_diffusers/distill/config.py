"""Training configuration: a YAML file plus ``--key value`` overrides, validated (docs/math.md §3, §4, §6, §8).

``python training/rcm.py --help`` prints every option with its default and meaning.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..models import TIME_INPUTS

__all__ = ["RCMConfig", "QADConfig", "load_config", "format_help", "noise_seeding_of"]


def opt(default, help: str, **kw):
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class RCMConfig:
    """All knobs of ``training/rcm.py``; names follow docs/math.md."""

    # model (docs/math.md §1, §6)
    pretrained: str = opt("", "diffusers pipeline directory or hub id holding the teacher transformer")
    transformer_subfolder: str = opt("transformer", "subfolder of the transformer to distill when one network is trained (experts one; Wan2.2 A14B: 'transformer' = high-noise expert, 'transformer_2' = low-noise expert)")
    experts: str = opt("auto", "Wan 2.2 two-expert pipelines (transformer_2 + boundary_ratio): 'both' = distil both experts in one run, "
                       "each call routed to the expert that owns its time (docs/math.md §6.1); 'one' = only transformer_subfolder; "
                       "'auto' = both when the pipeline has two experts")
    boundary_ratio: float = opt(0.0, "two experts: RF time r of the switch, transformer for 1000 r >= 1000 boundary_ratio (0 = the pipeline's boundary_ratio)")
    expert_sampling: str = opt("balanced", "two experts, sCM times: 'balanced' = each sample's expert is the high-noise one with probability "
                               "high_noise_share and its time is drawn from p_G restricted to that expert; 'natural' = p_G as is "
                               "(the high-noise expert then gets only P(sigma >= b / (1 - b)) of the samples)")
    high_noise_share: float = opt(0.5, "two experts, expert_sampling balanced: fraction of sCM samples given to the high-noise expert")
    boundary_weight: float = opt(1.0, "two experts: weight of the boundary term, which pulls the high-noise expert's student onto the "
                                 "low-noise one's at the switch time (the sCM term alone leaves the high-noise expert's consistency "
                                 "function unanchored; docs/math.md §6.1); 0 = off")
    pipeline_class: str = opt("auto", "diffusers pipeline class used to save/load the LoRA and for sample grids ('auto' = from model_index.json)")
    weight_dtype: str = opt("float32", "dtype of the frozen base weights: float32 | bfloat16")
    mixed_precision: str = opt("no", "accelerate mixed precision: no | bf16 | fp16")
    mode: str = opt("shared", "'shared' = one frozen base + peft adapters 'student' and 'fake' (docs/math.md §6); 'full' = full fine-tune copies")
    lora_rank: int = opt(32, "LoRA rank of the student adapter")
    lora_alpha: float = opt(0.0, "LoRA alpha (0 = equal to rank)")
    fake_lora_rank: int = opt(0, "LoRA rank of the fake-score adapter (0 = lora_rank)")
    lora_target_modules: list = opt([], "module names to adapt ([] = family default, see rcm_diffusers.distill.adapters.DEFAULT_LORA_TARGETS)")
    gradient_checkpointing: bool = opt(False, "checkpoint transformer blocks in the grad passes (JVP passes run under no_grad without it)")
    checkpointing_policy: str = opt("full", "with gradient_checkpointing: 'full' = keep each block's inputs, recompute the whole block in "
                                    "the backward; 'selective' = also keep the outputs of the matrix products (q/k/v/out and "
                                    "feed-forward projections, cross-attention text K/V, LoRA down-projections) and of the "
                                    "attention kernels, recompute the rest (norms, RoPE, modulation, GELU, residual adds, casts "
                                    "and the rank-r LoRA up-projections): more memory than full, less recompute (the official "
                                    "rCM mm_only mode; rcm_diffusers.distill.checkpointing)")
    flux_guidance: float = opt(3.5, "Flux-dev guidance-embedding value (ignored when the transformer has no guidance embedding)")
    # data (docs/math.md §8)
    data_dir: str = opt("", "directory in the rcm latent format (rcm_diffusers.distill.data; make one with training/prepare_data.py)")
    synthetic: bool = opt(False, "replace the dataset's latents by teacher samples (TrigFlow Euler + CFG) generated at start")
    synthetic_steps: int = opt(100, "teacher Euler steps for --synthetic")
    synthetic_shift: float = opt(3.0, "flow shift of the teacher grid for --synthetic")
    # objective (docs/math.md §3, §4)
    guidance_scale: float = opt(5.0, "standard CFG scale s of the teacher, F_u + s (F_c - F_u): the official rCM teacher_guidance (5); official code before 2026-02-20 wrote F_c + g (F_c - F_u), i.e. s = g + 1")
    P_mean: float = opt(-0.8, "p_G: mean of ln sigma")
    P_std: float = opt(1.6, "p_G: std of ln sigma")
    video_noise_multiplier: float = opt(0.0, "multiply p_G's sigma by this (0 = sqrt(latent frames) for video, 1 for images)")
    p_D_shift: float = opt(5.0, "p_D: flow shift s of r = s u / (1 + (s-1) u)")
    tangent_warmup: int = opt(1000, "iterations of the tangent warm-up r = min(1, step / tangent_warmup); DMD starts after it")
    fd_type: int = opt(0, "sCM derivative: 0 exact JVP, 1 JVP in x + finite difference in t, 2 finite difference (no JVP)")
    fd_h: float = opt(1e-4, "finite-difference step h (fd_type 1, 2)")
    use_dmd: bool = opt(True, "train a fake score and add the DMD term (False = sCM only)")
    dmd_weight: float = opt(0.01, "weight of L_DMD in L = scm_weight L_sCM + dmd_weight L_DMD (official rCM: 1 with scm_weight 100, its loss_scale_dmd)")
    scm_weight: float = opt(1.0, "weight of the consistency term L_sCM, or L_dCM with cm_type dcm (0 = DMD only, no JVP; official rCM: 100, its loss_scale)")
    regression_weight: float = opt(0.0, "weight of the ODE-pair regression of the one-step student, ||x0_theta(noise, pi/2) - "
                                   "x_teacher||^2 (DMD's regression loss, docs/math.md §4.7); needs regression_data_dir; 0 = off")
    regression_data_dir: str = opt("", "ODE pairs for regression_weight: a latent dataset whose 'latents' are teacher ODE samples "
                                   "and whose 'noise' is the noise each started from (training/prepare_data.py --synthetic writes one)")
    loss_reduction: str = opt("mean", "batch reduction of the per-sample losses (student and fake score): 'mean' or 'sum' (official rCM)")
    cm_type: str = opt("scm", "consistency term (official cm_type): 'scm' = continuous-time sCM (JVP tangent, fd_type) | 'dcm' = "
                       "discrete-time CM: the teacher's guided Euler steps from t_0 to t_N, target the student's sg(x0) at t_N, "
                       "no JVP (docs/math.md §4.6); scm_weight weights whichever term is chosen")
    dcm_total_steps: int = opt(48, "cm_type dcm: the grid has this many uniform steps in u before the shift (official 48)")
    dcm_skipping_interval_steps: int = opt(1, "cm_type dcm: grid steps between t_0 and t_N, i.e. teacher Euler steps per sample (official 1)")
    dcm_timestep_shift: float = opt(5.0, "cm_type dcm: flow shift s of the grid, r = s u / (1 + (s-1) u) (official 5)")
    dmd_fix_timesteps: bool = opt(False, "backward simulation (DMD term and fake score) on the fixed angles backward_timesteps "
                                  "instead of p_D draws (official dmd_fix_timesteps, default false; docs/math.md §4.2)")
    backward_timesteps: list = opt([1.5, 1.4, 1.0], "dmd_fix_timesteps: intermediate TrigFlow angles after pi/2, n steps use "
                                   "the first n - 1 (official default); sample the student on the same angles (mid_t)")
    student_update_freq: int = opt(5, "after warm-up, the student trains every this many iterations, the fake score otherwise")
    max_simulation_steps: int = opt(4, "backward simulation uses n = student_eff % this + 1 student steps")
    time_input: str = opt("bf16", "time the networks see: 'bf16' = (1000 r) rounded to bfloat16 as the official rCM code trains and samples; 'float' = exact. Sample the student with RCMScheduler(time_input=...) set the same")
    # optimisation (docs/math.md §4.4, §4.5)
    lr: float = opt(1e-4, "student learning rate (LoRA needs larger rates than the full fine-tune 2e-6)")
    fake_lr: float = opt(2e-5, "fake-score learning rate")
    weight_decay: float = opt(0.01, "AdamW weight decay")
    adam_betas: list = opt([0.0, 0.999], "AdamW betas")
    adam_eps: float = opt(1e-8, "AdamW eps")
    lr_warmup_steps: int = opt(100, "linear learning-rate warm-up (in each optimizer's own steps)")
    lr_decay: str = opt("none", "after the warm-up: 'none' = constant (official rCM), 'cosine' or 'linear' = decay to "
                        "lr_final_ratio x lr at the current launch's max_steps (each optimizer counts its own steps)")
    lr_final_ratio: float = opt(0.0, "with lr_decay cosine/linear: the last step's rate as a fraction of lr / fake_lr")
    lr_decay_fraction: float = opt(1.0, "with lr_decay cosine/linear: the decay spans this last fraction of each "
                                   "optimizer's steps after the warm-up (the rate is constant before it)")
    max_grad_norm: float = opt(1.0, "gradient clipping norm (0 = off, as the official rCM grad_clip False)")
    ema_rate: float = opt(0.10, "power-EMA rate s (0 = no EMA)")
    batch_size: int = opt(1, "samples per process and iteration")
    gradient_accumulation_steps: int = opt(1, "micro-batches of batch_size per process and optimizer step: one iteration = "
                                           "one optimizer step on batch_size x this samples per process (same samples, noise "
                                           "and loss as batch_size x this in one batch; needs noise_seeding sample, which auto picks)")
    noise_seeding: str = opt("auto", "'rank' = one generator per (seed, step, rank) for the process's whole batch; 'sample' = one "
                             "per (seed, step, global sample position), so a sample's noise does not depend on the split into "
                             "processes or micro-batches; 'auto' = sample with gradient accumulation, else rank")
    context_parallel_size: int = opt(1, "Wan: processes that run one sample together (Ulysses: video tokens split, all-to-all "
                                     "around self-attention, rcm_diffusers.attention.ulysses); data parallelism runs across "
                                     "the world_size / this groups, each group reading one process's batch_size samples")
    max_steps: int = opt(1000, "total iterations (student + fake-score steps)")
    seed: int = opt(0, "base seed; every random draw is a function of (seed, step, rank)")
    # outputs and guards
    output_dir: str = opt("outputs/rcm", "run directory: checkpoints/, metrics.jsonl, env.json, the LoRA")
    resume: str = opt("", "'' = fresh (output_dir must be empty), 'latest' = newest intact checkpoint in output_dir (fresh if none), or a checkpoint path; see docs/training.md for the settings that may change on resume")
    overwrite: bool = opt(False, "delete the previous run's files in output_dir (checkpoints, metrics, exports) and start again; with --resume PATH: delete the checkpoints after PATH")
    checkpoint_every: int = opt(500, "save a checkpoint (safetensors + JSON, docs/training.md) every N iterations (0 = only at the end)")
    checkpoints_total_limit: int = opt(3, "keep this many checkpoints (0 = all)")
    log_every: int = opt(1, "write metrics every N iterations")
    report_to: str = opt("none", "accelerate tracker: none | tensorboard | wandb | all")
    sample_every: int = opt(0, "write a student sample grid every N iterations (0 = off)")
    sample_steps: list = opt([1, 2, 4], "RCMScheduler step counts of the sample grid")
    sigma_max: float = opt(80.0, "sigma_max of the student sampler (80 T2V, 200 Wan I2V)")
    mid_t: list = opt([], "intermediate TrigFlow angles of the student sampler, strictly decreasing below "
                      "arctan(sigma_max); n steps use the first n - 1 (empty = the default of docs/math.md §2.1). "
                      "Or per step count: a mapping {2: [1.0], 4: [1.5, 1.4, 0.8]} (YAML), or on the command line "
                      "'2: 1.0; 4: 1.5, 1.4, 0.8'; n steps use the entry for n, else the next larger one, cut to "
                      "n - 1 angles. Written into the run's scheduler/ config")
    spike_factor: float = opt(5.0, "grad-norm spike: norm > factor x running median ...")
    spike_patience: int = opt(3, "... for this many consecutive steps of one network dumps spikes.jsonl")
    skip_nonfinite: bool = opt(True, "skip the optimizer step when the gradient norm is not finite (reported, counted in metrics and final.json)")
    max_skipped_fraction: float = opt(0.05, "fail the run once more than this fraction of max_steps was skipped (non-finite gradients)")
    exit_after_step: int = opt(-1, "testing: hard-exit (os._exit) right after this iteration, as if killed")
    progress: bool = opt(True, "tqdm progress bar on the main process")

    def __post_init__(self):
        self.mid_t = _normal_mid_t(self.mid_t)

    def validate(self) -> "RCMConfig":
        """Raise ``ValueError`` with the offending option on an invalid setting."""
        def bad(key, why):
            raise ValueError(f"config option {key} = {getattr(self, key)!r}: {why}")

        if not self.pretrained:
            bad("pretrained", "set the teacher pipeline directory or hub id")
        if not self.data_dir:
            bad("data_dir", "set a latent dataset directory (see rcm_diffusers.distill.data)")
        if self.mode not in ("shared", "full"):
            bad("mode", "use 'shared' or 'full'")
        if self.checkpointing_policy not in ("full", "selective"):
            bad("checkpointing_policy", "use 'full' or 'selective'")
        if self.checkpointing_policy != "full" and not self.gradient_checkpointing:
            bad("checkpointing_policy", "applies with gradient_checkpointing true; set it too")
        if self.fd_type not in (0, 1, 2):
            bad("fd_type", "use 0, 1 or 2")
        if self.time_input not in TIME_INPUTS:
            bad("time_input", f"use one of {TIME_INPUTS}")
        if self.experts not in ("auto", "both", "one"):
            bad("experts", "use 'auto', 'both' or 'one'")
        if not 0 <= self.boundary_ratio < 1:
            bad("boundary_ratio", "must lie in (0, 1), or 0 for the pipeline's value")
        if self.expert_sampling not in ("balanced", "natural"):
            bad("expert_sampling", "use 'balanced' or 'natural'")
        if not (self.boundary_weight >= 0 and math.isfinite(self.boundary_weight)):
            bad("boundary_weight", "must be a finite number >= 0")
        if not 0 < self.high_noise_share < 1:
            bad("high_noise_share", "must lie strictly between 0 and 1 (each expert needs samples)")
        if self.loss_reduction not in ("mean", "sum"):
            bad("loss_reduction", "use 'mean' or 'sum'")
        _validate_mid_t(self, bad, self.sample_steps, "sample_steps")
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
        if not 0 <= self.max_skipped_fraction <= 1:
            bad("max_skipped_fraction", "must lie in [0, 1]")
        if not 0 <= self.ema_rate < 1:
            bad("ema_rate", "must lie in [0, 1)")
        if self.lr_decay not in ("none", "cosine", "linear"):
            bad("lr_decay", "use none, cosine or linear")
        if not 0 <= self.lr_final_ratio <= 1:
            bad("lr_final_ratio", "must lie in [0, 1]")
        if not 0 < self.lr_decay_fraction <= 1:
            bad("lr_decay_fraction", "must lie in (0, 1]")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            bad("adam_betas", "two numbers in [0, 1)")
        if self.guidance_scale < 0:
            bad("guidance_scale", "must be >= 0 (1 = no guidance)")
        if self.cm_type not in ("scm", "dcm"):
            bad("cm_type", "use 'scm' (continuous-time) or 'dcm' (discrete-time)")
        if self.dcm_total_steps < 2:
            bad("dcm_total_steps", "must be >= 2")
        if not 1 <= self.dcm_skipping_interval_steps < self.dcm_total_steps:
            bad("dcm_skipping_interval_steps", f"must lie in [1, dcm_total_steps - 1 = {self.dcm_total_steps - 1}]")
        if not (self.dcm_timestep_shift > 0 and math.isfinite(self.dcm_timestep_shift)):
            bad("dcm_timestep_shift", "must be a positive finite number (1 = no shift)")
        if self.dmd_fix_timesteps:
            bt = self.backward_timesteps
            if (not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in bt)
                    or any(not 0 < a < math.pi / 2 for a in bt) or any(a <= b for a, b in zip(bt, bt[1:]))):
                bad("backward_timesteps", "TrigFlow angles strictly decreasing, strictly inside (0, pi/2)")
            if len(bt) < self.max_simulation_steps - 1:
                bad("backward_timesteps", f"max_simulation_steps {self.max_simulation_steps} needs at least "
                    f"{self.max_simulation_steps - 1} angles")
        if not (self.regression_weight >= 0 and math.isfinite(self.regression_weight)):
            bad("regression_weight", "must be a finite number >= 0 (0 = off)")
        if self.regression_weight > 0 and not self.regression_data_dir:
            bad("regression_data_dir", "regression_weight > 0 needs ODE pairs: a dataset from training/prepare_data.py --synthetic")
        if self.scm_weight == 0 and not self.use_dmd:
            bad("scm_weight", "sCM off and DMD off leaves nothing to train")
        if self.scm_weight == 0 and self.tangent_warmup > 0:
            bad("tangent_warmup", "with scm_weight 0 (DMD only) the warm-up iterations train nothing; set tangent_warmup 0")
        _validate_accumulation(self, bad)
        if self.context_parallel_size < 1:
            bad("context_parallel_size", "must be >= 1")
        if self.context_parallel_size > 1 and self.sample_every:
            bad("sample_every", "sample grids run on the main process alone, a context-parallel model needs its whole "
                                "group: use sample_every 0 with context_parallel_size > 1")
        return self



@dataclass
class QADConfig:
    """All knobs of ``training/qad.py`` (quantization-aware distillation, docs/math.md §7)."""

    # teacher (bf16 base model, or an rCM few-step student = base + its LoRA fused in)
    pretrained: str = opt("", "diffusers pipeline directory or hub id holding the teacher transformer")
    transformer_subfolder: str = opt("transformer", "subfolder of the transformer (Wan2.2 A14B: 'transformer' or 'transformer_2')")
    teacher_lora: str = opt("", "'' = the base model is the teacher; else an rCM student LoRA (training/rcm.py output dir or .safetensors) fused into it")
    weight_dtype: str = opt("float32", "dtype of teacher and student weights: float32 | bfloat16")
    mixed_precision: str = opt("no", "accelerate mixed precision: no | bf16 | fp16")
    flux_guidance: float = opt(3.5, "Flux-dev guidance-embedding value (ignored without a guidance embedding)")
    data_dir: str = opt("", "latent dataset (rcm_diffusers.distill.data): x0 of the flow-matching term and of the noised inputs x_r")
    # quantization (docs/math.md §7)
    format: str = opt("nvfp4", "weight format: nvfp4 | mxfp4 | fp8_e4m3 | int8")
    act_format: str = opt("", "target fake: activation format ('' = weight-only); static per-tensor range calibrated on calibration_batches")
    target: str = opt("auto", "arithmetic trained: comfyui = what ComfyUI runs for the format on a GPU with kernels for it "
                      "(nvfp4 W+A, fp8 W+A with calibrated input_scale, int8 W8A8 per-row dynamic) | fake = format / "
                      "act_format as given | auto = comfyui when the export layout is comfyui, else fake")
    act_scale: str = opt("static", "target comfyui, nvfp4: static = calibrated input_scale (exported) | dynamic = per-call "
                         "amax, ComfyUI's mode without input_scale (fp8 is always static, int8 always dynamic per row)")
    per_channel: bool = opt(False, "fp8_e4m3: per-output-channel weight scales (no ComfyUI field; export refuses it)")
    calibration_batches: int = opt(4, "batches run to calibrate activation ranges (act_format only)")
    exclude: list = opt([], "extra fnmatch patterns of Linear names kept in high precision (added to rcm_diffusers.quant.modules.DEFAULT_EXCLUDE)")
    overrides: list = opt([], "'pattern=format' entries, first match wins ('pattern=none' keeps a layer unquantized)")
    # trainable scope
    scope: str = opt("all", "'all' = every student weight trains (fake-quantized); 'lora' = frozen quantized base + bf16 LoRA")
    lora_rank: int = opt(32, "LoRA rank (scope lora)")
    lora_alpha: float = opt(0.0, "LoRA alpha (0 = equal to rank)")
    lora_target_modules: list = opt([], "module names to adapt ([] = family default, rcm_diffusers.distill.adapters.DEFAULT_LORA_TARGETS)")
    # objective (docs/math.md §7): L = alpha L_FM + (1 - alpha) L_distill
    alpha: float = opt(0.1, "weight of flow matching on real data; 1 - alpha weighs distillation of the guided teacher velocity")
    guidance: list = opt([[0.0, 2.0], [0.5, 5.0], [1.0, 4.0]], "teacher CFG schedule s(r): piecewise-linear [[r, s], ...] knots (a single number = constant; 1 = no CFG)")
    r_source: str = opt("shifted", "training times: 'shifted' = shifted uniform r (shift); 'rcm' = the rCM student's rcm_steps sampling times")
    shift: float = opt(3.0, "flow shift s of r = s u / (1 + (s - 1) u) (r_source shifted)")
    rcm_steps: int = opt(4, "number of RCMScheduler steps whose times r is drawn from (r_source rcm)")
    sigma_max: float = opt(80.0, "RCMScheduler sigma_max of those times (r_source rcm)")
    mid_t: list = opt([], "RCMScheduler intermediate TrigFlow angles ([] = docs/math.md §2.1 default; r_source rcm); "
                      "a list, or per step count as RCMConfig's mid_t")
    time_input: str = opt("bf16", "time the teacher and student see: 'bf16' = rounded to bfloat16 as the official rCM code; 'float' = exact")
    # block-wise warm start (docs/math.md §7)
    warm_start_batches: int = opt(0, "batches of block-wise warm start before end-to-end QAD (0 = off)")
    warm_start_steps_per_batch: int = opt(1, "optimizer steps per block and warm-start batch")
    warm_start_lr: float = opt(1e-4, "warm-start learning rate")
    # optimisation
    lr: float = opt(1e-5, "learning rate (scope lora wants larger, e.g. 1e-4)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    adam_betas: list = opt([0.9, 0.999], "AdamW betas")
    adam_eps: float = opt(1e-8, "AdamW eps")
    lr_warmup_steps: int = opt(0, "linear learning-rate warm-up steps")
    max_grad_norm: float = opt(1.0, "gradient clipping norm (0 = off)")
    batch_size: int = opt(1, "samples per process and iteration")
    gradient_accumulation_steps: int = opt(1, "micro-batches of batch_size per process and optimizer step (same samples, noise "
                                           "and loss as one batch of batch_size x this; needs noise_seeding sample, which auto picks)")
    noise_seeding: str = opt("auto", "'rank' = one generator per (seed, step, rank) for the process's whole batch; 'sample' = one "
                             "per (seed, step, global sample position); 'auto' = sample with gradient accumulation, else rank")
    max_steps: int = opt(1000, "total iterations")
    ema_rate: float = opt(0.0, "power-EMA rate s of the trained weights (0 = off); exports an EMA variant in ema/")
    export_delta: bool = opt(True, "scope all: also export the bf16 full-weight delta student - teacher (ComfyUI LoRA layout, .diff/.diff_b)")
    seed: int = opt(0, "base seed; every random draw is a function of (seed, step, rank)")
    eval_batches: int = opt(2, "fixed-seed batches of the distillation-loss probe logged before/after warm start and at the end")
    # outputs and guards
    output_dir: str = opt("outputs/qad", "run directory: checkpoints/, metrics.jsonl, env.json, final.json, the exports")
    export_layout: str = opt("auto", "quantized checkpoint layout: auto (comfyui for Wan, diffusers for Flux) | comfyui | diffusers")
    resume: str = opt("", "'' = fresh (output_dir must be empty), 'latest' = newest intact checkpoint in output_dir (fresh if none), or a checkpoint path; see docs/training.md for the settings that may change on resume")
    overwrite: bool = opt(False, "delete the previous run's files in output_dir (checkpoints, metrics, exports) and start again; with --resume PATH: delete the checkpoints after PATH")
    checkpoint_every: int = opt(500, "save a checkpoint (safetensors + JSON, docs/training.md) every N iterations (0 = only at the end)")
    checkpoints_total_limit: int = opt(3, "keep this many checkpoints (0 = all)")
    log_every: int = opt(1, "write metrics every N iterations")
    report_to: str = opt("none", "accelerate tracker: none | tensorboard | wandb | all")
    skip_nonfinite: bool = opt(True, "skip the optimizer step when the gradient norm is not finite (reported, counted in metrics and final.json)")
    max_skipped_fraction: float = opt(0.05, "fail the run once more than this fraction of max_steps was skipped (non-finite gradients)")
    exit_after_step: int = opt(-1, "testing: hard-exit (os._exit) right after this iteration, as if killed")
    progress: bool = opt(True, "tqdm progress bar on the main process")

    def __post_init__(self):
        self.mid_t = _normal_mid_t(self.mid_t)

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

    def validate(self) -> "QADConfig":
        """Raise ``ValueError`` with the offending option on an invalid setting."""
        from ..quant.formats import check_format
        from .qad import GuidanceSchedule

        def bad(key, why):
            raise ValueError(f"config option {key} = {getattr(self, key)!r}: {why}")

        if not self.pretrained:
            bad("pretrained", "set the teacher pipeline directory or hub id")
        if not self.data_dir:
            bad("data_dir", "set a latent dataset directory (see rcm_diffusers.distill.data)")
        if self.time_input not in TIME_INPUTS:
            bad("time_input", f"use one of {TIME_INPUTS}")
        for key in ("format", "act_format"):
            if getattr(self, key) or key == "format":
                try:
                    check_format(getattr(self, key))
                except ValueError as e:
                    bad(key, str(e))
        try:
            for f in self.quant_overrides().values():
                if f is not None:
                    check_format(f)
        except ValueError as e:
            bad("overrides", str(e))
        try:
            GuidanceSchedule(self.guidance_knots())
        except (ValueError, TypeError) as e:
            bad("guidance", f"{e} (use [[r, s], ...] or one number)")
        if self.scope not in ("all", "lora"):
            bad("scope", "use 'all' or 'lora'")
        if self.r_source not in ("shifted", "rcm"):
            bad("r_source", "use 'shifted' or 'rcm'")
        if self.export_layout not in ("auto", "comfyui", "diffusers"):
            bad("export_layout", "use auto, comfyui or diffusers")
        if self.weight_dtype not in ("float32", "bfloat16", "float16"):
            bad("weight_dtype", "use float32, bfloat16 or float16")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            bad("mixed_precision", "use no, bf16 or fp16")
        if not 0 <= self.max_skipped_fraction <= 1:
            bad("max_skipped_fraction", "must lie in [0, 1]")
        if not 0.0 <= self.alpha <= 1.0:
            bad("alpha", "must lie in [0, 1]")
        for k in ("lora_rank", "batch_size", "max_steps", "log_every", "rcm_steps", "warm_start_steps_per_batch", "calibration_batches"):
            if getattr(self, k) < 1:
                bad(k, "must be >= 1")
        for k in ("checkpoint_every", "lr_warmup_steps", "warm_start_batches", "eval_batches"):
            if getattr(self, k) < 0:
                bad(k, "must be >= 0")
        for k in ("lr", "warm_start_lr", "shift", "sigma_max"):
            if not (getattr(self, k) > 0 and math.isfinite(getattr(self, k))):
                bad(k, "must be a positive finite number")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            bad("adam_betas", "two numbers in [0, 1)")
        if self.per_channel and self.format != "fp8_e4m3":
            bad("per_channel", "only fp8_e4m3 has a per-channel option (int8 is always per-channel)")
        if self.target not in ("auto", "comfyui", "fake"):
            bad("target", "use auto, comfyui or fake")
        if self.act_scale not in ("static", "dynamic"):
            bad("act_scale", "use static or dynamic")
        if self.target == "comfyui":
            from ..quant.formats import COMFY_ACT

            if self.format not in COMFY_ACT:
                bad("format", f"target comfyui: ComfyUI has no layout for it (use {', '.join(COMFY_ACT)}, or target fake)")
            if self.act_format and self.act_format != self.format:
                bad("act_format", f"target comfyui quantizes activations as the weight format ({self.format}); leave it ''")
            if self.format == "fp8_e4m3" and self.act_scale == "dynamic":
                bad("act_scale", "target comfyui, fp8: ComfyUI without input_scale casts at scale 1.0; use static")
            if self.per_channel:
                bad("per_channel", "target comfyui: per-channel FP8 has no ComfyUI field")
        if not 0 <= self.ema_rate < 1:
            bad("ema_rate", "must lie in [0, 1)")
        _validate_accumulation(self, bad)
        _validate_mid_t(self, bad, [self.rcm_steps] if self.r_source == "rcm" else [], "rcm_steps")
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

def _normal_mid_t(value):
    """``mid_t`` in the JSON form ``RCMScheduler`` registers (a list of floats, or ``{"2": [...], ...}``), so that it
    compares equal to the one read back from a checkpoint; as given when it does not read (``validate`` says why)."""
    from ..sampling import mid_t_as_config

    try:
        return mid_t_as_config(value)
    except (TypeError, ValueError):
        return value


def _validate_mid_t(cfg, bad, steps, steps_key: str) -> None:
    """Every angle of ``cfg.mid_t`` (flat or per step count) against ``cfg.sigma_max``, and each step count the run
    samples (``steps``, named ``steps_key``) served by it (docs/math.md §2.1). Empty ``mid_t`` = the default angles."""
    if not cfg.mid_t:
        return
    from ..sampling import rcm_angles, validate_mid_t

    try:
        validate_mid_t(cfg.mid_t, cfg.sigma_max)
    except (TypeError, ValueError) as e:
        bad("mid_t", str(e))
    for n in steps:
        try:
            rcm_angles(n, cfg.sigma_max, cfg.mid_t)
        except (TypeError, ValueError) as e:
            bad("mid_t", f"{steps_key} {n}: {e}")


def _validate_accumulation(cfg, bad) -> None:
    """Checks of ``gradient_accumulation_steps`` and ``noise_seeding`` (both configs)."""
    if cfg.gradient_accumulation_steps < 1:
        bad("gradient_accumulation_steps", "must be >= 1")
    if cfg.noise_seeding not in ("auto", "rank", "sample"):
        bad("noise_seeding", "use auto, rank or sample")
    if cfg.gradient_accumulation_steps > 1 and cfg.noise_seeding == "rank":
        bad("noise_seeding", "with gradient_accumulation_steps > 1 each micro-batch must draw its samples' own noise: "
                              "use sample (or auto)")


def noise_seeding_of(cfg) -> str:
    """``cfg.noise_seeding`` with ``auto`` resolved: ``sample`` with gradient accumulation, else ``rank``."""
    if cfg.noise_seeding != "auto":
        return cfg.noise_seeding
    return "sample" if cfg.gradient_accumulation_steps > 1 else "rank"


# the script each config drives (kept off the dataclass fields)
RCMConfig.script = "training/rcm.py"
QADConfig.script = "training/qad.py"


def _fields(config_cls=None):
    return {f.name: f for f in dataclasses.fields(config_cls or RCMConfig)}


def _coerce(name: str, value: Any, config_cls=None):
    f = _fields(config_cls)[name]
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if name == "mid_t":  # a list or {steps: angles}: YAML flow text, or the forms "1.5,1.4,1.0" / "2: 1.0; 4: 1.5, 1.4, 0.8"
        if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
            value = yaml.safe_load(value)
        return value  # normalised by the config's __post_init__, checked by validate()
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


def format_help(config_cls=None) -> str:
    """One line per option of ``config_cls`` (default ``RCMConfig``): ``--name (default): meaning``."""
    config_cls = config_cls or RCMConfig
    lines = [f"usage: accelerate launch {config_cls.script} [--config FILE.yaml] [--key value ...]", "",
             "Options (YAML keys or --key value; later wins):"]
    for name, f in _fields(config_cls).items():
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  --{name} ({default!r}): {f.metadata['help']}")
    return "\n".join(lines)


def load_config(argv: list[str] | None = None, default_config: str | None = None, config_cls=None):
    """Build a ``config_cls`` (default ``RCMConfig``) from ``--config FILE`` (else ``default_config``) and ``--key value`` overrides."""
    config_cls = config_cls or RCMConfig
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(format_help(config_cls))
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
    fields = _fields(config_cls)
    for k, v in overrides:
        values[k] = v
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown config option(s) {unknown}; see --help")
    return config_cls(**{k: _coerce(k, v, config_cls) for k, v in values.items()}).validate()
