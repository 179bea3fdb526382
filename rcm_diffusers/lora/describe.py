"""``rcm-lora inspect``: what a LoRA or checkpoint file is, named by the layout family that wrote it."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .checkpoint import CheckpointReader, describe
from .keys import detect_arch, detect_format

__all__ = ["lora_layout", "inspect_file"]

_LORA_MARKERS = (".lora_A.", ".lora_B.", ".lora_down.", ".lora_up.", ".alpha", ".diff", ".diff_b", ".diff_m")


def _is_lora(keys) -> bool:
    return any(k.startswith("lora_unet_") or any(m in k + "." for m in _LORA_MARKERS) for k in keys)


def lora_layout(keys) -> str:
    """The family a LoRA's key names come from (kohya, LightX2V, Kijai, ComfyUI, diffusers)."""
    keys = list(keys)
    if any(k.startswith("lora_unet_") for k in keys):
        return "kohya/musubi-tuner (lora_unet_*)"
    if any(k.endswith(".diff_m") for k in keys):
        return "LightX2V (diffusion_model.*, .diff_m modulation deltas)"
    if detect_format(dict.fromkeys(keys)) == "original":
        kijai = any(k.endswith(".modulation.diff") for k in keys)
        return "ComfyUI / original Wan-Flux names (diffusion_model.*)" + (
            "; modulation deltas as .modulation.diff (Kijai-standardized)" if kijai else ""
        )
    return "diffusers/peft (transformer.*, lora_A/lora_B)"


def _lora_counts(out: dict, sd: dict) -> None:
    from .keys import lora_modules

    groups = lora_modules(sd)
    out["n_lora_modules"] = sum("lora_A.weight" in g for g in groups.values())
    out["n_full_deltas"] = sum(k in ("diff", "diff_b") for g in groups.values() for k in g)
    out["ranks"] = dict(Counter(g["lora_A.weight"].shape[0] for g in groups.values() if "lora_A.weight" in g))


def inspect_file(path, prefer: str | None = None) -> dict:
    """Layout, architecture, dtypes, prefixes, networks/EMA and metadata of a LoRA or checkpoint.

    A LoRA is fully validated (every key must be explained: ValueError lists those that are not).
    """
    from .io import load_comfyui_as_is, load_lora, lora_problems, read_metadata

    path = Path(path)
    reader = CheckpointReader(path, prefer)
    out = describe(reader)
    raw = reader.raw_keys()
    if _is_lora(raw):
        out["kind"] = "LoRA"
        as_is = load_comfyui_as_is(path)
        if as_is is not None:  # Qwen-Image, FLUX.2, HunyuanVideo-1.5: rcm-lora's ComfyUI file of the family
            family, sd, _ = as_is
            out["layout"] = lora_layout(raw)
            out["arch"] = family
            out["comfyui"] = (
                "stock LoraLoader maps every key of rcm-lora convert --format comfyui's file (ComfyUI's model names, "
                "q/k/v fused, .alpha)"
                if family == "hunyuan_video15"
                else "stock LoraLoader maps every key (rcm-lora convert --format comfyui adds .alpha)"
            )
            if path.suffix == ".safetensors":
                out["metadata"] = {k: (json.loads(v) if k == "rcm_lora" else v) for k, v in read_metadata(path).items()}
            _lora_counts(out, sd)
            out["problems"] = lora_problems(sd)
            return out
        out["layout"] = lora_layout(raw)
        out["arch"] = detect_arch(dict.fromkeys(raw))
        if path.suffix == ".safetensors":
            out["metadata"] = {k: (json.loads(v) if k == "rcm_lora" else v) for k, v in read_metadata(path).items()}
        sd, _ = load_lora(path)  # validates every key
        _lora_counts(out, sd)
        out["problems"] = lora_problems(sd, out["arch"])  # what convert refuses (inspect warns)
        return out
    out["kind"] = "model checkpoint"
    names = dict.fromkeys(reader.keys())
    out["arch"] = detect_arch(names)
    fmt = detect_format(names)
    if len(reader.info.get("networks", [])) >= 2:
        out["layout"] = "official rCM training dump (net./net_ema./net_fake_score.)"
    elif reader.info.get("dequantized_int8") or reader.info.get("set_aside"):
        out["layout"] = (
            "TurboDiffusion (original Wan names"
            + (", int8 block-quantized Linears" if reader.info.get("dequantized_int8") else "")
            + (", SLA projections" if reader.info.get("set_aside") else "")
            + ")"
        )
    elif fmt == "original" and "net" in reader.info.get("networks", []):
        out["layout"] = "official rCM (net.*, e.g. dcp_to_pth output)"
    else:
        out["layout"] = "diffusers" if fmt == "diffusers" else "original Wan/Flux names (ComfyUI single file)"
    return out
