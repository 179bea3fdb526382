"""The pieces of the rCM training loop (docs/math.md §4, §6, §8): one student step, one fake-score step,
checkpoints, metrics, guards, the environment snapshot and the LoRA export.

``training/rcm.py`` strings these together top to bottom.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext

import torch

from . import losses as L
from .. import rng
from .alternation import StepPlan
from .experts import sample_p_G_experts, switch_of
from ..models import network_timestep
from ..trigflow import r_to_t, sample_p_D, sample_p_G, t_to_r, trigflow_noise

__all__ = ["teacher_F", "teacher_x0", "batch_reduce", "needs_jvp", "backward_angles", "student_step", "dcm_step", "scm_times", "boundary_step", "fake_step", "TrainState", "SpikeGuard",
           "MetricsWriter", "latest_checkpoint", "env_snapshot", "load_transformer", "export_student", "save_student_lora", "sample_student",
           "lr_lambda", "batch_rows", "merge_logs", "ddp_jvp_bypass"]

F64 = torch.float64


# ----------------------------------------------------------------------------- teacher with CFG


def _teacher_guided(call, x_t, t, cond, uncond, guidance_scale: float):
    out_c = call("teacher", x_t, t, cond)
    if uncond is None or guidance_scale == 1.0:  # skip the unconditional call
        return out_c
    return L.guided(out_c, call("teacher", x_t, t, uncond), guidance_scale)


@torch.no_grad()
def teacher_F(nets, x_t, t, cond, uncond, guidance_scale: float):
    """Guided teacher velocity ``F_u + s (F_c - F_u)`` (docs/math.md §4.1), float64, no grad."""
    return _teacher_guided(nets.F, x_t, t, cond, uncond, guidance_scale)


@torch.no_grad()
def teacher_x0(nets, x_t, t, cond, uncond, guidance_scale: float):
    """Guided teacher ``x0`` (CFG is linear, so it equals ``x0`` of the guided velocity) (docs/math.md §4.2)."""
    return _teacher_guided(nets.x0, x_t, t, cond, uncond, guidance_scale)


# ----------------------------------------------------------------------------- steps


def batch_reduce(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    """Per-sample losses ``[B]`` to the scalar that is back-propagated: ``"mean"`` (ours) or ``"sum"``
    (the official rCM trainer, ``loss.sum()`` over the per-sample losses)."""
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.mean()
    raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {reduction!r}")


def needs_jvp(cfg) -> bool:
    """Whether a run takes a forward-mode JVP through the student (and so needs ``enable_jvp_attention``): only the sCM
    term with ``fd_type`` 0 or 1. dCM (``cm_type dcm``), ``fd_type`` 2 and DMD alone (``scm_weight 0``) run on the stock
    attention processors."""
    return cfg.scm_weight > 0 and getattr(cfg, "cm_type", "scm") == "scm" and cfg.fd_type in (0, 1)


def backward_angles(cfg):
    """The fixed intermediate angles of the backward simulation (``backward_timesteps`` with ``dmd_fix_timesteps``),
    else ``None`` (angles drawn from ``p_D``) (docs/math.md §4.2)."""
    return list(cfg.backward_timesteps) if getattr(cfg, "dmd_fix_timesteps", False) else None


def dcm_step(nets, x0, cond, uncond, cfg, generator):
    """The dCM term's per-sample loss (docs/math.md §4.6): ``eps``, then grid positions
    ``u ~ U[0, 1 - skip / total_steps)`` from ``generator``; teacher guided by ``cfg.guidance_scale``."""
    total, skip = cfg.dcm_total_steps, cfg.dcm_skipping_interval_steps
    B, dev = x0.shape[0], x0.device
    eps = rng.randn(x0.shape, dtype=F64, generator=generator, device=dev)
    u = rng.rand((B,), dtype=F64, generator=generator, device=dev) * (1.0 - skip / total)
    return L.dcm_loss(nets.x0_fn("student", cond), lambda x, t: teacher_F(nets, x, t, cond, uncond, cfg.guidance_scale),
                      x0, eps, u, total_steps=total, skip=skip, shift=cfg.dcm_timestep_shift)


def student_step(nets, x0, cond, uncond, plan: StepPlan, cfg, generator, backward, noise_multiplier: float = 1.0,
                 pairs=None):
    """One student iteration: ``L = scm_weight L_CM + dmd_weight L_DMD`` (docs/math.md §4.1, §4.2, §4.6; ``L_CM`` is
    ``L_sCM`` or, with ``cfg.cm_type == "dcm"``, ``L_dCM``), each
    per-sample loss reduced over the batch by ``cfg.loss_reduction`` (``batch_reduce``); two experts add
    ``boundary_weight L_bc`` (docs/math.md §6.1), and ``pairs`` = ``(noise, target, cond)`` of ODE pairs adds
    ``regression_weight L_reg`` (docs/math.md §4.7).

    ``backward(loss, last)`` back-propagates one term (``last`` marks the one that must
    synchronise gradients across processes); the DMD term goes first so each grad-enabled
    forward is followed by its own backward (DDP-safe; the regression term, when on, goes before it). Returns a
    dict of logged floats.
    """
    B, dev = x0.shape[0], x0.device
    logs = {}
    sw = switch_of(nets.modules["student"])
    with_bc = sw is not None and getattr(cfg, "boundary_weight", 0.0) > 0
    if pairs is not None:
        noise, target, p_cond = pairs
        l_reg, info = L.regression_loss(nets.x0_fn("student", p_cond), noise, target)
        rest = (plan.dmd and cfg.dmd_weight > 0) or cfg.scm_weight > 0 or with_bc
        backward(cfg.regression_weight * batch_reduce(l_reg, cfg.loss_reduction), last=not rest)
        logs.update(loss_reg=float(l_reg.detach().mean()), nan_reg=info["nan"])
    if plan.dmd and cfg.dmd_weight > 0:
        G_x0, _ = L.backward_simulation(nets.x0_fn("student", cond), x0.shape, plan.n_sim, shift=cfg.p_D_shift,
                                        generator=generator, device=dev, fixed_angles=backward_angles(cfg))
        t_D = sample_p_D(B, cfg.p_D_shift, generator=generator, device=dev)
        eps_D = rng.randn(x0.shape, dtype=F64, generator=generator, device=dev)
        x_t = trigflow_noise(G_x0.detach(), eps_D, t_D)
        with torch.no_grad():
            x0_fake = nets.x0("fake", x_t, t_D, cond)
            x0_teach = teacher_x0(nets, x_t, t_D, cond, uncond, cfg.guidance_scale)
        l_dmd, info = L.dmd_loss(G_x0, x0_fake, x0_teach)
        backward(cfg.dmd_weight * batch_reduce(l_dmd, cfg.loss_reduction), last=cfg.scm_weight == 0 and not with_bc)
        logs.update(loss_dmd=float(l_dmd.detach().mean()), nan_dmd=info["nan"], dmd_w=info["w"], n_sim=plan.n_sim)
    if cfg.scm_weight > 0 and getattr(cfg, "cm_type", "scm") == "dcm":
        # two experts: each call runs on the expert owning its own time (t_0 and t_N may straddle the switch)
        l_dcm, info = dcm_step(nets, x0, cond, uncond, cfg, generator)
        backward(cfg.scm_weight * batch_reduce(l_dcm, cfg.loss_reduction), last=not with_bc)
        logs.update(loss_dcm=float(l_dcm.detach().mean()), nan_dcm=info["nan"], dcm_t0=info["t0"])
    elif cfg.scm_weight > 0:
        t = scm_times(sw, B, cfg, noise_multiplier, generator, dev)
        eps = rng.randn(x0.shape, dtype=F64, generator=generator, device=dev)
        x_t = trigflow_noise(x0, eps, t)
        F_T = teacher_F(nets, x_t, t, cond, uncond, cfg.guidance_scale)
        # two experts: every student call of the term (t, and t - h for fd_type 1/2) stays on the expert owning t
        high = None if sw is None else sw.is_high(network_timestep(t_to_r(t), 1000.0, nets.time_input))
        with nullcontext() if sw is None else sw.pinned(high):
            l_scm, info = L.scm_loss(nets.F_fn("student", cond), x_t, t, F_T, step=plan.student_eff,
                                     tangent_warmup=cfg.tangent_warmup, fd_type=cfg.fd_type, h=cfg.fd_h)
        backward(cfg.scm_weight * batch_reduce(l_scm, cfg.loss_reduction), last=not with_bc)
        logs.update(loss_scm=float(l_scm.detach().mean()), nan_scm=info["nan"], g_norm=info["g_norm"], warmup_r=info["r"])
        if high is not None:
            logs["scm_high"] = int(high.sum())
    if with_bc:
        l_bc, info = boundary_step(nets, sw, x0, cond, generator)
        backward(cfg.boundary_weight * batch_reduce(l_bc, cfg.loss_reduction), last=True)
        logs.update(loss_bc=float(l_bc.detach().mean()), bc_d=info["d_norm"], nan_bc=info["nan"])
    return logs


def boundary_step(nets, switch, x0, cond, generator):
    """The boundary term's per-sample loss (docs/math.md §6.1): ``x_b = cos t_b x0 + sin t_b eps`` at the switch angle
    ``t_b = arctan(b / (1 - b))``; the high-noise expert's student ``F`` there (with gradient) is pulled onto the
    low-noise expert's student ``F`` (no gradient), the consistency function being continuous across the switch."""
    B, dev = x0.shape[0], x0.device
    t_b = r_to_t(torch.full((B,), switch.boundary_ratio, dtype=F64, device=dev))  # arctan(b / (1 - b))
    eps = rng.randn(x0.shape, dtype=F64, generator=generator, device=dev)
    x_b = trigflow_noise(x0, eps, t_b)
    with torch.no_grad(), switch.pinned(torch.zeros(B, dtype=torch.bool)):
        F_low = nets.F("student", x_b, t_b, cond)
    with switch.pinned(torch.ones(B, dtype=torch.bool)):
        F_high = nets.F("student", x_b, t_b, cond)
    return L.boundary_loss(F_high, F_low)


def scm_times(switch, B: int, cfg, noise_multiplier: float, generator, device) -> torch.Tensor:
    """sCM angles: ``p_G`` (docs/math.md §3); with two experts and ``expert_sampling="balanced"`` each sample is
    the high-noise expert's with probability ``high_noise_share`` and its angle comes from ``p_G`` restricted
    to that expert's side of the boundary (docs/math.md §6.1)."""
    if switch is None or cfg.expert_sampling == "natural":
        return sample_p_G(B, cfg.P_mean, cfg.P_std, noise_multiplier, generator=generator, device=device)
    high = rng.rand((B,), dtype=F64, generator=generator, device=device) < cfg.high_noise_share
    return sample_p_G_experts(high, switch.boundary_ratio, cfg.P_mean, cfg.P_std, noise_multiplier,
                              generator=generator, device=device)


def fake_step(nets, x0_shape, cond, plan: StepPlan, cfg, generator, backward, device):
    """One fake-score iteration: flow matching on a detached student sample (docs/math.md §4.3), reduced over the
    batch by ``cfg.loss_reduction`` like the student's terms."""
    B = x0_shape[0]
    n = plan.fake_eff % cfg.max_simulation_steps + 1
    with torch.no_grad():
        G_x0, _ = L.backward_simulation(nets.x0_fn("student", cond), x0_shape, n, shift=cfg.p_D_shift,
                                        generator=generator, device=device, fixed_angles=backward_angles(cfg))
    t = sample_p_D(B, cfg.p_D_shift, generator=generator, device=device)
    eps = rng.randn(x0_shape, dtype=F64, generator=generator, device=device)
    loss, info = L.fake_score_loss(nets.F_fn("fake", cond), G_x0, t, eps)
    backward(batch_reduce(loss, cfg.loss_reduction), last=True)
    return {"loss_fake": float(loss.detach().mean()), "nan_fake": info["nan"], "n_sim": n}


def lr_lambda(warmup_steps: int, total_steps: int = 0, decay: str = "none", final_ratio: float = 0.0,
              decay_fraction: float = 1.0):
    """LR factor of optimizer step ``k`` (docs/math.md §4.4): ``(k + 1) / W`` for ``k < W`` (warm-up), then 1
    (``decay`` none) or, over the last ``D = decay_fraction (total_steps - W)`` steps with ``p = (k + 1 - (total_steps - D)) / D``
    clipped to [0, 1]: ``f + (1 - f) (1 + cos pi p) / 2`` (cosine) or ``1 - (1 - f) p`` (linear), so the step
    ``total_steps - 1`` runs at ``f = final_ratio``."""
    if decay not in ("none", "cosine", "linear"):
        raise ValueError(f"lr decay {decay!r}: use none, cosine or linear")
    span = decay_fraction * (total_steps - warmup_steps)

    def factor(k: int) -> float:
        if k < warmup_steps:
            return (k + 1) / warmup_steps
        if decay == "none" or span <= 0:
            return 1.0
        p = min(1.0, max(0.0, (k + 1 - (total_steps - span)) / span))
        if decay == "cosine":
            return final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))
        return 1.0 - (1.0 - final_ratio) * p

    return factor


# ----------------------------------------------------------------------------- state, guards, metrics


class TrainState:
    """Counters saved with every checkpoint (JSON, ``checkpoints.Checkpointer``): the next iteration, the
    skipped optimizer steps, the spike guard's history and the student's initial weight fingerprint."""

    def __init__(self):
        self.step = 0  # next iteration to run
        self.skipped = 0
        self.skipped_steps = []
        self.guard = {}
        self.init_checksum = []  # runs.param_checksum of the student's trainable weights at step 0

    def state_dict(self):
        return {"step": self.step, "skipped": self.skipped, "skipped_steps": self.skipped_steps, "guard": self.guard,
                "init_checksum": self.init_checksum}

    def load_state_dict(self, s):
        self.step, self.skipped, self.guard = int(s["step"]), int(s["skipped"]), dict(s["guard"])
        self.skipped_steps = [int(i) for i in s["skipped_steps"]]
        self.init_checksum = [float(v) for v in s["init_checksum"]]


class SpikeGuard:
    """Gradient-norm spike detector: ``patience`` consecutive norms above ``factor`` x the running
    median (last 100 finite norms) of the same network fire; the caller dumps the evidence."""

    def __init__(self, state: dict, factor: float = 5.0, patience: int = 3, window: int = 100):
        self.s, self.factor, self.patience, self.window = state, factor, patience, window

    def check(self, net: str, norm: float) -> bool:
        hist = self.s.setdefault(net + "_hist", [])
        run = self.s.get(net + "_run", 0)
        spike = len(hist) >= 5 and (not math.isfinite(norm) or norm > self.factor * statistics.median(hist))
        run = run + 1 if spike else 0
        self.s[net + "_run"] = run
        if math.isfinite(norm) and not spike:
            hist.append(norm)
            del hist[:-self.window]
        return run >= self.patience


class MetricsWriter:
    """Append-only ``metrics.jsonl``; on resume, lines at or after the resumed step are dropped, and so is a
    line that does not parse (the torn last line of a killed run), with a warning."""

    def __init__(self, path: str, resume_step: int, enabled: bool):
        self.path, self.enabled = path, enabled
        if enabled and os.path.exists(path):
            keep, torn = [], 0
            with open(path) as f:
                for ln in f:
                    if not ln.strip():
                        continue
                    try:
                        rec = json.loads(ln)
                    except ValueError:
                        torn += 1
                        continue
                    if rec.get("step", -1) < resume_step:
                        keep.append(ln if ln.endswith("\n") else ln + "\n")
            if torn:
                print(f"warning: {path}: dropped {torn} unreadable line(s) (a write cut off by a kill)", file=sys.stderr)
            with open(path + ".tmp", "w") as f:
                f.writelines(keep)
            os.replace(path + ".tmp", path)

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


# ----------------------------------------------------------------------------- checkpoints


def latest_checkpoint(output_dir: str) -> str | None:
    """Newest checkpoint of a run that passes verification (``checkpoints.find_resumable``), or ``None``."""
    from .checkpoints import find_resumable

    return find_resumable(output_dir)[0]


def end_of_step(accelerator, cfg, i: int, record: dict, metrics, checkpointer) -> None:
    """Bookkeeping after iteration ``i`` shared by the trainers: ``metrics.jsonl`` (every ``log_every``
    and the last), the accelerate tracker, and the periodic checkpoint at ``step = i + 1``."""
    import dataclasses

    if i % cfg.log_every == 0 or i == cfg.max_steps - 1:
        metrics.write(record)
        if cfg.report_to != "none":
            accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=i)
    step = i + 1
    if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.max_steps:
        checkpointer.save(cfg.output_dir, step, dataclasses.asdict(cfg), cfg.checkpoints_total_limit)


def exit_if_asked(accelerator, cfg, i: int) -> None:
    """Testing aid: hard-exit (``os._exit(17)``) right after iteration ``cfg.exit_after_step``, as if killed."""
    if cfg.exit_after_step == i:
        accelerator.print(f"exit_after_step {i}: hard exit")
        sys.stdout.flush()
        os._exit(17)


# ----------------------------------------------------------------------------- snapshot, export, samples


def env_snapshot(path: str, cfg, extra: dict | None = None) -> dict:
    """Write ``env.json``: package versions, python, platform, git revision, config, seeds."""
    import dataclasses
    import importlib.metadata as md
    import platform

    vers = {}
    for pkg in ("torch", "diffusers", "transformers", "accelerate", "peft", "safetensors", "numpy", "triton", "rcm-diffusers"):
        try:
            vers[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        rev = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", here, "status", "--porcelain"], capture_output=True, text=True, timeout=10).stdout.strip())
    except Exception:  # noqa: BLE001 - no git is fine
        rev, dirty = "", None
    snap = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version, "platform": platform.platform(),
            "argv": sys.argv, "packages": vers, "git_revision": rev, "git_dirty": dirty,
            "cuda": torch.version.cuda, "config": dataclasses.asdict(cfg), **(extra or {})}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(snap, f, indent=1, default=str)
    os.replace(tmp, path)
    return snap


def load_transformer(transformer_cls, cfg, index: dict, dtype, device, log=print):
    """The teacher network of a run: ``cfg.transformer_subfolder``, or -- for a two-expert pipeline with
    ``cfg.experts`` ``both``/``auto`` -- ``transformer`` and ``transformer_2`` as one ``WanExpertSwitch`` at
    ``cfg.boundary_ratio`` (0 = the pipeline's ``boundary_ratio``) (docs/math.md §6.1)."""
    from .experts import HIGH, LOW, WanExpertSwitch, index_boundary_ratio

    def load(sub):
        return transformer_cls.from_pretrained(cfg.pretrained, subfolder=sub, torch_dtype=dtype).to(device)

    b = index_boundary_ratio(index)
    if cfg.experts == "both" and b is None and not cfg.boundary_ratio:
        raise SystemExit(f"--experts both: {cfg.pretrained} has no transformer_2 with a boundary_ratio in model_index.json; "
                         "use --experts one, or set --boundary_ratio for a pipeline that has transformer_2")
    if cfg.experts == "one" or (cfg.experts == "auto" and b is None):
        return load(cfg.transformer_subfolder)
    if cfg.experts == "auto" and cfg.transformer_subfolder != HIGH:
        raise SystemExit(f"--transformer_subfolder {cfg.transformer_subfolder}: {cfg.pretrained} has two experts, which "
                         "are trained together by default; add --experts one to train this one alone")
    if not index.get(LOW) or index[LOW][0] is None:
        raise SystemExit(f"--experts {cfg.experts}: {cfg.pretrained} has no transformer_2")
    b = cfg.boundary_ratio or b
    log(f"two experts: {HIGH} (high noise, 1000 r >= {1000 * b:g}) and {LOW} (low noise) trained in one run")
    return WanExpertSwitch(load(HIGH), load(LOW), b)


def export_student(pipeline_cls, cfg, base, ema) -> None:
    """Write the student: its LoRA (``pytorch_lora_weights.safetensors``, diffusers ``save_lora_weights``) and the EMA
    variant in ``ema/`` (shared mode), or ``student_transformer/`` (full mode). Two experts: the high-noise
    expert's files where a one-network run puts them, the low-noise expert's in a ``transformer_2/`` subfolder
    of each (``rcm_diffusers.lora.load_rcm_lora`` loads the pair). Next to each: ``scheduler/``, the
    ``RCMScheduler`` config the student was trained for (``sigma_max``, ``mid_t``, ``time_input``), so that
    ``RCMScheduler.from_pretrained(run_dir, subfolder="scheduler")`` samples it as the trainer's previews do."""
    from .experts import HIGH, LOW, expert_lora_weights, switch_of
    from ..schedulers import RCMScheduler

    sched = RCMScheduler(sigma_max=cfg.sigma_max, time_input=cfg.time_input, **({"mid_t": cfg.mid_t} if cfg.mid_t else {}))
    for d in [cfg.output_dir] + ([os.path.join(cfg.output_dir, "ema")] if ema is not None else []):
        sched.save_pretrained(os.path.join(d, "scheduler"))

    sw = switch_of(base)
    parts = [("", HIGH, sw.transformer), (LOW, LOW, sw.transformer_2)] if sw is not None else [("", None, base)]
    shadow = None if ema is None else ema.shadow
    for sub, expert, model in parts:
        def pick(w):
            return w if expert is None else expert_lora_weights(w, expert)

        if cfg.mode == "shared":
            lora_cfg = model.peft_config["student"]
            save_student_lora(pipeline_cls, os.path.join(cfg.output_dir, sub), model, lora_cfg)
            if shadow is not None:
                save_student_lora(pipeline_cls, os.path.join(cfg.output_dir, "ema", sub), model, lora_cfg, weights=pick(shadow))
            continue
        name = "student_" + (LOW if sub else "transformer")
        model.save_pretrained(os.path.join(cfg.output_dir, name))
        if shadow is not None:
            with torch.no_grad():
                live = dict(model.named_parameters())
                backup = {k: p.detach().clone() for k, p in live.items()}
                for k, v in pick(shadow).items():
                    live[k].copy_(v)
                model.save_pretrained(os.path.join(cfg.output_dir, "ema", name))
                for k, p in live.items():
                    p.copy_(backup[k])


def save_student_lora(pipeline_cls, out_dir: str, transformer, lora_config, weights: dict | None = None) -> None:
    """Save the ``"student"`` adapter with diffusers' own ``save_lora_weights`` so that
    ``pipe.load_lora_weights(out_dir)`` works; ``weights`` (e.g. EMA, keyed like the peft params)
    replaces the live values."""
    from peft.utils import get_peft_model_state_dict

    sd = get_peft_model_state_dict(transformer, adapter_name="student")
    if weights is not None:
        live = {k.replace(".student.", "."): k for k in weights}
        sd = {k: weights[live[k]].detach().clone() if k in live else v for k, v in sd.items()}
        missing = [k for k in sd if k not in live]
        if missing:
            raise KeyError(f"EMA weights lack {missing[:3]}")
    sd = {k: v.detach().to(torch.float32).cpu().contiguous() for k, v in sd.items()}
    meta = lora_config.to_dict()
    meta = {k: (sorted(v) if isinstance(v, set) else v) for k, v in meta.items()}
    os.makedirs(out_dir, exist_ok=True)
    pipeline_cls.save_lora_weights(out_dir, transformer_lora_layers=sd, transformer_lora_adapter_metadata=meta)


@torch.no_grad()
def sample_student(nets, cond, shape, steps: int, sigma_max: float, generator, device, role: str = "student",
                   mid_t=None):
    """Few-step student samples with ``RCMScheduler`` (docs/math.md §2.1; ``mid_t`` empty = its default angles, else
    a list or per step count), model-layout float32 latents; the network sees its time as in training
    (``nets.time_input``), the update runs on the exact RF times."""
    from ..models import velocity_fn
    from ..sampling import DEFAULT_MID_T
    from ..schedulers import RCMScheduler

    sch = RCMScheduler(sigma_max=sigma_max, mid_t=mid_t or DEFAULT_MID_T, time_input=nets.time_input)
    sch.set_timesteps(steps)
    x = sch.scale_initial_noise(torch.randn(shape, generator=generator, dtype=torch.float32).to(device))
    with nets.role(role):
        v_fn = velocity_fn(nets.modules[role], nets.time_input)
        for k, ts in enumerate(sch.timesteps):
            r = torch.tensor(float(sch.rf_times[k]), dtype=torch.float64, device=device)
            v = v_fn(x.to(nets.model_dtype), r, **cond).float()
            x = sch.step(v, ts, x, generator=generator).prev_sample
    return x


def batch_rows(obj, start: int, stop: int, batch: int):
    """Rows ``start:stop`` of every tensor in ``obj`` (a tensor, a dict of them, or ``None``) whose leading dimension
    is ``batch``; other values (shared conditions, scalars) are passed through."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return {k: batch_rows(v, start, stop, batch) for k, v in obj.items()}
    if torch.is_tensor(obj) and obj.dim() and obj.shape[0] == batch:
        return obj[start:stop]
    return obj


def merge_logs(parts: list[dict]) -> dict:
    """One iteration's logs from its micro-batches' (equal sizes): counts (``nan*``, ``scm_high``) are summed, other
    numbers averaged (so a per-sample mean such as ``loss_scm`` is the mean over the whole batch)."""
    if len(parts) == 1:
        return parts[0]
    out = {}
    for k in parts[0]:
        vals = [p[k] for p in parts if k in p]
        if k.startswith("nan") or k == "scm_high":
            out[k] = sum(vals)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[k] = vals[0] if all(v == vals[0] for v in vals) else sum(vals) / len(vals)
        else:
            out[k] = vals[-1]
    return out


def ddp_jvp_bypass(module) -> None:
    """Let ``torch.func.jvp`` run through a ``DistributedDataParallel`` wrapper: a call whose inputs carry a
    forward-mode tangent goes to the wrapped module. DDP's forward wraps its outputs in an autograd.Function without a
    forward-mode rule (``_DDPSink``, with ``find_unused_parameters``), which functorch refuses; the JVP passes run
    under ``no_grad`` and produce no gradients for DDP to synchronise. Anything else: no-op."""
    if not isinstance(module, torch.nn.parallel.DistributedDataParallel) or "forward" in module.__dict__:
        return
    from ..attention.function import has_tangent

    stock = module.forward

    def forward(*args, **kwargs):
        if has_tangent(*[a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]):
            return module.module(*args, **kwargs)
        return stock(*args, **kwargs)

    module.forward = forward


def grad_norm(params) -> float:
    """Total L2 norm of the gradients of ``params`` (inf/NaN propagate)."""
    gs = [p.grad.detach().double().norm() for p in params if p.grad is not None]
    return float(torch.stack(gs).norm()) if gs else 0.0


def no_sync_unless(accelerator, model, last: bool):
    """``accelerator.no_sync(model)`` for every backward but the last of a step."""
    return nullcontext() if last or accelerator.num_processes == 1 else accelerator.no_sync(model)


def write_samples(nets, data, cfg, step: int, device, transformer, n: int = 4, decoder=None) -> str:
    """Student samples at each of ``cfg.sample_steps`` for the first ``n`` dataset conditions, fixed
    seed, saved as ``samples/step-XXXXXXXX.safetensors`` (model-layout latents) and, with a
    ``previews.SampleDecoder``, a PNG grid (rows = step counts, columns = conditions; + GIF for video)."""
    from safetensors.torch import save_file

    from .data import model_inputs

    ids = list(range(min(n, len(data))))
    batch = data.get(ids)
    x0, cond, _ = model_inputs(data.family, batch, device, nets.model_dtype,
                               cfg.flux_guidance if getattr(transformer.config, "guidance_embeds", False) else None)
    out = {}
    for k in cfg.sample_steps:
        gen = torch.Generator().manual_seed(cfg.seed)
        out[f"steps_{k}"] = sample_student(nets, cond, tuple(x0.shape), int(k), cfg.sigma_max, gen, device,
                                           mid_t=cfg.mid_t).cpu()
    d = os.path.join(cfg.output_dir, "samples")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"step-{step:08d}.safetensors")
    save_file({k: v.contiguous() for k, v in out.items()}, path + ".tmp")
    os.replace(path + ".tmp", path)
    if decoder is not None:
        from .previews import save_grid

        hw = tuple(batch["latents"].shape[-2:])
        save_grid(path[: -len(".safetensors")], [decoder.decode(out[f"steps_{k}"], hw) for k in cfg.sample_steps])
    return path
