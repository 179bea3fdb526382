"""A frozen Wan base whose block Linears come already quantized from one safetensors file (option ``base_weights``;
docs/training.md, "Training on one card").

Files it reads (keys in the original / ComfyUI Wan layout, with or without ``model.diffusion_model.`` /
``diffusion_model.``, or in the diffusers layout; names converted by ``rcm_diffusers.lora.keys``):

* ComfyUI's ``fp8_scaled`` files: ``L.weight`` float8_e4m3fn, ``L.scale_weight`` one float32 scale per tensor, a
  ``scaled_fp8`` marker tensor (``L.scale_input``, an activation scale, is not used: the base computes weight-only);
* plain float8_e4m3fn files (no scales);
* the QAD export (``rcm_diffusers.quant.export``): ``float8_e4m3fn`` layers (``L.weight_scale`` per tensor) and
  ``int8_tensorwise`` layers (``L.weight_scale`` ``[N, 1]``); ``input_scale`` is not used; NVFP4 layers are refused.

Every block Linear of the teacher's config must be in the file with its shape, in one format: fp8 (E4M3, one scale
per tensor or none) or int8 (one scale per output channel). Those weights go into ``lowmem.FrozenLinear`` stores
as they are stored (``values.to(dtype) * scale.to(dtype)`` in each call, as ComfyUI computes them), never as a
``weight_dtype`` copy: the model is built empty, its block Linears get a one-element placeholder weight until
``lowmem.apply_low_memory`` swaps them for the stores. Every other tensor loads as ``from_pretrained`` would load
it (``weight_dtype``; float32 for the modules the transformer class keeps in float32): the teacher folder's, then
the file's over it (a quantized one dequantized by the same rule); a file that holds every tensor of the
transformer (ComfyUI's single files do) leaves the teacher folder's weights unread.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

__all__ = ["BaseWeights", "BaseWeightsError", "scan_base_weights", "block_linears", "load_base"]

#: per-layer tensors beside ``L.weight``: weight scales (ComfyUI fp8_scaled; the QAD export) and what is not used
SCALES = ("scale_weight", "weight_scale")
UNUSED = ("scale_input", "input_scale", "comfy_quant")
MARKERS = ("scaled_fp8",)
_SUFFIXES = ("scale_weight", "weight_scale_2", "weight_scale", "scale_input", "input_scale", "comfy_quant")
_SUFFIXES += ("weight", "bias")
_FLOAT = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_HELD = {"F8_E4M3": "fp8", "I8": "int8"}
_REFUSE_HINT = (
    "the frozen base can hold FP8 E4M3 (one scale per tensor or none) or INT8 (one scale per output channel): "
    "train on the teacher folder's weights with --base_dtype fp8 (or int8) instead, without --base_weights"
)


class BaseWeightsError(ValueError):
    """A ``base_weights`` file the trainer cannot use (one line)."""


@dataclass
class BaseWeights:
    """What ``scan_base_weights`` found: the format of the block Linears (``fmt`` "fp8" / "int8"), per block Linear
    ``(weight key, scale key or None)`` and per other parameter ``(key, scale key or None)``, by diffusers name."""

    path: str
    fmt: str
    scaled: bool
    linears: dict = field(default_factory=dict)
    others: dict = field(default_factory=dict)

    def describe(self) -> str:
        how = {"fp8": "FP8 E4M3, " + ("one scale per tensor" if self.scaled else "no scale"), "int8": "INT8"}
        return f"{len(self.linears)} block Linears {how[self.fmt]} from {self.path}"


def _empty_model(cls, config: dict, dtype=None):
    """``cls.from_config(config)`` without memory (parameters on the meta device), as ``from_pretrained`` builds it:
    under the default dtype ``dtype`` (its buffers are made in it)."""
    import accelerate
    from diffusers.models.modeling_utils import no_init_weights

    old = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        with no_init_weights(), accelerate.init_empty_weights():
            return cls.from_config(config)
    finally:
        torch.set_default_dtype(old)


def block_linears(model) -> dict[str, tuple[int, int]]:
    """``{diffusers name: (out, in)}`` of every ``nn.Linear`` inside the transformer blocks of ``model``."""
    from ..models import transformer_blocks

    where = {id(m): n for n, m in model.named_modules()}
    out = {}
    for block in transformer_blocks(model):
        for n, m in block.named_modules():
            if type(m) is torch.nn.Linear:
                out[f"{where[id(block)]}.{n}"] = (m.out_features, m.in_features)
    return out


def _split(key: str) -> tuple[str, str]:
    for s in _SUFFIXES:
        if key.endswith("." + s):
            return key[: -len(s) - 1], s
    return key, ""


def _shape(f, key) -> list[int]:
    return list(f.get_slice(key).get_shape())


def _dtype(f, key) -> str:
    return f.get_slice(key).get_dtype()


def scan_base_weights(path: str, cls, config: dict) -> BaseWeights:
    """Check a ``base_weights`` file against the teacher's transformer config from its header alone (no tensor is
    read): a safetensors file, a Wan teacher, every block Linear present with its shape, in a format the frozen base
    holds, every other key a parameter of the model with its shape. Raises ``BaseWeightsError`` (one line)."""
    from safetensors import safe_open

    from ..lora.keys import _strip_prefix, detect_format, rename_target

    opt = f"--base_weights {path}"
    p = os.path.expanduser(path)
    if not os.path.exists(p):
        raise BaseWeightsError(f"{opt}: no such file")
    if os.path.isdir(p):
        raise BaseWeightsError(f"{opt}: a folder; give the .safetensors file of the transformer")
    try:
        f = safe_open(p, "pt")
    except Exception as e:  # noqa: BLE001 - any header problem: not a file we read
        raise BaseWeightsError(
            f"{opt}: not a safetensors file ({type(e).__name__}); only safetensors files are read"
        ) from None
    if cls.__name__ != "WanTransformer3DModel":
        raise BaseWeightsError(f"{opt}: implemented for Wan teachers, not {cls.__name__}")
    meta = f.metadata() or {}
    keys = list(f.keys())
    if "_quantization_metadata" in meta:
        try:
            layers = json.loads(meta["_quantization_metadata"]).get("layers", {})
        except (ValueError, AttributeError):
            raise BaseWeightsError(f"{opt}: its _quantization_metadata is not JSON") from None
        bad = {
            n: c.get("format") for n, c in layers.items() if c.get("format") not in ("float8_e4m3fn", "int8_tensorwise")
        }
        if bad:
            n, fmt = next(iter(bad.items()))
            raise BaseWeightsError(f"{opt}: {len(bad)} layer(s) in {fmt} (e.g. {n}); {_REFUSE_HINT}")
    packed = [k for k in keys if k.endswith(".weight_scale_2")]
    if packed:
        raise BaseWeightsError(f"{opt}: NVFP4 layers ({packed[0][: -len('.weight_scale_2')]}, ...); {_REFUSE_HINT}")
    stripped = {_strip_prefix(k): k for k in keys}
    names = [k for k in stripped if k not in MARKERS]
    try:
        layout = detect_format(names)
    except ValueError as e:
        raise BaseWeightsError(f"{opt}: {e}") from None
    groups: dict[str, dict[str, str]] = {}
    unknown = []
    for k in names:
        target, suffix = _split(k)
        name = rename_target(target, "wan", "diffusers") if layout == "original" else target
        if name is None:
            unknown.append(stripped[k])
            continue
        groups.setdefault(name, {})[suffix] = stripped[k]
    with torch.random.fork_rng(devices=[]):  # building draws from the global RNG: leave it for the real build
        model = _empty_model(cls, config)
    linears = block_linears(model)
    params = {n: list(t.shape) for n, t in model.state_dict().items()}
    bw = BaseWeights(path=p, fmt="", scaled=False)
    missing, fmts, scaled = [], set(), set()
    for name, (out, k) in linears.items():
        g = groups.get(name, {})
        if "weight" not in g:
            missing.append(name)
            continue
        key = g["weight"]
        if _shape(f, key) != [out, k]:
            raise BaseWeightsError(
                f"{opt}: {key} is {_shape(f, key)}, the teacher's {name} is [{out}, {k}] (a file of another model?)"
            )
        dt = _dtype(f, key)
        fmt = _HELD.get(dt)
        if fmt is None:
            what = "not quantized" if dt in _FLOAT else "a format the frozen base does not hold"
            raise BaseWeightsError(f"{opt}: {key} is {dt}, {what}; {_REFUSE_HINT}")
        skey = next((g[s] for s in SCALES if s in g), None)
        if skey is not None:
            sh, sdt = _shape(f, skey), _dtype(f, skey)
            want = [[], [1]] if fmt == "fp8" else [[out, 1], [out]]
            if sdt not in _FLOAT or sh not in want:
                per = "one per tensor" if fmt == "fp8" else f"[{out}, 1]"
                raise BaseWeightsError(f"{opt}: {skey} is {sdt} {sh}; expected a float scale, {per}; {_REFUSE_HINT}")
        elif fmt == "int8":
            raise BaseWeightsError(f"{opt}: {key} is int8 without a weight_scale; {_REFUSE_HINT}")
        fmts.add(fmt)
        scaled.add(skey is not None)
        bw.linears[name] = (key, skey)
    if missing:
        shown = missing[0] if layout == "diffusers" else f"{rename_target(missing[0], 'wan', 'original')}.weight"
        raise BaseWeightsError(
            f"{opt}: no weight for {len(missing)} of the teacher's {len(linears)} block Linears, e.g. {shown}"
        )
    if len(fmts) > 1:
        raise BaseWeightsError(f"{opt}: block Linears in several formats ({', '.join(sorted(fmts))}); use one")
    bw.fmt = fmts.pop()
    bw.scaled = scaled == {True}
    for name, g in groups.items():
        skey = next((g[s] for s in SCALES if s in g), None)
        for suffix, key in g.items():
            if suffix in (*SCALES, *UNUSED) or (suffix == "weight" and name in linears):
                continue
            pname = f"{name}.{suffix}" if suffix else name
            if pname not in params:
                unknown.append(key)
                continue
            if _shape(f, key) != params[pname]:
                raise BaseWeightsError(f"{opt}: {key} is {_shape(f, key)}, the teacher's {pname} is {params[pname]}")
            dt = _dtype(f, key)
            if dt not in _FLOAT and dt not in _HELD:
                raise BaseWeightsError(f"{opt}: {key} is {dt}, not a float, FP8 E4M3 or INT8 tensor")
            bw.others[pname] = (key, skey if suffix == "weight" and dt in _HELD else None)
    if unknown:
        raise BaseWeightsError(
            f"{opt}: {len(unknown)} key(s) match no parameter of the teacher ({', '.join(sorted(unknown)[:3])}"
            f"{', ...' if len(unknown) > 3 else ''}); a file of another Wan model?"
        )
    return bw


def teacher_weight_files(pretrained: str, sub: str) -> list[str]:
    """The safetensors files of ``<pretrained>/<sub>`` (a local folder, else the hub cache)."""
    d = os.path.join(os.path.expanduser(pretrained), sub)
    if not os.path.isdir(d):
        from huggingface_hub import snapshot_download

        d = os.path.join(snapshot_download(pretrained, allow_patterns=[f"{sub}/*"]), sub)
    index = os.path.join(d, "diffusion_pytorch_model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            return [os.path.join(d, n) for n in sorted(set(json.load(fh)["weight_map"].values()))]
    one = os.path.join(d, "diffusion_pytorch_model.safetensors")
    if os.path.isfile(one):
        return [one]
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".safetensors"))


def load_base(cls, cfg, dtype, log=print):
    """The teacher transformer of ``cfg.pretrained`` with the block Linears of ``cfg.base_weights``: ``(model,
    stores, fmt)``, ``stores`` for ``lowmem.apply_low_memory`` (module docstring). On the host."""
    from safetensors import safe_open

    sub = cfg.transformer_subfolder
    config = dict(cls.load_config(cfg.pretrained, subfolder=sub))
    bw = scan_base_weights(cfg.base_weights, cls, config)
    keep = list(getattr(cls, "_keep_in_fp32_modules", None) or [])

    def target(name):  # the dtype from_pretrained(torch_dtype=dtype) gives this parameter
        return torch.float32 if any(m in name.split(".") for m in keep) else dtype

    model = _empty_model(cls, config, dtype)
    skip = {f"{n}.weight" for n in bw.linears}
    needed = set(model.state_dict()) - skip - set(bw.others)  # what the file leaves to the teacher folder
    sd = {}
    for path in teacher_weight_files(cfg.pretrained, sub) if needed else []:
        with safe_open(path, "pt") as f:
            for k in f.keys():
                if k in needed:
                    t = f.get_tensor(k)
                    sd[k] = t.to(target(k)) if t.is_floating_point() else t
    stores = {}
    with safe_open(bw.path, "pt") as f:
        for name, (key, skey) in bw.others.items():
            t, dt = f.get_tensor(key), target(name)
            w = t.to(dt)
            if skey is not None:
                s = f.get_tensor(skey).to(dt)
                w = w.mul_(s.reshape(-1, *[1] * (w.dim() - 1)) if s.numel() > 1 else s.reshape(()))
            sd[name] = w
        for name, (key, skey) in bw.linears.items():
            v = f.get_tensor(key)
            s = None
            if skey is not None:
                s = f.get_tensor(skey).float()
                s = s.reshape(()) if bw.fmt == "fp8" else s.reshape(-1, 1)
            stores[name] = (v, s)
    res = model.load_state_dict(sd, strict=False, assign=True)
    lacking = [k for k in res.missing_keys if k not in skip]
    if lacking:
        raise BaseWeightsError(
            f"--base_weights {cfg.base_weights}: {lacking[0]} is neither in the file nor in {cfg.pretrained}/{sub}"
        )
    for name in bw.linears:  # a one-element placeholder until apply_low_memory swaps in the store
        lin = model.get_submodule(name)
        ph = torch.zeros((), dtype=target(f"{name}.weight")).expand(lin.out_features, lin.in_features)
        lin.weight = torch.nn.Parameter(ph, requires_grad=False)
    model.register_to_config(_name_or_path=cfg.pretrained)
    model.eval()
    log(f"base weights: {bw.describe()}")
    return model, stores, bw.fmt
