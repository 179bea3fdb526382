"""LightX2V LoRA names: ``.diff_m`` for the modulation delta (besides ``lora_up/down``, ``.diff``, ``.diff_b``).

ModelTC/LightX2V ``tools/extract/lora_extractor.py`` (``_generate_lora_diff_key``) writes
``diffusion_model.<key>`` with ``.weight -> .diff``, ``.bias -> .diff_b`` and
``.modulation -> .diff_m`` (so ``blocks.N.modulation`` becomes ``blocks.N.diff_m`` and
``head.modulation`` becomes ``head.diff_m``); its LoRA pairs are ``lora_down``/``lora_up``
without ``.alpha`` (scale 1). ``lightx2v/utils/lora_loader.py`` (``extract_lora_diffs``) reads
``.diff_m`` back as ``<module>.modulation``. Kijai's standardized files write the same delta
as ``blocks.N.modulation.diff``, the name stock ComfyUI registers (but does not apply).
"""

from __future__ import annotations

__all__ = ["SUFFIX", "lightx2v_to_original"]

SUFFIX = ".diff_m"


def lightx2v_to_original(key: str) -> str:
    """``...blocks.0.diff_m`` -> ``...blocks.0.modulation.diff``; other keys unchanged."""
    if key.endswith(SUFFIX):
        return key[: -len(SUFFIX)] + ".modulation.diff"
    return key
