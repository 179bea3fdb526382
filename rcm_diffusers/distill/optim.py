"""Optimizers and the learning-rate schedule of the trainers (docs/math.md §4.4)."""

from __future__ import annotations

import math

import torch

__all__ = ["lr_lambda", "adamw"]


def lr_lambda(
    warmup_steps: int, total_steps: int = 0, decay: str = "none", final_ratio: float = 0.0, decay_fraction: float = 1.0
):
    """LR factor of optimizer step ``k`` (docs/math.md §4.4): ``(k + 1) / W`` for ``k < W`` (warm-up), then 1
    (``decay`` none) or, over the last ``D = decay_fraction (total_steps - W)`` steps with
    ``p = (k + 1 - (total_steps - D)) / D`` clipped to [0, 1]: ``f + (1 - f) (1 + cos pi p) / 2`` (cosine) or
    ``1 - (1 - f) p`` (linear), so the step ``total_steps - 1`` runs at ``f = final_ratio``."""
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


def adamw(params, lr: float, cfg) -> torch.optim.AdamW:
    """AdamW over ``params`` at ``lr`` with the config's betas, eps and weight decay."""
    return torch.optim.AdamW(
        params, lr=lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay
    )
