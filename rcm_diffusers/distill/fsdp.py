"""FSDP2 for rCM training in shared-base LoRA mode (docs/math.md §6): the frozen base is sharded per
transformer block, the LoRA adapters stay whole on every rank (their gradients are averaged as DDP
does), so checkpoints, EMA and the LoRA export are the single-process ones.

Why not accelerate's own FSDP path: (1) accelerate builds FSDP only on accelerators
(``AcceleratorState`` turns ``ACCELERATE_USE_FSDP`` into ``DistributedType.FSDP`` for MULTI_GPU/NPU/...
but never for MULTI_CPU), so it cannot be exercised on a CPU machine; (2) its ``save_state`` under
FSDP pairs optimizer ``i`` with model ``i`` and writes the whole sharded model, while the trainer has
one shared module, two optimizers (student, fake score) and stores only trainable weights.
So ``accelerate launch`` with an FSDP2 config (``training/accelerate/fsdp2_*.yaml``) sets the usual
``ACCELERATE_USE_FSDP``/``FSDP_*`` variables; ``take_fsdp_request`` reads and removes them before the
``Accelerator`` is built (accelerate then sets up a plain process group, NCCL or gloo), and
``shard_frozen_base`` applies ``torch.distributed.fsdp.fully_shard`` itself -- the same code on GPU and CPU.
Sharding the adapters too would save ``~12 x`` LoRA size per rank (weights, grads, AdamW, EMA; a few GB
for 14B at rank 64, see ``rcm_diffusers.distill.memory``) at the price of gathering them for every
checkpoint; not done.
"""

from __future__ import annotations

import os

import torch

__all__ = ["FSDP_ENV", "take_fsdp_request", "shard_frozen_base", "all_reduce_grads"]

#: environment variables ``accelerate launch`` sets for FSDP (popped by ``take_fsdp_request``)
FSDP_ENV = (
    "ACCELERATE_USE_FSDP",
    "FSDP_VERSION",
    "FSDP_TRANSFORMER_CLS_TO_WRAP",
    "FSDP_RESHARD_AFTER_FORWARD",
    "FSDP_AUTO_WRAP_POLICY",
    "FSDP_STATE_DICT_TYPE",
    "FSDP_OFFLOAD_PARAMS",
    "FSDP_CPU_RAM_EFFICIENT_LOADING",
    "FSDP_ACTIVATION_CHECKPOINTING",
    "FSDP_SYNC_MODULE_STATES",
    "FSDP_USE_ORIG_PARAMS",
    "FSDP_SHARDING_STRATEGY",
    "FSDP_BACKWARD_PREFETCH",
    "FSDP_FORWARD_PREFETCH",
    "FSDP_MIN_NUM_PARAMS",
    "FSDP_IGNORED_MODULES",
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD",
)

_TRUE = ("1", "true", "yes")


def take_fsdp_request(environ=None) -> dict | None:
    """``None`` unless ``accelerate launch`` asked for FSDP; then the FSDP2 options
    ``{"layer_classes": [...], "reshard_after_forward": bool}`` after removing the ``FSDP_ENV``
    variables from ``environ`` (default ``os.environ``). FSDP version 1, parameter offload and
    accelerate's activation checkpointing are refused with what to use instead."""
    env = os.environ if environ is None else environ
    if env.get("ACCELERATE_USE_FSDP", "false").lower() not in _TRUE:
        return None
    version = env.get("FSDP_VERSION", "1")
    from .errors import user_error  # a refused setting: one line, exit status 2

    if version != "2":
        user_error(
            f"FSDP version {version}: the rCM trainer supports FSDP2 only; set fsdp_version: 2 in the "
            "accelerate config (see training/accelerate/fsdp2_8gpu.yaml)"
        )
    if env.get("FSDP_OFFLOAD_PARAMS", "false").lower() in _TRUE:
        user_error("fsdp_offload_params is not supported by the rCM trainer's FSDP2 path; set it to false")
    if env.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() in _TRUE:
        user_error(
            "fsdp_activation_checkpointing: use the trainer's --gradient_checkpointing instead (set it to false "
            "in the accelerate config)"
        )
    classes = [c.strip() for c in env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if c.strip()]
    opts = {
        "layer_classes": classes,
        "reshard_after_forward": env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() in _TRUE,
    }
    for k in FSDP_ENV:
        env.pop(k, None)
    return opts


#: transformer block classes sharded when the accelerate config names none
DEFAULT_LAYER_CLASSES = (
    "WanTransformerBlock",
    "FluxTransformerBlock",
    "FluxSingleTransformerBlock",
    "QwenImageTransformerBlock",
    "Flux2TransformerBlock",
    "Flux2SingleTransformerBlock",
    "HunyuanVideo15TransformerBlock",
)


def shard_frozen_base(model: torch.nn.Module, layer_classes=(), reshard_after_forward: bool = True) -> torch.nn.Module:
    """``fully_shard`` every transformer block of ``model`` (classes named in ``layer_classes``, else
    ``DEFAULT_LAYER_CLASSES``), then the root, over all ranks of the default process group; parameters
    with ``requires_grad`` (the adapters) are left out (``ignored_params``): replicated, not sharded."""
    from torch.distributed.fsdp import fully_shard

    names = set(layer_classes) or set(DEFAULT_LAYER_CLASSES)
    trainable = {p for p in model.parameters() if p.requires_grad}
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"no module of classes {sorted(names)} in {type(model).__name__}; set fsdp_transformer_layer_cls_to_wrap "
            f"to its block class(es) in the accelerate config"
        )
    for b in blocks:
        fully_shard(b, reshard_after_forward=reshard_after_forward, ignored_params=trainable)
    fully_shard(model, reshard_after_forward=reshard_after_forward, ignored_params=trainable)
    return model


def all_reduce_grads(params) -> None:
    """Average the gradients of the replicated ``params`` over all ranks (what DDP does); one
    flattened all-reduce per dtype. No-op without an initialised process group of size > 1."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    world = dist.get_world_size()
    by_dtype: dict = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for g in grads:
            g.copy_(flat[off : off + g.numel()].view_as(g))
            off += g.numel()
