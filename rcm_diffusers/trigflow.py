"""TrigFlow time, the rectified-flow -> TrigFlow wrapping, and training-time distributions.

docs/math.md §1 (TrigFlow, wrapping a rectified-flow teacher) and §3 (p_G, p_D).
All schedule and coefficient arithmetic is float64; the network runs in its own dtype.
Every function here is plain torch arithmetic, so it works inside ``torch.func.jvp``
in both ``x_t`` and ``t``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from . import rng

__all__ = [
    "t_to_r",
    "r_to_t",
    "sigma_to_t",
    "t_to_sigma",
    "r_to_sigma",
    "sigma_to_r",
    "rf_precond",
    "x0_from_F",
    "eps_from_F",
    "F_from_x0_eps",
    "F_hat_from_v",
    "x0_hat_from_v",
    "trigflow_noise",
    "sample_p_G",
    "sample_p_D",
    "shift_r",
    "TrigFlowDenoiser",
]

F64 = torch.float64


def _as_f64(t) -> torch.Tensor:
    return torch.as_tensor(t, dtype=F64)


# ----------------------------------------------------------------------------- time maps (§1)


def t_to_r(t):
    """RF time of a TrigFlow angle: ``r(t) = sin t / (sin t + cos t)`` (docs/math.md §1, c_noise)."""
    t = _as_f64(t)
    s, c = torch.sin(t), torch.cos(t)
    return s / (s + c)


def r_to_t(r):
    """TrigFlow angle of an RF time: ``t = arctan(r / (1 - r))``, exact at r = 1 (t = pi/2)."""
    r = _as_f64(r)
    return torch.atan2(r, 1.0 - r)


def sigma_to_t(sigma):
    """EDM noise level to TrigFlow angle: ``t = arctan(sigma)`` (docs/math.md §1)."""
    return torch.atan(_as_f64(sigma))


def t_to_sigma(t):
    """TrigFlow angle to EDM noise level: ``sigma = tan t`` (docs/math.md §1)."""
    return torch.tan(_as_f64(t))


def r_to_sigma(r):
    """RF time to EDM sigma: ``sigma = r / (1 - r)``."""
    r = _as_f64(r)
    return r / (1.0 - r)


def sigma_to_r(sigma):
    """EDM sigma to RF time: ``r = sigma / (1 + sigma)``."""
    sigma = _as_f64(sigma)
    return sigma / (1.0 + sigma)


def shift_r(r, shift: float):
    """Flow-matching time shift ``r' = s r / (1 + (s - 1) r)`` (docs/math.md §2.2, §3)."""
    r = _as_f64(r)
    return shift * r / (1.0 + (shift - 1.0) * r)


# ----------------------------------------------------------------------------- TrigFlow identities (§1)


def x0_from_F(x_t, F, t):
    """``x0 = cos t x_t - sin t F`` (docs/math.md §1). ``t`` broadcasts from the batch dim."""
    t = _bcast(t, x_t)
    return torch.cos(t) * x_t - torch.sin(t) * F


def eps_from_F(x_t, F, t):
    """``eps = sin t x_t + cos t F`` (docs/math.md §1)."""
    t = _bcast(t, x_t)
    return torch.sin(t) * x_t + torch.cos(t) * F


def F_from_x0_eps(x0, eps, t):
    """Velocity ``F = -sin t x0 + cos t eps`` (docs/math.md §1)."""
    t = _bcast(t, x0)
    return -torch.sin(t) * x0 + torch.cos(t) * eps


def trigflow_noise(x0, eps, t):
    """``x_t = cos t x0 + sin t eps`` (docs/math.md §1)."""
    t = _bcast(t, x0)
    return torch.cos(t) * x0 + torch.sin(t) * eps


def rf_precond(t):
    """RF -> TrigFlow preconditioner (docs/math.md §1): returns ``(c_skip, c_out, c_in, c_noise)``.

    ``c_in = c_skip = 1/(sin t + cos t)``, ``c_out = -sin t/(sin t + cos t)``,
    ``c_noise = r(t) = sin t/(sin t + cos t)`` (before the model's timestep scale).
    """
    t = _as_f64(t)
    s, c = torch.sin(t), torch.cos(t)
    denom = s + c
    c_skip = 1.0 / denom
    return c_skip, -s / denom, c_skip, s / denom


def F_hat_from_v(x_t, v, t):
    """``F_hat = ((cos t - sin t) x_t + v) / (sin t + cos t)`` (docs/math.md §1, the form finite at t -> 0)."""
    t = _bcast(t, x_t)
    s, c = torch.sin(t), torch.cos(t)
    return ((c - s) * x_t + v) / (s + c)


def x0_hat_from_v(x_t, v, t):
    """``x0_hat = c_skip x_t + c_out v`` (docs/math.md §1)."""
    t = _bcast(t, x_t)
    s, c = torch.sin(t), torch.cos(t)
    return (x_t - s * v) / (s + c)


def _bcast(t, x) -> torch.Tensor:
    """Reshape a per-sample (or scalar) angle ``[B]`` to broadcast against ``x`` ``[B, ...]``."""
    t = torch.as_tensor(t, device=x.device)
    if t.dim() == 0:
        return t
    return t.reshape(t.shape[0], *([1] * (x.dim() - 1)))


# ----------------------------------------------------------------------------- distributions (§3)


def sample_p_G(
    batch: int,
    P_mean: float = -0.8,
    P_std: float = 1.6,
    video_noise_multiplier: float = 1.0,
    generator: torch.Generator | None = None,
    device=None,
) -> torch.Tensor:
    """sCM angles: ``ln sigma ~ N(P_mean, P_std^2)``, ``sigma *= video_noise_multiplier``, ``t = arctan sigma``
    (docs/math.md §3)."""
    n = rng.randn((batch,), dtype=F64, generator=generator, device=device)
    sigma = torch.exp(P_mean + P_std * n) * video_noise_multiplier
    return torch.atan(sigma)


def sample_p_D(batch: int, shift: float = 5.0, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """DMD/critic angles: ``u ~ U[0,1)``, ``r = s u / (1 + (s-1) u)``, ``t = arctan(r / (1 - r))`` (docs/math.md §3)."""
    u = rng.rand((batch,), dtype=F64, generator=generator, device=device)
    return r_to_t(shift_r(u, shift))


# ----------------------------------------------------------------------------- denoiser wrapper (§1)


class TrigFlowDenoiser:
    """Call a rectified-flow velocity model as a TrigFlow velocity ``F(x_t, t)`` (docs/math.md §1).

    ``velocity_fn(x_r, r, **cond) -> v`` is the raw model (``v = eps - x0``) taking the RF time
    ``r`` in [0, 1]; the model adapters (``rcm_diffusers.models``) turn a diffusers transformer
    into such a function, applying each model's own timestep scale. Coefficients are float64;
    ``x_r`` is cast to ``model_dtype`` for the call and ``v`` back to float64 for the combination.
    Differentiable in forward and reverse mode in ``x_t`` and ``t``.
    """

    def __init__(self, velocity_fn: Callable[..., torch.Tensor], model_dtype: torch.dtype | None = None):
        self.velocity_fn = velocity_fn
        self.model_dtype = model_dtype

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, **cond) -> torch.Tensor:
        """Raw model velocity at ``x_r = c_in x_t``, ``r = c_noise(t)``, returned in ``x_t``'s dtype."""
        c_skip, c_out, c_in, c_noise = rf_precond(t)
        x_r = _bcast(c_in, x_t) * x_t
        dtype = self.model_dtype or x_t.dtype
        v = self.velocity_fn(x_r.to(dtype), c_noise.to(x_t.device), **cond)
        return v.to(x_t.dtype)

    def F(self, x_t: torch.Tensor, t: torch.Tensor, **cond) -> torch.Tensor:
        """``F_hat(x_t, t)`` by the finite-at-0 form of docs/math.md §1."""
        return F_hat_from_v(x_t, self.velocity(x_t, t, **cond), t)

    def x0(self, x_t: torch.Tensor, t: torch.Tensor, **cond) -> torch.Tensor:
        """``x0_hat(x_t, t) = c_skip x_t + c_out v`` (docs/math.md §1)."""
        return x0_hat_from_v(x_t, self.velocity(x_t, t, **cond), t)

    __call__ = F


def assert_angles(t, name: str = "t") -> None:
    """Raise ``ValueError`` unless every angle is finite and inside [0, pi/2]."""
    t = _as_f64(t)
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} holds NaN or inf: {t.tolist()}; pass finite TrigFlow angles in [0, pi/2].")
    if (t < 0).any() or (t > math.pi / 2).any():
        raise ValueError(f"{name} must lie in [0, pi/2] (TrigFlow angles); got {t.tolist()}.")
