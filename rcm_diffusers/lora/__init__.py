"""LoRA and checkpoint tooling: key conversion, save/load, SVD extraction, merging, safe loading.

CLI: ``rcm-lora <subcommand>`` or ``python -m rcm_diffusers.lora <subcommand>``.
"""

from .keys import check_against_model, detect_arch, detect_format, from_any, to_comfy_keys, to_diffusers, to_original

__all__ = [
    "check_against_model",
    "detect_arch",
    "detect_format",
    "from_any",
    "to_comfy_keys",
    "to_diffusers",
    "to_original",
]
