"""LoRA extraction from a full fine-tuned checkpoint and its base, by truncated SVD per linear layer.

Streams one parameter pair at a time (memory ~ one layer), with a tqdm bar. For a 2-D weight
``delta = W_ft - W_base = U S V^T``; rank ``r`` keeps ``lora_B = U_r sqrt(S_r)``,
``lora_A = sqrt(S_r) V_r^T`` (alpha = r, scale 1); the report gives the measured relative
Frobenius error ``||delta - B A|| / ||delta||`` (optimum: ``sqrt(sum_{i>r} S_i^2 / sum S_i^2)``).
Every other delta (biases, norms, Wan modulation, the Conv3d patch embedding) is *non-linear* for a
LoRA: kept as a full ``diff``/``diff_b`` or dropped, and reported either way. (The official rCM
checkpoints hold the patch embedding as a 2-D Linear: its delta gets a LoRA, written as peft's
Conv3d LoRA in a diffusers file.) Inputs may be any checkpoint :class:`.checkpoint.CheckpointReader`
reads; the base is renamed into the fine-tuned file's naming tensor by tensor.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterator

import torch
from tqdm.auto import tqdm

from .checkpoint import CheckpointReader, in_layout_of

__all__ = ["TensorSource", "LayerReport", "extract_lora", "choose_rank"]


TensorSource = CheckpointReader  # the former name of the one-tensor-at-a-time reader


@dataclass
class LayerReport:
    name: str  # parameter name in the source layout
    kind: str  # "lora", "diff", "diff_b", "zero", "dropped"
    shape: tuple
    rank: int | None = None
    rel_error: float | None = None  # ||delta - B A||_F / ||delta||_F
    energy: float | None = None  # retained fraction of sum S^2


def choose_rank(S: torch.Tensor, rank: int | None, energy: float | None, max_rank: int | None = None) -> int:
    """Rank from singular values: fixed ``rank``, or the smallest keeping ``energy`` of sum S^2."""
    n = S.numel()
    _check_ranks(rank, max_rank)
    if rank is not None:
        r = min(rank, n)
    elif energy is not None:
        if not 0 < energy <= 1:
            raise ValueError(f"energy must be in (0, 1], got {energy}")
        e = S.double().pow(2)
        frac = e.cumsum(0) / e.sum().clamp_min(1e-300)
        r = int(torch.searchsorted(frac, torch.tensor(energy - 1e-12, dtype=frac.dtype)).item()) + 1
    else:
        raise ValueError("pass rank= or energy=")
    if max_rank is not None:
        r = min(r, max_rank)
    return max(1, min(r, n))


def _check_ranks(rank, max_rank) -> None:
    for name, v in (("rank", rank), ("max_rank", max_rank)):
        if v is not None and (isinstance(v, bool) or int(v) != v or v < 1):
            raise ValueError(f"{name} must be a whole number >= 1, got {v}; e.g. --rank 32")


def _diff_key(name: str) -> tuple[str, str]:
    if name.endswith(".bias"):
        return name[: -len(".bias")], "diff_b"
    if name.endswith(".weight"):
        return name[: -len(".weight")], "diff"
    return name, "diff"


def extract_lora(
    finetuned,
    base,
    rank: int | None = None,
    energy: float | None = None,
    max_rank: int | None = None,
    nonlinear: str = "keep",
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    progress: bool = True,
    prefer: str | None = None,
    oversample: int = 8,
    niter: int = 2,
):
    """LoRA (+ full diffs) of ``finetuned - base``; returns ``(state_dict, [LayerReport])``.

    Inputs are dicts or checkpoint paths in the same layout (either naming); the result uses
    that layout's names with canonical suffixes (``lora_A/lora_B.weight``, ``alpha``, ``diff``,
    ``diff_b``), ready for ``save_lora``. ``nonlinear="keep"|"drop"`` decides for non-2-D deltas.
    Fixed ``rank`` uses a randomized SVD (``rank + oversample`` columns, ``niter`` power
    iterations); ``energy`` needs the full spectrum (exact SVD). The reported error is measured.
    Raises ValueError listing keys or shapes that differ between the two checkpoints.
    """
    if nonlinear not in ("keep", "drop"):
        raise ValueError("nonlinear must be 'keep' or 'drop'")
    _check_ranks(rank, max_rank)
    if rank is None and energy is None:
        raise ValueError("pass rank= or energy=")
    ft, bs = CheckpointReader(finetuned, prefer), CheckpointReader(base, prefer)
    from .keys import detect_arch

    bs = in_layout_of(bs, ft, detect_arch(dict.fromkeys(ft.keys())))
    missing = sorted(set(ft.keys()) ^ set(bs.keys()))
    bad = [f"{k}: {ft.shape(k)} vs {bs.shape(k)}" for k in ft.keys() if k in bs and ft.shape(k) != bs.shape(k)]
    if missing or bad:
        raise ValueError(
            f"fine-tuned and base checkpoints differ: {len(missing)} key(s) in only one "
            f"({missing[:10]}), {len(bad)} shape mismatch(es) ({bad[:10]})"
        )
    out: dict[str, torch.Tensor] = {}
    report: list[LayerReport] = []
    for name in tqdm(ft.keys(), desc="extract", disable=not progress, unit="layer"):
        w_ft = ft[name]
        out_dtype = dtype or w_ft.dtype
        delta = w_ft.to(device=device, dtype=torch.float32) - bs[name].to(device=device, dtype=torch.float32)
        shape = tuple(delta.shape)
        if not torch.any(delta):
            report.append(LayerReport(name, "zero", shape))
            continue
        if delta.dim() == 2 and name.endswith(".weight"):
            total = float(delta.double().pow(2).sum())
            if rank is not None and rank + oversample < min(shape):
                # fixed rank: randomized SVD on a (rank + oversample)-dim range; exact for rank <= rank
                U, S, V = torch.svd_lowrank(delta, q=rank + oversample, niter=niter)
                Vh = V.T
            else:
                U, S, Vh = torch.linalg.svd(delta, full_matrices=False)
            r = choose_rank(S, rank, energy, max_rank)
            root = S[:r].sqrt()
            target = name[: -len(".weight")]
            B = U[:, :r] * root
            A = root[:, None] * Vh[:r]
            out[f"{target}.lora_B.weight"] = B.to(out_dtype).contiguous()
            out[f"{target}.lora_A.weight"] = A.to(out_dtype).contiguous()
            out[f"{target}.alpha"] = torch.tensor(float(r), dtype=out_dtype)
            resid = float((delta - B @ A).double().pow(2).sum())  # measured, not estimated
            rel = math.sqrt(resid / total) if total > 0 else 0.0
            kept = total - resid
            report.append(LayerReport(name, "lora", shape, r, rel, kept / total if total > 0 else 1.0))
        elif nonlinear == "keep":
            target, kind = _diff_key(name)
            out[f"{target}.{kind}"] = delta.to(out_dtype)
            report.append(LayerReport(name, kind, shape))
        else:
            report.append(LayerReport(name, "dropped", shape))
    return out, report


def report_table(report: list[LayerReport]) -> list[dict]:
    """The report as JSON-ready dicts."""
    return [asdict(r) for r in report]


def iter_pairs(finetuned, base) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, finetuned tensor, base tensor) one pair at a time, for streaming tools."""
    ft, bs = CheckpointReader(finetuned), CheckpointReader(base)
    for k in ft.keys():
        if k in bs:
            yield k, ft[k], bs[k]
