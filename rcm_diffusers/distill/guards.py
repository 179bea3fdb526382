"""Guards of a training run: gradient-norm spikes, skipped non-finite steps, a student that learned nothing."""

from __future__ import annotations

import math
import statistics

import torch

from .errors import fail

__all__ = ["SpikeGuard", "note_skip", "param_checksum", "check_learned", "grad_norm"]


class SpikeGuard:
    """Gradient-norm spike detector: ``patience`` consecutive norms above ``factor`` x the running
    median (last 100 finite norms) of the same network fire; the caller dumps the evidence."""

    def __init__(self, state: dict, factor: float = 5.0, patience: int = 3, window: int = 100):
        self.s, self.factor, self.patience, self.window = state, factor, patience, window

    def check(self, net: str, norm: float) -> bool:
        hist = self.s.setdefault(net + "_hist", [])
        run = self.s.get(net + "_run", 0)
        spike = len(hist) >= 5 and (not math.isfinite(norm) or norm > self.factor * statistics.median(hist))
        run = run + 1 if spike else 0
        self.s[net + "_run"] = run
        if math.isfinite(norm) and not spike:
            hist.append(norm)
            del hist[: -self.window]
        return run >= self.patience


def note_skip(state, cfg, i: int, role: str, norm: float, ids, log=print) -> None:
    """Count a skipped optimizer step (non-finite gradient norm), say so, and stop the run once more than
    ``max_skipped_fraction`` of ``max_steps`` were skipped."""
    state.skipped += 1
    state.skipped_steps.append(i)
    log(
        f"warning: step {i}: {role} gradient norm is {norm}, optimizer step skipped "
        f"({state.skipped} skipped so far; batch sample ids {list(ids)})"
    )
    limit = cfg.max_skipped_fraction * cfg.max_steps
    if state.skipped > limit:
        fail(
            f"{state.skipped} of {i + 1} steps had a non-finite gradient and were skipped "
            f"(steps {state.skipped_steps[:10]}"
            f"{' ...' if state.skipped > 10 else ''}), more than max_skipped_fraction {cfg.max_skipped_fraction} of "
            f"max_steps {cfg.max_steps}. Check the data for NaN/inf (rcm_diffusers.distill.data) "
            "and the learning rate; "
            "raise --max_skipped_fraction to accept more."
        )


@torch.no_grad()
def param_checksum(params) -> list[float]:
    """``[sum, sum of squares]`` of the parameters in float64 (a fingerprint of the weights)."""
    ps = list(params.values()) if isinstance(params, dict) else list(params)
    s = sum(float(p.detach().double().sum()) for p in ps)
    q = sum(float(p.detach().double().square().sum()) for p in ps)
    return [s, q]


def check_learned(params, init_checksum, state, cfg) -> None:
    """Fail when the student's weights (``{name: param}`` or a list) are non-finite, still exactly their initial
    values, or form a LoRA whose ``lora_B`` matrices are all zero (``B A = 0``: the adapter changes nothing,
    whatever weight decay did to ``A``)."""
    now = param_checksum(params)
    if not all(math.isfinite(v) for v in now):
        fail(
            "the student weights contain NaN or inf; the exports would be garbage. Lower the learning rate, keep "
            "skip_nonfinite true, and check the data for NaN/inf."
        )
    if state.step == 0:
        return
    named = params if isinstance(params, dict) else {}
    b = [p for n, p in named.items() if "lora_B" in n]
    if (init_checksum and now == list(init_checksum)) or (b and all(not bool(p.detach().any()) for p in b)):
        fail(
            f"after {state.step} steps the student "
            f"{'LoRA is zero' if b else 'weights are exactly their initial values'}: "
            f"nothing was learned ({state.skipped} steps skipped). Check the data and the learning rate."
        )


def grad_norm(params) -> float:
    """Total L2 norm of the gradients of ``params`` (inf/NaN propagate)."""
    gs = [p.grad.detach().double().norm() for p in params if p.grad is not None]
    return float(torch.stack(gs).norm()) if gs else 0.0
