"""TrigFlow core (docs/math.md §1, §3) against float64 math written from the spec."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from rcm_diffusers import trigflow as tf
from rcm_diffusers.sampling import shift_family, unshift_family

F64 = torch.float64


def test_time_maps_round_trip_and_values():
    t = torch.linspace(0.0, math.pi / 2, 101, dtype=F64)
    r = tf.t_to_r(t)
    assert torch.allclose(tf.r_to_t(r), t, atol=1e-12)
    # r / (1 - r) = tan t  (matching signal-to-noise)
    inner = t[1:-1]
    assert torch.allclose(tf.r_to_sigma(tf.t_to_r(inner)), torch.tan(inner), rtol=1e-10)
    assert torch.allclose(tf.sigma_to_t(torch.tan(inner)), inner, atol=1e-12)
    assert float(tf.t_to_r(0.0)) == 0.0 and abs(float(tf.t_to_r(math.pi / 2)) - 1.0) < 1e-15
    assert abs(float(tf.r_to_t(1.0)) - math.pi / 2) < 1e-15
    assert abs(float(tf.sigma_to_r(80.0)) - 80 / 81) < 1e-15


def test_x0_eps_F_round_trips():
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(3, 4, 5, generator=g, dtype=F64), torch.randn(3, 4, 5, generator=g, dtype=F64)
    t = torch.tensor([0.1, 0.8, 1.5], dtype=F64)
    x_t = tf.trigflow_noise(x0, eps, t)
    F = tf.F_from_x0_eps(x0, eps, t)
    assert torch.allclose(tf.x0_from_F(x_t, F, t), x0, atol=1e-12)
    assert torch.allclose(tf.eps_from_F(x_t, F, t), eps, atol=1e-12)
    # F is dx_t/dt: compare with a central difference of the interpolant
    h = 1e-6
    fd = (tf.trigflow_noise(x0, eps, t + h) - tf.trigflow_noise(x0, eps, t - h)) / (2 * h)
    assert torch.allclose(fd, F, atol=1e-8)


def test_preconditioner_and_F_hat_forms():
    g = torch.Generator().manual_seed(1)
    x_t, v = torch.randn(4, 3, generator=g, dtype=F64), torch.randn(4, 3, generator=g, dtype=F64)
    t = torch.tensor([0.05, 0.6, 1.2, 1.55], dtype=F64)
    c_skip, c_out, c_in, c_noise = tf.rf_precond(t)
    s, c = torch.sin(t), torch.cos(t)
    assert torch.allclose(c_skip, 1 / (s + c)) and torch.allclose(c_in, c_skip)
    assert torch.allclose(c_out, -s / (s + c)) and torch.allclose(c_noise, s / (s + c))
    x0_hat = c_skip[:, None] * x_t + c_out[:, None] * v
    assert torch.allclose(tf.x0_hat_from_v(x_t, v, t), x0_hat, atol=1e-13)
    first_form = (c[:, None] * x_t - x0_hat) / s[:, None]
    assert torch.allclose(tf.F_hat_from_v(x_t, v, t), first_form, atol=1e-10)
    # rectified-flow consistency: x_r = c_in x_t is on the RF path of the same x0/eps
    x0 = torch.randn(4, 3, generator=g, dtype=F64)
    eps = torch.randn(4, 3, generator=g, dtype=F64)
    xt = tf.trigflow_noise(x0, eps, t)
    r = c_noise[:, None]
    assert torch.allclose(c_in[:, None] * xt, (1 - r) * x0 + r * eps, atol=1e-12)
    # with the exact RF velocity, F_hat is the exact TrigFlow velocity
    assert torch.allclose(tf.F_hat_from_v(xt, eps - x0, t), tf.F_from_x0_eps(x0, eps, t), atol=1e-12)


def test_preconditioner_limits():
    c_skip, c_out, c_in, c_noise = tf.rf_precond(torch.tensor([0.0, math.pi / 2], dtype=F64))
    # t = 0: x0_hat = x_t; t = pi/2: x_r = x_t is pure noise and x0_hat = x_t - v
    assert torch.allclose(c_skip, torch.tensor([1.0, 1.0], dtype=F64), atol=1e-15)
    assert torch.allclose(c_out, torch.tensor([0.0, -1.0], dtype=F64), atol=1e-15)
    assert torch.allclose(c_noise, torch.tensor([0.0, 1.0], dtype=F64), atol=1e-15)
    x_t, v = torch.ones(1, 2, dtype=F64), torch.full((1, 2), 3.0, dtype=F64)
    F0 = tf.F_hat_from_v(x_t, v, torch.zeros(1, dtype=F64))  # first form would be 0/0 here
    assert torch.isfinite(F0).all() and torch.allclose(F0, x_t + v)


def _mlp_velocity(seed=0):
    g = torch.Generator().manual_seed(seed)
    W1, W2 = torch.randn(6, 16, generator=g, dtype=F64) / 3, torch.randn(16, 6, generator=g, dtype=F64) / 4
    wt = torch.randn(16, generator=g, dtype=F64)

    def v(x_r, r):
        h = torch.tanh(x_r @ W1 + torch.sin(3 * r)[:, None] * wt)
        return h @ W2 + r[:, None] * x_r

    return v


def test_denoiser_jvp_matches_central_differences():
    D = tf.TrigFlowDenoiser(_mlp_velocity(), model_dtype=F64)
    g = torch.Generator().manual_seed(2)
    x, dx = torch.randn(3, 6, generator=g, dtype=F64), torch.randn(3, 6, generator=g, dtype=F64)
    t = torch.tensor([0.2, 0.9, 1.4], dtype=F64)
    dt = torch.tensor([0.3, -1.0, 0.5], dtype=F64)
    F, dF = torch.func.jvp(D.F, (x, t), (dx, dt))
    h = 1e-6
    fd = (D.F(x + h * dx, t + h * dt) - D.F(x - h * dx, t - h * dt)) / (2 * h)
    assert torch.allclose(F, D.F(x, t))
    assert torch.allclose(dF, fd, rtol=1e-7, atol=1e-8)
    # t-only tangent (what fd_type 1 drops) is non-zero and also matches
    _, dF_t = torch.func.jvp(D.F, (x, t), (torch.zeros_like(x), dt))
    fd_t = (D.F(x, t + h * dt) - D.F(x, t - h * dt)) / (2 * h)
    assert dF_t.abs().max() > 1e-3 and torch.allclose(dF_t, fd_t, rtol=1e-7, atol=1e-8)


def test_denoiser_casts_for_model_dtype():
    seen = {}

    def v(x_r, r):
        seen["dtype"] = x_r.dtype
        return torch.zeros_like(x_r)

    D = tf.TrigFlowDenoiser(v, model_dtype=torch.bfloat16)
    out = D.x0(torch.ones(2, 3, dtype=F64), torch.tensor([0.3, 0.7], dtype=F64))
    assert seen["dtype"] == torch.bfloat16 and out.dtype == F64
    c_skip = tf.rf_precond(torch.tensor([0.3, 0.7], dtype=F64))[0]
    assert torch.allclose(out, c_skip[:, None].expand(2, 3))


def test_p_G_lognormal_and_video_multiplier():
    g = torch.Generator().manual_seed(3)
    t = tf.sample_p_G(200_000, P_mean=-0.8, P_std=1.6, generator=g)
    assert t.dtype == F64 and (t > 0).all() and (t < math.pi / 2).all()
    ln_sigma = torch.log(torch.tan(t))
    assert abs(ln_sigma.mean().item() + 0.8) < 0.02 and abs(ln_sigma.std().item() - 1.6) < 0.02
    g = torch.Generator().manual_seed(3)
    t_video = tf.sample_p_G(200_000, P_mean=-0.8, P_std=1.6, video_noise_multiplier=math.sqrt(21), generator=g)
    assert torch.allclose(torch.log(torch.tan(t_video)) - ln_sigma, torch.full_like(t, 0.5 * math.log(21)), atol=1e-6)


def test_p_D_shifted_uniform():
    g = torch.Generator().manual_seed(4)
    t = tf.sample_p_D(50_000, shift=5.0, generator=g)
    assert t.dtype == F64
    r = tf.t_to_r(t).numpy()
    u = unshift_family(r, 5.0)
    assert stats.kstest(u, "uniform").pvalue > 1e-3
    assert np.allclose(shift_family(u, 5.0), r, atol=1e-12)
    # shifted towards noise: median r = shift(0.5) = 5/6
    assert abs(np.median(r) - 5 / 6) < 0.01


def test_assert_angles():
    tf.assert_angles([0.0, 1.0, math.pi / 2])
    with pytest.raises(ValueError, match="NaN or inf"):
        tf.assert_angles([0.1, float("nan")])
    with pytest.raises(ValueError, match=r"\[0, pi/2\]"):
        tf.assert_angles([2.0])
