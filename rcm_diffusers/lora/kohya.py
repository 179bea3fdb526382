"""kohya / musubi-tuner LoRA names: ``lora_unet_<module with dots as underscores>.lora_down.weight``.

kohya-ss/musubi-tuner ``networks/lora.py`` (``LoRANetwork.create_modules``) names each LoRA module
``f"{prefix}.{original_name}".replace(".", "_")`` with prefix ``lora_unet`` and the *original* Wan
(``networks/lora_wan.py``: Linears inside ``WanAttentionBlock``) or BFL Flux module names
(``networks/lora_flux.py``: ``DoubleStreamBlock``/``SingleStreamBlock``), and stores
``.lora_down.weight``, ``.lora_up.weight`` and ``.alpha``. Wan-Fun files write ``lora_unet__``
(ComfyUI's ``comfy/lora_convert.py`` ``convert_lora_wan_fun`` folds the extra underscore).

Underscores are ambiguous (``self_attn_q``), so names are matched against the known original
module names of both architectures; a name no rule explains is left as it is, and the key
converter then lists it as unknown.
"""

from __future__ import annotations

import re
from functools import lru_cache

from .names import FLUX_FUSED, FLUX_PAIRS, WAN_PAIRS

__all__ = ["PREFIX", "is_kohya_key", "kohya_to_original"]

PREFIX = "lora_unet_"


def is_kohya_key(key: str) -> bool:
    return key.startswith(PREFIX)


@lru_cache(maxsize=1)
def _patterns() -> list[tuple[re.Pattern, str]]:
    templates = {o for _, o in WAN_PAIRS} | {o for _, o in FLUX_PAIRS} | {f for f, _ in FLUX_FUSED}
    out = []
    for t in sorted(templates, key=len, reverse=True):
        rx = re.escape(t.replace(".", "_")).replace(re.escape("{i}"), r"(?P<i>\d+)")
        out.append((re.compile("^" + rx + "$"), t))
    return out


@lru_cache(maxsize=None)
def _module(name: str) -> str | None:
    for rx, t in _patterns():
        m = rx.match(name)
        if m:
            return t.replace("{i}", m.group("i")) if "i" in m.groupdict() else t
    return None


def kohya_to_original(key: str) -> str:
    """``lora_unet_blocks_0_self_attn_q.lora_down.weight`` -> ``diffusion_model.blocks.0.self_attn.q.lora_down.weight``.

    Keys that are not kohya names, or whose module no rule explains, come back unchanged.
    """
    if not is_kohya_key(key):
        return key
    body = key[len(PREFIX) :].lstrip("_")  # Wan-Fun: lora_unet__blocks_...
    name, dot, rest = body.partition(".")
    module = _module(name)
    if module is None:
        return key
    return f"diffusion_model.{module}{dot}{rest}"
