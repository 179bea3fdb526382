"""Low-bit number formats and fake quantization with a straight-through gradient (docs/math.md §7).

Written here rather than taken from torchao / modelopt / comfy-kitchen: their NVFP4 and MX
fake-quant paths either need CUDA (Blackwell kernels) or have no straight-through gradient, and
QAD needs both a CPU path (tests, the digits benchmark) and a differentiable one.

Formats (quantization runs along the **last** dimension, the reduction dimension of a Linear:
weights ``[out, in]``, activations ``[..., in]``):

- ``nvfp4``: E2M1 elements {0, .5, 1, 1.5, 2, 3, 4, 6} (and signs), blocks of 16, one E4M3 scale
  per block, one FP32 scale per tensor. ``s2 = amax / (6 * 448)``; per block
  ``s_b = e4m3(min(amax_b / 6 / s2, 448))``; ``q = e2m1(x / (s_b * s2))``; ``x_hat = q * (s2 * s_b)``.
- ``mxfp4``: E2M1 elements, blocks of 32, one power-of-two (E8M0) scale per block (OCP MX rule):
  ``s_b = 2^(floor(log2 amax_b) - 2)`` (2 = exponent of E2M1's largest value), exponent clamped to
  [-127, 127]; elements above 6 after scaling saturate to 6.
- ``fp8_e4m3``: ``s = amax / 448`` per tensor or per output channel (rows of the weight);
  ``x_hat = e4m3(x / s) * s``.
- ``int8``: symmetric, ``s = amax / 127``; ``x_hat = clamp(round(x / s), -127, 127) * s``.

Rounding is round-to-nearest-even everywhere. A zero block (or an all-zero tensor) quantizes to
zeros. **Block tails**: when the last dimension is not a multiple of the block size, the tail is
zero-padded to a full block (``pad=True``, the default, which is also how ComfyUI's NVFP4 storage
pads); ``pad=False`` refuses with ``ValueError``. Zero padding never changes a block's amax.

**Gradient** (``fake_quant``): exactly 1 for every element inside the range the scales cover and
0 outside it. With dynamic scales (weights, computed from the tensor itself) every element is
inside, so the gradient is the identity; saturation caused only by scale rounding (E4M3 block
scales, the E8M0 floor rule) counts as rounding, not clipping. With a static ``amax`` (calibrated
activations) elements with ``|x| > amax`` are clipped to ``+-amax`` in the forward pass and get
gradient 0 (clipped straight-through estimator).

**Deployment arithmetic** (``comfy_act_quant``): the activation quantizers ComfyUI 0.29 runs
(``comfy/ops.py`` ``mixed_precision_ops.Linear.forward`` -> ``QuantizedTensor.from_float`` ->
comfy-kitchen 0.2.24 ``backends/eager/quantization.py``), reproduced operation by operation:

- ``nvfp4`` (``quantize_nvfp4``): per-tensor ``s2 = input_scale`` (static, exported) or, without one,
  ``amax(|x|) / (448 * 6)`` of the whole 2-D input per call (dynamic); per block of 16
  ``s_b = e4m3(min(amax_b / 6 / s2, 448))``; ``q = e2m1(clamp(x / (s2 s_b), +-6))`` (no clipping of ``x``
  before the block scales). Elements with ``|x| > 6 * 448 * s2`` saturate (gradient 0).
- ``fp8_e4m3`` (``quantize_per_tensor_fp8``): ``q = e4m3(clamp(x * (1 / s), +-448))`` with the reciprocal
  rounded to ``x.dtype`` and the product taken in ``x.dtype``; ``s = input_scale``, or ``1.0`` when the
  file has none (ComfyUI's fallback). Saturated elements get gradient 0.
- ``int8`` (``int8_linear`` -> ``quantize_int8_rowwise``): dynamic per row (one token):
  ``s = max(amax_row / 127, 1e-30)``, ``q = clamp(round(x / s), -128, 127)``.

``x_hat = q * scale`` in float32, returned in ``x.dtype``: the tensor-core GEMM accumulates the exact
products ``q_x q_w`` in float32 and applies the scales after, the same numbers up to float32 summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "FORMATS",
    "E2M1_VALUES",
    "E4M3_MAX",
    "QTensor",
    "check_format",
    "round_e2m1",
    "round_e4m3",
    "quantize",
    "dequantize",
    "fake_quant",
    "COMFY_ACT",
    "input_scale_of",
    "comfy_act_quant",
    "comfy_act_fake_quant",
]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
INT8_MAX = 127.0

#: format name -> (block size or None, element max)
FORMATS = {"nvfp4": (16, E2M1_MAX), "mxfp4": (32, E2M1_MAX), "fp8_e4m3": (None, E4M3_MAX), "int8": (None, INT8_MAX)}


def check_format(fmt: str) -> str:
    """Return ``fmt`` if it is one of ``FORMATS``, else raise ``ValueError`` naming the known ones."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; known: {', '.join(FORMATS)}")
    return fmt


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even mantissa), saturating at +-6 (docs/math.md §7)."""
    a = y.abs()
    # grid step 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6]; torch.round is half-to-even on the step index,
    # and an even step index is an even mantissa in every binade
    q = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.copysign(q.clamp(max=E2M1_MAX), y)


def round_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round float32 to the nearest FP8 E4M3 (fn) value, saturating at +-448 (docs/math.md §7)."""
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


@dataclass
class QTensor:
    """A quantized tensor: ``values`` in the element domain (float32, exactly representable in the
    format), ``scale`` (per block / channel / tensor, float32) and, for NVFP4, ``scale_2`` (FP32 per tensor).

    Block formats keep ``values`` as ``[..., n_blocks, block]`` (padded) and ``scale`` as
    ``[..., n_blocks]``; ``shape`` is the original shape.
    """

    fmt: str
    shape: tuple
    values: torch.Tensor
    scale: torch.Tensor
    scale_2: torch.Tensor | None = None


def _blocks(x: torch.Tensor, block: int, pad: bool) -> torch.Tensor:
    k = x.shape[-1]
    if k % block:
        if not pad:
            raise ValueError(
                f"block size {block} does not divide the reduction dimension {k} "
                f"(shape {tuple(x.shape)}); use pad=True to zero-pad the tail block"
            )
        x = torch.nn.functional.pad(x, (0, block - k % block))
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _safe(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s == 0, torch.ones_like(s), s)


def quantize(
    x: torch.Tensor, fmt: str, *, amax: torch.Tensor | float | None = None, per_channel: bool = False, pad: bool = True
) -> QTensor:
    """Quantize ``x`` along its last dimension (docs/math.md §7 formats and scale rules, see the module docstring).

    ``amax``: a static range (calibrated activations); ``x`` is clipped to ``+-amax`` first and the
    per-tensor scales (NVFP4 ``s2``, FP8/INT8 ``s``) use it. ``None``: scales from ``x`` itself.
    ``per_channel`` (FP8/INT8 only): one scale per row (amax over the last dimension).
    """
    check_format(fmt)
    block, qmax = FORMATS[fmt]
    xf = x.detach().to(torch.float32)
    if amax is not None:
        amax = torch.as_tensor(amax, dtype=torch.float32, device=xf.device)
        xf = torch.maximum(torch.minimum(xf, amax), -amax)
    if per_channel and block is not None:
        raise ValueError(f"per_channel applies to fp8_e4m3 / int8; {fmt} already has per-block scales")

    if fmt == "nvfp4":
        xb = _blocks(xf, block, pad)
        a_t = xb.abs().amax() if amax is None else amax
        s2 = (a_t / (E2M1_MAX * E4M3_MAX)).to(torch.float32)
        s2 = _safe(s2)  # all-zero tensor: any scale works, every value is 0
        s_b = round_e4m3(xb.abs().amax(-1) / E2M1_MAX / s2)
        total = s2 * s_b
        q = torch.where(total[..., None] == 0, torch.zeros_like(xb), round_e2m1(xb / _safe(total)[..., None]))
        return QTensor(fmt, tuple(x.shape), q, s_b, s2)
    if fmt == "mxfp4":
        xb = _blocks(xf, block, pad)
        a_b = xb.abs().amax(-1)
        _, e = torch.frexp(a_b)  # a_b = m 2^e with m in [0.5, 1): floor(log2 a_b) = e - 1, exact
        exp = torch.where(a_b > 0, e - 1 - 2, torch.full_like(e, -127)).clamp(-127, 127)
        s_b = torch.ldexp(torch.ones_like(a_b), exp)
        q = round_e2m1(xb / s_b[..., None])
        return QTensor(fmt, tuple(x.shape), q, s_b)
    # per-tensor / per-channel formats
    if amax is not None:
        a = amax.expand(xf.shape[:-1] + (1,)) if per_channel else amax
    else:
        a = xf.abs().amax(-1, keepdim=True) if per_channel else xf.abs().amax()
    s = _safe((a / qmax).to(torch.float32))
    if fmt == "fp8_e4m3":
        q = round_e4m3(xf / s)
    else:
        q = torch.round(xf / s).clamp(-qmax, qmax)
    return QTensor(fmt, tuple(x.shape), q, s)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x_hat`` of a ``QTensor`` in ``dtype`` (docs/math.md §7): ``values * scale`` (NVFP4:
    ``values * (scale_2 * scale)``)."""
    if q.fmt in ("nvfp4", "mxfp4"):
        s = q.scale if q.scale_2 is None else q.scale_2 * q.scale
        y = (q.values * s[..., None]).flatten(-2)[..., : q.shape[-1]]
        return y.reshape(q.shape).to(dtype)
    return (q.values * q.scale).to(dtype)


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmt, amax, per_channel, pad):
        y = dequantize(quantize(x, fmt, amax=amax, per_channel=per_channel, pad=pad), x.dtype)
        if amax is not None:
            ctx.save_for_backward(x.detach().abs() <= torch.as_tensor(amax, dtype=x.dtype, device=x.device))
        ctx.static = amax is not None
        return y

    @staticmethod
    def backward(ctx, g):
        if ctx.static:
            (inside,) = ctx.saved_tensors
            g = g * inside
        return g, None, None, None, None


def fake_quant(x: torch.Tensor, fmt: str, *, amax=None, per_channel: bool = False, pad: bool = True) -> torch.Tensor:
    """Quantize -> dequantize in the forward pass, straight-through gradient in the backward (docs/math.md §7).

    ``dx = dy`` where ``|x| <= amax`` (everywhere when ``amax`` is None), ``0`` elsewhere.
    NaN/inf in ``x`` are not checked here (one device sync per call); calibration and export check.
    """
    check_format(fmt)
    return _FakeQuant.apply(x, fmt, amax, per_channel, pad)


#: weight format -> how ComfyUI quantizes that layer's input: "static_or_dynamic" (nvfp4: ``input_scale``
#: if the file has one, else per call), "static" (fp8: ``input_scale``, else scale 1.0), "dynamic_row" (int8)
COMFY_ACT = {"nvfp4": "static_or_dynamic", "fp8_e4m3": "static", "int8": "dynamic_row"}


def input_scale_of(fmt: str, amax: torch.Tensor) -> torch.Tensor:
    """The exported FP32 ``input_scale`` for a calibrated range ``amax``: ``amax / (6 * 448)`` (nvfp4),
    ``amax / 448`` (fp8_e4m3). Training under target ``comfyui`` uses exactly this number."""
    amax = amax.detach().to(torch.float32)
    if fmt == "nvfp4":
        return amax / (E2M1_MAX * E4M3_MAX)
    if fmt == "fp8_e4m3":
        return amax / E4M3_MAX
    raise ValueError(f"{fmt}: ComfyUI has no input_scale field for this format")


def _comfy_act(x: torch.Tensor, fmt: str, input_scale):
    """``(x_hat, inside)``: ComfyUI's activation quantization of ``x`` (see the module docstring) and the
    mask of elements inside the representable range (the straight-through region)."""
    K = x.shape[-1]
    x2 = x.detach().reshape(-1, K)
    if fmt == "nvfp4":
        s2 = (
            (torch.amax(x2.abs()) / (E4M3_MAX * E2M1_MAX)).to(torch.float32)
            if input_scale is None
            else torch.as_tensor(input_scale, dtype=torch.float32, device=x.device)
        )
        xb = _blocks(x2, 16, True)
        s_b = round_e4m3(torch.clamp(torch.amax(xb.abs(), -1).to(torch.float32) / E2M1_MAX / s2, max=E4M3_MAX))
        total = s2 * s_b
        zero = total == 0
        q = xb.float() / torch.where(zero, torch.ones_like(total), total)[..., None]
        q = torch.where(zero[..., None], torch.zeros_like(q), q)
        q = round_e2m1(q.clamp(-E2M1_MAX, E2M1_MAX))
        y = (q * total[..., None]).flatten(-2)[:, :K]
        inside = x2.abs().float() <= E2M1_MAX * E4M3_MAX * s2
    elif fmt == "fp8_e4m3":
        s = (
            torch.ones((), dtype=torch.float32, device=x.device)
            if input_scale is None
            else torch.as_tensor(input_scale, dtype=torch.float32, device=x.device)
        )
        t = x2 * (1.0 / s).to(x2.dtype)
        inside = t.abs() <= E4M3_MAX
        q = t.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        y = q.to(torch.float32) * s
    elif fmt == "int8":
        if input_scale is not None:
            raise ValueError("int8: ComfyUI quantizes activations per row dynamically; it has no input_scale")
        s = (x2.abs().amax(-1, keepdim=True).float() / INT8_MAX).clamp(min=1e-30)
        q = torch.round(x2 / s.to(x2.dtype)).clamp(-128.0, 127.0)
        y = q.float() * s
        inside = torch.ones_like(x2, dtype=torch.bool)
    else:
        raise ValueError(f"{fmt}: ComfyUI has no activation quantizer for this format (nvfp4, fp8_e4m3, int8)")
    return y.to(x.dtype).reshape(x.shape), inside.reshape(x.shape)


def comfy_act_quant(x: torch.Tensor, fmt: str, input_scale=None) -> torch.Tensor:
    """ComfyUI's quantize -> dequantize of a Linear input ``x`` for weight format ``fmt`` (no gradient);
    ``input_scale`` as exported (``input_scale_of``) or ``None`` (nvfp4: per call; fp8: 1.0; int8: always None)."""
    return _comfy_act(x, fmt, input_scale)[0]


class _ComfyActQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmt, input_scale):
        y, inside = _comfy_act(x, fmt, input_scale)
        ctx.save_for_backward(inside)
        return y

    @staticmethod
    def backward(ctx, g):
        (inside,) = ctx.saved_tensors
        return g * inside, None, None


def comfy_act_fake_quant(x: torch.Tensor, fmt: str, input_scale=None) -> torch.Tensor:
    """``comfy_act_quant`` in the forward pass, straight-through gradient inside the representable range
    (0 where an element saturates) in the backward (docs/math.md §7)."""
    return _ComfyActQuant.apply(x, fmt, input_scale)
