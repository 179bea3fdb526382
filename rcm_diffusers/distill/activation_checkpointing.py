"""Activation checkpointing of the transformer blocks in the grad passes: ``full`` or ``selective`` (docs/training.md).

Both policies checkpoint every transformer block through the hook diffusers gives its models
(``enable_gradient_checkpointing(gradient_checkpointing_func=...)``; the Wan / Flux forward calls it per block only
while grad is enabled, so the no-grad JVP and teacher passes never checkpoint).

* ``full``: ``torch.utils.checkpoint.checkpoint`` (non-reentrant) of each block: only the block's inputs are kept
  and the whole block is recomputed in the backward pass (what diffusers' default hook does).
* ``selective``: the same checkpoint with a ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` policy
  (``selective_policy``): the outputs of the expensive ops are kept from the forward pass -- the matrix
  products ``aten.mm`` / ``aten.addmm`` (every ``nn.Linear`` on the tokens: q, k, v, out and the feed-forward, and
  the text K/V of cross-attention) and the fused attention kernels (``aten._scaled_dot_product_*``, output and
  log-sum-exp) -- and everything else is recomputed: norms, RoPE, modulation, GELU, residual adds, casts.
  Matrix products whose reduction dimension is at most the LoRA rank (the LoRA up-projection ``lora_B``, which
  costs ``rank / width`` of its base projection) are recomputed as well; their ``lora_A`` inputs are kept.

Both keep the adapter state of the block's peft LoRA layers (``_disable_adapters``, ``_active_adapter``) as it was
in the forward pass and put it back for the recompute: the trainer switches roles (teacher / student / fake score,
``Networks.role``) by those attributes and leaves the role before the backward, so a recompute under the state of
backward time would run another adapter than the forward did and give wrong gradients.

The official rCM trainer (NVlabs/rcm) has the same split as its ``mm_only`` mode: ``mm_only_policy`` in
``rcm/utils/selective_activation_checkpoint.py`` keeps ``aten.mm`` / ``aten.addmm`` and the flash / efficient
attention outputs and recomputes the rest, applied per block by ``enable_selective_checkpoint`` in
``rcm/networks/wan2pt1_jvp.py`` (Wan2.1-14B recipe ``rcm/configs/experiments/rcm/wan2pt1_t2v.py``; 1.3B uses
``block_wise``, i.e. ``full`` here). It trains full weights, so it has no LoRA up-projection to recompute.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["POLICIES", "SAVED_OPS", "selective_policy", "checkpoint_function", "enable_checkpointing", "recording"]

POLICIES = ("full", "selective")

_aten = torch.ops.aten
#: ops whose outputs ``selective`` keeps (the fused attention variants that exist in this torch build)
SAVED_OPS = frozenset(
    [_aten.mm.default, _aten.addmm.default]
    + [
        getattr(_aten, name).default
        for name in (
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
        )
        if hasattr(_aten, name)
    ]
)

_LAYERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # block -> its peft tuner layers
_RECORD: list | None = None  # set by ``recording``: (block inputs, SAC caching context) of each checkpointed call


def _reduction_dim(func, args) -> int:
    a = args[1] if func is _aten.addmm.default else args[0]  # addmm(bias, a, b) / mm(a, b): a is [M, K]
    return int(a.shape[-1])


def selective_policy(recompute_rank: int = 0):
    """Policy function for ``create_selective_checkpoint_contexts``: ``MUST_SAVE`` for ``SAVED_OPS`` except matrix
    products with reduction dimension ``<= recompute_rank`` (LoRA up-projections), ``PREFER_RECOMPUTE`` otherwise."""

    def policy(ctx, func, *args, **kwargs):
        if func in SAVED_OPS and not (
            func in (_aten.mm.default, _aten.addmm.default) and _reduction_dim(func, args) <= recompute_rank
        ):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _contexts(policy):
    ctx = create_selective_checkpoint_contexts(policy)
    if _RECORD is not None:
        _RECORD[-1] = (_RECORD[-1][0], ctx[0])
    return ctx


def checkpoint_function(policy: str = "full", recompute_rank: int = 0):
    """A diffusers ``gradient_checkpointing_func(module, *args)``: non-reentrant checkpoint of ``module(*args)``,
    with ``selective_policy(recompute_rank)`` when ``policy`` is ``"selective"``."""
    if policy not in POLICIES:
        raise ValueError(f"checkpointing policy must be one of {POLICIES}, got {policy!r}")
    context_fn = functools.partial(_contexts, selective_policy(recompute_rank)) if policy == "selective" else None

    def run(module, *args):
        if _RECORD is not None:
            _RECORD.append((args, None))
        kw = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(_with_adapter_state(module), *args, use_reentrant=False, **kw)

    return run


def _tuner_layers(module) -> list:
    if module not in _LAYERS:
        try:
            from peft.tuners.tuners_utils import BaseTunerLayer
        except ImportError:  # no peft: no adapters to track
            BaseTunerLayer = ()
        _LAYERS[module] = [m for m in module.modules() if BaseTunerLayer and isinstance(m, BaseTunerLayer)]
    return _LAYERS[module]


def _with_adapter_state(module):
    """``module.__call__`` that runs under the adapter state of now (the forward pass), also when the checkpoint
    calls it again in the backward pass."""
    layers = _tuner_layers(module)
    if not layers:
        return module.__call__
    state = [(m._disable_adapters, m._active_adapter) for m in layers]

    def call(*args):
        now = [(m._disable_adapters, m._active_adapter) for m in layers]
        for m, (d, a) in zip(layers, state):
            m._disable_adapters, m._active_adapter = d, a
        try:
            return module(*args)
        finally:
            for m, (d, a) in zip(layers, now):
                m._disable_adapters, m._active_adapter = d, a

    return call


def enable_checkpointing(model, policy: str = "full", recompute_rank: int = 0) -> None:
    """Checkpoint every block of the diffusers transformer ``model`` (or a ``WanExpertSwitch``) in grad-enabled
    forwards with ``checkpoint_function(policy, recompute_rank)``; pass the largest LoRA rank as ``recompute_rank``."""
    model.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint_function(policy, recompute_rank))


@contextlib.contextmanager
def recording():
    """Measurement aid: yields a list that receives ``(inputs, caching_context)`` per checkpointed block call made
    inside the ``with`` (``caching_context`` is ``None`` under ``full``); ``memory.checkpoint_held_bytes`` reads it."""
    global _RECORD
    prev, _RECORD = _RECORD, []
    try:
        yield _RECORD
    finally:
        _RECORD = prev
