"""Linear swap on a tiny Wan / Flux transformer, calibration, and the ComfyUI export / reload (docs/math.md §7)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tiny import tiny_flux_pipeline, tiny_wan_transformer, wan_embeds

from rcm_diffusers.quant.export import (
    dequantized_copy,
    export_quantized,
    from_blocked,
    load_quantized,
    pack_e2m1,
    to_blocked,
    unpack_e2m1,
)
from rcm_diffusers.quant.modules import QuantLinear, calibration, quant_layers, quantize_transformer

WAN_QUANTIZED = {
    f"blocks.{i}.{m}"
    for i in range(2)
    for m in [
        "attn1.to_q",
        "attn1.to_k",
        "attn1.to_v",
        "attn1.to_out.0",
        "attn2.to_q",
        "attn2.to_k",
        "attn2.to_v",
        "attn2.to_out.0",
        "ffn.net.0.proj",
        "ffn.net.2",
    ]
}


def wan_inputs(seed=0, B=1):
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(B, 4, 2, 8, 8, generator=g),
        timestep=torch.tensor([500.0] * B),
        encoder_hidden_states=wan_embeds(B, seed),
    )


def test_default_exclusions_wan_and_flux():
    m = tiny_wan_transformer()
    assert set(quantize_transformer(m, "nvfp4")) == WAN_QUANTIZED
    f = tiny_flux_pipeline().transformer
    names = set(quantize_transformer(f, "nvfp4"))
    assert "single_transformer_blocks.0.proj_out" in names and "transformer_blocks.0.attn.to_q" in names
    assert not {n for n in names if "embed" in n or "norm" in n or n == "proj_out"}
    assert len(names) == 17  # 12 double-block + 5 single-block linears


def test_overrides_and_bad_patterns():
    m = tiny_wan_transformer()
    layers = quantize_transformer(
        m, "nvfp4", extra_exclude=["blocks.1.*"], overrides={"*ffn*": "fp8_e4m3", "*attn2.to_k": None}
    )
    assert "blocks.1.attn1.to_q" not in layers and "blocks.0.attn2.to_k" not in layers
    assert layers["blocks.0.ffn.net.2"].fmt == "fp8_e4m3" and layers["blocks.1.ffn.net.2"].fmt == "fp8_e4m3"
    assert layers["blocks.0.attn1.to_q"].fmt == "nvfp4"
    with pytest.raises(ValueError, match=r"match no Linear layer: \['transformer_blocks\*'\]"):
        quantize_transformer(tiny_wan_transformer(), "nvfp4", extra_exclude=["transformer_blocks*"])
    with pytest.raises(ValueError, match="unknown quantization format 'nf4'"):
        quantize_transformer(tiny_wan_transformer(), "nf4")


def test_weight_only_forward_is_fake_quant_and_ste():
    m = tiny_wan_transformer()
    ref = {n: mod.weight.detach().clone() for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)}
    out_t = m(**wan_inputs()).sample
    quantize_transformer(m, "nvfp4")
    lin = m.blocks[0].attn1.to_q
    assert isinstance(lin, QuantLinear) and torch.equal(lin.weight, ref["blocks.0.attn1.to_q"])
    x = torch.randn(3, 24)
    # the forward is the plain linear layer on the fake-quantized weight: exact against the same kernel call,
    # and against float64 matmul + bias up to float32 round-off (addmm and matmul-then-add may sum differently)
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.quantized_weight(), lin.bias), rtol=0, atol=0)
    ref64 = x.double() @ lin.quantized_weight().double().T + lin.bias.double()
    torch.testing.assert_close(lin(x).double(), ref64, rtol=1e-5, atol=1e-5)
    out_q = m(**wan_inputs()).sample
    rel = ((out_q - out_t).norm() / out_t.norm()).item()
    assert 1e-3 < rel < 0.3, rel
    # STE through the whole model: gradients reach every quantized weight
    m.requires_grad_(True)
    m(**wan_inputs()).sample.square().mean().backward()
    assert all(l.weight.grad is not None and l.weight.grad.abs().sum() > 0 for l in quant_layers(m).values())


def test_calibration_activation_mode_and_errors():
    m = tiny_wan_transformer()
    quantize_transformer(m, "nvfp4", act_fmt="nvfp4")
    with pytest.raises(RuntimeError, match="needs a calibrated input_amax"):
        m(**wan_inputs())
    with calibration(m) as layers:
        for s in range(3):
            m(**wan_inputs(seed=s))
    a = layers["blocks.0.attn1.to_q"].input_amax.item()
    assert torch.isfinite(torch.tensor(a)) and a > 0
    y = m(**wan_inputs()).sample
    assert torch.isfinite(y).all()
    bad = wan_inputs()
    bad["hidden_states"][0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite activation"):
        with calibration(m):
            m(**bad)
    m2 = tiny_wan_transformer()
    quantize_transformer(m2, "fp8_e4m3")
    with pytest.raises(ValueError, match="no layer quantizes activations"):
        with calibration(m2):
            pass


def test_blocked_layout_and_nibbles():
    s = torch.arange(1.0, 1 + 200 * 6).reshape(200, 6)
    b = to_blocked(s)
    assert b.shape == (256, 8)
    assert torch.equal(from_blocked(b, 200, 6), s)
    # cuBLAS 128x4 tile: row r of a tile is at (r % 32) * 16 + (r // 32) * 4 inside its 512 entries
    flat = b.flatten()
    assert flat[0] == s[0, 0] and flat[1] == s[0, 1] and flat[4] == s[32, 0] and flat[16] == s[1, 0]
    assert flat[512] == s[0, 4] and flat[1024] == s[128, 0]
    v = torch.tensor([[6.0, 0.5, -1.0, 0.0]])
    p = pack_e2m1(v)
    assert p.tolist() == [[0x71, 0xA0]]  # even element high nibble; sign = bit 3
    assert torch.equal(unpack_e2m1(p), v)


@pytest.mark.filterwarnings("ignore:.*W8A8 with dynamic per-row")  # int8 weight-only: warned, tested below
@pytest.mark.parametrize("fmt,act", [("nvfp4", "nvfp4"), ("fp8_e4m3", "fp8_e4m3"), ("int8", None)])
def test_export_reload_exact(tmp_path, fmt, act):
    m = tiny_wan_transformer()
    layers = quantize_transformer(m, fmt, act_fmt=act)
    if act:
        with calibration(m):
            m(**wan_inputs())
    path = tmp_path / "wan_q.safetensors"
    meta = export_quantized(m, path)
    comfy = {"nvfp4": "nvfp4", "fp8_e4m3": "float8_e4m3fn", "int8": "int8_tensorwise"}[fmt]
    assert meta["layers"]["blocks.0.self_attn.q"] == {"format": comfy} and len(meta["layers"]) == 20
    with safe_open(str(path), "pt") as f:
        header = json.loads(f.metadata()["_quantization_metadata"])
        raw = {k: f.get_tensor(k) for k in f.keys()}
    assert header == meta
    W = "blocks.0.ffn.0"  # diffusers blocks.0.ffn.net.0.proj, [32, 24]
    if fmt == "nvfp4":
        assert raw[f"{W}.weight"].dtype == torch.uint8 and raw[f"{W}.weight"].shape == (32, 16)
        assert raw[f"{W}.weight_scale"].dtype == torch.float8_e4m3fn and raw[f"{W}.weight_scale"].shape == (128, 4)
        assert raw[f"{W}.weight_scale_2"].dtype == torch.float32 and raw[f"{W}.weight_scale_2"].shape == ()
    elif fmt == "fp8_e4m3":
        assert raw[f"{W}.weight"].dtype == torch.float8_e4m3fn and raw[f"{W}.weight_scale"].shape == ()
    else:
        assert raw[f"{W}.weight"].dtype == torch.int8 and raw[f"{W}.weight_scale"].shape == (32, 1)
    if act:
        qmax = 6 * 448 if fmt == "nvfp4" else 448
        assert raw[f"{W}.input_scale"].item() == pytest.approx(
            layers["blocks.0.ffn.net.0.proj"].input_amax.item() / qmax, rel=1e-6
        )
    assert "head.head.weight" in raw and raw["head.head.weight"].dtype == torch.float32  # excluded: kept as is
    sd, _ = load_quantized(path)
    for name, lay in layers.items():
        from rcm_diffusers.lora.keys import to_original

        orig = next(iter(to_original({f"{name}.weight": torch.zeros(1)}, arch="wan", prefix="")))
        assert torch.equal(sd[orig], lay.quantized_weight().detach()), name
        assert torch.equal(sd[orig.replace("weight", "bias")], lay.bias.detach())
    plain = dequantized_copy(tiny_wan_transformer(), path)  # any layout back into a plain diffusers model
    for name, lay in layers.items():
        assert torch.equal(plain.get_submodule(name).weight, lay.quantized_weight().detach()), name


def test_export_refuses_mxfp4_and_uncalibrated(tmp_path):
    m = tiny_wan_transformer()
    quantize_transformer(m, "mxfp4")
    with pytest.raises(ValueError, match="has no ComfyUI checkpoint layout"):
        export_quantized(m, tmp_path / "x.safetensors")
    m = tiny_wan_transformer()
    quantize_transformer(m, "nvfp4", act_fmt="nvfp4")
    with pytest.raises(ValueError, match="input_amax is not calibrated"):
        export_quantized(m, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize(
    "fmt,act_scale", [("nvfp4", "static"), ("nvfp4", "dynamic"), ("fp8_e4m3", "static"), ("int8", "dynamic")]
)
def test_target_comfyui_forward_export_and_runtime_reload(tmp_path, fmt, act_scale):
    """Target comfyui: each layer computes comfy_act_quant(x) W_hat^T + b; the export carries exactly the
    input_scale trained with (none when dynamic), and comfy_runtime_copy of it reproduces the model."""
    import warnings

    import torch.nn.functional as F

    from rcm_diffusers.quant.export import comfy_runtime_copy
    from rcm_diffusers.quant.formats import comfy_act_quant

    m = tiny_wan_transformer()
    layers = quantize_transformer(m, fmt, target="comfyui", act_scale=act_scale)
    lay = layers["blocks.0.ffn.net.0.proj"]
    assert lay.act_fmt == fmt and lay.static_act == (act_scale == "static")
    if lay.static_act:
        with pytest.raises(RuntimeError, match="needs a calibrated"):
            m(**wan_inputs())
        with calibration(m):
            m(**wan_inputs(1))
    x = torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(3))
    expected = F.linear(comfy_act_quant(x, fmt, lay.input_scale()), lay.quantized_weight(), lay.bias)
    assert torch.equal(lay(x), expected)
    with torch.no_grad():
        y = m(**wan_inputs(2)).sample
    for layout in ("comfyui", "diffusers"):
        path = tmp_path / f"{layout}.safetensors"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # trained as ComfyUI runs it: nothing to warn about
            export_quantized(m, path, layout=layout)
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
            assert f.metadata()["rcm_quant_target"] == "comfyui"
            W = "blocks.0.ffn.0" if layout == "comfyui" else "blocks.0.ffn.net.0.proj"
            if lay.static_act:
                assert torch.equal(f.get_tensor(f"{W}.input_scale"), lay.input_scale())
        assert lay.static_act == any(k.endswith(".input_scale") for k in keys)
        rt = comfy_runtime_copy(tiny_wan_transformer(), path)
        with torch.no_grad():
            assert torch.equal(rt(**wan_inputs(2)).sample, y), layout
            wo = comfy_runtime_copy(tiny_wan_transformer(), path, native=False)(**wan_inputs(2)).sample
        assert torch.equal(wo, y) == (fmt == "int8")  # nvfp4 / fp8 without kernels: weight-only, other numbers


def test_target_comfyui_refuses_what_comfyui_cannot_run():
    for kw, match in (
        ({"fmt": "mxfp4"}, "no layout for 'mxfp4'"),
        ({"fmt": "nvfp4", "act_fmt": "fp8_e4m3"}, "not fp8_e4m3"),
        ({"fmt": "fp8_e4m3", "act_scale": "dynamic"}, "scale 1.0"),
        ({"fmt": "fp8_e4m3", "per_channel": True}, "per-channel"),
    ):
        with pytest.raises(ValueError, match=match):
            QuantLinear(32, 16, target="comfyui", **kw)
    with pytest.raises(ValueError, match="target 'gpu'"):
        QuantLinear(32, 16, target="gpu")


@pytest.mark.parametrize(
    "fmt,act,kind,match",
    [
        ("nvfp4", None, "warn", "quantizes the activations to NVFP4 per call"),
        ("fp8_e4m3", None, "warn", "at scale 1.0"),
        ("int8", None, "warn", "W8A8 with dynamic per-row"),
        ("int8", "int8", "refuse", "has no input_scale"),
        ("nvfp4", "fp8_e4m3", "refuse", "input as NVFP4"),
        ("fp8_e4m3", "nvfp4", "refuse", "input as float8_e4m3fn"),
        ("nvfp4", "nvfp4", None, None),
        ("fp8_e4m3", "fp8_e4m3", None, None),
    ],
)
def test_export_warns_or_refuses_train_deploy_mismatch(tmp_path, fmt, act, kind, match):
    import warnings

    m = tiny_wan_transformer()
    quantize_transformer(m, fmt, act_fmt=act, target="fake")
    if act:
        with calibration(m):
            m(**wan_inputs())
    path = tmp_path / "q.safetensors"
    if kind == "refuse":
        with pytest.raises(ValueError, match=match):
            export_quantized(m, path)
        assert not path.exists()
        export_quantized(m, path, check_comfyui=False)  # the caller can still insist
    elif kind == "warn":
        with pytest.warns(UserWarning, match=match):
            export_quantized(m, path)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            export_quantized(m, path)
    assert path.exists()
