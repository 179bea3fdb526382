"""JVP-capable attention for diffusers transformers (docs/math.md §5).

``jvp_attention`` computes attention and its tangent in one fused pass (Triton on CUDA, an exact
chunked torch path elsewhere); ``enable_jvp_attention(transformer)`` installs processors that make
``torch.func.jvp`` work through unmodified diffusers Wan and Flux transformers.
"""

from .function import attention, has_tangent, jvp_attention, select_backend
from .processors import (
    FluxJVPAttnProcessor,
    WanJVPAttnProcessor,
    disable_jvp_attention,
    enable_jvp_attention,
    time_embedding_fp32,
)

__all__ = [
    "jvp_attention",
    "attention",
    "select_backend",
    "has_tangent",
    "enable_jvp_attention",
    "disable_jvp_attention",
    "WanJVPAttnProcessor",
    "FluxJVPAttnProcessor",
    "time_embedding_fp32",
]
