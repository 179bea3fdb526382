"""Fake-quantized Linear layers over a diffusers Wan / Flux transformer (docs/math.md §7).

``quantize_transformer(model, "nvfp4")`` swaps every ``nn.Linear`` whose dotted name is not
excluded for a ``QuantLinear`` (a ``nn.Linear`` subclass: same parameters, same state-dict keys,
peft LoRA wraps it like any Linear). Default exclusions (``DEFAULT_EXCLUDE``, fnmatch patterns on
the full module name): patch / time / text / image / guidance embeddings, Wan's ``time_proj``
modulation, norm-modulation linears (Flux ``norm1.linear``, ``norm_out.linear``) and the final
``proj_out``. Override with ``exclude=`` (replace) / ``extra_exclude=`` (add) and ``overrides=``
(``{pattern: format or None}``, first match wins). A user pattern that matches no Linear raises.

Targets (the arithmetic trained):

- ``target="fake"``: weight-only (``act_fmt=None``) or weight + activation (``act_fmt`` given):
  activations are fake-quantized with our quantizer and a static per-tensor range (``input_amax``)
  calibrated on a few batches with ``calibration(model)``.
- ``target="comfyui"``: what ComfyUI executes for the layer's format on a GPU with native kernels
  for it (``formats.comfy_act_quant``): NVFP4 weights + NVFP4 activations with a static calibrated
  ``input_scale`` (``act_scale="static"``, exported) or a per-call one (``act_scale="dynamic"``, the
  mode ComfyUI falls back to without ``input_scale``); FP8 weights + FP8 activations with a calibrated
  ``input_scale`` (always exported); INT8 weights + dynamic per-row INT8 activations.
"""

from __future__ import annotations

import contextlib
import fnmatch

import torch
import torch.nn.functional as F

from .formats import COMFY_ACT, check_format, comfy_act_fake_quant, fake_quant, input_scale_of, quantize

__all__ = ["DEFAULT_EXCLUDE", "TARGETS", "QuantLinear", "quantize_transformer", "quant_layers", "calibration"]

TARGETS = ("fake", "comfyui")

DEFAULT_EXCLUDE = (
    "*embed*",  # Wan condition_embedder.*, patch_embedding; Flux x_embedder, context_embedder, time_text_embed.*
    "*time_proj*",  # Wan timestep -> modulation projection
    "*norm*",  # AdaLN modulation linears (Flux norm1.linear, norm1_context.linear, norm.linear, norm_out.linear)
    "proj_out",  # final projection to the latent channels (top-level only; Flux single blocks' proj_out stays)
)


class QuantLinear(torch.nn.Linear):
    """``y = x_hat W_hat^T + b`` with ``W_hat = fake_quant(W)`` and ``x_hat = fake_quant(x, amax)`` (docs/math.md §7).

    Weights: dynamic scales (NVFP4 / MXFP4 blocks; FP8 per tensor or, with ``per_channel``, per
    row; INT8 per row). Activations (``act_fmt``): static per-tensor range ``input_amax``.
    The fake-quantized weight is cached while the weight is frozen (LoRA scope).
    """

    def __init__(
        self,
        in_features,
        out_features,
        bias=True,
        *,
        fmt="nvfp4",
        act_fmt=None,
        per_channel=None,
        target="fake",
        act_scale="static",
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.fmt = check_format(fmt)
        self.per_channel = (fmt == "int8") if per_channel is None else bool(per_channel)
        if target not in TARGETS:
            raise ValueError(f"target {target!r}: use one of {TARGETS}")
        if act_scale not in ("static", "dynamic"):
            raise ValueError(f"act_scale {act_scale!r}: use 'static' or 'dynamic'")
        self.target = target
        if target == "comfyui":
            mode = COMFY_ACT.get(fmt)
            if mode is None:
                raise ValueError(f"target comfyui: ComfyUI has no layout for {fmt!r} (use nvfp4, fp8_e4m3 or int8)")
            if act_fmt not in (None, fmt):
                raise ValueError(f"target comfyui: ComfyUI quantizes a {fmt} layer's input as {fmt}, not {act_fmt}")
            if fmt == "fp8_e4m3" and act_scale == "dynamic":
                raise ValueError(
                    "target comfyui, fp8_e4m3: without input_scale ComfyUI casts activations to e4m3 at "
                    "scale 1.0 (saturating at +-448); use act_scale 'static' (calibrated, exported)"
                )
            if fmt == "fp8_e4m3" and self.per_channel:
                raise ValueError("target comfyui, fp8_e4m3: per-channel weight scales have no ComfyUI field")
            act_fmt = fmt
            act_scale = {"static_or_dynamic": act_scale, "static": "static", "dynamic_row": "dynamic"}[mode]
        self.act_fmt = None if act_fmt is None else check_format(act_fmt)
        self.act_scale = act_scale if self.act_fmt is not None else None
        self.register_buffer("input_amax", torch.tensor(float("nan")), persistent=True)
        self.calibrating = False
        self._cache = None

    @classmethod
    def from_linear(cls, lin: torch.nn.Linear, **kw) -> "QuantLinear":
        """Wrap ``lin``'s own parameters (no copy) in a ``QuantLinear``."""
        q = cls(
            lin.in_features,
            lin.out_features,
            lin.bias is not None,
            device=lin.weight.device,
            dtype=lin.weight.dtype,
            **kw,
        )
        q.weight, q.bias = lin.weight, lin.bias
        q.input_amax = q.input_amax.to(lin.weight.device)
        return q

    def quantized_weight(self) -> torch.Tensor:
        """``W_hat`` (differentiable, straight-through) in the weight dtype."""
        w = self.weight
        if not w.requires_grad:
            key = (w.data_ptr(), w._version, w.dtype, w.device)
            if self._cache is None or self._cache[0] != key:
                self._cache = (key, fake_quant(w.detach(), self.fmt, per_channel=self.per_channel))
            return self._cache[1]
        self._cache = None
        return fake_quant(w, self.fmt, per_channel=self.per_channel)

    def qtensor(self):
        """The weight's ``QTensor`` (what ``export`` writes); ``dequantize`` of it equals ``quantized_weight``."""
        return quantize(self.weight, self.fmt, per_channel=self.per_channel)

    @property
    def static_act(self) -> bool:
        """Whether this layer needs a calibrated ``input_amax`` (and exports an ``input_scale``)."""
        return self.act_fmt is not None and self.act_scale == "static"

    def input_scale(self):
        """The FP32 ``input_scale`` ComfyUI reads (``formats.input_scale_of``), ``None`` when dynamic."""
        return input_scale_of(self.fmt, self.input_amax) if self.static_act else None

    def forward(self, x):
        if self.target == "comfyui":
            if self.calibrating and self.static_act:
                self._record(x)
            else:
                if self.static_act and torch.isnan(self.input_amax):
                    raise RuntimeError(
                        f"{self._qname}: target comfyui ({self.fmt}, static input_scale) needs a calibrated "
                        "input_amax; run a few batches under rcm_diffusers.quant.modules.calibration(model)"
                    )
                x = comfy_act_fake_quant(x, self.fmt, self.input_scale())
            return F.linear(x, self.quantized_weight(), self.bias)
        if self.act_fmt is not None and not self.static_act:
            x = fake_quant(x, self.act_fmt)  # dynamic per-tensor range of this call
        elif self.act_fmt is not None:
            if self.calibrating:
                self._record(x)
            else:
                if torch.isnan(self.input_amax):
                    raise RuntimeError(
                        f"{self._qname}: activation quantization ({self.act_fmt}) needs a calibrated "
                        "input_amax; run a few batches under rcm_diffusers.quant.modules.calibration(model)"
                    )
                x = fake_quant(x, self.act_fmt, amax=self.input_amax.to(x.dtype))
        return F.linear(x, self.quantized_weight(), self.bias)

    def _record(self, x):
        a = x.detach().abs().amax().float()
        if not torch.isfinite(a):
            raise ValueError(f"{self._qname}: non-finite activation (max |x| = {a.item()}) during calibration")
        self.input_amax = torch.where(torch.isnan(self.input_amax), a, torch.maximum(self.input_amax, a))

    _qname = "QuantLinear"

    def extra_repr(self):
        return (
            f"{super().extra_repr()}, fmt={self.fmt}, act_fmt={self.act_fmt}, act_scale={self.act_scale}, "
            f"per_channel={self.per_channel}, target={self.target}"
        )


def _match(name: str, patterns) -> str | None:
    return next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)


def quantize_transformer(
    model: torch.nn.Module,
    fmt: str = "nvfp4",
    *,
    act_fmt: str | None = None,
    per_channel: bool | None = None,
    exclude=DEFAULT_EXCLUDE,
    extra_exclude=(),
    overrides: dict | None = None,
    target: str = "fake",
    act_scale: str = "static",
) -> dict[str, QuantLinear]:
    """Swap ``model``'s Linear layers for ``QuantLinear`` in place; return ``{name: QuantLinear}`` (docs/math.md §7).

    A layer is skipped when its name matches ``exclude`` or ``extra_exclude``, unless an
    ``overrides`` pattern names a format for it (``None`` as the format skips it). ``target`` /
    ``act_scale``: the arithmetic trained (module docstring); under ``comfyui`` each layer's activation
    format follows its own weight format. Raises ``ValueError`` for an unknown format or a user pattern that
    matches no Linear layer.
    """
    check_format(fmt)
    if act_fmt is not None:
        check_format(act_fmt)
    overrides = dict(overrides or {})
    for f in overrides.values():
        if f is not None:
            check_format(f)
    linears = {
        n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not isinstance(m, QuantLinear)
    }
    user = list(extra_exclude) + list(overrides) + ([] if exclude is DEFAULT_EXCLUDE else list(exclude))
    unmatched = [p for p in user if not any(fnmatch.fnmatchcase(n, p) for n in linears)]
    if unmatched:
        raise ValueError(
            f"quantization patterns match no Linear layer: {unmatched} (layers look like {sorted(linears)[:4]}...)"
        )
    swapped = {}
    for name, lin in linears.items():
        hit = _match(name, overrides)
        if hit is not None:
            f = overrides[hit]
        elif _match(name, tuple(exclude) + tuple(extra_exclude)):
            continue
        else:
            f = fmt
        if f is None:
            continue
        q = QuantLinear.from_linear(
            lin,
            fmt=f,
            act_fmt=None if target == "comfyui" else act_fmt,
            per_channel=per_channel if f == fmt else None,
            target=target,
            act_scale=act_scale,
        )
        q._qname = name
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, q)
        swapped[name] = q
    if not swapped:
        raise ValueError("no Linear layer left to quantize after exclusions")
    return swapped


def quant_layers(model: torch.nn.Module) -> dict[str, QuantLinear]:
    """``{name: QuantLinear}`` of a swapped model (names without peft's ``base_layer`` suffix)."""
    return {n.replace(".base_layer", ""): m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


@contextlib.contextmanager
def calibration(model: torch.nn.Module, reset: bool = True):
    """Record ``input_amax = max |x|`` of every activation-quantized layer over the batches run inside.

    On exit, raises ``RuntimeError`` naming layers that saw no batch. NaN/inf inputs raise ``ValueError``.
    """
    layers = {n: m for n, m in quant_layers(model).items() if m.static_act}
    if not layers:
        raise ValueError("calibration: no layer quantizes activations with a static range")
    for m in layers.values():
        if reset:
            m.input_amax.fill_(float("nan"))
        m.calibrating = True
    try:
        yield layers
    finally:
        for m in layers.values():
            m.calibrating = False
    missing = [n for n, m in layers.items() if torch.isnan(m.input_amax)]
    if missing:
        raise RuntimeError(f"calibration: layers never called: {missing}")
