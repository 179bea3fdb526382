"""Safe reading of model checkpoints of any layout people hold, one tensor at a time.

Accepted sources: a tensor dict; a ``.safetensors`` file; a ``.pt/.pth/.bin`` file read with
``torch.load(weights_only=True)`` (no pickled code; mmap'ed when it is a zip); a diffusers model
folder (``transformer/`` with ``diffusion_pytorch_model.safetensors`` or the sharded
``diffusion_pytorch_model-0000X-of-0000Y.safetensors`` + ``.index.json`` that the Wan 14B and FLUX
repos ship; the pipeline root works too). Then, in this order:

1. nested containers are unwrapped (``{"model": ...}``, ``{"ema": ...}``, ``{"state_dict": ...}``);
2. an official rCM training dump's networks (``net.``/``net_ema.``/``net_fake_score.``) are told
   apart and one is taken, the EMA by default (:mod:`.rcm_official`);
3. wrapper prefixes shared by every key are stripped (``net.``, ``module.``, ``_orig_mod.``,
   ``model.diffusion_model.``, ...);
4. TurboDiffusion's int8 block-quantized Linears read as dequantized ``.weight`` and its
   sparse-linear-attention keys are set aside (:mod:`.turbodiffusion`).

``CheckpointReader.info`` says what was found and done; dtypes are kept.
"""

from __future__ import annotations

import json
import math
import pickle
import zipfile
from collections import Counter
from pathlib import Path

import torch

from . import rcm_official, turbodiffusion

__all__ = [
    "UnsafeCheckpointError",
    "CheckpointReader",
    "load_state_dict",
    "load_checkpoint",
    "unwrap_state_dict",
    "open_safetensors",
    "describe",
    "SafetensorsFile",
]

NESTED_KEYS = ("ema", "net_ema", "model_ema", "state_dict", "model", "net", "module", "transformer")
_NESTED_ALIASES = {
    "ema": ("ema", "net_ema", "model_ema"),
    "net": ("net", "model", "state_dict"),
    "fake_score": ("net_fake_score", "fake_score"),
}
PREFIXES = ("module.", "_orig_mod.", "net.", "model.diffusion_model.", "diffusion_model.", "model.", "transformer.")
_ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class UnsafeCheckpointError(ValueError):
    """The file needs pickled code (classes/functions) to load; it was refused."""


def open_safetensors(path):
    """A ``safe_open`` handle (framework pt, CPU); ValueError naming the file when it is unreadable."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(
            f"{path} is not a readable safetensors file (empty, truncated or not safetensors?): {e}"
        ) from e


class SafetensorsFile:
    """One safetensors file read tensor by tensor with plain reads (no mmap).

    The header is checked by ``safe_open``; each tensor is then read into its own buffer, so a
    streamed pass over a large file keeps only the tensors in use resident (an mmap'ed read leaves
    every touched page of the file counted in the process's memory until the file is closed).
    """

    def __init__(self, path):
        self.path = str(path)
        open_safetensors(path)  # validates the header and offsets (closed again)
        with open(self.path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self._start = 8 + n
        self._header = header

    def keys(self) -> list[str]:
        return list(self._header)

    def shape(self, k) -> tuple:
        return tuple(self._header[k]["shape"])

    def dtype(self, k) -> torch.dtype:
        return _ST_DTYPES[self._header[k]["dtype"]]

    def get_tensor(self, k) -> torch.Tensor:
        begin, end = self._header[k]["data_offsets"]
        buf = torch.empty(end - begin, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self._start + begin)
            if f.readinto(buf.numpy()) != end - begin:
                raise ValueError(f"{self.path}: truncated data for {k}")
        return buf.view(self.dtype(k)).reshape(self.shape(k))


def _torch_load(path: Path):
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        msg = str(e)
        if "Weights only load failed" in msg or "Unsupported global" in msg or "GLOBAL" in msg:
            raise UnsafeCheckpointError(
                f"{path} needs pickled code to load, which is refused (torch.load weights_only=True): "
                f"{msg.splitlines()[0] if msg else e!r}. Re-save it as a plain state dict or safetensors "
                "from a trusted environment."
            ) from e
        raise ValueError(f"{path} is not a readable checkpoint ({e})") from e
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as e:
        raise ValueError(f"{path} is not a readable checkpoint (empty, corrupt or truncated?): {e}") from e


def _model_folder_files(folder: Path) -> list[Path]:
    """The safetensors files of a diffusers model folder (or of its ``transformer/``)."""
    if not any(folder.glob("*.safetensors")) and (folder / "transformer").is_dir():
        folder = folder / "transformer"
    index = sorted(folder.glob("*.safetensors.index.json"))
    if len(index) == 1:
        try:
            weight_map = json.loads(index[0].read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"{index[0]} is not a safetensors index (no weight_map): {e}") from e
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index[0].name} names shards that are missing: {missing[:5]}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if len(files) == 1:
        return files
    if not files:
        raise FileNotFoundError(
            f"{folder} holds no .safetensors model (expected diffusion_pytorch_model*.safetensors "
            "or a transformer/ subfolder)"
        )
    raise ValueError(
        f"{folder} holds {len(files)} .safetensors files and no index.json: "
        f"{[f.name for f in files[:5]]}; pass one file"
    )


def _find_tensor_dict(obj, prefer: str | None) -> dict:
    order = (_NESTED_ALIASES.get(prefer, (prefer,)) if prefer else ()) + NESTED_KEYS
    for _ in range(4):
        if not isinstance(obj, dict) or (obj and all(isinstance(v, torch.Tensor) for v in obj.values())):
            break
        nxt = next((obj[k] for k in order if k in obj and isinstance(obj[k], dict)), None)
        if nxt is None:
            dicts = [v for v in obj.values() if isinstance(v, dict)]
            nxt = dicts[0] if len(dicts) == 1 else None
        if nxt is not None:
            obj = nxt
            continue
        obj = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}  # drop counters, configs
        break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        top = list(obj)[:10] if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"no tensor state dict found in the checkpoint (top-level entries: {top})")
    return obj


def _clean_names(raw_keys, prefer: str | None, info: dict) -> dict[str, str]:
    """clean name -> raw name: pick a training-dump network, strip shared wrapper prefixes."""
    names = {k: k for k in raw_keys}
    prefix, present = rcm_official.select_network(list(names), prefer)
    if present:
        info["networks"] = present
    if prefix is not None:
        names = {k[len(prefix) :]: r for k, r in names.items() if k.startswith(prefix)}
        info["network"] = prefix.rstrip(".")
    changed = True
    while changed:
        changed = False
        for p in PREFIXES:
            if names and all(k.startswith(p) for k in names):
                names = {k[len(p) :]: r for k, r in names.items()}
                changed = True
    return names


class CheckpointReader:
    """Read-one-tensor-at-a-time view of a checkpoint (dict, file or diffusers folder); see the module doc.

    ``keys()`` are the cleaned names; ``reader[name]`` loads one tensor (dequantizing TurboDiffusion
    int8 Linears); ``info`` records the network taken, keys set aside and tensors dequantized.
    """

    def __init__(self, src, prefer: str | None = None):
        self.info: dict = {"source": str(src) if isinstance(src, (str, Path)) else "dict"}
        self._handles: dict[str, SafetensorsFile] = {}  # raw name -> its file
        self._dict: dict[str, torch.Tensor] = {}
        if isinstance(src, (str, Path)):
            path = Path(src)
            if path.is_dir():
                files = _model_folder_files(path)
                self.info["files"] = [str(f) for f in files]
                for f in files:
                    h = SafetensorsFile(f)
                    self._handles.update({k: h for k in h.keys()})
            elif not path.is_file():
                raise FileNotFoundError(f"checkpoint not found: {path}")
            elif path.suffix == ".safetensors":
                h = SafetensorsFile(path)
                self._handles = {k: h for k in h.keys()}
            else:
                self._dict = _find_tensor_dict(_torch_load(path), prefer)
        else:
            self._dict = _find_tensor_dict(src, prefer)
        raw = list(self._handles) or list(self._dict)
        if not raw:
            raise ValueError(f"{self.info['source']}: the checkpoint holds no tensors")
        names = _clean_names(raw, prefer, self.info)
        sla = sorted(k for k in names if turbodiffusion.is_sla_key(k))
        if sla:
            self.info["set_aside"] = sla
            names = {k: r for k, r in names.items() if k not in set(sla)}
        self._int8 = {}
        for m in turbodiffusion.int8_linears(names):
            self._int8[f"{m}.weight"] = (names.pop(f"{m}.int8_weight"), names.pop(f"{m}.scale"), names.get(f"{m}.bias"))
        if self._int8:
            self.info["dequantized_int8"] = len(self._int8)
        self._names = names

    # raw access -----------------------------------------------------------------------------
    def _raw(self, r: str) -> torch.Tensor:
        return self._handles[r].get_tensor(r) if self._handles else self._dict[r]

    def _raw_shape(self, r: str) -> tuple:
        return self._handles[r].shape(r) if self._handles else tuple(self._dict[r].shape)

    def _raw_dtype(self, r: str) -> torch.dtype:
        if self._handles:
            return self._handles[r].dtype(r)
        return self._dict[r].dtype

    # public ---------------------------------------------------------------------------------
    def raw_keys(self) -> list[str]:
        """The names as stored (before any unwrapping or renaming)."""
        return list(self._handles) or list(self._dict)

    def keys(self) -> list[str]:
        return list(self._names) + list(self._int8)

    def __contains__(self, k) -> bool:
        return k in self._names or k in self._int8

    def __len__(self) -> int:
        return len(self._names) + len(self._int8)

    def shape(self, k) -> tuple:
        if k in self._int8:
            return self._raw_shape(self._int8[k][0])
        return self._raw_shape(self._names[k])

    def dtype(self, k) -> torch.dtype:
        if k in self._int8:
            b = self._int8[k][2]
            return self._raw_dtype(b) if b is not None else torch.bfloat16
        return self._raw_dtype(self._names[k])

    def __getitem__(self, k) -> torch.Tensor:
        if k in self._int8:
            q, s, _ = self._int8[k]
            return turbodiffusion.dequantize_int8(self._raw(q), self._raw(s), self.dtype(k))
        return self._raw(self._names[k])

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {k: self[k] for k in self.keys()}


class RenamedReader:
    """A reader seen through a name map ``{new name: (old name, transform or None)}`` (lazy, per tensor)."""

    def __init__(self, reader, mapping: dict, shapes: dict):
        self._r, self._map, self._shapes = reader, mapping, shapes
        self.info = reader.info

    def keys(self) -> list[str]:
        return list(self._map)

    def __contains__(self, k) -> bool:
        return k in self._map

    def __len__(self) -> int:
        return len(self._map)

    def shape(self, k) -> tuple:
        return self._shapes[k]

    def dtype(self, k) -> torch.dtype:
        return self._r.dtype(self._map[k][0])

    def __getitem__(self, k) -> torch.Tensor:
        old, fn = self._map[k]
        t = self._r[old]
        return fn(t) if fn is not None else t

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {k: self[k] for k in self.keys()}


def in_layout_of(reader, like, arch: str):
    """``reader`` renamed into the naming (diffusers or original) of reader ``like``, lazily.

    Wan maps one name to one name; the patch embedding takes ``like``'s form (Linear or Conv3d)
    where the two differ only by that reshape. Flux's fused original layers cannot be renamed
    one tensor at a time: the tensors are then converted in memory. Readers already in the same
    naming come back unchanged.
    """
    from .keys import detect_format, to_diffusers, to_original

    src_fmt, dst_fmt = detect_format(dict.fromkeys(reader.keys())), detect_format(dict.fromkeys(like.keys()))
    convert = (
        (lambda d: to_original(d, arch, prefix="", source=src_fmt))
        if dst_fmt == "original"
        else (lambda d: to_diffusers(d, arch, prefix="", source=src_fmt))
    )
    mapping, shapes = {}, {}
    if src_fmt != dst_fmt:
        try:
            for k in reader.keys():
                out = convert({k: torch.empty(reader.shape(k), device="meta")})
                ((new, t),) = out.items()
                mapping[new] = (k, None)
                shapes[new] = tuple(t.shape)
        except (ValueError, RuntimeError):  # Flux fused layers: not one tensor at a time
            return CheckpointReader(convert(reader.to_dict()))
    else:
        mapping = {k: (k, None) for k in reader.keys()}
        shapes = {k: reader.shape(k) for k in reader.keys()}
    for new, (old, _) in list(mapping.items()):
        if (
            new in like
            and rcm_official.is_patch_embedding(new)
            and shapes[new] != like.shape(new)
            and math.prod(shapes[new]) == math.prod(like.shape(new))
        ):
            target = like.shape(new)
            mapping[new] = (old, lambda t, target=target: t.reshape(target))
            shapes[new] = target
        elif src_fmt != dst_fmt and rcm_official.is_patch_embedding(new):
            # the converter reshapes the patch embedding by rank; apply the same per tensor
            target = shapes[new]
            mapping[new] = (old, lambda t, target=target: t.reshape(target))
    if src_fmt == dst_fmt and all(fn is None for _, fn in mapping.values()):
        return reader
    return RenamedReader(reader, mapping, shapes)


def unwrap_state_dict(obj, prefer: str | None = None) -> dict[str, torch.Tensor]:
    """The flat, prefix-free tensor dict inside a loaded checkpoint object (see the module doc)."""
    return CheckpointReader(obj, prefer).to_dict()


def load_checkpoint(path, prefer: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """``(state_dict, info)`` of a checkpoint file or diffusers folder; ``info`` as ``CheckpointReader.info``."""
    r = CheckpointReader(path, prefer)
    return r.to_dict(), r.info


def load_state_dict(path, prefer: str | None = None, unwrap: bool = True) -> dict[str, torch.Tensor]:
    """Load ``path`` (.safetensors, .pt/.pth/.bin with ``weights_only=True``, or a diffusers folder).

    Dtypes are kept. A pickle that references code raises ``UnsafeCheckpointError``; a corrupt,
    empty or truncated file raises ValueError naming the file. ``unwrap=False`` returns the file's
    tensors as stored (nested containers still searched, names untouched).
    """
    if unwrap:
        return load_checkpoint(path, prefer)[0]
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.suffix == ".safetensors":
        h = open_safetensors(path)
        return {k: h.get_tensor(k) for k in h.keys()}
    return _find_tensor_dict(_torch_load(path), prefer)


def describe(reader: CheckpointReader) -> dict:
    """Summary for ``rcm-lora inspect``: dtypes, raw prefixes, networks, patch-embedding form."""
    raw = reader.raw_keys()
    dtypes = Counter(str(reader._raw_dtype(k)).removeprefix("torch.") for k in raw)
    prefixes = Counter(k.split(".", 1)[0] + "." for k in raw if "." in k)
    out = {
        "n_tensors": len(reader),
        "dtypes_stored": dict(dtypes),
        "top_level_prefixes": dict(prefixes.most_common(6)),
        **reader.info,
    }
    out["ema_present"] = "ema" in reader.info.get("networks", []) or any(
        k.startswith(("net_ema.", "ema.", "model_ema.")) for k in raw
    )
    if "patch_embedding.weight" in reader:
        out["patch_embedding"] = (
            "Linear [dim, C*kt*kh*kw] (official rCM / TurboDiffusion form)"
            if len(reader.shape("patch_embedding.weight")) == 2
            else "Conv3d"
        )
    return out
