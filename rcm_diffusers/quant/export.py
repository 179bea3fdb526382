"""Export a fake-quantized transformer as a ComfyUI-loadable low-bit safetensors file, and read it back (SPEC §7).

Per quantized layer ``L`` (field names as ComfyUI's ``comfy/quant_ops.py`` ``QUANT_ALGOS`` reads them):

- ``nvfp4``: ``L.weight`` uint8 ``[roundup(N,16), roundup(K,16)/2]``, two E2M1 codes per byte
  (sign bit 3, magnitude index into ``E2M1_VALUES``), the even column in the **high** nibble as
  ComfyUI's quantizer packs it (``HI_FIRST``); ``L.weight_scale`` float8_e4m3fn block scales in
  cuBLAS's tiled layout ``[roundup(N,128), roundup(K/16,4)]`` (128x4 tiles, 32x16 interleave);
  ``L.weight_scale_2`` FP32 scalar; ``L.input_scale`` FP32 scalar ``amax / (6 * 448)`` when activations are quantized.
- ``float8_e4m3fn``: ``L.weight`` float8_e4m3fn ``[N, K]``, ``L.weight_scale`` FP32 scalar
  (per-tensor; per-channel FP8 has no ComfyUI field and is refused), ``L.input_scale`` ``amax / 448``.
- ``int8_tensorwise``: ``L.weight`` int8, ``L.weight_scale`` FP32 ``[N, 1]`` (per-row, symmetric).

The header carries ``_quantization_metadata = {"format_version": "1.0", "layers": {L: {"format": ...}}}``
(ComfyUI turns each entry into ``L.comfy_quant``) and ``rcm_quant_shapes`` (the unpadded ``[N, K]``).
Every other tensor is written unchanged. ``layout="comfyui"`` renames Wan keys to the original
layout through ``rcm_diffusers.lora.keys``; ``layout="diffusers"`` keeps diffusers names.
"""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from ..lora.io import atomic_save_safetensors
from .formats import E2M1_VALUES, QTensor, dequantize
from .modules import quant_layers

__all__ = ["COMFY_FORMAT", "HI_FIRST", "to_blocked", "from_blocked", "pack_e2m1", "unpack_e2m1",
           "export_quantized", "load_quantized"]

COMFY_FORMAT = {"nvfp4": "nvfp4", "fp8_e4m3": "float8_e4m3fn", "int8": "int8_tensorwise"}
HI_FIRST = True  # ComfyUI / comfy-kitchen packing: element 2j in bits 7..4, element 2j+1 in bits 3..0


def _roundup(n: int, m: int) -> int:
    return -(-n // m) * m


def _blocked_index(rows: int, cols: int) -> torch.Tensor:
    """Flat position in the tiled layout of each scale ``(r, c)`` of a ``[roundup(rows,128), roundup(cols,4)]`` grid.

    Tiles of 128 rows x 4 columns, row-major over tiles; inside a tile row ``r`` goes to
    ``(r % 32) * 16 + (r // 32) * 4`` and column ``c`` adds ``c``.
    """
    R, C = _roundup(rows, 128), _roundup(cols, 4)
    r = torch.arange(R)[:, None]
    c = torch.arange(C)[None, :]
    tile = (r // 128) * (C // 4) + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def to_blocked(s: torch.Tensor) -> torch.Tensor:
    """``[rows, cols]`` block scales -> cuBLAS tiled layout ``[roundup(rows,128), roundup(cols,4)]`` (zero padded)."""
    rows, cols = s.shape
    R, C = _roundup(rows, 128), _roundup(cols, 4)
    padded = torch.zeros(R, C, dtype=s.dtype)
    padded[:rows, :cols] = s
    out = torch.empty(R * C, dtype=s.dtype)
    out[_blocked_index(rows, cols).flatten()] = padded.flatten()
    return out.reshape(R, C)


def from_blocked(b: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``to_blocked``: the ``[rows, cols]`` scales."""
    return b.flatten()[_blocked_index(rows, cols)][:rows, :cols]


def _codes(values: torch.Tensor) -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES)
    idx = torch.searchsorted(mags, values.abs().contiguous())
    if not torch.equal(mags[idx.clamp(max=7)], values.abs()):
        raise ValueError("values are not E2M1")
    return (idx | (torch.signbit(values).long() << 3)).to(torch.uint8)


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` E2M1 values (K even) -> ``[N, K/2]`` uint8, even column in the high nibble (``HI_FIRST``)."""
    c = _codes(values)
    hi, lo = (c[:, 0::2], c[:, 1::2]) if HI_FIRST else (c[:, 1::2], c[:, 0::2])
    return (hi << 4) | lo


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_e2m1``: float32 E2M1 values ``[N, 2 * packed.shape[1]]``."""
    hi, lo = (packed >> 4).long(), (packed & 0x0F).long()
    first, second = (hi, lo) if HI_FIRST else (lo, hi)
    codes = torch.stack([first, second], -1).flatten(-2)
    mag = torch.tensor(E2M1_VALUES)[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def _layer_tensors(name: str, layer) -> tuple[dict, dict]:
    q = layer.qtensor()
    N, K = layer.weight.shape
    fmt = COMFY_FORMAT.get(layer.fmt)
    if fmt is None:
        raise ValueError(f"{name}: format {layer.fmt!r} has no ComfyUI checkpoint layout (export nvfp4, fp8_e4m3 or int8)")
    t = {}
    amax = layer.input_amax.float() if layer.act_fmt is not None else None
    if amax is not None and torch.isnan(amax):
        raise ValueError(f"{name}: activation format {layer.act_fmt} but input_amax is not calibrated")
    if layer.fmt == "nvfp4":
        Np, Kp = _roundup(N, 16), _roundup(K, 16)
        v = torch.zeros(Np, Kp)
        v[:N] = q.values.flatten(-2)  # blocks of 16: already padded to Kp columns
        s = torch.zeros(Np, Kp // 16)
        s[:N, : q.scale.shape[-1]] = q.scale
        t["weight"] = pack_e2m1(v)
        t["weight_scale"] = to_blocked(s.to(torch.float8_e4m3fn))
        t["weight_scale_2"] = q.scale_2.reshape(()).float()
        if amax is not None:
            t["input_scale"] = (amax / (6.0 * 448.0)).reshape(())
    elif layer.fmt == "fp8_e4m3":
        if layer.per_channel:
            raise ValueError(f"{name}: per-channel FP8 has no ComfyUI field (float8_e4m3fn weight_scale is a scalar)")
        t["weight"] = q.values.to(torch.float8_e4m3fn)
        t["weight_scale"] = q.scale.reshape(()).float()
        if amax is not None:
            t["input_scale"] = (amax / 448.0).reshape(())
    else:  # int8
        if not layer.per_channel:
            raise ValueError(f"{name}: int8_tensorwise export expects per-channel weights")
        t["weight"] = q.values.to(torch.int8)
        t["weight_scale"] = q.scale.reshape(N, 1).float()
    if layer.bias is not None:
        t["bias"] = layer.bias.detach()
    return t, {"format": fmt}


def _rename_wan(keys: list[str]) -> dict[str, str]:
    from ..lora.keys import to_original

    out = {}
    for k in keys:
        target, _, suffix = k.rpartition(".") if k.rsplit(".", 1)[-1] in ("weight", "bias") else (k, "", "")
        probe = to_original({(f"{target}.weight" if suffix else target): torch.zeros(1)}, arch="wan", prefix="")
        new = next(iter(probe))
        out[k] = (new[: -len(".weight")] + "." + suffix) if suffix else new
    return out


def export_quantized(model: torch.nn.Module, path, *, layout: str = "comfyui", arch: str = "wan",
                     prefix: str = "") -> dict:
    """Write ``model``'s quantized layers as real low-bit tensors + scales and the rest unchanged (SPEC §7).

    Returns the ``_quantization_metadata`` dict. ``layout="comfyui"`` is implemented for Wan
    (Flux's original layout fuses q/k/v, which would need one shared NVFP4 tensor scale).
    """
    if layout not in ("comfyui", "diffusers"):
        raise ValueError(f"layout {layout!r}: use 'comfyui' or 'diffusers'")
    if layout == "comfyui" and arch != "wan":
        raise NotImplementedError(f"comfyui layout for {arch!r}: fused q/k/v needs a shared tensor scale; use layout='diffusers'")
    layers = quant_layers(model)
    if not layers:
        raise ValueError("model has no QuantLinear layers (run quantize_transformer first)")
    sd = {}
    for k, v in model.state_dict().items():
        if "lora_" in k or k.endswith("input_amax"):
            continue
        k = k.replace(".base_layer.", ".")
        if k.rpartition(".")[0] in layers:
            continue
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise ValueError(f"non-finite values in {k}")
        sd[k] = v.detach()
    qlayers, shapes = {}, {}
    for name, layer in layers.items():
        if not torch.isfinite(layer.weight).all():
            raise ValueError(f"{name}: non-finite weight")
        t, conf = _layer_tensors(name, layer)
        for s, v in t.items():
            sd[f"{name}.{s}"] = v
        qlayers[name] = conf
        shapes[name] = list(layer.weight.shape)
    if layout == "comfyui":
        plain = [k for k in sd if k.rpartition(".")[0] not in layers]
        ren = _rename_wan(plain + [f"{n}.weight" for n in layers])
        lay_ren = {n: ren[f"{n}.weight"][: -len(".weight")] for n in layers}
        sd = {(ren[k] if k in ren else lay_ren[k.rpartition(".")[0]] + "." + k.rpartition(".")[2]): v for k, v in sd.items()}
        qlayers = {lay_ren[n]: c for n, c in qlayers.items()}
        shapes = {lay_ren[n]: s for n, s in shapes.items()}
    sd = {prefix + k: v for k, v in sd.items()}
    meta = {"format_version": "1.0", "layers": {prefix + k: v for k, v in qlayers.items()}}
    atomic_save_safetensors(sd, path, metadata={"_quantization_metadata": json.dumps(meta),
                                                "rcm_quant_shapes": json.dumps({prefix + k: v for k, v in shapes.items()})})
    return meta


def load_quantized(path) -> tuple[dict[str, torch.Tensor], dict]:
    """Read an ``export_quantized`` file: ``({key: tensor}, layers)`` with each quantized layer's
    ``weight`` dequantized to float32 exactly as the fake-quant forward computes it (SPEC §7)."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        raw = {k: f.get_tensor(k) for k in f.keys()}
    if "_quantization_metadata" not in meta:
        raise ValueError(f"{path}: no _quantization_metadata header")
    layers = json.loads(meta["_quantization_metadata"])["layers"]
    shapes = json.loads(meta.get("rcm_quant_shapes", "{}"))
    out = dict(raw)
    for name, conf in layers.items():
        fmt = conf["format"]
        w = raw[f"{name}.weight"]
        N, K = shapes.get(name, (w.shape[0], w.shape[1] * (2 if fmt == "nvfp4" else 1)))
        if fmt == "nvfp4":
            nb = -(-K // 16)
            vals = unpack_e2m1(w)[:N, : nb * 16].reshape(N, nb, 16)
            s_b = from_blocked(raw[f"{name}.weight_scale"], _roundup(N, 16), w.shape[1] * 2 // 16)[:N, :nb].float()
            q = QTensor("nvfp4", (N, K), vals, s_b, raw[f"{name}.weight_scale_2"].float())
        elif fmt == "float8_e4m3fn":
            q = QTensor("fp8_e4m3", (N, K), w.float(), raw[f"{name}.weight_scale"].float())
        elif fmt == "int8_tensorwise":
            q = QTensor("int8", (N, K), w.float(), raw[f"{name}.weight_scale"].float())
        else:
            raise ValueError(f"{name}: unknown format {fmt!r}")
        out[f"{name}.weight"] = dequantize(q)
        for s in ("weight_scale", "weight_scale_2"):
            out.pop(f"{name}.{s}", None)
    return out, layers


def dequantized_copy(model: torch.nn.Module, path) -> torch.nn.Module:
    """A deep copy of the plain (unquantized-module) ``model`` carrying the weights of an
    ``export_quantized`` file (either layout), dequantized (what a serving stack computes with), in eval mode.
    Weights only: activation quantization (``input_scale``) is not applied by the copy."""
    import copy

    from ..lora.keys import detect_format, to_diffusers

    sd, _ = load_quantized(path)
    sd = {k: v for k, v in sd.items() if not k.endswith(".input_scale")}  # activation scales: no parameter to hold them
    if detect_format(sd) == "original":
        sd = to_diffusers(sd, prefix="")
    m = copy.deepcopy(model)
    m.load_state_dict(sd, strict=True)
    return m.eval()
