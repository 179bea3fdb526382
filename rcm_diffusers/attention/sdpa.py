"""Forward-mode AD for ``torch.nn.functional.scaled_dot_product_attention`` calls (docs/math.md §5).

PyTorch's fused SDPA kernels (flash, memory-efficient, cuDNN; the CPU flash kernel) have no forward-AD formula, and
the math backend, which has one, holds the whole ``Lq x Lk`` score matrix. ``JVPAttentionMode`` is a
``TorchFunctionMode``: while it is active, an SDPA call whose query, key or value carries a forward-mode tangent goes
to ``sdpa_jvp``, our fused kernel (Triton on CUDA, chunked torch elsewhere) with SDPA's arguments: boolean or additive
masks, ``is_causal``, ``scale``, ``enable_gqa``; any other call, and every other torch function, runs unchanged.
``enable_jvp_attention`` activates it for the forwards of a model that carry a tangent; ``jvp_attention_mode()`` is
the same for any code.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .function import attention, has_tangent

__all__ = ["JVPAttentionMode", "jvp_attention_mode", "sdpa_jvp"]

_SDPA = F.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_jvp(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    backend: str = "auto",
):
    """``F.scaled_dot_product_attention`` (layout ``[B, H, L, D]``, or ``[B, L, D]``) with the fused JVP rule of
    ``attention``. Refused (``ValueError``, one line): dropout, other ranks, a mask together with ``is_causal``."""
    if dropout_p:
        raise ValueError(f"JVP attention: dropout_p={dropout_p} in a JVP pass; run the model in eval() mode")
    dims = {query.dim(), key.dim(), value.dim()}
    if dims not in ({3}, {4}):
        raise ValueError(
            f"JVP attention takes SDPA's [B, H, L, D] (or [B, L, D]) query, key and value, got "
            f"{list(query.shape)}, {list(key.shape)}, {list(value.shape)}"
        )
    squeeze = dims == {3}
    if squeeze:
        query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(1)
    if is_causal:
        if attn_mask is not None:
            raise ValueError("JVP attention: pass either attn_mask or is_causal=True, not both (as SDPA)")
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
    hq, hk = query.shape[1], key.shape[1]
    if hk != hq:
        if not enable_gqa or hq % hk:
            raise ValueError(
                f"JVP attention: {hq} query heads and {hk} key/value heads (grouped-query attention needs "
                "enable_gqa=True and a head count that divides)"
            )
        key, value = key.repeat_interleave(hq // hk, dim=1), value.repeat_interleave(hq // hk, dim=1)
    out = attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        scale=scale,
        backend=backend,
        attn_mask=attn_mask,
    ).transpose(1, 2)
    return out.squeeze(1) if squeeze else out


class JVPAttentionMode(TorchFunctionMode):
    """While active, SDPA calls whose inputs carry a tangent run ``sdpa_jvp``; ``calls`` counts them."""

    def __init__(self, backend: str = "auto"):
        super().__init__()
        self.backend = backend
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            bound = {**dict(zip(_SDPA_ARGS, args)), **kwargs}
            if has_tangent(bound.get("query"), bound.get("key"), bound.get("value")):
                self.calls += 1
                return sdpa_jvp(**bound, backend=self.backend)
        return func(*args, **kwargs)


@contextlib.contextmanager
def jvp_attention_mode(backend: str = "auto"):
    """Within the block, SDPA calls with tangents (``torch.func.jvp``, ``torch.autograd.forward_ad``) go through the
    fused JVP kernel; yields the ``JVPAttentionMode`` (its ``calls`` counts them)."""
    with JVPAttentionMode(backend) as mode:
        yield mode
