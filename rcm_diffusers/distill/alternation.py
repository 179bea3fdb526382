"""Student / fake-score alternation and effective iterations (docs/math.md §4.3, §4.2).

The schedule is the current official one (NVlabs/rcm ``rcm/models/t2v_model_distill_rcm.py``,
``is_student_phase`` / ``get_effective_iteration``, since 2026-01-15): after the tangent warm-up, iteration ``i``
trains the student when ``(i - tangent_warmup) % student_update_freq == 0``, so the first iteration after the
warm-up is a student (sCM + DMD) step, then ``student_update_freq - 1`` fake-score steps, and so on. The first
official release (2025-10) tested ``i % student_update_freq == 0`` instead; the two differ whenever
``tangent_warmup`` is not a multiple of ``student_update_freq``. The fake score's effective iteration
``i - student_eff - 1`` drives its backward-simulation length ``fake_eff % max_simulation_steps + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "is_student_step",
    "optimizer_steps",
    "student_effective_iter",
    "fake_effective_iter",
    "StepPlan",
    "plan_step",
    "plan_of",
]


def is_student_step(i: int, tangent_warmup: int, student_update_freq: int, has_fake: bool = True) -> bool:
    """Iteration ``i`` trains the student when there is no fake score, during the tangent warm-up,
    or when ``(i - tangent_warmup) % student_update_freq == 0``; otherwise the fake score (docs/math.md §4.3)."""
    if not has_fake or i < tangent_warmup:
        return True
    return (i - tangent_warmup) % student_update_freq == 0


def optimizer_steps(
    max_steps: int, tangent_warmup: int, student_update_freq: int, has_fake: bool = True, regression_warmup: int = 0
) -> dict:
    """Optimizer steps of each network in iterations ``0 .. max_steps - 1``: ``{"student": n, "fake": max_steps - n}``,
    ``n`` = the iterations ``plan_step`` gives the student (what a decaying LR schedule runs down over)."""
    n = sum(
        plan_step(i, tangent_warmup, student_update_freq, 1, has_fake, regression_warmup).student
        for i in range(max_steps)
    )
    return {"student": n, "fake": max_steps - n}


def student_effective_iter(i: int, tangent_warmup: int, student_update_freq: int, has_fake: bool = True) -> int:
    """``i`` during warm-up (or without a fake score), then ``tangent_warmup + (i - tangent_warmup) // freq``
    (docs/math.md §4.3)."""
    if not has_fake or i < tangent_warmup:
        return i
    return tangent_warmup + (i - tangent_warmup) // student_update_freq


def fake_effective_iter(i: int, tangent_warmup: int, student_update_freq: int, has_fake: bool = True) -> int:
    """The fake score's effective iteration ``i - student_eff - 1`` (docs/math.md §4.3)."""
    return i - student_effective_iter(i, tangent_warmup, student_update_freq, has_fake) - 1


@dataclass(frozen=True)
class StepPlan:
    """What iteration ``i`` does: which network, its effective iteration, whether DMD is on and
    the number of backward-simulation steps ``n`` (docs/math.md §4.2, §4.3)."""

    i: int
    student: bool
    student_eff: int
    fake_eff: int
    dmd: bool
    n_sim: int
    regression_only: bool = False  # an iteration of the regression warm-up: the ODE-pair term alone


def plan_step(
    i: int,
    tangent_warmup: int,
    student_update_freq: int,
    max_simulation_steps: int,
    has_fake: bool = True,
    regression_warmup: int = 0,
) -> StepPlan:
    """Plan iteration ``i``: the first ``regression_warmup`` iterations train the student on the ODE-pair regression
    alone (docs/math.md §4.7); the schedule then runs on ``j = i - regression_warmup``: DMD starts after the tangent
    warm-up, ``n = student_eff % max_simulation_steps + 1``."""
    if i < regression_warmup:
        return StepPlan(i=i, student=True, student_eff=0, fake_eff=-1, dmd=False, n_sim=1, regression_only=True)
    j = i - regression_warmup
    stu = is_student_step(j, tangent_warmup, student_update_freq, has_fake)
    s_eff = student_effective_iter(j, tangent_warmup, student_update_freq, has_fake)
    return StepPlan(
        i=i,
        student=stu,
        student_eff=s_eff,
        fake_eff=j - s_eff - 1,
        dmd=has_fake and j >= tangent_warmup,
        n_sim=s_eff % max_simulation_steps + 1,
    )


def plan_of(cfg, i: int, has_fake: bool) -> StepPlan:
    """``plan_step`` of iteration ``i`` with a run config's schedule options (``tangent_warmup``,
    ``student_update_freq``, ``max_simulation_steps``, ``regression_warmup``)."""
    return plan_step(
        i,
        cfg.tangent_warmup,
        cfg.student_update_freq,
        cfg.max_simulation_steps,
        has_fake,
        getattr(cfg, "regression_warmup", 0),
    )
