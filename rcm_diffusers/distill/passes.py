"""Counting the network passes a training iteration makes, per role (docs/benchmarks.md, "What an iteration costs").

``PassCounter`` hooks the networks of a run (``Networks.modules``, or any ``{role: module}``) and counts, per role
(``teacher``, ``student``, ``fake``), the passes of each kind:

* ``forward``: a forward pass without gradient (teacher, the student's backward-simulation steps, the fake score
  inside the DMD term, the student's finite-difference call of ``fd_type`` 2);
* ``forward_grad``: a forward pass with gradient enabled (autograd saves its activations for a backward);
* ``jvp``: a forward-mode pass (``torch.func.jvp``: the primal and its tangent in one pass);
* ``backward``: a backward pass through the network's output;
* ``recompute``: gradient checkpointing's recompute of the blocks inside a backward (``full``: the whole block;
  ``selective``: everything but the matrix products and attention, which it kept).

A call is counted in passes over the batch: a call on ``k`` of the ``B`` samples counts ``k / B`` (two experts split a
batch between them), so ``passes(B)`` gives whole numbers for an iteration whatever the split. The role of a call is
the module's when roles have their own modules (``full`` mode, QAD's teacher and student), else the peft adapter state
of the shared base at the call (adapters off: teacher; else the active adapter): the state ``Networks.role`` sets, and
that ``activation_checkpointing`` restores for a recompute. A backward is counted when the gradient reaches the
output of a grad-enabled call, a recompute when a block starts a forward inside a backward.
"""

from __future__ import annotations

import collections

import torch

from ..models import _base_model

__all__ = ["KINDS", "PassCounter"]

KINDS = ("forward", "forward_grad", "jvp", "backward", "recompute")


def _rows(args, kwargs) -> int:
    x = kwargs.get("hidden_states", args[0] if args else None)
    return int(x.shape[0]) if torch.is_tensor(x) else 1


def _has_tangent(args, kwargs) -> bool:
    from ..attention.function import has_tangent

    return has_tangent(*[a for a in (*args, *kwargs.values()) if torch.is_tensor(a)])


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tuner_layers(module) -> list:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no peft: no adapters
        return []
    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


def _first_blocks(model) -> list:
    """The first repeated block of each transformer in ``model`` (both experts of a ``WanExpertSwitch``)."""
    experts = getattr(model, "experts", None)
    nets = list(experts.values()) if isinstance(experts, dict) else [model]
    from ..models import transformer_blocks

    return [blocks[0] for blocks in map(transformer_blocks, nets) if blocks]


class PassCounter:
    """Context manager counting the passes of ``modules`` (``{role: module}``; one module may serve several roles,
    told apart by its peft adapter state). ``samples[role][kind]`` counts sample-passes; ``passes(batch)`` divides by
    the batch size. ``PassCounter.of(nets)`` counts a ``Networks``."""

    def __init__(self, modules: dict):
        self.samples: dict = collections.defaultdict(lambda: collections.defaultdict(int))
        self._groups = []  # (base module, roles, tuner layers)
        seen = {}
        for role, m in modules.items():
            base = _base_model(m)
            if id(base) in seen:
                seen[id(base)][1].append(role)
            else:
                seen[id(base)] = (base, [role])
        for base, roles in seen.values():
            self._groups.append((base, roles, _tuner_layers(base) if len(roles) > 1 else []))
        self._handles = []

    @classmethod
    def of(cls, nets) -> "PassCounter":
        return cls(nets.modules)

    # ------------------------------------------------------------------ roles
    @staticmethod
    def _role(roles, layers) -> str:
        if len(roles) == 1:
            return roles[0]
        if not layers:
            raise ValueError(f"roles {roles} share one module without peft adapters to tell them apart")
        layer = layers[0]
        if layer._disable_adapters:
            return "teacher"
        active = layer._active_adapter
        return active if isinstance(active, str) else active[0]

    def add(self, role: str, kind: str, rows: int) -> None:
        self.samples[role][kind] += rows

    # ------------------------------------------------------------------ hooks
    def __enter__(self) -> "PassCounter":
        for base, roles, layers in self._groups:
            self._handles.append(base.register_forward_pre_hook(self._pre(roles, layers), with_kwargs=True))
            self._handles.append(base.register_forward_hook(self._post(), with_kwargs=True))
            for block in _first_blocks(base):
                block_layers = _tuner_layers(block) if len(roles) > 1 else []
                self._handles.append(
                    block.register_forward_pre_hook(self._block_pre(roles, block_layers), with_kwargs=True)
                )
        self._open = []
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, roles, layers):
        def hook(module, args, kwargs):
            role, rows = self._role(roles, layers), _rows(args, kwargs)
            if _has_tangent(args, kwargs):
                kind = "jvp"
            elif torch.is_grad_enabled():
                kind = "forward_grad"
            else:
                kind = "forward"
            self.add(role, kind, rows)
            self._open.append((role, kind, rows))

        return hook

    def _post(self):
        def hook(module, args, kwargs, output):
            role, kind, rows = self._open.pop()
            out = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
            if kind == "forward_grad" and torch.is_tensor(out) and out.requires_grad:
                out.register_hook(lambda grad: self.add(role, "backward", rows))

        return hook

    def _block_pre(self, roles, layers):
        def hook(module, args, kwargs):
            if _in_backward():
                self.add(self._role(roles, layers), "recompute", _rows(args, kwargs))

        return hook

    # ------------------------------------------------------------------ results
    def passes(self, batch: int) -> dict:
        """``{role: {kind: passes}}`` over a batch of ``batch`` samples, kinds in ``KINDS`` order, zeros left out."""
        out = {}
        for role in ("teacher", "student", "fake", *sorted(set(self.samples) - {"teacher", "student", "fake"})):
            kinds = {k: self.samples[role][k] / batch for k in KINDS if self.samples.get(role, {}).get(k)}
            if kinds:
                out[role] = kinds
        return out

    def reset(self) -> None:
        self.samples.clear()
