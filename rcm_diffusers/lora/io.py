"""Save and load LoRA files in the diffusers or the ComfyUI layout, with metadata in the header.

``format="diffusers"``: ``transformer.<module>.lora_A/lora_B.weight`` (+ ``lora_B.bias``), alphas in
diffusers' own ``lora_adapter_metadata`` header entry, so ``pipe.load_lora_weights(file)`` applies
them. ``format="comfyui"``: ``diffusion_model.<original module>.lora_down/lora_up.weight``,
``.alpha``, ``.diff``, ``.diff_b``, as ComfyUI's LoRA loader reads them.
Our own metadata (rank, alpha, target modules, base model, how it was made) is the JSON
header entry ``rcm_lora``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
import tempfile
from collections import Counter
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .keys import comfyui_file_forms, detect_arch, from_any, lora_modules, to_comfy_keys

__all__ = [
    "FORMATS",
    "save_lora",
    "load_lora",
    "lora_problems",
    "architecture_problems",
    "check_lora",
    "read_metadata",
    "diffusers_loadable",
    "dropped_by_stock_diffusers",
    "atomic_save_safetensors",
    "stream_safetensors",
    "not_applied_by_comfyui",
]

logger = logging.getLogger(__name__)
FORMATS = ("diffusers", "comfyui")
METADATA_KEY = "rcm_lora"
DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY


def _check_file_target(path: Path) -> None:
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give a file name such as {path / 'model.safetensors'}")
    if path.parent.exists() and not path.parent.is_dir():
        raise ValueError(f"cannot write {path}: {path.parent} is a file, not a folder")


@contextlib.contextmanager
def atomic_target(path: Path):
    """Yield a temp file path beside ``path``; on success it is ``os.replace``d onto ``path``, on any error
    it is deleted (the target is never half-written)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path, metadata: dict[str, str] | None = None) -> Path:
    """Write a safetensors file via a temp file in the same folder and ``os.replace``."""
    path = Path(path)
    _check_file_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_target(path) as tmp:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
    return path


_ST_NAMES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def stream_safetensors(
    path, specs: list[tuple[str, tuple, torch.dtype]], tensors, metadata: dict | None = None
) -> Path:
    """Write a safetensors file tensor by tensor: header from ``specs`` first, then each tensor's bytes.

    ``specs`` lists ``(name, shape, dtype)`` in file order; ``tensors`` yields ``(name, tensor)`` in
    the same order. Memory: one tensor at a time (``safetensors.torch.save_file`` needs the whole
    dict in RAM, which a 14B model does not fit; this writes the same format: 8-byte little-endian
    header size, JSON header with ``data_offsets``, raw little-endian data). Atomic (temp file +
    ``os.replace``); a mismatch between ``specs`` and ``tensors`` raises and leaves nothing behind.
    """
    path = Path(path)
    _check_file_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header, offset = {}, 0
    for name, shape, dtype in specs:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_target(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            it = iter(tensors)
            for name, shape, dtype in specs:
                got_name, t = next(it)
                if got_name != name or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                    raise RuntimeError(
                        f"stream_safetensors: expected {name} {tuple(shape)} {dtype}, "
                        f"got {got_name} {tuple(t.shape)} {t.dtype}"
                    )
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return path


def _summary(state_dict) -> dict:
    groups = lora_modules(state_dict)
    ranks = {t: g["lora_A.weight"].shape[0] for t, g in groups.items() if "lora_A.weight" in g}
    alphas = {t: float(g["alpha"]) for t, g in groups.items() if "alpha" in g}
    kinds = sorted({re.sub(r"^.*blocks\.\d+\.", "", t) for t in ranks})
    return {
        "rank": Counter(ranks.values()).most_common(1)[0][0] if ranks else None,
        "ranks_min_max": [min(ranks.values()), max(ranks.values())] if ranks else None,
        "alpha": Counter(alphas.values()).most_common(1)[0][0] if alphas else None,
        "target_modules": kinds,
        "n_lora_modules": len(ranks),
        "n_full_deltas": sum(1 for g in groups.values() for k in g if k in ("diff", "diff_b")),
    }


def not_applied_by_comfyui(state_dict, arch: str) -> list[str]:
    """Keys of a ComfyUI-layout dict that stock ComfyUI registers but does not apply (Wan modulation)."""
    if arch != "wan":
        return []
    return sorted(k for k in state_dict if k.endswith(("modulation.diff", "modulation")))


def _zero_lora_biases(tensors: dict) -> None:
    """Give every LoRA module without a ``lora_B.bias`` a zero one, in place. peft's ``lora_bias`` is one switch for
    all modules of an adapter: with it on, a module whose bias is missing from the file keeps an uninitialised
    (meta-device) bias and its forward fails. A zero bias adds exactly nothing."""
    for key in [k for k in tensors if k.endswith(".lora_B.weight")]:
        b = key[: -len("weight")] + "bias"
        if b not in tensors:
            tensors[b] = tensors[key].new_zeros(tensors[key].shape[0])


def dropped_by_stock_diffusers(keys) -> list[str]:
    """The keys of a LoRA file (names as written, any layout) that stock diffusers' ``load_lora_weights`` does not
    apply, sorted: what :func:`diffusers_loadable` leaves out, by name: every full delta ``.diff`` (norms, Wan
    modulation, a ComfyUI file's patch embedding) and each ``.diff_b`` of a module without a LoRA pair. diffusers' Wan
    converter drops them with an INFO (norms: DEBUG) log; ``rcm_diffusers.load_full_lora`` applies them."""
    keys = list(keys)
    paired = {k.rsplit(".", 2)[0] for k in keys if k.endswith((".lora_down.weight", ".lora_A.weight"))}
    return sorted(
        k for k in keys if k.endswith(".diff") or (k.endswith(".diff_b") and k[: -len(".diff_b")] not in paired)
    )


def diffusers_loadable(state_dict, arch: str | None = None):
    """Split any-layout LoRA into what ``load_lora_weights`` applies and what it cannot.

    Returns ``(tensors, adapter_metadata, not_applied)``: ``tensors`` in diffusers names
    (``transformer.`` prefix, ``lora_B.bias`` for bias deltas of LoRA modules), the peft
    ``LoraConfig`` fields for diffusers' ``lora_adapter_metadata`` header (None when every
    alpha equals its rank), and the sorted keys peft cannot load (full deltas of norms,
    modulation, bias deltas of modules without a LoRA).
    """
    arch = arch or detect_arch(state_dict)
    groups = lora_modules(from_any(state_dict, arch))
    tensors, not_applied = {}, []
    ranks, alphas, bias = {}, {}, False
    for t, g in groups.items():
        has_lora = "lora_A.weight" in g
        for k, v in g.items():
            if k in ("lora_A.weight", "lora_B.weight"):
                tensors[f"transformer.{t}.{k}"] = v
            elif k == "diff_b" and has_lora:
                tensors[f"transformer.{t}.lora_B.bias"] = v
                bias = True
            elif k != "alpha":
                not_applied.append(f"transformer.{t}.{k}" if k else f"transformer.{t}")
        if has_lora:
            ranks[t] = g["lora_A.weight"].shape[0]
            alphas[t] = float(g["alpha"]) if "alpha" in g else float(ranks[t])
    if bias:
        _zero_lora_biases(tensors)
    meta = None
    if ranks and (bias or any(alphas[t] != ranks[t] for t in ranks)):
        r = Counter(ranks.values()).most_common(1)[0][0]
        a = Counter(alphas.values()).most_common(1)[0][0]
        meta = {
            "r": r,
            "lora_alpha": a,
            # exact module names (a regex string is full-matched by peft)
            "target_modules": "^(?:" + "|".join(re.escape(t) for t in sorted(ranks)) + ")$",
            "rank_pattern": {f"^{t}": v for t, v in ranks.items() if v != r},
            "alpha_pattern": {f"^{t}": v for t, v in alphas.items() if v != a},
            "lora_bias": bias,
        }
    return tensors, meta, sorted(not_applied)


def save_lora(
    path, state_dict, arch: str | None = None, format: str = "diffusers", metadata: dict | None = None
) -> dict:
    """Write a LoRA (any input layout) as ``format`` to ``path`` atomically; returns the header summary.

    ``metadata`` (e.g. ``{"base_model": ..., "made_by": ...}``) is stored in the ``rcm_lora``
    header entry. Keys the target loader would not apply are dropped from a diffusers file and
    listed (warning + ``not_applied`` in the header); a ComfyUI file keeps them all and lists the
    ones stock ComfyUI ignores.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    arch = arch or detect_arch(state_dict)
    header = {"format": "pt"}
    if format == "comfyui":
        tensors = comfyui_file_forms(to_comfy_keys(state_dict, arch), arch)  # loadable by diffusers too
        not_applied = not_applied_by_comfyui(tensors, arch)
        note = "kept; stock ComfyUI does not apply them (RCMLoraLoader does)"
    else:
        tensors, adapter_meta, not_applied = diffusers_loadable(state_dict, arch)
        if adapter_meta is not None:
            header[DIFFUSERS_METADATA_KEY] = json.dumps(
                {f"transformer.{k}": v for k, v in adapter_meta.items()}, sort_keys=True
            )
        note = "dropped; peft/diffusers cannot load them (use format='comfyui' or merge)"
    if not_applied:
        logger.warning("%d delta(s) %s: %s", len(not_applied), note, ", ".join(not_applied[:10]))
    summary = {
        "arch": arch,
        "format": format,
        **_summary(from_any(state_dict, arch)),
        "not_applied": not_applied,
        **(metadata or {}),
    }
    header[METADATA_KEY] = json.dumps(summary, sort_keys=True, default=str)
    atomic_save_safetensors(tensors, path, header)
    return summary


def lora_problems(state_dict, arch: str | None = None) -> list[str]:
    """What makes a LoRA unusable, whatever the target model (any naming): tensors holding NaN or inf, ``lora_A``
    without ``lora_B`` (or the reverse), rank 0, matrices that are not 2-D (convolutions: trailing 1s), ranks of
    ``lora_A`` and ``lora_B`` that differ, an ``alpha`` that is not one finite number. With ``arch`` ("wan" / "flux")
    and a diffusers-named dict (``load_lora``'s), also the shapes against the target architecture where it is known:
    :func:`architecture_problems`. Empty when usable."""
    bad = sorted(k for k, v in state_dict.items() if v.is_floating_point() and not torch.isfinite(v).all())
    problems = [f"{len(bad)} LoRA tensor(s) hold NaN or inf: {bad[:10]}"] if bad else []
    for target, g in lora_modules(state_dict).items():
        A, B = g.get("lora_A.weight"), g.get("lora_B.weight")
        if A is None and B is None:
            continue
        if A is None or B is None:
            problems.append(f"{target}: lora_A without lora_B (or the reverse); the LoRA file is incomplete")
            continue
        if A.dim() < 2 or B.dim() < 2 or any(d != 1 for d in B.shape[2:]):
            problems.append(
                f"{target}: wrong shapes, lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} must be "
                "matrices [rank, in] and [out, rank]"
            )
        elif A.shape[0] == 0 or B.shape[1] == 0:
            problems.append(f"{target}: rank 0 (lora_A {tuple(A.shape)}, lora_B {tuple(B.shape)}): the LoRA is empty")
        elif A.shape[0] != B.shape[1]:
            problems.append(
                f"{target}: rank mismatch, lora_A {tuple(A.shape)} has rank {A.shape[0]} but "
                f"lora_B {tuple(B.shape)} has {B.shape[1]}"
            )
        if "alpha" in g and (g["alpha"].numel() != 1 or not math.isfinite(float(g["alpha"].reshape(-1)[0]))):
            problems.append(f"{target}: alpha {tuple(g['alpha'].shape)} is not one finite number")
    if arch is not None and not problems:
        problems = architecture_problems(state_dict, arch)
    return problems


@functools.lru_cache(maxsize=None)
def _shipped_shapes(name: str) -> dict[str, tuple[int, ...]]:
    """Parameter shapes (diffusers names) of the shipped architecture ``name``, from a model built on the meta
    device."""
    import diffusers

    from ..arch import arch_config, arch_meta

    with torch.device("meta"):
        model = getattr(diffusers, arch_meta(name)["class_name"])(**arch_config(name))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _fits_in_one_dimension(group: dict, w: tuple) -> bool:
    """The target's output size or (for a matrix) its input width equals the weight's: the model this LoRA is for."""
    if "lora_A.weight" in group and "lora_B.weight" in group:
        out, inp = group["lora_B.weight"].shape[0], math.prod(group["lora_A.weight"].shape[1:])
    else:
        d = next((group[k] for k in ("diff", "weight", "", "scale", "diff_b", "bias") if k in group), None)
        if d is None or d.dim() == 0:
            return True  # nothing shaped to compare (e.g. an alpha alone)
        out, inp = d.shape[0], (math.prod(d.shape[1:]) if d.dim() >= 2 else None)
    return out == w[0] or (inp is not None and len(w) >= 2 and inp == math.prod(w[1:]))


def architecture_problems(state_dict, arch: str) -> list[str]:
    """Mismatches of a diffusers-named LoRA against the architecture it targets, where that is known: a shipped
    architecture of the family ``arch`` (``rcm_diffusers/arch_configs``: Wan 2.1 / 2.2, FLUX.1) that has every target
    and agrees with each in its output size or input width. The LoRA fits when one such architecture takes it whole
    (``keys.model_mismatches``, the check merge and the ComfyUI loader run against a real model); otherwise the lines of
    the closest one, each naming it. Empty when the LoRA fits, or when no shipped architecture is its target (a model
    of another size: then only a model to merge into can tell)."""
    from ..arch import arch_config, arch_names
    from .keys import model_mismatches

    groups = lora_modules(state_dict)
    widths = {d for g in groups.values() for v in g.values() for d in v.shape}
    found = []
    for name in arch_names():
        if not name.startswith(arch):
            continue
        cfg = arch_config(name)
        if cfg.get("num_attention_heads", 0) * cfg.get("attention_head_dim", 0) not in widths:
            continue  # its hidden size appears nowhere in the LoRA: not this model (no model built)
        try:
            shapes = _shipped_shapes(name)
        except (AttributeError, TypeError, ValueError):  # a diffusers without this class or these config keys
            continue
        weights = [shapes.get(f"{t}.weight", shapes.get(f"{t}.scale", shapes.get(t))) for t in groups]
        if any(w is None for w in weights) or not all(
            _fits_in_one_dimension(g, w) for g, w in zip(groups.values(), weights)
        ):
            continue
        problems = model_mismatches(state_dict, shapes)
        if not problems:
            return []
        found.append((len(problems), name, problems))
    if not found:
        return []
    _, name, problems = min(found)
    return [f"{p} in {name}" for p in problems]


def check_lora(state_dict, what: str = "the LoRA", arch: str | None = None) -> None:
    """Raise ValueError naming every problem ``lora_problems`` finds (the same check for convert, merge, inspect,
    extract's output and the trainers' exports; ``arch``: also against the target architecture where known)."""
    problems = lora_problems(state_dict, arch)
    if problems:
        more = f" (+{len(problems) - 10} more)" if len(problems) > 10 else ""
        raise ValueError(f"{what} is broken: " + "; ".join(problems[:10]) + more)


def read_metadata(path) -> dict[str, str]:
    """The raw safetensors header metadata of ``path`` (empty dict when none)."""
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def _alphas_from_adapter_metadata(tensors: dict, raw: str) -> dict:
    cfg = {k.split(".", 1)[1] if k.startswith("transformer.") else k: v for k, v in json.loads(raw).items()}
    out = dict(tensors)
    for key, A in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[: -len(".lora_A.weight")].removeprefix("transformer.")
        alpha = cfg.get("lora_alpha", A.shape[0])
        for pat, v in (cfg.get("alpha_pattern") or {}).items():
            if re.match(rf"(.*\.)?({pat})$", module):
                alpha = v
        out[f"transformer.{module}.alpha"] = torch.tensor(float(alpha))
    for key in list(out):
        if key.endswith(".lora_B.bias"):
            out[key[: -len("lora_B.bias")] + "diff_b"] = out.pop(key)
    return out


def load_comfyui_as_is(path):
    """``(family, state_dict, rcm_metadata)`` of a Qwen-Image, FLUX.2 or HunyuanVideo-1.5 LoRA file
    (:func:`keys.comfyui_as_is_family`; alphas of diffusers' header come back as ``.alpha`` keys), or None for a file
    of any other family. The state dict is in the names stock ComfyUI maps (:func:`keys.comfyui_as_is`: Qwen-Image and
    FLUX.2 keep their diffusers names, HunyuanVideo-1.5 takes ComfyUI's model names with q/k/v fused; ValueError
    listing keys it would not load)."""
    from .keys import comfyui_as_is, comfyui_as_is_family

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"LoRA file not found: {path}")
    meta: dict[str, str] = {}
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{path} is not a readable safetensors file ({e})") from e
        if comfyui_as_is_family(dict.fromkeys(names)) is None:
            return None
        tensors, meta = load_file(str(path)), read_metadata(path)
    else:
        from .checkpoint import load_state_dict

        tensors = load_state_dict(path, unwrap=False)
    family = comfyui_as_is_family(tensors)
    if family is None:
        return None
    if DIFFUSERS_METADATA_KEY in meta:
        tensors = _alphas_from_adapter_metadata(tensors, meta[DIFFUSERS_METADATA_KEY])
    info = json.loads(meta[METADATA_KEY]) if METADATA_KEY in meta else {}
    return family, comfyui_as_is(tensors, family), info


def load_lora(path, format: str = "diffusers", arch: str | None = None):
    """Read a LoRA file of any layout and return ``(state_dict, rcm_metadata)`` in ``format`` names.

    Alphas stored in diffusers' header come back as ``.alpha`` keys; ``.pt`` files go through
    the safe loader. Raises ValueError for a corrupt file or unknown keys.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"LoRA file not found: {path}")
    meta: dict[str, str] = {}
    if path.suffix == ".safetensors":
        try:
            tensors = load_file(str(path))
            meta = read_metadata(path)
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{path} is not a readable safetensors file ({e})") from e
    else:
        from .checkpoint import load_state_dict

        tensors = load_state_dict(path, unwrap=False)
    if DIFFUSERS_METADATA_KEY in meta:
        tensors = _alphas_from_adapter_metadata(tensors, meta[DIFFUSERS_METADATA_KEY])
    arch = arch or detect_arch(tensors)
    out = to_comfy_keys(tensors, arch) if format == "comfyui" else from_any(tensors, arch)
    info = json.loads(meta[METADATA_KEY]) if METADATA_KEY in meta else {}
    return out, info
