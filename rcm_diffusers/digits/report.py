"""The digits report: sample grids, the markdown table, and the demo's run variants and run-state check."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from .teacher import NUM_CLASSES, atomic_write_text, to_pixels

# ----------------------------------------------------------------------------- report


def save_grid(path: str, rows: list[tuple[str, torch.Tensor]], per_class: int = 1, scale: int = 4) -> str:
    """PNG grid: one row per ``(name, samples [10 * per_class, ...])`` (samples ordered class-major), columns =
    classes (``per_class`` images each); a label strip on the left. Written atomically."""
    from PIL import Image, ImageDraw

    cell, pad, label_w = 8 * scale, 2, 150
    ncol = NUM_CLASSES * per_class
    W = label_w + ncol * (cell + pad)
    H = len(rows) * (cell + pad) + pad
    img = Image.new("L", (W, H), 255)
    draw = ImageDraw.Draw(img)
    for ri, (name, x) in enumerate(rows):
        y0 = pad + ri * (cell + pad)
        draw.text((2, y0 + cell // 3), name[:24], fill=0)
        pix = ((1 - (to_pixels(x).numpy() + 1) / 2) * 255).clip(0, 255).astype(np.uint8)  # ink dark on white
        for j in range(min(ncol, len(pix))):
            tile = Image.fromarray(pix[j].reshape(8, 8)).resize((cell, cell), Image.NEAREST)
            img.paste(tile, (label_w + j * (cell + pad), y0))
    tmp = path + ".tmp.png"
    img.save(tmp)
    os.replace(tmp, path)
    return path


@dataclass
class Row:
    """One line of the benchmark table."""

    method: str
    steps: int
    nfe: int
    fd: float
    accuracy: float
    diversity: float
    ms_per_sample: float
    peak_mb: float
    fd_vs_teacher: float = math.nan
    fd_pixel: float = math.nan  # Fréchet distance in raw pixels, the second feature space (Evaluator.evaluate)


def write_report(path: str, rows: list[Row], header: str = "") -> str:
    """Markdown table (NFE, FD, pixel FD, accuracy, diversity, ms/sample, peak memory) written atomically; returns the
    table."""
    lines = [
        "| method | steps | NFE | FD ↓ | FD vs teacher-100 ↓ | pixel FD ↓ | accuracy ↑ "
        "| diversity (real = 1) | ms/sample | peak MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fdt = "—" if math.isnan(r.fd_vs_teacher) else f"{r.fd_vs_teacher:.2f}"
        pix = "—" if math.isnan(r.fd_pixel) else f"{r.fd_pixel:.3f}"
        lines.append(
            f"| {r.method} | {r.steps} | {r.nfe} | {r.fd:.2f} | {fdt} | {pix} | {r.accuracy:.3f} | {r.diversity:.2f} | "
            f"{r.ms_per_sample:.2f} | {r.peak_mb:.0f} |"
        )
    table = "\n".join(lines) + "\n"
    atomic_write_text(path, (header + "\n\n" if header else "") + table)
    return table


# ----------------------------------------------------------------------------- demo runs (training/demo_digits.py)

# Trainer overrides of the sCM-only / DMD-only ablations, applied on top of the rCM config (same iterations, same data):
# sCM-only drops the fake score, so every iteration is a student sCM step; DMD-only zeroes the sCM term and
# the tangent warm-up, because during the warm-up DMD is off by design (docs/math.md §4.3) and with scm_weight 0 those
# iterations would be empty student steps (no loss, yet they consume the lr warm-up and the EMA schedule).
ABLATIONS = {
    "scm-only": {"use_dmd": False, "regression_weight": 0.0},
    "dmd-only": {"scm_weight": 0.0, "tangent_warmup": 0, "regression_weight": 0.0},
    "no-regression": {"regression_weight": 0.0},
}

# config keys that do not change what a run trains (a finished run that differs only in these is reused); sigma_max
# and mid_t are the student sampler's: the rCM trainer uses them only for preview samples and the scheduler config it
# exports, and the demos sample every student with the sampler of their current config
_RUN_NEUTRAL = {
    "output_dir",
    "resume",
    "progress",
    "log_every",
    "checkpoint_every",
    "checkpoints_total_limit",
    "report_to",
    "exit_after_step",
    "sample_every",
    "sample_steps",
    "sigma_max",
    "mid_t",
}
# the two-expert options: a one-expert run (``experts: one``) never reads them
_TWO_EXPERT_ONLY = {"expert_sampling", "high_noise_share", "boundary_weight"}


def run_overrides(variant: str) -> list[str]:
    """``--key value`` trainer arguments of a demo variant: ``"rcm"`` (none) or a key of :data:`ABLATIONS`."""
    if variant == "rcm":
        return []
    if variant not in ABLATIONS:
        raise ValueError(f"unknown variant {variant!r}; use rcm or one of {sorted(ABLATIONS)}")
    return [
        a for k, v in ABLATIONS[variant].items() for a in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))
    ]


def run_state(run_dir: str, config: dict | None = None) -> str:
    """``"missing"``, ``"partial"`` (started, no final export) or ``"finished"`` (``final.json`` and the student
    LoRA or transformer written); raises ``ValueError`` naming the keys when ``config`` (a ``RCMConfig`` as dict)
    differs from the run's ``env.json`` in anything that changes the training (the two-expert options do not change a
    one-expert run; an option the run's ``env.json`` lacks counts as its default)."""
    env = os.path.join(run_dir, "env.json")
    if not os.path.exists(env):
        return "missing" if not os.path.exists(os.path.join(run_dir, "final.json")) else "partial"
    if config is not None:
        from ..distill.config import RCMConfig

        with open(env) as f:
            saved = json.load(f).get("config", {})
        # an option newer than the run counts as its default there (the behaviour before the option existed)
        old = {n: f.get_default(call_default_factory=True) for n, f in RCMConfig.model_fields.items()} | saved
        neutral = _RUN_NEUTRAL | (_TWO_EXPERT_ONLY if old.get("experts") == config.get("experts") == "one" else set())
        diff = sorted(k for k in set(config) | set(saved) if k not in neutral and old.get(k) != config.get(k))
        if diff:
            raise ValueError(
                f"{run_dir} holds a run with a different config "
                f"({', '.join(f'{k}: {old.get(k)!r} -> {config.get(k)!r}' for k in diff)}); "
                "pass --force to retrain it, or choose another --out"
            )
    exported = any(
        os.path.exists(os.path.join(run_dir, f)) for f in ("pytorch_lora_weights.safetensors", "student_transformer")
    )
    return "finished" if os.path.exists(os.path.join(run_dir, "final.json")) and exported else "partial"
