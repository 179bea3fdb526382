"""What DistributedDataParallel needs from the trainers: forward-mode AD through the wrapper, sync on the last
backward."""

from __future__ import annotations

from contextlib import nullcontext

import torch

__all__ = ["ddp_jvp_bypass", "no_sync_unless", "no_buffer_sync_in_forward"]


def ddp_jvp_bypass(module) -> None:
    """Let ``torch.func.jvp`` run through a ``DistributedDataParallel`` wrapper: a call whose inputs carry a
    forward-mode tangent goes to the wrapped module. DDP's forward wraps its outputs in an autograd.Function without a
    forward-mode rule (``_DDPSink``, with ``find_unused_parameters``), which functorch refuses; the JVP passes run
    under ``no_grad`` and produce no gradients for DDP to synchronise. Anything else: no-op."""
    if not isinstance(module, torch.nn.parallel.DistributedDataParallel) or "forward" in module.__dict__:
        return
    from ..attention.function import has_tangent

    stock = module.forward

    def forward(*args, **kwargs):
        if has_tangent(*[a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]):
            return module.module(*args, **kwargs)
        return stock(*args, **kwargs)

    module.forward = forward


def no_sync_unless(accelerator, model, last: bool):
    """``accelerator.no_sync(model)`` for every backward but the last of a step."""
    return nullcontext() if last or accelerator.num_processes == 1 else accelerator.no_sync(model)


def no_buffer_sync_in_forward(module) -> None:
    """Stop a ``DistributedDataParallel`` wrapper from broadcasting rank 0's buffers in every forward: an in-place
    write that ``torch.func.jvp`` refuses, and needless for a frozen base whose buffers (Wan's RoPE tables, constants)
    are equal on every rank. Set on the wrapper after construction (DDP reads it at each forward: torch >= 2.13 as
    ``forward_sync_buffers``, earlier as ``broadcast_buffers``), so no deprecated constructor argument is passed.
    Anything else: no-op."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        for attr in ("forward_sync_buffers", "broadcast_buffers"):
            if hasattr(module, attr):
                setattr(module, attr, False)
