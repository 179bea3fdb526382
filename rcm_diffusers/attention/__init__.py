"""JVP-capable attention for diffusers transformers (docs/math.md §5).

``jvp_attention`` computes attention and its tangent in one fused pass (Triton on CUDA, an exact
chunked torch path elsewhere); ``enable_jvp_attention(transformer)`` makes ``torch.func.jvp`` work through
any unmodified diffusers transformer whose attention reaches PyTorch's ``scaled_dot_product_attention``
(its JVP passes run under ``JVPAttentionMode``, which routes those calls through the fused kernel).
"""

from .function import attention, has_tangent, jvp_attention, select_backend
from .processors import check_jvp_servable, disable_jvp_attention, enable_jvp_attention, time_embedding_fp32
from .sdpa import JVPAttentionMode, jvp_attention_mode, sdpa_jvp

__all__ = [
    "jvp_attention",
    "attention",
    "select_backend",
    "has_tangent",
    "enable_jvp_attention",
    "disable_jvp_attention",
    "check_jvp_servable",
    "JVPAttentionMode",
    "jvp_attention_mode",
    "sdpa_jvp",
    "time_embedding_fp32",
]
