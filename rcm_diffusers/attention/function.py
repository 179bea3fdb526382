"""Functional JVP attention, backend choice, input checks, and the forward-mode AD rule (docs/math.md §5).

``jvp_attention`` is the explicit API: primals and tangents in, ``(O, tO)`` out.
``attention`` is a drop-in ``softmax(scale Q K^T + mask) V`` on ``[B, S, H, D]`` that PyTorch's forward
AD (``torch.func.jvp``, ``torch.autograd.forward_ad``) can differentiate: with no tangent attached
it is plain SDPA; with tangents it runs the fused kernel once through ``_JVPAttention``. Masks follow
SDPA's convention: boolean (``True`` = attend) or additive float, broadcastable to ``[B, H, Lq, Lk]``.

One primal, not two: PyTorch calls an ``autograd.Function``'s ``forward`` (primal) and then its
``jvp`` (tangent). Run naively, ``forward`` would compute ``O`` and ``jvp`` would need ``P`` again, so
the primal would be computed twice. ``attention`` instead reads the tangents off the dual inputs
before ``apply`` and hands them to ``forward`` as extra (non-differentiated) inputs; ``forward``
runs the fused kernel once and ``jvp`` returns the ``tO`` it already has. ``jvp`` checks that the
tangents it receives are the ones ``forward`` used (same storage) and recomputes only if they are not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd import forward_ad

from .torch_backend import jvp_attention_torch

__all__ = ["jvp_attention", "attention", "select_backend", "has_tangent", "mask_bias", "STATS"]

BACKENDS = ("auto", "triton", "torch")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: call counters, read by tests and the benchmark to show the primal runs once per JVP
STATS = {"fused_calls": 0, "jvp_recomputes": 0}


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def select_backend(q: torch.Tensor, backend: str = "auto") -> str:
    """``"triton"`` on CUDA (or under ``TRITON_INTERPRET=1``) when Triton imports and the head dim
    and dtype fit the kernel, else ``"torch"``; an explicit ``backend`` wins."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    fits = 16 <= q.shape[-1] <= 256 and q.dtype != torch.float64
    return "triton" if fits and q.is_cuda and _triton_available() else "torch"


def _check(q, k, v, t_q, t_k, t_v, backend):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, S, H, D]; got {getattr(x, 'shape', type(x))}")
        if x.dtype not in _DTYPES:
            raise ValueError(f"{name} has unsupported dtype {x.dtype}; use one of {_DTYPES}")
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(
                f"q, k, v must share dtype and device; {name} is {x.dtype} on {x.device}, q is {q.dtype} on {q.device}"
            )
    B, _, H, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != H or k.shape[3] != D:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [B={B}, Lk, H={H}, D={D}] like q {tuple(q.shape)}"
        )
    for name, x, t in (("q", q, t_q), ("k", k, t_k), ("v", v, t_v)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.shape != x.shape:
            raise ValueError(
                f"tangent of {name} must have the shape of {name} {tuple(x.shape)}; "
                f"got {tuple(getattr(t, 'shape', ()))}"
            )
        if t.dtype != x.dtype:
            raise ValueError(
                f"tangent of {name} has dtype {t.dtype}, its primal {x.dtype}; cast it, no implicit promotion"
            )
        if t.device != x.device:
            raise ValueError(
                f"tangent of {name} is on {t.device}, its primal on {x.device}; move it to the same device"
            )
    if backend == "triton":
        if not 16 <= D <= 256:
            raise ValueError(f"triton backend supports head dims 16..256, got D={D}; use backend='torch'")
        if q.dtype == torch.float64:
            raise ValueError("triton backend takes float16, bfloat16 or float32; use backend='torch' for float64")
        if not (q.is_cuda or _interpreting()):
            raise ValueError(f"triton backend needs CUDA tensors (or TRITON_INTERPRET=1); got {q.device}")


def _check_mask(attn_mask, q, k) -> None:
    if not isinstance(attn_mask, torch.Tensor):
        raise ValueError(f"attn_mask must be a tensor (boolean or float), got {type(attn_mask).__name__}")
    B, Lq, H, _ = q.shape
    full = (B, H, Lq, k.shape[1])
    shape = tuple(attn_mask.shape)
    if attn_mask.dim() > 4 or any(m not in (1, f) for m, f in zip(shape[::-1], full[::-1])):
        raise ValueError(f"attn_mask of shape {list(shape)} does not broadcast to [B, H, Lq, Lk] = {list(full)}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise ValueError(f"attn_mask must be boolean or floating point (SDPA's convention), got {attn_mask.dtype}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device}, q on {q.device}; move it to the same device")


def mask_bias(attn_mask, q, k):
    """An SDPA attention mask as an additive float32 bias (float64 for float64 ``q``) of at most 4 dims, checked to
    broadcast to ``[B, H, Lq, Lk]`` for ``q`` / ``k`` on ``[B, S, H, D]``: boolean ``True`` = attend (``False`` ->
    ``-inf``), a float mask is added as it is. ``None`` stays ``None``."""
    if attn_mask is None:
        return None
    _check_mask(attn_mask, q, k)
    acc = torch.promote_types(q.dtype, torch.float32)
    if attn_mask.dtype == torch.bool:
        return torch.zeros(attn_mask.shape, dtype=acc, device=attn_mask.device).masked_fill_(~attn_mask, float("-inf"))
    return attn_mask.to(acc)


def jvp_attention(
    q, k, v, t_q=None, t_k=None, t_v=None, scale=None, backend: str = "auto", return_lse: bool = False, attn_mask=None
):
    """``(O, tO)`` with ``O = softmax(S) V``, ``S = scale Q K^T + mask`` and
    ``tO = (P * tS) V - rowsum(P * tS) O + P tV``, ``tS = scale (tQ K^T + Q tK^T)`` (docs/math.md §5).

    Layout ``[B, S, H, D]``; ``Lq`` may differ from ``Lk``; a ``None`` tangent is zero;
    ``scale`` defaults to ``D**-0.5``. ``attn_mask``: boolean (``True`` = attend) or additive float, broadcastable to
    ``[B, H, Lq, Lk]`` (SDPA's convention); a query whose keys are all masked gets ``O = tO = 0``.
    ``return_lse=True`` also returns ``LSE = logsumexp(S)`` ``[B, H, Lq]`` float32, which with ``O`` is what a flash
    backward needs.
    """
    backend = select_backend(q, backend)
    _check(q, k, v, t_q, t_k, t_v, backend)
    bias = mask_bias(attn_mask, q, k)
    STATS["fused_calls"] += 1
    if backend == "triton":
        from .triton_kernel import jvp_attention_triton

        o, t_o, lse = jvp_attention_triton(q, k, v, t_q, t_k, t_v, scale, bias=bias)
    else:
        o, t_o, lse = jvp_attention_torch(q, k, v, t_q, t_k, t_v, scale, bias=bias)
    return (o, t_o, lse) if return_lse else (o, t_o)


def has_tangent(*xs) -> bool:
    """True when any tensor carries a forward-mode tangent (inside ``torch.func.jvp`` or a dual level)."""
    return any(x is not None and forward_ad.unpack_dual(x).tangent is not None for x in xs)


def _sdpa(q, k, v, scale, attn_mask=None):
    """Plain SDPA on ``[B, S, H, D]``."""
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, scale=scale
    )
    return o.transpose(1, 2)


def _same(g, t):
    """Whether the tangent handed to ``jvp`` is the one ``forward`` used (zeros stand in for None)."""
    return t is None or g is t  # PyTorch hands zeros where the dual had no tangent


class _JVPAttention(torch.autograd.Function):
    """Attention whose forward-AD rule is the fused kernel; reverse mode goes through SDPA."""

    @staticmethod
    def forward(q, k, v, t_q, t_k, t_v, scale, backend, attn_mask):
        o, t_o = jvp_attention(q, k, v, t_q, t_k, t_v, scale, backend, attn_mask=attn_mask)
        return o, t_o

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, t_q, t_k, t_v, scale, backend, attn_mask = inputs
        ctx.scale, ctx.backend, ctx.attn_mask = scale, backend, attn_mask
        ctx.save_for_backward(q, k, v)
        ctx.save_for_forward(q, k, v)
        ctx.tangents = (t_q, t_k, t_v)
        ctx.set_materialize_grads(False)
        ctx.t_o = output[1]
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def jvp(ctx, g_q, g_k, g_v, *_):
        t_o = ctx.t_o
        if not all(_same(g, t) for g, t in zip((g_q, g_k, g_v), ctx.tangents)):
            # tangents differ from the ones forward saw (not the path `attention` takes): recompute
            STATS["jvp_recomputes"] += 1
            q, k, v = ctx.saved_tensors
            _, t_o = jvp_attention(q, k, v, g_q, g_k, g_v, ctx.scale, ctx.backend, attn_mask=ctx.attn_mask)
        ctx.t_o = ctx.tangents = None
        return t_o, None

    @staticmethod
    def backward(ctx, g_o, _g_to):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(need) for x, need in zip((q, k, v), ctx.needs_input_grad[:3])]
            o = _sdpa(*leaves, ctx.scale, ctx.attn_mask)
            wrt = [x for x in leaves if x.requires_grad]
            grads = iter(torch.autograd.grad(o, wrt, g_o))
        g = [next(grads) if x.requires_grad else None for x in leaves]
        return (*g, None, None, None, None, None, None)


def attention(q, k, v, scale=None, backend: str = "auto", attn_mask=None):
    """``softmax(scale Q K^T + mask) V`` on ``[B, S, H, D]`` with a forward-AD rule (docs/math.md §5).

    No tangent attached: SDPA, with SDPA's backward. Tangents attached (JVP pass): one fused
    ``jvp_attention`` call gives ``O`` and ``tO``; the primal's backward goes through SDPA;
    tangents themselves are not differentiated (second order is not supported). ``attn_mask`` as SDPA's
    (boolean or additive float, broadcastable to ``[B, H, Lq, Lk]``), a constant: a mask carrying a tangent is refused.
    """
    tangents = [forward_ad.unpack_dual(x).tangent for x in (q, k, v)]
    if all(t is None for t in tangents):
        return _sdpa(q, k, v, scale, attn_mask)
    if attn_mask is not None and has_tangent(attn_mask):
        raise ValueError(
            "JVP attention: the attention mask carries a tangent; a mask must not depend on the differentiated inputs"
        )
    with torch.no_grad():  # validate here, on the caller's tensors, for a clear message
        _check(q, k, v, *tangents, select_backend(q, backend))
        if attn_mask is not None:
            _check_mask(attn_mask, q, k)
    return _JVPAttention.apply(q, k, v, *tangents, scale, backend, attn_mask)[0]
