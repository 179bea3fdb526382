"""Exact chunked torch backend of the attention JVP (docs/math.md §5), the CPU path and a readable reference.

Queries are processed in chunks of ``chunk`` rows, so the score matrix held at any time is
``[B, H, chunk, Lk]``: memory O(chunk * Lk) instead of O(Lq * Lk). Accumulation is float32
(float64 for float64 inputs); outputs are cast back to the input dtype.
"""

from __future__ import annotations

import torch

__all__ = ["jvp_attention_torch"]


def jvp_attention_torch(q, k, v, t_q=None, t_k=None, t_v=None, scale=None, chunk: int = 1024, bias=None):
    """``(O, tO, LSE)`` for ``O = softmax(scale Q K^T + bias) V`` on ``[B, S, H, D]`` (docs/math.md §5).

    ``tS = scale (tQ K^T + Q tK^T)``, ``tO = (P * tS) V - rowsum(P * tS) O + P tV``,
    ``LSE = logsumexp(S)`` of shape ``[B, H, Lq]`` (float32, or float64 for float64 inputs). A ``None`` tangent counts
    as zero. ``bias``: an additive mask broadcastable to ``[B, H, Lq, Lk]`` (``-inf`` masks a key; a row with every
    key masked gives ``O = tO = 0`` and ``LSE = -inf``, as PyTorch's SDPA).
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    def bhsd(x):  # [B, S, H, D] -> [B, H, S, D] in the accumulation dtype
        return None if x is None else x.transpose(1, 2).to(acc)

    K, V, tK, tV = bhsd(k), bhsd(v), bhsd(t_k), bhsd(t_v)
    if bias is not None:
        bias = bias.to(acc)
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    o_chunks, to_chunks, lse_chunks = [], [], []
    for start in range(0, q.shape[1], chunk):
        Q = bhsd(q[:, start : start + chunk])
        tQ = bhsd(None if t_q is None else t_q[:, start : start + chunk])
        S = scale * (Q @ K.transpose(-1, -2))
        if bias is not None:
            S = S + (bias[:, :, start : start + chunk] if bias.shape[2] > 1 else bias)
        lse = torch.logsumexp(S, dim=-1, keepdim=True)
        P = torch.exp(S - torch.where(torch.isneginf(lse), 0.0, lse))  # a fully masked row: P = 0
        O = P @ V
        tS = torch.zeros_like(S)
        if tQ is not None:
            tS += tQ @ K.transpose(-1, -2)
        if tK is not None:
            tS += Q @ tK.transpose(-1, -2)
        H_ = P * (scale * tS)  # H~ of docs/math.md §5, normalised
        tO = H_ @ V - H_.sum(-1, keepdim=True) * O
        if tV is not None:
            tO = tO + P @ tV
        o_chunks.append(O)
        to_chunks.append(tO)
        lse_chunks.append(lse.squeeze(-1))
    O = torch.cat(o_chunks, dim=2).transpose(1, 2).to(q.dtype)
    tO = torch.cat(to_chunks, dim=2).transpose(1, 2).to(q.dtype)
    lse = torch.cat(lse_chunks, dim=2)  # float32 (float64 for float64 inputs)
    return O, tO, lse
