"""TurboDiffusion checkpoints (thu-ml/TurboDiffusion): int8 block-quantized Linears and SLA projections.

As ``turbodiffusion/inference/modify_model.py`` (``__main__``) writes them: ``torch.save`` of
``net.state_dict()`` without prefix, original Wan names, and

- with ``--attention_type sla|sagesla`` (``replace_attention``): extra keys
  ``blocks.N.self_attn.attn_op.local_attn.proj_l.{weight,bias}`` (fp32), the sparse-linear-attention
  projection. A diffusers or ComfyUI Wan has no such layer, so these are set aside and listed.
- with ``--quant_linear`` (``replace_linear_norm`` -> ``ops.core.Int8Linear``): every Linear in
  the blocks becomes ``int8_weight`` (int8 ``[out, in]``), ``scale`` (fp32
  ``[ceil(out/128), ceil(in/128)]``, one per 128x128 block; the CUDA kernel
  ``ops/quant/quant.hpp`` stores ``amax / 128``) and ``bias`` (the Linear's dtype). The weight is
  ``W[i, j] = int8_weight[i, j] * scale[i // 128, j // 128]``.
- norms replaced by FastRMSNorm/FastLayerNorm keep their ``weight``/``bias`` names.

``merge_models.py`` computes ``Base + w * (Target - DiffBase)``: ``rcm-lora transfer``.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "SLA_MARKER", "is_sla_key", "int8_linears", "dequantize_int8"]

BLOCK = 128
SLA_MARKER = ".attn_op."


def is_sla_key(name: str) -> bool:
    """A sparse-linear-attention tensor (``...self_attn.attn_op.local_attn.proj_l.weight``)."""
    return SLA_MARKER in name


def int8_linears(keys) -> list[str]:
    """Module names ``X`` with both ``X.int8_weight`` and ``X.scale`` among ``keys``."""
    ks = set(keys)
    return sorted(
        k[: -len(".int8_weight")]
        for k in ks
        if k.endswith(".int8_weight") and k[: -len(".int8_weight")] + ".scale" in ks
    )


def dequantize_int8(
    int8_weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``W = int8_weight * scale`` per 128x128 block, one float32 product (correctly rounded), cast to ``dtype``.

    float32 is the precision TurboDiffusion's int8 GEMM applies its block scales in.
    """
    if int8_weight.dtype != torch.int8 or int8_weight.dim() != 2:
        raise ValueError(f"int8_weight must be a 2-D int8 tensor, got {int8_weight.dtype} {tuple(int8_weight.shape)}")
    out_f, in_f = int8_weight.shape
    want = (-(-out_f // BLOCK), -(-in_f // BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"int8 scale of shape {tuple(scale.shape)} does not match weight {(out_f, in_f)}: "
            f"expected one scale per {BLOCK}x{BLOCK} block, {want}"
        )
    s = scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:out_f, :in_f]
    return (int8_weight.float() * s).to(dtype)
