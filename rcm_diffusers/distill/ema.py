"""Power EMA of the student's trainable weights (docs/math.md §4.5)."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["power_ema_exponent", "power_ema_beta", "PowerEMA"]


def power_ema_exponent(s: float = 0.10) -> float:
    """Largest real root of ``x^3 + 7x^2 + (16 - s^-2) x + (12 - s^-2) = 0`` (docs/math.md §4.5; 6.94 for s = 0.1)."""
    if not 0.0 < s < 1.0:
        raise ValueError(f"power-EMA rate s must lie in (0, 1), got {s}")
    roots = np.roots([1.0, 7.0, 16.0 - s**-2, 12.0 - s**-2])
    return float(max(r.real for r in roots if abs(r.imag) < 1e-9))


def power_ema_beta(i: int, alpha: float) -> float:
    """``beta(i) = (1 - 1/(i+1))^(alpha+1)``, 0 for ``i < 1`` (docs/math.md §4.5)."""
    if i < 1:
        return 0.0
    return (1.0 - 1.0 / (i + 1)) ** (alpha + 1.0)


class PowerEMA:
    """Float32 power EMA of named parameters, updated after each student step at its effective
    iteration ``i``: ``ema = beta(i) ema + (1 - beta(i)) param`` (docs/math.md §4.5)."""

    def __init__(self, named_params: dict[str, torch.Tensor], s: float = 0.10):
        self.s = s
        self.alpha = power_ema_exponent(s)
        self.shadow = {k: v.detach().to(torch.float32).clone() for k, v in named_params.items()}

    @torch.no_grad()
    def update(self, named_params: dict[str, torch.Tensor], i: int) -> float:
        """Blend the current weights in at effective student iteration ``i``; returns ``beta``."""
        beta = power_ema_beta(i, self.alpha)
        for k, v in named_params.items():
            self.shadow[k].mul_(beta).add_(v.detach().to(torch.float32), alpha=1.0 - beta)
        return beta

    def state_dict(self) -> dict:
        return {"s": self.s, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.s = float(state["s"])
        self.alpha = power_ema_exponent(self.s)
        for k, v in state["shadow"].items():
            self.shadow[k].copy_(v)
