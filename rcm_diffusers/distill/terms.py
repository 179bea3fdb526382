"""The loss terms of an rCM iteration (docs/math.md §4, §6.1), built once from the config.

Each student term is an object that draws its own times and noise from the step's generator and says whether it
runs on an iteration (``runs``); ``student_terms(cfg)`` lists them in the order they run (the order fixes the
random stream: regression, DMD, consistency (sCM or dCM), boundary), and ``run_student_terms`` back-propagates
each one right after its forward (DDP-safe), the last one synchronising gradients. Adding a term edits this module.
The fake score's flow-matching step is ``fake_step``.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from .. import rng
from ..models import network_timestep
from ..trigflow import F_hat_from_v, r_to_t, sample_p_D, sample_p_G, t_to_r, trigflow_noise, x0_hat_from_v
from . import losses as L
from .alternation import StepPlan
from .experts import sample_p_G_experts, switch_of

__all__ = [
    "teacher_F",
    "teacher_x0",
    "batch_reduce",
    "needs_jvp",
    "backward_angles",
    "StudentBatch",
    "RegressionTerm",
    "DMDTerm",
    "SCMTerm",
    "DCMTerm",
    "BoundaryTerm",
    "student_terms",
    "run_student_terms",
    "student_step",
    "scm_times",
    "fake_step",
]

F64 = torch.float64


# ----------------------------------------------------------------------------- teacher with CFG


def _teacher_guided(nets, kind: str, x_t, t, cond, uncond, guidance_scale: float):
    call = nets.F if kind == "F" else nets.x0
    if getattr(nets, "cfg_norm_rescale", False) and uncond is not None:  # Qwen-Image: on the velocities
        v = L.guided_norm_rescaled(
            nets.v("teacher", x_t, t, cond),
            nets.v("teacher", x_t, t, uncond) if guidance_scale > 1.0 else None,
            guidance_scale,
        )
        return F_hat_from_v(x_t, v, t) if kind == "F" else x0_hat_from_v(x_t, v, t)
    out_c = call("teacher", x_t, t, cond)
    if uncond is None or guidance_scale == 1.0:  # skip the unconditional call
        return out_c
    return L.guided(out_c, call("teacher", x_t, t, uncond), guidance_scale)


@torch.no_grad()
def teacher_F(nets, x_t, t, cond, uncond, guidance_scale: float):
    """Guided teacher velocity ``F_u + s (F_c - F_u)`` (docs/math.md §4.1), float64, no grad; a teacher whose
    pipeline rescales the guided velocity (``nets.cfg_norm_rescale``, Qwen-Image) ``F`` of that velocity."""
    return _teacher_guided(nets, "F", x_t, t, cond, uncond, guidance_scale)


@torch.no_grad()
def teacher_x0(nets, x_t, t, cond, uncond, guidance_scale: float):
    """Guided teacher ``x0`` (CFG is linear, so it equals ``x0`` of the guided velocity) (docs/math.md §4.2)."""
    return _teacher_guided(nets, "x0", x_t, t, cond, uncond, guidance_scale)


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


# ----------------------------------------------------------------------------- the student's terms


class StudentBatch:
    """What a student iteration's terms read: clean latents ``x0``, conditions, the step plan, p_G's noise multiplier
    and the regression term's ODE pairs ``(noise, target, cond)`` (``None`` without them)."""

    def __init__(self, x0, cond, uncond, plan: StepPlan, noise_multiplier: float = 1.0, pairs=None):
        self.x0, self.cond, self.uncond, self.plan = x0, cond, uncond, plan
        self.noise_multiplier, self.pairs = noise_multiplier, pairs
        self.B, self.device = x0.shape[0], x0.device


class Term:
    """One weighted per-sample loss of the student: ``weight * reduce(loss(nets, batch, generator))``."""

    name = ""

    def __init__(self, cfg):
        self.cfg = cfg

    @property
    def weight(self) -> float:
        """``<name>_weight`` of the config (0 = off; a partial config without it, as in unit tests, means off)."""
        return getattr(self.cfg, self.name + "_weight", 0.0)

    def runs(self, nets, batch: StudentBatch) -> bool:
        return self.weight > 0 and not batch.plan.regression_only

    def loss(self, nets, batch: StudentBatch, generator) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError


class RegressionTerm(Term):
    """ODE-pair regression of the one-step student, ``||x0_theta(z, pi/2) - y||^2`` (docs/math.md §4.7)."""

    name = "regression"

    def runs(self, nets, batch):
        return batch.pairs is not None and self.weight > 0

    def loss(self, nets, batch, generator):
        noise, target, p_cond = batch.pairs
        l_reg, info = L.regression_loss(nets.x0_fn("student", p_cond), noise, target)
        return l_reg, {"loss_reg": float(l_reg.detach().mean()), "nan_reg": info["nan"]}


class DMDTerm(Term):
    """DMD on a backward-simulated student sample, after the tangent warm-up (docs/math.md §4.2)."""

    name = "dmd"

    def runs(self, nets, batch):
        return batch.plan.dmd and self.weight > 0

    def loss(self, nets, batch, generator):
        cfg, shape, dev = self.cfg, batch.x0.shape, batch.device
        G_x0, _ = L.backward_simulation(
            nets.x0_fn("student", batch.cond),
            shape,
            batch.plan.n_sim,
            shift=cfg.p_D_shift,
            generator=generator,
            device=dev,
            fixed_angles=backward_angles(cfg),
        )
        t_D = sample_p_D(batch.B, cfg.p_D_shift, generator=generator, device=dev)
        eps_D = rng.randn(shape, dtype=F64, generator=generator, device=dev)
        x_t = trigflow_noise(G_x0.detach(), eps_D, t_D)
        with torch.no_grad():
            x0_fake = nets.x0("fake", x_t, t_D, batch.cond)
            x0_teach = teacher_x0(nets, x_t, t_D, batch.cond, batch.uncond, cfg.guidance_scale)
        l_dmd, info = L.dmd_loss(G_x0, x0_fake, x0_teach)
        return l_dmd, {
            "loss_dmd": float(l_dmd.detach().mean()),
            "nan_dmd": info["nan"],
            "dmd_w": info["w"],
            "n_sim": batch.plan.n_sim,
        }


class SCMTerm(Term):
    """Continuous-time consistency with the JVP tangent (or finite differences, ``fd_type``) (docs/math.md §4.1)."""

    name = "scm"

    def loss(self, nets, batch, generator):
        cfg, x0, dev = self.cfg, batch.x0, batch.device
        sw = switch_of(nets.modules["student"])
        t = scm_times(sw, batch.B, cfg, batch.noise_multiplier, generator, dev)
        eps = rng.randn(x0.shape, dtype=F64, generator=generator, device=dev)
        x_t = trigflow_noise(x0, eps, t)
        F_T = teacher_F(nets, x_t, t, batch.cond, batch.uncond, cfg.guidance_scale)
        # two experts: every student call of the term (t, and t - h for fd_type 1/2) stays on the expert owning t
        high = None if sw is None else sw.is_high(network_timestep(t_to_r(t), 1000.0, nets.time_input))
        with nullcontext() if sw is None else sw.pinned(high):
            l_scm, info = L.scm_loss(
                nets.F_fn("student", batch.cond),
                x_t,
                t,
                F_T,
                step=batch.plan.student_eff,
                tangent_warmup=cfg.tangent_warmup,
                fd_type=cfg.fd_type,
                h=cfg.fd_h,
            )
        logs = {
            "loss_scm": float(l_scm.detach().mean()),
            "nan_scm": info["nan"],
            "g_norm": info["g_norm"],
            "warmup_r": info["r"],
        }
        if high is not None:
            logs["scm_high"] = int(high.sum())
        return l_scm, logs


class DCMTerm(Term):
    """Discrete-time consistency on the teacher's guided Euler steps, no JVP (docs/math.md §4.6); two experts: each
    call runs on the expert owning its own time (t_0 and t_N may straddle the switch). Weighted by ``scm_weight``."""

    name = "dcm"

    @property
    def weight(self) -> float:
        return self.cfg.scm_weight

    def loss(self, nets, batch, generator):
        cfg, x0, dev = self.cfg, batch.x0, batch.device
        total, skip = cfg.dcm_total_steps, cfg.dcm_skipping_interval_steps
        eps = rng.randn(x0.shape, dtype=F64, generator=generator, device=dev)
        u = rng.rand((batch.B,), dtype=F64, generator=generator, device=dev) * (1.0 - skip / total)
        l_dcm, info = L.dcm_loss(
            nets.x0_fn("student", batch.cond),
            lambda x, t: teacher_F(nets, x, t, batch.cond, batch.uncond, cfg.guidance_scale),
            x0,
            eps,
            u,
            total_steps=total,
            skip=skip,
            shift=cfg.dcm_timestep_shift,
        )
        return l_dcm, {"loss_dcm": float(l_dcm.detach().mean()), "nan_dcm": info["nan"], "dcm_t0": info["t0"]}


class BoundaryTerm(Term):
    """Two experts: the high-noise expert's student ``F`` at the switch angle ``t_b = arctan(b / (1 - b))`` (with
    gradient) pulled onto the low-noise expert's (no gradient) (docs/math.md §6.1)."""

    name = "boundary"

    def runs(self, nets, batch):
        return super().runs(nets, batch) and switch_of(nets.modules["student"]) is not None

    def loss(self, nets, batch, generator):
        switch, x0, B, dev = switch_of(nets.modules["student"]), batch.x0, batch.B, batch.device
        t_b = r_to_t(torch.full((B,), switch.boundary_ratio, dtype=F64, device=dev))
        eps = rng.randn(x0.shape, dtype=F64, generator=generator, device=dev)
        x_b = trigflow_noise(x0, eps, t_b)
        with torch.no_grad(), switch.pinned(torch.zeros(B, dtype=torch.bool)):
            F_low = nets.F("student", x_b, t_b, batch.cond)
        with switch.pinned(torch.ones(B, dtype=torch.bool)):
            F_high = nets.F("student", x_b, t_b, batch.cond)
        l_bc, info = L.boundary_loss(F_high, F_low)
        return l_bc, {"loss_bc": float(l_bc.detach().mean()), "bc_d": info["d_norm"], "nan_bc": info["nan"]}


def student_terms(cfg) -> list[Term]:
    """The student's terms of a run, in the order they run: regression, DMD, the consistency term (sCM or dCM by
    ``cm_type``), boundary. Each decides per iteration whether it runs."""
    cm = DCMTerm(cfg) if getattr(cfg, "cm_type", "scm") == "dcm" else SCMTerm(cfg)
    return [RegressionTerm(cfg), DMDTerm(cfg), cm, BoundaryTerm(cfg)]


def run_student_terms(terms: list[Term], nets, batch: StudentBatch, generator, backward) -> dict:
    """One student iteration: ``L = sum_k weight_k reduce(L_k)`` over the terms that run, each per-sample loss reduced
    over the batch by ``cfg.loss_reduction``; ``backward(loss, last)`` right after each term's forward (``last`` marks
    the one that synchronises gradients across processes). Returns the logged floats."""
    active = [t for t in terms if t.runs(nets, batch)]
    logs = {}
    for k, term in enumerate(active):
        loss, info = term.loss(nets, batch, generator)
        backward(term.weight * batch_reduce(loss, term.cfg.loss_reduction), last=k == len(active) - 1)
        logs.update(info)
    return logs


def student_step(
    nets,
    x0,
    cond,
    uncond,
    plan: StepPlan,
    cfg,
    generator,
    backward,
    noise_multiplier: float = 1.0,
    pairs=None,
    terms: list[Term] | None = None,
):
    """``run_student_terms`` on one batch with ``terms`` (default ``student_terms(cfg)``); ``pairs`` = ``(noise, target,
    cond)`` of ODE pairs feeds the regression term."""
    batch = StudentBatch(x0, cond, uncond, plan, noise_multiplier, pairs)
    return run_student_terms(terms if terms is not None else student_terms(cfg), nets, batch, generator, backward)


def scm_times(switch, B: int, cfg, noise_multiplier: float, generator, device) -> torch.Tensor:
    """sCM angles: ``p_G`` (docs/math.md §3); with two experts and ``expert_sampling="balanced"`` each sample is
    the high-noise expert's with probability ``high_noise_share`` and its angle comes from ``p_G`` restricted
    to that expert's side of the boundary (docs/math.md §6.1)."""
    if switch is None or cfg.expert_sampling == "natural":
        return sample_p_G(B, cfg.P_mean, cfg.P_std, noise_multiplier, generator=generator, device=device)
    high = rng.rand((B,), dtype=F64, generator=generator, device=device) < cfg.high_noise_share
    return sample_p_G_experts(
        high, switch.boundary_ratio, cfg.P_mean, cfg.P_std, noise_multiplier, generator=generator, device=device
    )


def fake_step(nets, x0_shape, cond, plan: StepPlan, cfg, generator, backward, device):
    """One fake-score iteration: flow matching on a detached student sample (docs/math.md §4.3), reduced over the
    batch by ``cfg.loss_reduction`` like the student's terms."""
    B = x0_shape[0]
    n = plan.fake_eff % cfg.max_simulation_steps + 1
    with torch.no_grad():
        G_x0, _ = L.backward_simulation(
            nets.x0_fn("student", cond),
            x0_shape,
            n,
            shift=cfg.p_D_shift,
            generator=generator,
            device=device,
            fixed_angles=backward_angles(cfg),
        )
    t = sample_p_D(B, cfg.p_D_shift, generator=generator, device=device)
    eps = rng.randn(x0_shape, dtype=F64, generator=generator, device=device)
    loss, info = L.fake_score_loss(nets.F_fn("fake", cond), G_x0, t, eps)
    backward(batch_reduce(loss, cfg.loss_reduction), last=True)
    return {"loss_fake": float(loss.detach().mean()), "nan_fake": info["nan"], "n_sim": n}
