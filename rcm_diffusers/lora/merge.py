"""Merge a LoRA or a full delta into a model: ``W = W_base + w * delta``.

Includes the T2V -> I2V transfer ``I2V_rcm = I2V_base + w * (T2V_rcm - T2V_base)`` (only
layers present in both with equal shapes; I2V-only layers untouched and listed) and the
two-expert Wan 2.2 case (one delta per expert). Output: a diffusers model folder or a
ComfyUI single file (original names).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .extract import TensorSource
from .io import atomic_save_safetensors
from .keys import detect_arch, detect_format, lora_modules, to_diffusers, to_original

__all__ = ["merge_lora", "merge_delta", "merge_experts", "save_model"]


def _to_layout(delta, like: dict, arch: str) -> dict:
    """Rename ``delta`` into the naming of the model dict ``like`` (no prefix)."""
    if detect_format(like) == "original":
        return to_original(delta, arch, prefix="", lora_names=("lora_A", "lora_B"))
    return to_diffusers(delta, arch, prefix="")


def merge_lora(base: dict, lora: dict, weight: float = 1.0, arch: str | None = None,
               on_missing: str = "error") -> tuple[dict, list[str]]:
    """``base`` + ``weight`` * (LoRA ``alpha/r B A``, ``diff``, ``diff_b``) as a new dict; base dtype kept.

    ``lora`` may use either naming; it is renamed to the base's. ``on_missing="error"`` raises
    ValueError listing targets absent from the base or of another shape; ``"skip"`` skips and
    returns them (second item).
    """
    arch = arch or detect_arch(base)
    if detect_arch(lora) != arch:
        raise ValueError(f"the LoRA is for {detect_arch(lora)!r} but the model is {arch!r}")
    groups = lora_modules(_to_layout(lora, base, arch))
    out = dict(base)
    skipped, problems = [], []
    for target, g in groups.items():
        if "lora_A.weight" in g:
            key = f"{target}.weight"
            if key not in base:
                problems.append(f"{target}: not in the base model")
                continue
            A, B = g["lora_A.weight"].float(), g["lora_B.weight"].float()
            if (B.shape[0], A.shape[1]) != tuple(base[key].shape):
                problems.append(f"{target}: LoRA {(B.shape[0], A.shape[1])} vs weight {tuple(base[key].shape)}")
                continue
            scale = float(g["alpha"]) / A.shape[0] if "alpha" in g else 1.0
            out[key] = (base[key].float() + (weight * scale) * (B @ A)).to(base[key].dtype)
        for kind, d in g.items():
            if kind not in ("diff", "diff_b", "scale"):
                continue
            if kind == "diff_b":
                key = f"{target}.bias"
            else:
                key = next((k for k in (f"{target}.weight", f"{target}.scale", target) if k in base), None)
            if key is None or key not in base:
                problems.append(f"{target}.{kind}: not in the base model")
            elif tuple(d.shape) != tuple(base[key].shape):
                problems.append(f"{target}.{kind}: {tuple(d.shape)} vs {tuple(base[key].shape)}")
            else:
                out[key] = (out[key].float() + weight * d.float()).to(base[key].dtype)
    if problems:
        if on_missing == "error":
            raise ValueError(f"{len(problems)} delta(s) do not match the base model: " + "; ".join(problems[:20]))
        skipped = problems
    return out, skipped


def merge_delta(base, finetuned, finetuned_base, weight: float = 1.0, progress: bool = True):
    """``base + weight * (finetuned - finetuned_base)`` on the parameters the three share with equal shapes.

    The T2V -> I2V transfer: ``base`` = I2V base, ``finetuned``/``finetuned_base`` = T2V rCM and
    T2V base (dicts or checkpoint paths, same naming as ``base``). Returns ``(merged, untouched)``:
    untouched = base parameters left as they were (I2V-only layers, shape mismatches such as the
    patch embedding). Streams the two T2V checkpoints one tensor at a time.
    """
    b = TensorSource(base)
    ft, fb = TensorSource(finetuned), TensorSource(finetuned_base)
    merged, untouched = {}, []
    for k in tqdm(b.keys(), desc="merge", disable=not progress, unit="layer"):
        w = b[k]
        if k in ft and k in fb and ft.shape(k) == tuple(w.shape) == fb.shape(k):
            merged[k] = (w.float() + weight * (ft[k].float() - fb[k].float())).to(w.dtype)
        else:
            merged[k] = w
            untouched.append(k)
    only_ft = sorted(set(ft.keys()) - set(b.keys()))
    if len(only_ft) == len(ft.keys()):
        raise ValueError("no parameter names in common: are both checkpoints in the same naming? "
                         f"(e.g. {only_ft[:3]} vs {b.keys()[:3]})")
    return merged, untouched


def merge_experts(bases: dict[str, dict], deltas: dict[str, dict], weight: float = 1.0,
                  arch: str = "wan") -> dict[str, dict]:
    """Wan 2.2 A14B: merge one LoRA per expert (``{"transformer": ..., "transformer_2": ...}``).

    A single LoRA dict holding ``transformer.`` and ``transformer_2.`` keys may be passed under
    both names; each expert takes its own prefix. Raises ValueError when an expert has no delta.
    """
    out = {}
    for name, base in bases.items():
        d = deltas.get(name)
        if d is None:
            raise ValueError(f"no delta for expert {name!r}; got {sorted(deltas)}")
        own = {k[len(name) + 1:]: v for k, v in d.items() if k.startswith(name + ".")}
        out[name] = merge_lora(base, own or d, weight, arch)[0]
    return out


def save_model(state_dict: dict, out, layout: str = "diffusers", arch: str | None = None,
               config: dict | None = None) -> Path:
    """Write a diffusers model folder (``diffusion_pytorch_model.safetensors`` + ``config.json``)
    or a ComfyUI single file (original names); atomic. ``state_dict`` may use either naming."""
    arch = arch or detect_arch(state_dict)
    out = Path(out)
    if layout == "comfyui":
        return atomic_save_safetensors(to_original(state_dict, arch, prefix=""), out, {"format": "pt"})
    if layout != "diffusers":
        raise ValueError(f"layout must be 'diffusers' or 'comfyui', got {layout!r}")
    out.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(to_diffusers(state_dict, arch, prefix=""), out / "diffusion_pytorch_model.safetensors",
                            {"format": "pt"})
    if config is not None:
        tmp = out / ".config.json.tmp"
        tmp.write_text(json.dumps(dict(config), indent=2, sort_keys=True, default=str))
        tmp.replace(out / "config.json")
    return out
