"""Power EMA (docs/math.md §4.5) and the student/fake alternation (docs/math.md §4.3)."""

import pytest
import torch

from rcm_diffusers.distill.alternation import optimizer_steps, plan_step
from rcm_diffusers.distill.ema import PowerEMA, power_ema_beta, power_ema_exponent


def test_exponent_root():
    a = power_ema_exponent(0.10)
    assert a == pytest.approx(6.94, abs=0.01)
    s2 = 0.1**-2
    assert abs(a**3 + 7 * a**2 + (16 - s2) * a + (12 - s2)) < 1e-8
    assert power_ema_exponent(0.05) > a  # slower rate, larger exponent


def test_beta():
    a = power_ema_exponent(0.1)
    assert power_ema_beta(0, a) == 0.0
    assert power_ema_beta(3, a) == pytest.approx((3 / 4) ** (a + 1))


def test_ema_weights_closed_form():
    """After updates at i = 0..N the EMA is sum_j w_j p_j with
    w_j = ((j+1)^(a+1) - j^(a+1)) / (N+1)^(a+1) (product of the betas telescopes)."""
    N = 12
    ps = [torch.randn(3, dtype=torch.float32) for _ in range(N + 1)]
    ema = PowerEMA({"p": ps[0]}, s=0.1)
    for i, p in enumerate(ps):
        ema.update({"p": p}, i)
    a = ema.alpha
    w = [((j + 1) ** (a + 1) - j ** (a + 1)) / (N + 1) ** (a + 1) for j in range(N + 1)]
    ref = sum(wj * p.double() for wj, p in zip(w, ps))
    torch.testing.assert_close(ema.shadow["p"].double(), ref, rtol=1e-5, atol=1e-6)
    assert ema.shadow["p"].dtype == torch.float32


def test_ema_state_roundtrip():
    e = PowerEMA({"p": torch.ones(2)}, s=0.2)
    e.update({"p": torch.zeros(2)}, 5)
    f = PowerEMA({"p": torch.zeros(2)}, s=0.1)
    f.load_state_dict(e.state_dict())
    assert f.alpha == e.alpha
    torch.testing.assert_close(f.shadow["p"], e.shadow["p"])


def test_alternation_table():
    # warm-up 3, student every 5th iteration, up to 4 simulation steps (hand-computed from docs/math.md §4.3)
    plans = [plan_step(i, 3, 5, 4) for i in range(15)]
    assert [p.student for p in plans] == [True] * 4 + [False] * 4 + [True] + [False] * 4 + [True] + [False]
    assert [p.student_eff for p in plans] == [0, 1, 2, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 5, 5]
    assert [p.fake_eff for p in plans] == [-1, -1, -1, -1, 0, 1, 2, 3, 3, 4, 5, 6, 7, 7, 8]
    assert [p.dmd for p in plans] == [False] * 3 + [True] * 12
    assert [p.n_sim for p in plans if p.student and p.dmd] == [4, 1, 2]
    # no fake score: every iteration is a student step, no DMD
    assert all(plan_step(i, 3, 5, 4, has_fake=False).student for i in range(10))
    assert not any(plan_step(i, 3, 5, 4, has_fake=False).dmd for i in range(10))


def test_regression_warmup_shifts_the_schedule():
    """``regression_warmup 4``: iterations 0-3 are regression-only student steps (no DMD), and iteration ``i >= 4``
    is what iteration ``i - 4`` is without it (warm-up 3, frequency 5, up to 4 simulation steps); the student's
    optimizer steps count both."""
    plans = [plan_step(i, 3, 5, 4, regression_warmup=4) for i in range(19)]
    assert all(p.regression_only and p.student and not p.dmd for p in plans[:4])
    for p in plans[4:]:
        q = plan_step(p.i - 4, 3, 5, 4)
        assert not p.regression_only
        assert (p.student, p.student_eff, p.fake_eff, p.dmd, p.n_sim) == (
            q.student,
            q.student_eff,
            q.fake_eff,
            q.dmd,
            q.n_sim,
        )
    assert optimizer_steps(19, 3, 5, regression_warmup=4) == {"student": 4 + 6, "fake": 9}


def test_alternation_matches_official_rule():
    """Against the rule of the current official code, written out here (NVlabs/rcm
    rcm/models/t2v_model_distill_rcm.py ``is_student_phase``, ``get_effective_iteration``,
    ``get_effective_iteration_fake``, since 2026-01-15), over warm-ups that are and are not multiples of the
    frequency; the first release's ``i % freq == 0`` differs for warm-up 3 / freq 5 (iteration 3 is a student step)."""
    for warmup in (0, 3, 10, 12):
        for freq in (1, 5, 10):
            for i in range(60):
                student = i < warmup or (i - warmup) % freq == 0
                eff = i if i < warmup else warmup + (i - warmup) // freq
                p = plan_step(i, warmup, freq, 4)
                assert (p.student, p.student_eff, p.fake_eff, p.n_sim) == (student, eff, i - eff - 1, eff % 4 + 1)
    assert plan_step(3, 3, 5, 4).student and 3 % 5 != 0
