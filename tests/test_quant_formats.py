"""Fake-quant numerics (docs/math.md §7) against an independent float64 reference written element by element."""

from __future__ import annotations

import math

import pytest
import torch

from rcm_diffusers.quant.formats import E2M1_VALUES, FORMATS, dequantize, fake_quant, quantize, round_e2m1, round_e4m3

# ----------------------------------------------------------------------------- float64 reference


def f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float64).to(torch.float32))


def _nearest(y: float, grid: list[tuple[float, int]]) -> float:
    """Nearest grid magnitude to |y|, ties to the even code; sign copied; saturates at the top."""
    a = abs(y)
    best = min(grid, key=lambda vc: (abs(vc[0] - a), vc[1] & 1))
    return math.copysign(best[0], y)


E2M1_GRID = [(v, i) for i, v in enumerate(E2M1_VALUES)]
# E4M3 (fn): exponent bias 7, subnormals m/8 * 2^-6, no infinities, 0x7F is NaN -> max 448
E4M3_GRID = [
    ((m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7), (e << 3) | m)
    for e in range(16)
    for m in range(8)
    if not (e == 15 and m == 7)
]


def ref_e2m1(y):
    return _nearest(y, E2M1_GRID)


def ref_e4m3(y):
    return _nearest(y, E4M3_GRID)


def ref_nvfp4(x: torch.Tensor) -> torch.Tensor:
    rows, k = x.shape
    xs = x.double().tolist()
    amax = max(abs(v) for r in xs for v in r)
    s2 = f32(amax / (6 * 448)) or 1.0
    out = torch.zeros(rows, k, dtype=torch.float64)
    for i in range(rows):
        for b0 in range(0, k, 16):
            blk = xs[i][b0 : b0 + 16]
            s_b = ref_e4m3(f32(f32(max(abs(v) for v in blk) / 6) / s2))
            tot = f32(s2 * s_b)
            for j, v in enumerate(blk):
                out[i, b0 + j] = 0.0 if tot == 0 else f32(ref_e2m1(f32(v / tot)) * tot)
    return out


def ref_mxfp4(x: torch.Tensor) -> torch.Tensor:
    rows, k = x.shape
    xs = x.double().tolist()
    out = torch.zeros(rows, k, dtype=torch.float64)
    for i in range(rows):
        for b0 in range(0, k, 32):
            blk = xs[i][b0 : b0 + 32]
            a = max(abs(v) for v in blk)
            e = math.floor(math.log2(a)) - 2 if a > 0 else -127
            s = 2.0 ** max(-127, min(127, e))
            for j, v in enumerate(blk):
                out[i, b0 + j] = ref_e2m1(v / s) * s
    return out


def ref_scaled(x: torch.Tensor, fmt: str, per_channel: bool) -> torch.Tensor:
    qmax = 448.0 if fmt == "fp8_e4m3" else 127.0
    xs = x.double().tolist()
    amaxes = [max(abs(v) for v in r) for r in xs] if per_channel else [max(abs(v) for r in xs for v in r)] * len(xs)
    out = torch.zeros_like(x, dtype=torch.float64)
    for i, r in enumerate(xs):
        s = f32(amaxes[i] / qmax) or 1.0
        for j, v in enumerate(r):
            y = f32(v / s)
            q = ref_e4m3(max(-448.0, min(448.0, y))) if fmt == "fp8_e4m3" else max(-127, min(127, round(y)))
            out[i, j] = f32(q * s)
    return out


def sample(rows=6, k=40, seed=0) -> torch.Tensor:
    """Random rows with a heavy tail, a zero block, a zero row and a tail block (k % 16 != 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))
    x[1, :16] = 0  # zero block
    x[2] = 0  # zero row
    x[3, 5] = 40.0  # outlier sets the tensor amax
    x[4, 16:32] *= 1e-4  # tiny block: E4M3 subnormal block scale
    return x


# ----------------------------------------------------------------------------- element grids


def test_e2m1_value_set_and_ties():
    y = torch.linspace(-8, 8, 20001)
    got = set(round_e2m1(y).abs().tolist())
    assert got == set(E2M1_VALUES)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.25, -5.0])
    assert round_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -4.0]
    r = torch.randn(2000, generator=torch.Generator().manual_seed(1)) * 3
    assert round_e2m1(r).tolist() == [ref_e2m1(v) for v in r.tolist()]


def test_e4m3_matches_reference():
    g = torch.Generator().manual_seed(2)
    y = torch.cat(
        [
            torch.randn(3000, generator=g) * 100,
            torch.randn(1000, generator=g) * 2.0**-8,
            torch.tensor([448.0, 460.0, 1e4, -1e4, 2.0**-10, 3 * 2.0**-11]),
        ]
    )
    assert round_e4m3(y).tolist() == [ref_e4m3(max(-448.0, min(448.0, v))) for v in y.tolist()]
    assert round_e4m3(torch.tensor([1e4])).item() == 448.0


# ----------------------------------------------------------------------------- formats vs reference


@pytest.mark.parametrize("k", [48, 40, 7])
def test_nvfp4_matches_reference(k):
    x = sample(k=max(k, 17))[:, :k] if k < 17 else sample(k=k)
    q = quantize(x, "nvfp4")
    torch.testing.assert_close(dequantize(q).double(), ref_nvfp4(x), rtol=0, atol=0)
    # scale rules: FP32 tensor scale amax/(6*448), E4M3-representable block scales, E2M1 values
    assert q.scale_2.dtype == torch.float32 and q.scale_2.item() == f32(x.abs().max().item() / 2688)
    assert torch.equal(q.scale, round_e4m3(q.scale)) and q.scale.max() <= 448
    assert set(q.values.abs().unique().tolist()) <= set(E2M1_VALUES)
    assert q.values.shape == (x.shape[0], math.ceil(k / 16), 16)
    assert torch.all(dequantize(q)[2] == 0)


@pytest.mark.parametrize("k", [64, 40])
def test_mxfp4_matches_reference(k):
    x = sample(k=k, seed=3)
    q = quantize(x, "mxfp4")
    torch.testing.assert_close(dequantize(q).double(), ref_mxfp4(x), rtol=0, atol=0)
    m, _ = torch.frexp(q.scale)
    assert torch.all(m == 0.5)  # powers of two (E8M0)
    assert torch.all(dequantize(q)[2] == 0)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_scaled_formats_match_reference(fmt, per_channel):
    x = sample(seed=4)
    q = quantize(x, fmt, per_channel=per_channel)
    torch.testing.assert_close(dequantize(q).double(), ref_scaled(x, fmt, per_channel), rtol=0, atol=0)
    assert q.scale.shape == ((x.shape[0], 1) if per_channel else ())


def test_error_sizes_are_those_of_the_formats():
    """Relative RMS error on Gaussian weights: NVFP4 < MXFP4 (finer scales), FP8/INT8 far below both."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    err = {f: ((dequantize(quantize(w, f, per_channel=f in ("int8",))) - w).norm() / w.norm()).item() for f in FORMATS}
    assert 0.08 < err["nvfp4"] < 0.105 < err["mxfp4"] < 0.13, err
    assert err["fp8_e4m3"] < 0.04 and err["int8"] < 0.02, err


# ----------------------------------------------------------------------------- straight-through gradient


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_ste_is_identity_on_a_linear_probe(fmt):
    w = sample(k=48, seed=6).requires_grad_(True)
    c = torch.randn(w.shape, generator=torch.Generator().manual_seed(7))
    (fake_quant(w, fmt) * c).sum().backward()
    assert torch.equal(w.grad, c)


def test_ste_static_amax_clips_outside():
    x = torch.tensor([[-3.0, -1.0, 0.5, 1.9, 2.0, 2.1, 5.0] + [0.0] * 9], requires_grad=True)
    c = torch.arange(1.0, 17.0)[None]
    y = fake_quant(x, "fp8_e4m3", amax=2.0)
    (y * c).sum().backward()
    inside = (x.detach().abs() <= 2.0).float()
    assert torch.equal(x.grad, c * inside)
    assert y.detach().abs().max().item() == 2.0  # clipped to +-amax in the forward


# ----------------------------------------------------------------------------- bad input


def test_bad_input_errors():
    x = torch.randn(4, 40)
    with pytest.raises(ValueError, match="unknown quantization format 'nvfp8'"):
        quantize(x, "nvfp8")
    with pytest.raises(ValueError, match="unknown quantization format"):
        fake_quant(x, "fp4")
    with pytest.raises(ValueError, match="block size 16 does not divide the reduction dimension 40"):
        quantize(x, "nvfp4", pad=False)
    with pytest.raises(ValueError, match="per_channel"):
        quantize(x, "mxfp4", per_channel=True)


# ----------------------------------------------------------------------------- torchao (optional)


def test_nvfp4_and_mxfp4_agree_with_torchao():
    pytest.importorskip("torchao.prototype.mx_formats", reason="torchao not installed: NVFP4/MX cross-check skipped")
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    x = sample(k=64, seed=8)
    x[2] = torch.randn(64)  # torchao divides by a zero amax on an all-zero row; keep the zero block
    # torchao clamps NVFP4 block scales below at E4M3's smallest normal (2^-6); we (like ComfyUI's
    # quantizer) round them to E4M3 subnormals. The rules differ only for such tiny blocks:
    tiny = x[4, 16:32].clone()
    assert not torch.equal(
        quantize(x, "nvfp4").scale[4, 1:2], round_e4m3(quantize(x, "nvfp4").scale[4, 1:2]).clamp(min=2.0**-6)
    )
    x[4, 16:32] = tiny * 1e4
    ours = dequantize(quantize(x, "nvfp4"))
    theirs = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().max())).dequantize(torch.float32)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    ours = dequantize(quantize(x, "mxfp4"))
    theirs = MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32).dequantize(torch.float32)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


# ----------------------------------------------------------------------------- ComfyUI's activation arithmetic
# References written element by element from comfy-kitchen 0.2.24 backends/eager/quantization.py
# (quantize_nvfp4, quantize_per_tensor_fp8, quantize_int8_rowwise) and ComfyUI 0.29 comfy/quant_ops.py
# (TensorCoreNVFP4Layout / _TensorCoreFP8LayoutBase.quantize: the dynamic / missing input_scale fallbacks).


def ref_comfy_nvfp4(rows, input_scale=None):
    """float64 per element; the per-tensor scale is the FP32 number ComfyUI holds (file value or amax/2688 in fp32)."""
    s2 = f32(max(abs(v) for r in rows for v in r) / 2688.0) if input_scale is None else input_scale
    out = []
    for r in rows:
        o = []
        for b0 in range(0, len(r), 16):
            blk = r[b0 : b0 + 16]
            s_b = ref_e4m3(min(f32(f32(max(abs(v) for v in blk) / 6.0) / s2), 448.0))
            tot = f32(s2 * s_b)
            o += [0.0 if tot == 0 else ref_e2m1(max(-6.0, min(6.0, v / tot))) * tot for v in blk]
        out.append(o)
    return out


def test_comfy_nvfp4_activations_static_and_dynamic_vs_float64():
    from rcm_diffusers.quant.formats import comfy_act_fake_quant, comfy_act_quant, input_scale_of

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 40, generator=g) * torch.logspace(-3, 1, 40)  # K = 40: a zero-padded tail block
    x[0, 1, 7] = 9.0  # an outlier the static range below clips
    rows = x.reshape(-1, 40).double().tolist()
    for scale in (None, input_scale_of("nvfp4", torch.tensor(4.0))):
        got = comfy_act_quant(x, "nvfp4", scale).reshape(-1, 40).double()
        ref = torch.tensor(
            ref_comfy_nvfp4(rows, None if scale is None else float(scale))
        ).double()  # x_hat held in fp32
        # fp32 vs float64 division can only move a value lying within ~1e-7 of a rounding boundary
        assert (got == ref).double().mean() > 0.995 and torch.allclose(got, ref, rtol=0, atol=0.35), scale
    # static range: |x| > 6 * 448 * s2 = 4 saturates at +-4 and gets no gradient; the rest passes straight through
    xs = x.clone().requires_grad_(True)
    y = comfy_act_fake_quant(xs, "nvfp4", input_scale_of("nvfp4", torch.tensor(4.0)))
    assert y[0, 1, 7].item() == pytest.approx(4.0, rel=1e-6)
    y.sum().backward()
    assert xs.grad[0, 1, 7] == 0 and torch.equal(
        xs.grad.flatten()[x.abs().flatten() <= 4.0 - 1e-6], torch.ones(int((x.abs() <= 4.0 - 1e-6).sum()))
    )
    # dynamic: the tensor scale is the whole call's amax (the batch matters), not a per-sample one
    a, b = comfy_act_quant(x, "nvfp4"), comfy_act_quant(x[1:], "nvfp4")
    assert not torch.equal(a[1:], b)


def test_comfy_fp8_activations_multiply_by_the_rounded_reciprocal():
    from rcm_diffusers.quant.formats import comfy_act_fake_quant, comfy_act_quant, input_scale_of

    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 48, generator=g) * 3
    s = input_scale_of("fp8_e4m3", torch.tensor(5.0))
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        r = float((1.0 / s).to(dtype))  # ComfyUI: x * (1 / scale).to(x.dtype), product in x.dtype
        ref = torch.tensor(
            [
                [
                    ref_e4m3(max(-448.0, min(448.0, float(torch.tensor(v * r, dtype=torch.float64).to(dtype)))))
                    * float(s)
                    for v in row
                ]
                for row in xd.double().tolist()
            ],
            dtype=torch.float64,
        )
        got = comfy_act_quant(xd, "fp8_e4m3", s).double()
        assert torch.allclose(got, ref.to(dtype).double(), rtol=0, atol=0), dtype
    # bf16: dividing by the scale instead would give other numbers (the reciprocal is rounded to bf16 first)
    xb = x.to(torch.bfloat16)
    by_division = (round_e4m3(xb.float() / s) * s).to(torch.bfloat16)
    assert not torch.equal(comfy_act_quant(xb, "fp8_e4m3", s), by_division)
    # no input_scale: ComfyUI casts at scale 1.0: |x| > 448 saturates (no gradient), tiny values flush to 0
    x1 = torch.tensor([1000.0, -500.0, 300.0, 1e-4, 0.01], requires_grad=True)
    y = comfy_act_fake_quant(x1, "fp8_e4m3")
    assert y.tolist() == [448.0, -448.0, 288.0, 0.0, ref_e4m3(0.01)]
    y.sum().backward()
    assert x1.grad.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]


def test_comfy_int8_activations_per_row_vs_float64():
    from rcm_diffusers.quant.formats import comfy_act_fake_quant, comfy_act_quant

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, 33, generator=g) * torch.linspace(0.01, 10, 7)[:, None]
    x[0, 2] = 0.0  # an all-zero row stays zero
    ref = []
    for row in x.reshape(-1, 33).double().tolist():
        s = max(f32(max(abs(v) for v in row) / 127.0), 1e-30)
        ref.append([max(-128, min(127, round(v / s))) * s for v in row])  # Python round: half to even
    got = comfy_act_quant(x, "int8").reshape(-1, 33).double()
    ref = torch.tensor(ref, dtype=torch.float64)
    assert (got == ref.float().double()).double().mean() > 0.995 and torch.allclose(got, ref, rtol=1e-6, atol=0)
    assert torch.equal(got[2], torch.zeros(33, dtype=torch.float64))
    xs = x.clone().requires_grad_(True)
    comfy_act_fake_quant(xs, "int8").sum().backward()
    assert torch.equal(xs.grad, torch.ones_like(x))  # dynamic: nothing saturates
    with pytest.raises(ValueError, match="no input_scale"):
        comfy_act_quant(x, "int8", torch.tensor(0.1))
    with pytest.raises(ValueError, match="no activation quantizer"):
        comfy_act_quant(x, "mxfp4")
