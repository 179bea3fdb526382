"""Load an rCM student LoRA into a diffusers pipeline in one call, one expert or the Wan 2.2 pair.

``training/rcm.py`` writes a two-expert run as ``pytorch_lora_weights.safetensors`` (the high-noise expert,
``transformer``) plus ``transformer_2/pytorch_lora_weights.safetensors`` (the low-noise expert), and the same under
``ema/``. diffusers loads one LoRA per call (``load_lora_weights(..., load_into_transformer_2=True)`` for the
second expert); :func:`load_rcm_lora` makes the two calls with one adapter name and strength.
"""

from __future__ import annotations

import os

__all__ = ["WEIGHT_NAME", "expert_lora_files", "load_rcm_lora"]

WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def expert_lora_files(path: str) -> dict[str, str]:
    """``{"transformer": file[, "transformer_2": file]}`` of a trainer output folder (or its ``ema/``), or
    ``{"transformer": path}`` for a single ``.safetensors`` file. Raises ``FileNotFoundError`` when nothing is there."""
    if os.path.isfile(path):
        return {"transformer": path}
    high, low = os.path.join(path, WEIGHT_NAME), os.path.join(path, "transformer_2", WEIGHT_NAME)
    if not os.path.isfile(high):
        raise FileNotFoundError(f"{path}: no {WEIGHT_NAME} (a training/rcm.py output folder, its ema/, or a LoRA file)")
    return {"transformer": high, **({"transformer_2": low} if os.path.isfile(low) else {})}


def load_rcm_lora(pipe, path: str, adapter_name: str = "rcm", weight: float = 1.0, reuse_for_both: bool = False) -> dict[str, str]:
    """Load the student LoRA of ``path`` (see :func:`expert_lora_files`) into ``pipe`` under ``adapter_name`` at
    strength ``weight``: a two-expert pair goes to ``transformer`` and ``transformer_2``; a one-network LoRA goes
    to ``transformer``, and on a two-expert pipeline only with ``reuse_for_both=True`` (then into both experts,
    the "one LoRA for both" approach). Returns ``{component: file}`` of what was loaded."""
    files = expert_lora_files(path)
    two_expert_pipe = getattr(pipe, "transformer_2", None) is not None
    if "transformer_2" in files and not two_expert_pipe:
        raise ValueError(f"{path} holds a LoRA per Wan 2.2 expert, but {type(pipe).__name__} has no transformer_2: "
                         "load it into a two-expert pipeline (or load one expert's file with load_lora_weights)")
    if "transformer_2" not in files and two_expert_pipe:
        if not reuse_for_both:
            raise ValueError(f"{path} holds one network's LoRA and {type(pipe).__name__} has two experts: pass "
                             "reuse_for_both=True to apply it to both, or train both experts (training/rcm.py --experts both)")
        files = {"transformer": files["transformer"], "transformer_2": files["transformer"]}
    for component, f in files.items():
        d, name = os.path.split(f)
        pipe.load_lora_weights(d or ".", weight_name=name, adapter_name=adapter_name,
                               **({"load_into_transformer_2": True} if component == "transformer_2" else {}))
    if weight != 1.0:
        pipe.set_adapters([adapter_name], [weight])
    return files
