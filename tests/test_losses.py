"""rCM losses against independent float64 references written from docs/math.md §4 (numpy, closed forms)."""

import math

import numpy as np
import pytest
import torch

from rcm_diffusers.distill import losses as L

torch.manual_seed(0)
B, D = 4, 6


class ToyF(torch.nn.Module):
    """F(x, t) = cos(t) * (W x) + sin(2t) * b, whose derivatives are known in closed form."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.W = torch.nn.Parameter(torch.randn(D, D, dtype=torch.float64, generator=g) / 3)
        self.b = torch.nn.Parameter(torch.randn(D, dtype=torch.float64, generator=g))

    def forward(self, x, t):
        return torch.cos(t)[:, None] * (x @ self.W.T) + torch.sin(2 * t)[:, None] * self.b


def np_F(W, b, x, t):
    return math.cos(t) * (W @ x) + math.sin(2 * t) * b


def np_dF(W, b, x, t, dx, dt):  # exact directional derivative of np_F
    return math.cos(t) * (W @ dx) - math.sin(t) * dt * (W @ x) + 2 * math.cos(2 * t) * dt * b


def ref_g(W, b, x, t, F_T, r):
    """docs/math.md §4.1 written out per sample in numpy, in the form of the current official code
    (NVlabs/rcm rcm/models/t2v_model_distill_rcm.py, ``_student_scm_step``, since commit f9b7be9 of 2026-01-08):
    ``g = -cos t sqrt(1 - r^2 sin^2 t) (F - F_T) - (r cos t sin t x_t + cos t sin t dF/dt)``."""
    cs = math.cos(t) * math.sin(t)
    Fm = np_F(W, b, x, t)
    dF = np_dF(W, b, x, t, cs * F_T, cs)
    return -math.cos(t) * math.sqrt(1 - r**2 * math.sin(t) ** 2) * (Fm - F_T) - (r * cs * x + dF)


@pytest.fixture
def case():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, D, dtype=torch.float64, generator=g)
    t = torch.tensor([0.05, 0.4, 1.0, 1.5], dtype=torch.float64)
    F_T = torch.randn(B, D, dtype=torch.float64, generator=g)
    return ToyF(), x, t, F_T


def test_fd0_matches_closed_form_derivative(case):
    net, x, t, F_T = case
    F_minus, dF = L.scm_dF(net, x, t, F_T, fd_type=0)
    W, b = net.W.detach().numpy(), net.b.detach().numpy()
    for i in range(B):
        ti = float(t[i])
        cs = math.cos(ti) * math.sin(ti)
        np.testing.assert_allclose(F_minus[i].numpy(), np_F(W, b, x[i].numpy(), ti), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(
            dF[i].numpy(), np_dF(W, b, x[i].numpy(), ti, cs * F_T[i].numpy(), cs), rtol=1e-10, atol=1e-12
        )


@pytest.mark.parametrize("fd_type", [1, 2])
def test_finite_differences_converge_to_fd0(case, fd_type):
    net, x, t, F_T = case
    _, dF0 = L.scm_dF(net, x, t, F_T, fd_type=0)
    errs = []
    for h in (1e-1, 1e-2, 1e-3, 1e-4):
        _, dF = L.scm_dF(net, x, t, F_T, fd_type=fd_type, h=h)
        errs.append(float((dF - dF0).abs().max()))
    # first-order convergence: each 10x smaller h cuts the error by roughly 10x, and it ends tiny
    for a, b_ in zip(errs, errs[1:]):
        assert b_ < a / 5, errs
    assert errs[-1] < 1e-3, errs
    assert errs[0] > 1e-3, errs  # h = 0.1 is visibly off: the test can fail


@pytest.mark.parametrize("step,warmup", [(0, 10), (3, 10), (10, 10), (50, 10), (7, 0)])
def test_scm_loss_value_and_grad_match_reference(case, step, warmup):
    net, x, t, F_T = case
    loss, info = L.scm_loss(net, x, t, F_T, step=step, tangent_warmup=warmup, fd_type=0)
    r = 1.0 if warmup == 0 else min(1.0, step / warmup)
    assert info["r"] == pytest.approx(r) and info["nan"] == 0
    W, b = net.W.detach().numpy(), net.b.detach().numpy()
    gs = []
    for i in range(B):
        g = ref_g(W, b, x[i].numpy(), float(t[i]), F_T[i].numpy(), r)
        g = g / (np.sqrt((g**2).sum()) + 0.1)
        gs.append(g)
        # F_theta - sg(F_theta) is 0 in value, so the loss is ||g_normalised||^2
        assert float(loss[i].detach()) == pytest.approx(float((g**2).sum()), rel=1e-10)
    loss.sum().backward()
    # dL/dF_theta = -2 g  ->  dL/db = sum_i -2 sin(2 t_i) g_i
    ref_db = sum(-2 * math.sin(2 * float(t[i])) * gs[i] for i in range(B))
    np.testing.assert_allclose(net.b.grad.numpy(), ref_db, rtol=1e-9, atol=1e-12)
    ref_dW = sum(-2 * math.cos(float(t[i])) * np.outer(gs[i], x[i].numpy()) for i in range(B))
    np.testing.assert_allclose(net.W.grad.numpy(), ref_dW, rtol=1e-9, atol=1e-12)


def test_scm_loss_fd2_reference_and_two_student_calls(case):
    """fd_type 2: the loss equals the numpy float64 reference with the finite-difference tangent of docs/math.md §4.1
    (NVlabs/rcm ``_student_scm_step``, ``fd_type == 2``:
    ``dF = cos t sin t (cos h F(x_t, t) - F(x_{t-h}, t - h)) / sin h`` with ``x_{t-h} = cos h x_t - sin h F_T``), and
    the student runs twice per step: ``F(x_t, t)`` with gradient serves as the tangent's ``F_minus`` too."""
    net, x, t, F_T = case
    h, r = 1e-3, 0.6
    calls = []

    def counted(x_, t_):
        calls.append(torch.is_grad_enabled())
        return net(x_, t_)

    loss, _ = L.scm_loss(counted, x, t, F_T, step=6, tangent_warmup=10, fd_type=2, h=h)
    assert sorted(calls) == [False, True]
    W, b = net.W.detach().numpy(), net.b.detach().numpy()
    for i in range(B):
        xi, ti, Fi = x[i].numpy(), float(t[i]), F_T[i].numpy()
        cs = math.cos(ti) * math.sin(ti)
        Fm = np_F(W, b, xi, ti)
        dF = cs * (math.cos(h) * Fm - np_F(W, b, math.cos(h) * xi - math.sin(h) * Fi, ti - h)) / math.sin(h)
        g = -math.cos(ti) * math.sqrt(1 - r**2 * math.sin(ti) ** 2) * (Fm - Fi) - (r * cs * xi + dF)
        g = g / (np.sqrt((g**2).sum()) + 0.1)
        assert float(loss[i].detach()) == pytest.approx(float((g**2).sum()), rel=1e-10)


def test_warmup_changes_target(case):
    net, x, t, F_T = case
    l0, _ = L.scm_loss(net, x, t, F_T, step=0, tangent_warmup=10)
    l1, _ = L.scm_loss(net, x, t, F_T, step=10, tangent_warmup=10)
    assert (l0 - l1).abs().max() > 1e-3


def test_warmup_ramps_only_the_x_term():
    """r = 0: ``-cos t (F_minus - F_T) - dF`` (the student's tangent is never switched off); r = 1: the full
    sCM direction. The older form ``- r (cos t sin t x_t + dF)`` dropped dF at r = 0 and fails the first check."""
    g = torch.Generator().manual_seed(0)
    x, Fm, FT, dF = (torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(4))
    t = torch.tensor([0.3, 0.9, 1.4], dtype=torch.float64)
    c, cs = torch.cos(t)[:, None], (torch.cos(t) * torch.sin(t))[:, None]
    out = L.scm_g(x, t, Fm, FT, dF, r=0.0)
    assert torch.allclose(out, -c * (Fm - FT) - dF, atol=1e-14)
    full = L.scm_g(x, t, Fm, FT, dF, r=1.0)
    assert torch.allclose(full, -(c**2) * (Fm - FT) - (cs * x + dF), atol=1e-14)
    half = L.scm_g(x, t, Fm, FT, dF, r=0.5)
    s2 = torch.sin(t)[:, None] ** 2
    assert torch.allclose(half, -c * torch.sqrt(1 - 0.25 * s2) * (Fm - FT) - (0.5 * cs * x + dF), atol=1e-14)
    old = -c * torch.sqrt(1 - 0.25 * s2) * (Fm - FT) - 0.5 * (cs * x + dF)
    assert (half - old).abs().max() > 0.1  # the two forms really differ mid-warm-up


def test_normalisation_per_sample_float64():
    g = torch.randn(3, 2, 5, dtype=torch.float32) * torch.tensor([1e-3, 1.0, 1e3])[:, None, None]
    n = L.normalize_g(g)
    assert n.dtype == torch.float64
    for i in range(3):
        gi = g[i].double().numpy()
        ni = np.sqrt((gi**2).sum())
        np.testing.assert_allclose(n[i].numpy(), gi / (ni + 0.1), rtol=1e-12)


def test_nan_sample_is_masked_others_unchanged(case):
    net, x, t, F_T = case
    clean, _ = L.scm_loss(net, x, t, F_T, step=5, tangent_warmup=10)
    F_bad = F_T.clone()
    F_bad[2, 3] = float("nan")
    loss, info = L.scm_loss(net, x, t, F_bad, step=5, tangent_warmup=10)
    assert info["nan"] == 1
    assert float(loss[2]) == 0.0
    keep = [0, 1, 3]
    torch.testing.assert_close(loss[keep], clean[keep], rtol=0, atol=0)
    loss.sum().backward()
    assert torch.isfinite(net.W.grad).all() and torch.isfinite(net.b.grad).all()


def test_guidance_is_standard_cfg():
    """``guided`` is the current official CFG ``F_u + s (F_c - F_u)`` (NVlabs/rcm ``_student_scm_step`` /
    ``_student_dmd_step`` since commit 4f45bdf of 2026-02-20, ``teacher_guidance = 5``): s = 5 is the official
    setting, no conversion. ``scale_from_reference_g`` converts the older code's ``F_c + g (F_c - F_u)``."""
    c, u = torch.tensor([2.0, -1.0], dtype=torch.float64), torch.tensor([1.0, 0.5], dtype=torch.float64)
    torch.testing.assert_close(L.guided(c, u, 5.0), u + 5.0 * (c - u), rtol=0, atol=0)
    torch.testing.assert_close(L.guided(c, u, 5.0), torch.tensor([6.0, -7.0], dtype=torch.float64), rtol=0, atol=0)
    assert L.guided(c, u, 1.0) is c
    assert L.guided(c, None, 5.0) is c
    # the pre-2026-02-20 form with g = 5 is the standard scale 6
    assert L.scale_from_reference_g(5) == 6.0
    g = 5.0
    torch.testing.assert_close(L.guided(c, u, L.scale_from_reference_g(g)), c + g * (c - u))


def ref_dmd(G, xf, xt):
    w = max(np.abs(G - xt).mean(), 1e-5)
    grad = (xf - xt) / w
    return float((grad**2).sum()), 2 * grad  # loss value, dL/dG


def test_dmd_loss_matches_reference():
    g = torch.Generator().manual_seed(3)
    G = torch.randn(B, 2, 3, dtype=torch.float64, generator=g, requires_grad=True)
    xf = torch.randn(B, 2, 3, dtype=torch.float64, generator=g)
    xt = torch.randn(B, 2, 3, dtype=torch.float64, generator=g)
    xt[1] = G[1].detach()  # w clipped at 1e-5
    loss, info = L.dmd_loss(G, xf, xt)
    loss.sum().backward()
    for i in range(B):
        v, dG = ref_dmd(G[i].detach().numpy(), xf[i].numpy(), xt[i].numpy())
        assert float(loss[i]) == pytest.approx(v, rel=1e-12)
        np.testing.assert_allclose(G.grad[i].numpy(), dG, rtol=1e-12)
    assert info["nan"] == 0


def test_dmd_nan_sample_zero():
    G = torch.randn(3, 4, dtype=torch.float64)
    xf, xt = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    xf[0, 0] = float("inf")
    loss, info = L.dmd_loss(G, xf, xt)
    assert info["nan"] == 1 and float(loss[0]) == 0.0 and float(loss[1]) > 0


def test_fake_score_loss_reference():
    g = torch.Generator().manual_seed(4)
    net = ToyF()
    G = torch.randn(B, D, dtype=torch.float64, generator=g)
    eps = torch.randn(B, D, dtype=torch.float64, generator=g)
    t = torch.tensor([0.1, 0.5, 1.2, 1.55], dtype=torch.float64)
    loss, _ = L.fake_score_loss(net, G, t, eps)
    W, b = net.W.detach().numpy(), net.b.detach().numpy()
    for i in range(B):
        ti = float(t[i])
        xt = math.cos(ti) * G[i].numpy() + math.sin(ti) * eps[i].numpy()
        target = math.cos(ti) * eps[i].numpy() - math.sin(ti) * G[i].numpy()
        assert float(loss[i]) == pytest.approx(float(((np_F(W, b, xt, ti) - target) ** 2).sum()), rel=1e-12)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_backward_simulation(n):
    calls = []
    w = torch.nn.Parameter(torch.tensor(0.5, dtype=torch.float64))

    def student_x0(x, t):
        calls.append((t.clone(), torch.is_grad_enabled(), x.clone()))
        return w * x

    gen = torch.Generator().manual_seed(0)
    G, angles = L.backward_simulation(student_x0, (3, 2), n, generator=gen)
    assert len(calls) == n and angles.shape == (n, 3)
    assert [c[1] for c in calls] == [False] * (n - 1) + [True]
    torch.testing.assert_close(calls[0][0], torch.full((3,), math.pi / 2, dtype=torch.float64))
    assert (angles[1:] <= angles[:-1]).all() and (angles[1:] > 0).all()
    # re-noising follows x = cos t x0 + sin t eps with fresh noise from the same generator
    gen2 = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, dtype=torch.float64, generator=gen2)
    for k in range(1, n):
        x0 = 0.5 * x
        torch.rand(3, dtype=torch.float64, generator=gen2)  # consumes the p_D draw
        eps = torch.randn(3, 2, dtype=torch.float64, generator=gen2)
        tk = angles[k][:, None]
        x = torch.cos(tk) * x0 + torch.sin(tk) * eps
        torch.testing.assert_close(calls[k][2], x)
    G.sum().backward()
    assert w.grad is not None and float(w.grad) == pytest.approx(float(calls[-1][2].sum()))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_backward_simulation_fixed_angles(n):
    """``fixed_angles`` (``dmd_fix_timesteps``): the calls run at ``[pi/2, *fixed[:n - 1]]`` and no angle is drawn, so
    the generator gives only the initial noise and one fresh noise per re-noising."""
    calls = []

    def student_x0(x, t):
        calls.append((t.clone(), x.clone()))
        return 0.5 * x

    fixed = [1.5, 1.4, 1.0]
    G, angles = L.backward_simulation(
        student_x0, (3, 2), n, generator=torch.Generator().manual_seed(0), fixed_angles=fixed
    )
    want = torch.tensor([math.pi / 2, *fixed[: n - 1]], dtype=torch.float64)[:, None].expand(n, 3)
    assert torch.equal(angles, want)
    gen2 = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, dtype=torch.float64, generator=gen2)
    for k in range(1, n):
        x = math.cos(fixed[k - 1]) * 0.5 * x + math.sin(fixed[k - 1]) * torch.randn(
            3, 2, dtype=torch.float64, generator=gen2
        )
        torch.testing.assert_close(calls[k][1], x, rtol=1e-15, atol=0)
    torch.testing.assert_close(G, 0.5 * x, rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match="fixed angles"):
        L.backward_simulation(student_x0, (3, 2), 5, fixed_angles=fixed)


def test_dcm_angles_grid():
    """``dcm_angles``: consecutive points of the shifted grid of ``total_steps`` steps in ``u``, mapped to TrigFlow
    angles; strictly decreasing in k, inside (0, pi/2], ``u = 0`` is pi/2 and shift 1 is the plain grid."""
    u = torch.tensor([0.0, 0.3, 1 - 2 / 48 - 1e-9], dtype=torch.float64)
    t = L.dcm_angles(u, 48, 2, 5.0)
    assert t.shape == (3, 3) and (t[1:] < t[:-1]).all() and (t > 0).all() and (t <= math.pi / 2).all()
    assert float(t[0, 0]) == pytest.approx(math.pi / 2, abs=1e-15)
    for k in range(3):
        for b in range(3):
            s = 1 - float(u[b]) - k / 48
            r = 5 * s / (1 + 4 * s)
            assert float(t[k, b]) == pytest.approx(math.atan2(r, 1 - r), rel=1e-14)
    s = 1 - 0.3 - 1 / 48
    assert float(L.dcm_angles(torch.tensor([0.3], dtype=torch.float64), 48, 1, 1.0)[1, 0]) == pytest.approx(
        math.atan2(s, 1 - s)
    )


def test_dcm_loss_reference_toy():
    """``dcm_loss`` on a toy linear student/teacher: the Euler steps, the detached target and the per-sample sum,
    against a numpy re-computation; the gradient reaches the student only through its call at t_0; a NaN sample gives
    0."""
    w = torch.nn.Parameter(torch.tensor(0.7, dtype=torch.float64))

    def student_x0(x, t):
        return w * torch.cos(t)[:, None] * x

    def teacher_F(x, t):
        return -0.3 * x + torch.sin(t)[:, None]

    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(B, D, dtype=torch.float64, generator=g), torch.randn(B, D, dtype=torch.float64, generator=g)
    u = torch.rand(B, dtype=torch.float64, generator=g) * (1 - 3 / 10)
    loss, info = L.dcm_loss(student_x0, teacher_F, x0, eps, u, total_steps=10, skip=3, shift=2.0)
    t = L.dcm_angles(u, 10, 3, 2.0).numpy()
    X0, E = x0.numpy(), eps.numpy()
    for b in range(B):
        xt = math.cos(t[0, b]) * X0[b] + math.sin(t[0, b]) * E[b]
        x = xt.copy()
        for k in range(3):
            x = x - (t[k, b] - t[k + 1, b]) * (-0.3 * x + math.sin(t[k, b]))
        target = 0.7 * math.cos(t[3, b]) * x
        pred = 0.7 * math.cos(t[0, b]) * xt
        assert float(loss[b]) == pytest.approx(float(((pred - target) ** 2).sum()), rel=1e-12)
    loss.sum().backward()
    want = 0.0  # d/dw of sum (w cos t_0 x_t0 - target)^2, the target held fixed
    for b in range(B):
        xt = math.cos(t[0, b]) * X0[b] + math.sin(t[0, b]) * E[b]
        x = xt.copy()
        for k in range(3):
            x = x - (t[k, b] - t[k + 1, b]) * (-0.3 * x + math.sin(t[k, b]))
        pred, target = 0.7 * math.cos(t[0, b]) * xt, 0.7 * math.cos(t[3, b]) * x
        want += float((2 * (pred - target) * math.cos(t[0, b]) * xt).sum())
    assert float(w.grad) == pytest.approx(want, rel=1e-12)
    assert info["nan"] == 0
    bad = x0.clone()
    bad[1, 0] = float("nan")
    loss, info = L.dcm_loss(student_x0, teacher_F, bad, eps, u, total_steps=10, skip=3, shift=2.0)
    assert info["nan"] == 1 and loss[1] == 0 and (loss[[0, 2, 3]] > 0).all()


def test_regression_loss_reference_toy():
    """``regression_loss``: the student's one-step ``x0`` at ``t = pi/2`` from the pair's noise against the teacher's
    ODE sample, per-sample sum of squares, against numpy; the gradient w.r.t. the student's weight; the target gets
    none; a non-finite sample gives 0 and leaves the others."""
    w = torch.nn.Parameter(torch.tensor(0.6, dtype=torch.float64))
    seen = []

    def student_x0(x, t):
        seen.append(t)
        return w * x + torch.sin(t)[:, None] - 1.0  # sin(pi/2) - 1 = 0: a wrong time shows in the value

    g = torch.Generator().manual_seed(5)
    noise = torch.randn(B, D, dtype=torch.float64, generator=g)
    target = torch.randn(B, D, dtype=torch.float64, generator=g).requires_grad_(True)
    loss, info = L.regression_loss(student_x0, noise, target)
    assert torch.equal(seen[0], torch.full((B,), math.pi / 2, dtype=torch.float64)) and info["nan"] == 0
    Z, Y = noise.numpy(), target.detach().numpy()
    for b in range(B):
        assert float(loss[b]) == pytest.approx(float(((0.6 * Z[b] - Y[b]) ** 2).sum()), rel=1e-12)
    loss.sum().backward()
    assert float(w.grad) == pytest.approx(float((2 * (0.6 * Z - Y) * Z).sum()), rel=1e-12)
    assert target.grad is None
    noise[2, 0] = float("nan")
    loss2, info2 = L.regression_loss(student_x0, noise, target.detach())
    assert info2["nan"] == 1 and float(loss2[2]) == 0.0
    assert torch.equal(loss2[[0, 1, 3]], loss.detach()[[0, 1, 3]])
