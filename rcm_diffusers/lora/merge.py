"""Merge a LoRA or a full delta into a model: ``W = W_base + w * delta``, streamed to disk.

Includes the T2V -> I2V transfer ``I2V_rcm = I2V_base + w * (T2V_rcm - T2V_base)`` (only
layers present in both with equal shapes; I2V-only layers untouched and listed; TurboDiffusion's
``merge_models.py`` computes the same) and the two-expert Wan 2.2 case (one delta per expert).
Output: a diffusers model folder (sharded above ``max_shard_size``) or a ComfyUI single file
(original names). ``merge_lora_to``/``merge_delta_to`` read the base one tensor at a time and
write each merged tensor as soon as it is made, so memory stays near one layer (measured in
docs/benchmarks.md); ``merge_lora``/``merge_delta`` are the in-memory versions for dicts.
The patch embedding's official-rCM Linear form and the Conv3d form meet by an exact reshape.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .checkpoint import CheckpointReader, in_layout_of
from .io import atomic_target, check_lora, stream_safetensors
from .keys import _FUSED_FROM, _split, detect_arch, detect_format, lora_modules, to_diffusers, to_original
from .rcm_official import is_patch_embedding

__all__ = [
    "merge_lora",
    "merge_delta",
    "merge_experts",
    "save_model",
    "merge_lora_to",
    "merge_delta_to",
    "LoraDelta",
    "DeltaTransfer",
    "convert_checkpoint",
]

DEFAULT_MAX_SHARD = 10 * 2**30  # diffusers' default max_shard_size, "10GB"


def _check_weight(weight: float) -> float:
    if not math.isfinite(float(weight)):
        raise ValueError(f"weight must be a finite number, got {weight}; use e.g. --weight 1.0")
    return float(weight)


def _to_layout(delta, like_keys, arch: str) -> dict:
    """Rename ``delta`` into the naming of the model keys ``like_keys`` (no prefix)."""
    if detect_format(dict.fromkeys(like_keys)) == "original":
        return to_original(delta, arch, prefix="", lora_names=("lora_A", "lora_B"))
    return to_diffusers(delta, arch, prefix="")


def _fit(d: torch.Tensor, shape: tuple, key: str) -> torch.Tensor | None:
    """``d`` in the weight's shape: equal, or the patch embedding's Linear/Conv3d forms (same numel)."""
    if tuple(d.shape) == tuple(shape):
        return d
    if is_patch_embedding(key) and d.numel() == math.prod(shape):
        return d.reshape(shape)
    return None


class LoraDelta:
    """A LoRA (``alpha/r B A``, ``diff``, ``diff_b``) checked against a base's names/shapes, applied per tensor.

    ``shapes``: base parameter name -> shape. Raises ValueError for non-finite LoRA tensors, A/B
    rank mismatches, and (``on_missing="error"``) targets absent from the base or of another
    shape; ``skipped`` lists those skipped with ``on_missing="skip"``.
    """

    def __init__(
        self, lora: dict, shapes: dict, weight: float = 1.0, arch: str | None = None, on_missing: str = "error"
    ):
        self.weight = _check_weight(weight)
        arch = arch or detect_arch(dict.fromkeys(shapes))
        if detect_arch(lora) != arch:
            raise ValueError(f"the LoRA is for {detect_arch(lora)!r} but the model is {arch!r}")
        renamed = _to_layout(lora, shapes, arch)
        check_lora(renamed, "the LoRA file (nothing was merged)")
        self.by_key: dict[str, list] = {}
        problems = []
        for target, g in lora_modules(renamed).items():
            if "lora_A.weight" in g or "lora_B.weight" in g:
                A, B = g.get("lora_A.weight"), g.get("lora_B.weight")
                key = f"{target}.weight"
                if key not in shapes:
                    problems.append(f"{target}: not in the base model")
                elif (B.shape[0], math.prod(A.shape[1:])) != (shapes[key][0], math.prod(shapes[key][1:])):
                    problems.append(
                        f"{target}: LoRA {(B.shape[0], math.prod(A.shape[1:]))} vs weight {tuple(shapes[key])}"
                    )
                else:
                    scale = float(g["alpha"]) / A.shape[0] if "alpha" in g else 1.0
                    self.by_key.setdefault(key, []).append(("lora", scale, A, B))
            for kind, d in g.items():
                if kind not in ("diff", "diff_b", "scale"):
                    continue
                if kind == "diff_b":
                    key = f"{target}.bias"
                else:
                    key = next((k for k in (f"{target}.weight", f"{target}.scale", target) if k in shapes), None)
                if key is None or key not in shapes:
                    problems.append(f"{target}.{kind}: not in the base model")
                elif _fit(d, shapes[key], key) is None:
                    problems.append(f"{target}.{kind}: {tuple(d.shape)} vs {tuple(shapes[key])}")
                else:
                    self.by_key.setdefault(key, []).append(("diff", 1.0, d, None))
        self.skipped = []
        if problems:
            if on_missing == "error":
                raise ValueError(f"{len(problems)} delta(s) do not match the base model: " + "; ".join(problems[:20]))
            self.skipped = problems

    def __call__(self, key: str, w: torch.Tensor) -> torch.Tensor:
        """``w + weight * delta`` for parameter ``key`` (computed in float32, returned in ``w``'s dtype)."""
        parts = self.by_key.get(key)
        if not parts:
            return w
        out = w.float()  # a copy when w is not float32: updated in place below (memory: ~2 copies of w)
        if out is w:
            out = out.clone()
        for kind, scale, a, b in parts:
            if kind == "lora":  # out += weight * scale * B @ A, without a separate product tensor
                out.view(out.shape[0], -1).addmm_(b.float().flatten(1), a.float().flatten(1), alpha=self.weight * scale)
            else:
                out.add_(_fit(a.float(), tuple(w.shape), key), alpha=self.weight * scale)
        return out.to(w.dtype)


class DeltaTransfer:
    """``w + weight * (finetuned - finetuned_base)`` per parameter, the T2V -> I2V transfer.

    ``finetuned``/``finetuned_base``: readers renamed into the base naming. Parameters missing
    from either, or of another shape (beyond the patch embedding's Linear/Conv3d forms), are
    left as they are and listed in ``untouched``. A non-finite delta raises.
    """

    def __init__(self, finetuned, finetuned_base, weight: float = 1.0):
        self.ft, self.fb, self.weight = finetuned, finetuned_base, _check_weight(weight)
        self.untouched: list[str] = []

    def __call__(self, key: str, w: torch.Tensor) -> torch.Tensor:
        shape = tuple(w.shape)
        if key in self.ft and key in self.fb and self.ft.shape(key) == self.fb.shape(key):
            t = self.ft[key]
            d = t.float()
            if d is t:
                d = d.clone()
            d = _fit(d.sub_(self.fb[key].float()), shape, key)
            if d is not None:
                if not torch.isfinite(d).all():
                    raise ValueError(f"{key}: finetuned - finetuned_base holds NaN or inf; nothing was written")
                return d.mul_(self.weight).add_(w.float()).to(w.dtype)
        self.untouched.append(key)
        return w


def merge_lora(
    base: dict, lora: dict, weight: float = 1.0, arch: str | None = None, on_missing: str = "error"
) -> tuple[dict, list[str]]:
    """``base`` + ``weight`` * (LoRA ``alpha/r B A``, ``diff``, ``diff_b``) as a new dict; base dtype kept.

    ``lora`` may use either naming; it is renamed to the base's. ``on_missing="error"`` raises
    ValueError listing targets absent from the base or of another shape; ``"skip"`` skips and
    returns them (second item). Non-finite weights or LoRA tensors and rank mismatches raise.
    """
    delta = LoraDelta(lora, {k: tuple(v.shape) for k, v in base.items()}, weight, arch, on_missing)
    return {k: delta(k, v) for k, v in base.items()}, delta.skipped


def merge_delta(base, finetuned, finetuned_base, weight: float = 1.0, progress: bool = True):
    """``base + weight * (finetuned - finetuned_base)`` on the parameters the three share with equal shapes.

    Inputs: dicts, checkpoint files or diffusers folders (the T2V pair is renamed into the base's
    naming). Returns ``(merged, untouched)``: untouched = base parameters left as they were
    (I2V-only layers, shape mismatches such as the 16- vs 36-channel patch embedding).
    """
    b = base if isinstance(base, (CheckpointReader,)) else CheckpointReader(base)
    transfer = _transfer(b, finetuned, finetuned_base, weight)
    merged = {k: transfer(k, b[k]) for k in tqdm(b.keys(), desc="merge", disable=not progress, unit="layer")}
    return merged, transfer.untouched


def _transfer(b, finetuned, finetuned_base, weight) -> DeltaTransfer:
    arch = detect_arch(dict.fromkeys(b.keys()))
    ft = in_layout_of(CheckpointReader(finetuned), b, arch)
    fb = in_layout_of(CheckpointReader(finetuned_base), b, arch)
    if not set(ft.keys()) & set(b.keys()):
        raise ValueError(
            "no parameter names in common between the base and the fine-tuned checkpoint "
            f"(e.g. {list(ft.keys())[:3]} vs {list(b.keys())[:3]})"
        )
    return DeltaTransfer(ft, fb, weight)


def merge_experts(
    bases: dict[str, dict], deltas: dict[str, dict], weight: float = 1.0, arch: str = "wan"
) -> dict[str, dict]:
    """Wan 2.2 A14B: merge one LoRA per expert (``{"transformer": ..., "transformer_2": ...}``).

    A single LoRA dict holding ``transformer.`` and ``transformer_2.`` keys may be passed under
    both names; each expert takes its own prefix. Raises ValueError when an expert has no delta.
    """
    out = {}
    for name, base in bases.items():
        d = deltas.get(name)
        if d is None:
            raise ValueError(f"no delta for expert {name!r}; got {sorted(deltas)}")
        own = {k[len(name) + 1 :]: v for k, v in d.items() if k.startswith(name + ".")}
        out[name] = merge_lora(base, own or d, weight, arch)[0]
    return out


# ----------------------------------------------------------------------------- streamed output


def _units(keys: list[str], arch: str, src_format: str, layout: str) -> list[list[str]]:
    """Base keys grouped so each group converts on its own: one module (weight with bias), and Flux's
    q/k/v(/mlp) members together when they fuse into one original layer."""
    if arch != "flux":
        return [[k] for k in keys]
    groups: dict[str, list[str]] = {}
    for k in keys:
        unit, _ = _split(k)
        if src_format == "diffusers" and layout == "comfyui":
            for _, fused_t, member_res, _ in _FUSED_FROM:
                m = next((mre.match(unit) for mre in member_res if mre.match(unit)), None)
                if m:
                    unit = fused_t.replace("{i}", m.group("i"))
                    break
        groups.setdefault(unit, []).append(k)
    return list(groups.values())


def _convert(sd: dict, arch: str, layout: str, source: str) -> dict:
    if layout == "comfyui":
        return to_original(sd, arch, prefix="", source=source)
    return to_diffusers(sd, arch, prefix="", source=source)


def _write_streamed(
    reader, fn, out, layout: str, arch: str, config: dict | None, max_shard_size: int, progress: bool
) -> Path:
    """Apply ``fn(key, tensor)`` to every tensor of ``reader`` and write ``layout`` output, one unit at a time."""
    if layout not in ("diffusers", "comfyui", "rcm"):
        raise ValueError(f"layout must be 'diffusers', 'comfyui' or 'rcm', got {layout!r}")
    out = Path(out)
    keys = reader.keys()
    src_format = detect_format(dict.fromkeys(keys))
    if layout == "rcm":
        return _write_rcm(reader, fn, out, arch, src_format, progress)
    units = _units(keys, arch, src_format, layout)
    specs = []
    for unit in units:  # output names/shapes from a conversion of meta tensors
        meta = _convert(
            {k: torch.empty(reader.shape(k), dtype=reader.dtype(k), device="meta") for k in unit},
            arch,
            layout,
            src_format,
        )
        specs += [(n, tuple(t.shape), t.dtype) for n, t in meta.items()]

    def tensors():
        for unit in tqdm(units, desc="merge", disable=not progress, unit="layer"):
            yield from _convert({k: fn(k, reader[k]) for k in unit}, arch, layout, src_format).items()

    if layout == "comfyui":
        if out.suffix != ".safetensors":
            raise ValueError(
                f"a ComfyUI model is one .safetensors file; got {out} (use --layout diffusers for a folder)"
            )
        return stream_safetensors(out, specs, tensors(), {"format": "pt"})
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; a diffusers model is a folder (use --layout comfyui for one file)")
    out.mkdir(parents=True, exist_ok=True)
    shards, size = [[]], 0
    for s in specs:
        n = math.prod(s[1]) * torch.empty((), dtype=s[2]).element_size()
        if shards[-1] and size + n > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += n
    it = tensors()
    base = "diffusion_pytorch_model"
    if len(shards) == 1:
        stream_safetensors(out / f"{base}.safetensors", shards[0], it, {"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"{base}-{i:05d}-of-{len(shards):05d}.safetensors"
            stream_safetensors(out / name, shard, it, {"format": "pt"})
            weight_map.update({s[0]: name for s in shard})
        total = sum(math.prod(s[1]) * torch.empty((), dtype=s[2]).element_size() for s in specs)
        _atomic_text(
            out / f"{base}.safetensors.index.json",
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2),
        )
    if config is not None:
        _atomic_text(out / "config.json", json.dumps(dict(config), indent=2, sort_keys=True, default=str))
    return out


def _write_rcm(reader, fn, out: Path, arch: str, src_format: str, progress: bool) -> Path:
    """The official rCM layout (``scripts/dcp_to_pth.py``): ``torch.save`` of ``net.<original name>``, Wan's
    patch embedding in its Linear form. A ``.pt`` is one pickle, so this holds the whole model in memory."""
    from .rcm_official import patch_embedding_to_linear

    if arch != "wan":
        raise ValueError("the official rCM layout is for Wan models; use --layout comfyui or diffusers for Flux")
    if out.suffix not in (".pt", ".pth"):
        raise ValueError(f"the official rCM layout is a .pt/.pth file; got {out}")
    if out.is_dir():
        raise ValueError(f"{out} is a folder; give a file name such as {out / 'model.pt'}")
    sd = {}
    for unit in tqdm(
        _units(reader.keys(), arch, src_format, "comfyui"), desc="merge", disable=not progress, unit="layer"
    ):
        for k, v in _convert({k: fn(k, reader[k]) for k in unit}, arch, "comfyui", src_format).items():
            sd["net." + k] = patch_embedding_to_linear(v) if k == "patch_embedding.weight" else v
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_target(out) as tmp:
        torch.save(sd, tmp)
    return out


def _atomic_text(path: Path, text: str) -> None:
    with atomic_target(path) as tmp, open(tmp, "w") as f:
        f.write(text)


def merge_lora_to(
    out,
    base,
    lora: dict,
    weight: float = 1.0,
    layout: str = "comfyui",
    on_missing: str = "error",
    config: dict | None = None,
    prefer: str | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD,
    progress: bool = True,
) -> tuple[Path, list[str]]:
    """Stream ``base`` (file, folder or dict) + ``weight`` * LoRA to ``out``; returns ``(path, skipped)``."""
    reader = CheckpointReader(base, prefer)
    arch = detect_arch(dict.fromkeys(reader.keys()))
    delta = LoraDelta(lora, {k: reader.shape(k) for k in reader.keys()}, weight, arch, on_missing)
    return _write_streamed(reader, delta, out, layout, arch, config, max_shard_size, progress), delta.skipped


def merge_delta_to(
    out,
    base,
    finetuned,
    finetuned_base,
    weight: float = 1.0,
    layout: str = "comfyui",
    config: dict | None = None,
    prefer: str | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD,
    progress: bool = True,
) -> tuple[Path, list[str]]:
    """Stream ``base + weight * (finetuned - finetuned_base)`` to ``out``; returns ``(path, untouched)``."""
    reader = CheckpointReader(base, prefer)
    arch = detect_arch(dict.fromkeys(reader.keys()))
    transfer = _transfer(reader, finetuned, finetuned_base, weight)
    path = _write_streamed(reader, transfer, out, layout, arch, config, max_shard_size, progress)
    return path, transfer.untouched


def convert_checkpoint(
    src,
    out,
    layout: str = "diffusers",
    config: dict | None = None,
    arch: str | None = None,
    prefer: str | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD,
    progress: bool = True,
) -> Path:
    """A model checkpoint (any readable layout) rewritten as a diffusers folder or a ComfyUI file, streamed."""
    reader = src if isinstance(src, CheckpointReader) else CheckpointReader(src, prefer)
    arch = arch or detect_arch(dict.fromkeys(reader.keys()))
    return _write_streamed(reader, lambda k, v: v, out, layout, arch, config, max_shard_size, progress)


def save_model(
    state_dict: dict, out, layout: str = "diffusers", arch: str | None = None, config: dict | None = None
) -> Path:
    """Write a diffusers model folder (``diffusion_pytorch_model.safetensors`` + ``config.json``)
    or a ComfyUI single file (original names); atomic. ``state_dict`` may use either naming."""
    arch = arch or detect_arch(state_dict)
    return _write_streamed(
        CheckpointReader(state_dict), lambda k, v: v, out, layout, arch, config, DEFAULT_MAX_SHARD, progress=False
    )
