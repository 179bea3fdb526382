"""Export a fake-quantized transformer as a ComfyUI-loadable low-bit safetensors file, and read it back
(docs/math.md §7).

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
import warnings

import torch
from safetensors import safe_open

from ..lora.io import atomic_save_safetensors
from .formats import E2M1_VALUES, QTensor, comfy_act_quant, dequantize
from .modules import quant_layers

__all__ = [
    "COMFY_FORMAT",
    "HI_FIRST",
    "to_blocked",
    "from_blocked",
    "pack_e2m1",
    "unpack_e2m1",
    "comfy_mismatch",
    "export_quantized",
    "load_quantized",
    "dequantized_copy",
    "ComfyRuntimeLinear",
    "comfy_runtime_copy",
]

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


def comfy_mismatch(layer) -> tuple[str, str] | None:
    """``("refuse" | "warn", reason)`` when ComfyUI 0.29 would run ``layer``'s export differently from how
    it was trained (``comfy/ops.py`` ``mixed_precision_ops``; on GPUs with native kernels for the format),
    else ``None``. Target ``comfyui`` trains that arithmetic and always matches."""
    if layer.target == "comfyui":
        return None
    if layer.fmt == "nvfp4":
        if layer.act_fmt is None:
            return (
                "warn",
                "trained weight-only, but ComfyUI on GPUs with NVFP4 kernels (SM >= 10.0) also quantizes "
                "the activations to NVFP4 per call (amax / (6 * 448)); train with target comfyui",
            )
        if layer.act_fmt != "nvfp4":
            return (
                "refuse",
                f"activations trained as {layer.act_fmt}, but ComfyUI quantizes an nvfp4 layer's input "
                "as NVFP4 (and would read input_scale as an NVFP4 tensor scale)",
            )
        if not layer.static_act:
            return None  # dynamic per call: exported without input_scale, as ComfyUI then runs it
    elif layer.fmt == "fp8_e4m3":
        if layer.act_fmt is None:
            return (
                "warn",
                "trained weight-only, but ComfyUI on GPUs with FP8 kernels (SM >= 8.9) casts the activations "
                "to float8_e4m3fn at scale 1.0 when the file has no input_scale (|x| > 448 saturates, small "
                "values lose precision); train with target comfyui (calibrated input_scale)",
            )
        if layer.act_fmt != "fp8_e4m3" or not layer.static_act:
            return (
                "refuse",
                f"activations trained as {layer.act_fmt} ({layer.act_scale}), but ComfyUI quantizes an fp8 "
                "layer's input as float8_e4m3fn with the exported input_scale (or 1.0 without one)",
            )
    elif layer.fmt == "int8":
        if layer.act_fmt is None:
            return (
                "warn",
                "trained weight-only, but ComfyUI runs int8_tensorwise as W8A8 with dynamic per-row INT8 "
                "activations on every device (CPU included); train with target comfyui",
            )
        return (
            "refuse",
            f"activations trained as {layer.act_fmt} ({layer.act_scale} per tensor), but ComfyUI's "
            "int8_tensorwise has no input_scale: it quantizes activations per row dynamically",
        )
    return None


def _layer_tensors(name: str, layer) -> tuple[dict, dict]:
    q = layer.qtensor()
    N, K = layer.weight.shape
    fmt = COMFY_FORMAT.get(layer.fmt)
    if fmt is None:
        raise ValueError(
            f"{name}: format {layer.fmt!r} has no ComfyUI checkpoint layout (export nvfp4, fp8_e4m3 or int8)"
        )
    t = {}
    if layer.static_act and torch.isnan(layer.input_amax):
        raise ValueError(f"{name}: activation format {layer.act_fmt} but input_amax is not calibrated")
    input_scale = None
    if layer.static_act and layer.act_fmt == layer.fmt and layer.fmt in ("nvfp4", "fp8_e4m3"):
        input_scale = layer.input_scale()
    if layer.fmt == "nvfp4":
        Np, Kp = _roundup(N, 16), _roundup(K, 16)
        v = torch.zeros(Np, Kp)
        v[:N] = q.values.flatten(-2)  # blocks of 16: already padded to Kp columns
        s = torch.zeros(Np, Kp // 16)
        s[:N, : q.scale.shape[-1]] = q.scale
        t["weight"] = pack_e2m1(v)
        t["weight_scale"] = to_blocked(s.to(torch.float8_e4m3fn))
        t["weight_scale_2"] = q.scale_2.reshape(()).float()
    elif layer.fmt == "fp8_e4m3":
        if layer.per_channel:
            raise ValueError(f"{name}: per-channel FP8 has no ComfyUI field (float8_e4m3fn weight_scale is a scalar)")
        t["weight"] = q.values.to(torch.float8_e4m3fn)
        t["weight_scale"] = q.scale.reshape(()).float()
    else:  # int8
        if not layer.per_channel:
            raise ValueError(f"{name}: int8_tensorwise export expects per-channel weights")
        t["weight"] = q.values.to(torch.int8)
        t["weight_scale"] = q.scale.reshape(N, 1).float()
    if input_scale is not None:
        t["input_scale"] = input_scale.reshape(())
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


def export_quantized(
    model: torch.nn.Module,
    path,
    *,
    layout: str = "comfyui",
    arch: str = "wan",
    prefix: str = "",
    check_comfyui: bool = True,
) -> dict:
    """Write ``model``'s quantized layers as real low-bit tensors + scales and the rest unchanged (docs/math.md §7).

    ``check_comfyui``: refuse (``ValueError``) or warn (``UserWarning``) with the reason when ComfyUI
    would run a layer differently from how it was trained (``comfy_mismatch``); warnings name the
    first layers and the count. Returns the ``_quantization_metadata`` dict. ``layout="comfyui"`` is implemented for Wan
    (Flux's original layout fuses q/k/v, which would need one shared NVFP4 tensor scale).
    """
    if layout not in ("comfyui", "diffusers"):
        raise ValueError(f"layout {layout!r}: use 'comfyui' or 'diffusers'")
    if layout == "comfyui" and arch != "wan":
        raise NotImplementedError(
            f"comfyui layout for {arch!r}: fused q/k/v needs a shared tensor scale; use layout='diffusers'"
        )
    layers = quant_layers(model)
    if not layers:
        raise ValueError("model has no QuantLinear layers (run quantize_transformer first)")
    if check_comfyui:
        found = {n: f for n, f in ((n, comfy_mismatch(m)) for n, m in layers.items()) if f is not None}
        refused = {n: r for n, (kind, r) in found.items() if kind == "refuse"}
        if refused:
            n, r = next(iter(refused.items()))
            raise ValueError(
                f"{len(refused)} layer(s) would run differently in ComfyUI, e.g. {n}: {r} "
                "(export_quantized(..., check_comfyui=False) writes it anyway)"
            )
        warned = {n: r for n, (kind, r) in found.items()}
        for reason in dict.fromkeys(warned.values()):
            names = [n for n, r in warned.items() if r == reason]
            warnings.warn(
                f"{len(names)} layer(s) ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): {reason}",
                UserWarning,
                stacklevel=2,
            )
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
        sd = {
            (ren[k] if k in ren else lay_ren[k.rpartition(".")[0]] + "." + k.rpartition(".")[2]): v
            for k, v in sd.items()
        }
        qlayers = {lay_ren[n]: c for n, c in qlayers.items()}
        shapes = {lay_ren[n]: s for n, s in shapes.items()}
    sd = {prefix + k: v for k, v in sd.items()}
    meta = {"format_version": "1.0", "layers": {prefix + k: v for k, v in qlayers.items()}}
    targets = sorted({m.target for m in layers.values()})
    atomic_save_safetensors(
        sd,
        path,
        metadata={
            "_quantization_metadata": json.dumps(meta),
            "rcm_quant_shapes": json.dumps({prefix + k: v for k, v in shapes.items()}),
            "rcm_quant_target": ",".join(targets),
        },
    )
    return meta


def load_quantized(path) -> tuple[dict[str, torch.Tensor], dict]:
    """Read an ``export_quantized`` file: ``({key: tensor}, layers)`` with each quantized layer's
    ``weight`` dequantized to float32 exactly as the fake-quant forward computes it (docs/math.md §7)."""
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


class ComfyRuntimeLinear(torch.nn.Linear):
    """A Linear layer loaded from an exported file that computes as ComfyUI does (docs/math.md §7):
    ``y = comfy_act_quant(x) W_hat^T + b`` with ``W_hat`` the dequantized stored weight and the
    activation quantizer of the file's format (``formats.comfy_act_quant``: nvfp4 with the file's
    ``input_scale`` or per call, fp8 with ``input_scale`` or 1.0, int8 per row); ``native=False``:
    weight-only, as ComfyUI runs nvfp4 / fp8 on devices without kernels for them (CPU, older GPUs)."""

    def __init__(self, weight, bias, fmt: str, input_scale, native: bool = True):
        super().__init__(weight.shape[1], weight.shape[0], bias is not None, dtype=weight.dtype)
        with torch.no_grad():
            self.weight.copy_(weight)
            if bias is not None:
                self.bias.copy_(bias)
        self.requires_grad_(False)
        self.fmt, self.input_scale, self.native = fmt, input_scale, native

    def forward(self, x):
        if self.native or self.fmt == "int8":
            x = comfy_act_quant(x, self.fmt, self.input_scale)
        return torch.nn.functional.linear(
            x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        )


def comfy_runtime_copy(model: torch.nn.Module, path, *, native: bool = True) -> torch.nn.Module:
    """``dequantized_copy`` whose quantized layers are ``ComfyRuntimeLinear``: the forward ComfyUI runs for
    this file on a GPU with kernels for its formats (``native=True``) or weight-only for nvfp4 / fp8
    (``native=False``; int8 is W8A8 everywhere). The reference the QAD benchmarks sample with."""
    from ..lora.keys import detect_format, to_diffusers

    m = dequantized_copy(model, path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        scales = {k[: -len(".input_scale")]: f.get_tensor(k).float() for k in f.keys() if k.endswith(".input_scale")}
    layers = json.loads(meta["_quantization_metadata"])["layers"]
    fmt_of = {"nvfp4": "nvfp4", "float8_e4m3fn": "fp8_e4m3", "int8_tensorwise": "int8"}
    if detect_format({f"{n}.weight": torch.zeros(1) for n in layers}) == "original":
        names = {
            next(iter(to_diffusers({f"{n}.weight": torch.zeros(1)}, arch="wan", prefix=""))).removesuffix(".weight"): n
            for n in layers
        }
    else:
        names = {n: n for n in layers}
    for dn, fn in names.items():
        lin = m.get_submodule(dn)
        parent, _, leaf = dn.rpartition(".")
        new = ComfyRuntimeLinear(
            lin.weight.detach(),
            None if lin.bias is None else lin.bias.detach(),
            fmt_of[layers[fn]["format"]],
            scales.get(fn),
            native,
        )
        setattr(m.get_submodule(parent) if parent else m, leaf, new)
    return m.eval()
