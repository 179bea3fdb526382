"""Fused FlashAttention-2-style forward of attention and its JVP in one pass (docs/math.md §5).

One program owns BLOCK_M query rows of one (batch, head) and streams the K/V tiles once,
keeping per row the running max ``m`` and the accumulators of docs/math.md §5 (all float32):
``l = sum P~``, ``O~ = P~ V``, ``A~ = P~ tV``, ``r = sum H~``, ``B~ = H~ V`` with ``H~ = P~ * tS``.
Six matrix products per tile: ``Q K^T``, ``tQ K^T``, ``Q tK^T``, ``P~ V``, ``P~ tV``, ``H~ V``
(the tangent products are skipped at compile time when a tangent is absent).
Softmax runs in base 2 (``exp2``) with ``log2(e)`` folded into the score scale. An additive mask (``BIAS``, any
broadcast strides, ``-inf`` masks a key) is added to the scores; a row whose keys are all masked gives ``O = tO = 0``
and ``LSE = -inf``, as PyTorch's SDPA.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["jvp_attention_triton", "interpreting"]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with float32 accumulation. UPCAST: the CPU interpreter multiplies 16-bit floats
    wrongly, so there the operands (already rounded to their dtype) are widened first."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _jvp_attn_fwd(
    Q,
    K,
    V,
    TQ,
    TK,
    TV,
    O,
    TO,
    LSE,
    BIAS,
    sq_b,
    sq_s,
    sq_h,
    stq_b,
    stq_s,
    stq_h,
    sk_b,
    sk_s,
    sk_h,
    stk_b,
    stk_s,
    stk_h,
    sv_b,
    sv_s,
    sv_h,
    stv_b,
    stv_s,
    stv_h,
    so_b,
    so_s,
    so_h,
    sto_b,
    sto_s,
    sto_h,
    sb_b,
    sb_h,
    sb_m,
    sb_n,
    H,
    Lq,
    Lk,
    D,
    scale,
    HAS_TQ: tl.constexpr,
    HAS_TK: tl.constexpr,
    HAS_TV: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Lq
    d_ok = offs_d < D
    qmask = row_ok[:, None] & d_ok[None, :]

    # load the query tile and its tangent once: [BLOCK_M, BLOCK_D]
    q = tl.load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :], mask=qmask, other=0.0)
    if HAS_TQ:
        tq = tl.load(TQ + b * stq_b + h * stq_h + offs_m[:, None] * stq_s + offs_d[None, :], mask=qmask, other=0.0)
    qk_scale = scale * 1.4426950408889634  # log2(e): scores in log2 units for exp2

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # l = sum P~
    r_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # r = sum H~
    acc_o = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # O~ = P~ V
    acc_a = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # A~ = P~ tV
    acc_b = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # B~ = H~ V

    for start_n in range(0, Lk, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < Lk
        kvmask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(K + b * sk_b + h * sk_h + cols[:, None] * sk_s + offs_d[None, :], mask=kvmask, other=0.0)
        v = tl.load(V + b * sv_b + h * sv_h + cols[:, None] * sv_s + offs_d[None, :], mask=kvmask, other=0.0)
        kT = tl.trans(k)

        # scores S = scale Q K^T (log2 units) and tangent tS = scale (tQ K^T + Q tK^T)
        s = _dot(q, kT, IEEE, UPCAST) * qk_scale
        if HAS_BIAS:
            bias = tl.load(
                BIAS + b * sb_b + h * sb_h + offs_m[:, None] * sb_m + cols[None, :] * sb_n,
                mask=row_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            s += bias.to(tl.float32) * 1.4426950408889634
        s = tl.where(col_ok[None, :], s, float("-inf"))
        ts = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if HAS_TQ:
            ts += _dot(tq, kT, IEEE, UPCAST)
        if HAS_TK:
            tk = tl.load(TK + b * stk_b + h * stk_h + cols[:, None] * stk_s + offs_d[None, :], mask=kvmask, other=0.0)
            ts += _dot(q, tl.trans(tk), IEEE, UPCAST)
        ts = ts * scale

        # online softmax: new max, rescale every accumulator by exp(m_old - m_new); a row masked so far keeps
        # m = -inf and takes its exponentials against 0 (all of them 0)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])  # P~ (0 on masked columns)
        hh = p * ts  # H~ = P~ * tS
        l_i = l_i * alpha + tl.sum(p, axis=1)
        r_i = r_i * alpha + tl.sum(hh, axis=1)
        acc_o = acc_o * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, UPCAST)
        acc_b = acc_b * alpha[:, None] + _dot(hh.to(v.dtype), v, IEEE, UPCAST)
        if HAS_TV:
            tv = tl.load(TV + b * stv_b + h * stv_h + cols[:, None] * stv_s + offs_d[None, :], mask=kvmask, other=0.0)
            acc_a = acc_a * alpha[:, None] + _dot(p.to(tv.dtype), tv, IEEE, UPCAST)
        m_i = m_new

    # epilogue: O = O~/l, tO = (A~ + B~)/l - (r/l) O, LSE = m + log l (natural log); l = 0: every key masked
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc_o / l_safe[:, None]
    t_o = (acc_a + acc_b) / l_safe[:, None] - (r_i / l_safe)[:, None] * o
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    tl.store(O + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :], o.to(O.dtype.element_ty), mask=qmask)
    tl.store(
        TO + b * sto_b + h * sto_h + offs_m[:, None] * sto_s + offs_d[None, :], t_o.to(TO.dtype.element_ty), mask=qmask
    )
    tl.store(LSE + pid_bh * Lq + offs_m, lse, mask=row_ok)


def _configs(small_d: bool):
    blocks = [(128, 64), (128, 32), (64, 64), (64, 32)] if small_d else [(64, 32), (64, 16), (32, 32)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bm, bn in blocks
        for w in (4, 8)
        for st in (2, 3)
        if not (bm == 128 and w == 4 and not small_d)
    ]


_AUTOTUNED = {}


def _autotuned(small_d: bool):
    """Autotuned launcher, built on first use on a GPU; key: head dim, lengths bucket, tangents present."""
    if small_d not in _AUTOTUNED:
        _AUTOTUNED[small_d] = triton.autotune(
            configs=_configs(small_d), key=["D", "Lq", "Lk", "HAS_TQ", "HAS_TK", "HAS_TV", "HAS_BIAS", "IEEE", "UPCAST"]
        )(_jvp_attn_fwd)
    return _AUTOTUNED[small_d]


def jvp_attention_triton(q, k, v, t_q=None, t_k=None, t_v=None, scale=None, block=None, bias=None):
    """Fused ``(O, tO, LSE)`` of docs/math.md §5 on ``[B, S, H, D]``; inputs already validated.

    ``bias``: an additive mask broadcastable to ``[B, H, Lq, Lk]`` (read through broadcast strides, not expanded).
    ``block=(BLOCK_M, BLOCK_N)`` fixes the tile (default: autotuned on GPU, 16x16 in the interpreter).
    """
    B, Lq, H, D = q.shape
    Lk = k.shape[1]
    scale = D**-0.5 if scale is None else float(scale)

    def unit_d(x):  # the kernel reads rows with unit stride along D; other strides are free
        return x if x is None or x.stride(-1) == 1 else x.contiguous()

    q, k, v, t_q, t_k, t_v = (unit_d(x) for x in (q, k, v, t_q, t_k, t_v))
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    t_o = torch.empty_like(o)
    lse = torch.empty((B, H, Lq), device=q.device, dtype=torch.float32)
    if bias is not None:
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)).expand(B, H, Lq, Lk)

    def strides(x, like):
        return (x if x is not None else like).stride()[:3]

    args = (
        q,
        k,
        v,
        t_q if t_q is not None else q,
        t_k if t_k is not None else k,
        t_v if t_v is not None else v,
        o,
        t_o,
        lse,
        bias if bias is not None else lse,
        *q.stride()[:3],
        *strides(t_q, q),
        *k.stride()[:3],
        *strides(t_k, k),
        *v.stride()[:3],
        *strides(t_v, v),
        *o.stride()[:3],
        *t_o.stride()[:3],
        *(bias.stride() if bias is not None else (0, 0, 0, 0)),
        H,
        Lq,
        Lk,
        D,
        scale,
    )
    flags = dict(
        HAS_TQ=t_q is not None,
        HAS_TK=t_k is not None,
        HAS_TV=t_v is not None,
        HAS_BIAS=bias is not None,
        IEEE=q.dtype == torch.float32,
        UPCAST=interpreting() and q.dtype != torch.float32,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    if block is None and not interpreting():
        kernel = _autotuned(D <= 128)
        grid = lambda meta: (triton.cdiv(Lq, meta["BLOCK_M"]), B * H)  # noqa: E731
        kernel[grid](*args, **flags)
    else:
        bm, bn = block or (16, 16)
        _jvp_attn_fwd[(triton.cdiv(Lq, bm), B * H)](*args, **flags, BLOCK_M=bm, BLOCK_N=bn)
    return o, t_o, lse
