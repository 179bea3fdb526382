"""Quantization-aware distillation objective and the block-wise warm start (docs/math.md §7).

QAD: the student (fake-quantized linears) matches the frozen teacher's *guided* velocity with
CFG folded in, plus flow matching on real data, in the rectified-flow frame
``x_r = (1 - r) x0 + r eps``, ``v = eps - x0`` (docs/math.md §1):

    L = alpha * ||v_S(x_r, r) - (eps - x0)||^2 + (1 - alpha) * ||v_S(x_r, r) - v_T^g(x_r, r)||^2
    v_T^g = v_T(x_r, r, uncond) + s(r) * (v_T(x_r, r, cond) - v_T(x_r, r, uncond))

``s(r)`` is a piecewise-linear guidance schedule (higher at noisy / middle r, lower near clean r);
the student runs one branch (guidance 1). With a few-step rCM student as the teacher, pass its
sampling times as ``times`` so ``r`` is drawn among them.

Block-wise warm start: per transformer block, ``||y_q - y_t||^2 / ||y_t||^2`` between the student
block and the teacher block on the teacher's input to that block; one block's autograd graph at a
time, gradients clipped per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import rng
from ..models import _base_model, named_transformer_blocks
from ..trigflow import shift_r

__all__ = ["GuidanceSchedule", "sample_r", "qad_loss", "transformer_blocks", "relative_error", "blockwise_warm_start"]


class GuidanceSchedule:
    """Piecewise-linear ``s(r)`` through knots ``[(r_0, s_0), (r_1, s_1), ...]``, constant beyond the ends
    (docs/math.md §7)."""

    def __init__(self, knots):
        knots = [(float(r), float(s)) for r, s in (knots if not isinstance(knots, (int, float)) else [(0.0, knots)])]
        if not knots:
            raise ValueError("guidance schedule needs at least one (r, s) knot")
        for r, s in knots:
            if not (0.0 <= r <= 1.0) or not math.isfinite(s) or s < 0:
                raise ValueError(f"guidance knot (r={r}, s={s}): need 0 <= r <= 1 and finite s >= 0")
        if any(b[0] <= a[0] for a, b in zip(knots, knots[1:])):
            raise ValueError(f"guidance knots must have strictly increasing r: {knots}")
        self.knots = knots

    def __call__(self, r: torch.Tensor) -> torch.Tensor:
        r = torch.as_tensor(r, dtype=torch.float64)
        rs = torch.tensor([k[0] for k in self.knots], dtype=torch.float64, device=r.device)
        ss = torch.tensor([k[1] for k in self.knots], dtype=torch.float64, device=r.device)
        if len(self.knots) == 1:
            return ss[0].expand_as(r).clone()
        i = torch.searchsorted(rs, r.clamp(rs[0], rs[-1]), right=True).clamp(1, len(rs) - 1)
        w = (r.clamp(rs[0], rs[-1]) - rs[i - 1]) / (rs[i] - rs[i - 1])
        return ss[i - 1] + w * (ss[i] - ss[i - 1])

    @property
    def is_one(self) -> bool:
        return all(s == 1.0 for _, s in self.knots)


def sample_r(batch: int, shift: float = 1.0, times=None, generator=None, device="cpu") -> torch.Tensor:
    """``r`` per sample (float64): shifted uniform ``s u / (1 + (s - 1) u)``, or uniform among ``times`` (rCM
    teacher)."""
    if times:
        t = torch.as_tensor(list(times), dtype=torch.float64, device=device)
        return t[rng.randint(len(t), (batch,), generator=generator, device=device)]
    u = rng.rand((batch,), dtype=torch.float64, generator=generator, device=device)
    return shift_r(u, shift)


def _bc(r, x):
    return r.reshape(-1, *([1] * (x.dim() - 1)))


def qad_loss(
    student_v,
    teacher_v,
    x0,
    cond,
    uncond,
    *,
    alpha: float,
    guidance: GuidanceSchedule,
    generator=None,
    shift: float = 1.0,
    times=None,
    model_dtype=None,
):
    """Per-sample ``alpha L_FM + (1 - alpha) L_distill`` (docs/math.md §7, see module docstring) and a dict of
    logged floats.

    ``student_v`` / ``teacher_v``: ``v(x_r, r, **cond)`` (``rcm_diffusers.models.velocity_fn``); ``x0`` float64.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha = {alpha}: must lie in [0, 1]")
    B = x0.shape[0]
    dtype = model_dtype or torch.float32
    r = sample_r(B, shift, times, generator, x0.device)
    eps = rng.randn(x0.shape, dtype=torch.float64, generator=generator, device=x0.device)
    x_r = ((1 - _bc(r, x0)) * x0 + _bc(r, x0) * eps).to(dtype)
    r_m = r.to(torch.float32)
    v_S = student_v(x_r, r_m, **cond).double()
    dims = tuple(range(1, x0.dim()))
    zero = torch.zeros(B, dtype=torch.float64, device=x0.device)
    l_fm = ((v_S - (eps - x0)) ** 2).mean(dims) if alpha > 0 else zero
    l_d = zero
    if alpha < 1:
        with torch.no_grad():
            v_c = teacher_v(x_r, r_m, **cond).double()
            if uncond is None or guidance.is_one:
                v_T = v_c
            else:
                v_u = teacher_v(x_r, r_m, **uncond).double()
                v_T = v_u + _bc(guidance(r), v_u) * (v_c - v_u)
        l_d = ((v_S - v_T) ** 2).mean(dims)
    loss = alpha * l_fm + (1 - alpha) * l_d
    return loss, {
        "loss": float(loss.detach().mean()),
        "loss_fm": float(l_fm.detach().mean()),
        "loss_distill": float(l_d.detach().mean()),
        "r_mean": float(r.mean()),
    }


def transformer_blocks(model) -> list[tuple[str, torch.nn.Module]]:
    """``(name, block)`` of the repeated blocks of a Wan (``blocks.i``) or Flux (``transformer_blocks.i`` then
    ``single_transformer_blocks.i``) model under its peft / accelerate wrappers
    (``models.named_transformer_blocks``)."""
    base = _base_model(model)
    out = named_transformer_blocks(base)
    if not out:
        raise ValueError(f"no transformer blocks found on {type(base).__name__}")
    return out


def _tensors(y):
    return [y] if torch.is_tensor(y) else [t for t in y if torch.is_tensor(t)]


def relative_error(y_q, y_t) -> torch.Tensor:
    """``sum_k ||y_q,k - y_t,k||^2 / ||y_t,k||^2`` over the block's tensor outputs (docs/math.md §7 warm start)."""
    return sum(
        ((q.float() - t.float()) ** 2).sum() / (t.float() ** 2).sum().clamp_min(1e-30)
        for q, t in zip(_tensors(y_q), _tensors(y_t))
    )


@dataclass
class BlockStats:
    name: str
    rel_err_first: float
    rel_err_last: float
    steps: int


def _capture(teacher, run_teacher, blocks_t):
    """Run the teacher once; record each block's (args, kwargs) input and its output (detached, no graph)."""
    io = {}
    hooks = []
    for name, b in blocks_t:

        def pre(mod, args, kwargs, name=name):
            io[name] = [
                tuple(a.detach() if torch.is_tensor(a) else a for a in args),
                {k: (v.detach() if torch.is_tensor(v) else v) for k, v in kwargs.items()},
                None,
            ]

        def post(mod, args, kwargs, out, name=name):
            io[name][2] = tuple(t.detach() for t in _tensors(out))

        hooks += [b.register_forward_pre_hook(pre, with_kwargs=True), b.register_forward_hook(post, with_kwargs=True)]
    try:
        with torch.no_grad():
            run_teacher(teacher)
    finally:
        for h in hooks:
            h.remove()
    return io


def blockwise_warm_start(
    student,
    teacher,
    run_batches,
    *,
    steps_per_batch: int = 1,
    lr: float = 1e-4,
    max_grad_norm: float = 1.0,
    optimizer_cls=torch.optim.AdamW,
) -> list[BlockStats]:
    """Align every student block to the teacher block on the teacher's block input (docs/math.md §7).

    ``run_batches``: iterable of callables ``f(model)`` that run one forward pass of a batch.
    Per batch the teacher runs once (hooks store each block's input/output without a graph);
    then for each block in turn ``steps_per_batch`` steps of ``||y_q - y_t||^2 / ||y_t||^2``, with
    only that block's graph alive and its gradient norm clipped to ``max_grad_norm``.
    Only parameters with ``requires_grad`` train (all weights, or LoRA weights only).
    """
    blocks_s, blocks_t = transformer_blocks(student), transformer_blocks(teacher)
    if [n for n, _ in blocks_s] != [n for n, _ in blocks_t]:
        raise ValueError("student and teacher have different blocks")
    params = {n: [p for p in b.parameters() if p.requires_grad] for n, b in blocks_s}
    if not any(params.values()):
        raise ValueError("no trainable parameter in the student blocks")
    opts = {n: optimizer_cls(ps, lr=lr) for n, ps in params.items() if ps}
    stats = {n: BlockStats(n, float("nan"), float("nan"), 0) for n, _ in blocks_s}
    for run in run_batches:
        io = _capture(teacher, run, blocks_t)
        for name, block in blocks_s:
            if name not in opts:
                continue
            args, kwargs, y_t = io[name]
            for _ in range(steps_per_batch):
                opts[name].zero_grad(set_to_none=True)
                loss = relative_error(block(*args, **kwargs), y_t)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"warm start: non-finite relative error in {name}")
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params[name], max_grad_norm)
                opts[name].step()
                st = stats[name]
                if st.steps == 0:
                    st.rel_err_first = float(loss.detach())
                st.rel_err_last, st.steps = float(loss.detach()), st.steps + 1
                del loss
            opts[name].zero_grad(set_to_none=True)  # free this block's gradients before the next block
    return list(stats.values())
