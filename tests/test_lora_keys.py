"""Key converter: exact round trips for Wan (T2V, I2V) and Flux, full weights and LoRAs."""

import pytest
import torch
from diffusers import FluxTransformer2DModel, WanTransformer3DModel
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

from rcm_diffusers.lora import keys


def tiny_wan(i2v=False, seed=0):
    torch.manual_seed(seed)
    kw = dict(image_dim=24, added_kv_proj_dim=24, in_channels=36) if i2v else dict(in_channels=16)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        out_channels=16,
        text_dim=32,
        freq_dim=16,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        **kw,
    )


def tiny_flux(seed=0):
    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )


def random_lora(model, rank=4, seed=1, alpha=True, vary=False):
    """A diffusers-named LoRA on every nn.Linear of `model`, random A and B."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for j, (name, mod) in enumerate(model.named_modules()):
        if isinstance(mod, torch.nn.Linear):
            r = rank + (j % 3 if vary else 0)
            sd[f"transformer.{name}.lora_A.weight"] = torch.randn(r, mod.in_features, generator=g)
            sd[f"transformer.{name}.lora_B.weight"] = torch.randn(mod.out_features, r, generator=g)
            if alpha:
                sd[f"transformer.{name}.alpha"] = torch.tensor(float(2 * r if not vary else r + j % 2))
    return sd


def lora_deltas(sd):
    """{target: alpha/r * B @ A} in float64 for a canonical-named dict."""
    out = {}
    for t, g in keys.lora_modules(sd).items():
        if "lora_A.weight" in g:
            A, B = g["lora_A.weight"].double(), g["lora_B.weight"].double()
            s = float(g["alpha"]) / A.shape[0] if "alpha" in g else 1.0
            out[t] = s * B @ A
    return out


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def assert_same_effect(a, b, rtol=0.0):
    """Same LoRA deltas (float64 alpha/r B @ A; bitwise unless ``rtol``) and the same full deltas, in one naming.
    A ComfyUI file folds alpha/r into lora_down outside the Wan blocks (``keys.comfyui_file_forms``): the keys
    differ there, the deltas do not (a power-of-two alpha/r folds exactly)."""
    da, db = lora_deltas(a), lora_deltas(b)
    assert sorted(da) == sorted(db)
    for t in da:
        if rtol:
            torch.testing.assert_close(da[t], db[t], rtol=rtol, atol=rtol * db[t].abs().max().item(), msg=t)
        else:
            assert torch.equal(da[t], db[t]), t
    ga, gb = keys.lora_modules(a), keys.lora_modules(b)
    for t in ga:
        for k in ("diff", "diff_b"):
            assert (k in ga[t]) == (k in gb[t]) and (k not in ga[t] or torch.equal(ga[t][k], gb[t][k])), (t, k)


@pytest.mark.parametrize("i2v", [False, True])
def test_wan_full_weights_round_trip_and_match_diffusers(i2v):
    sd = {k: v.clone() for k, v in tiny_wan(i2v).state_dict().items()}
    orig = keys.to_original(sd, "wan", prefix="")
    assert "blocks.0.self_attn.q.weight" in orig and "head.head.weight" in orig and "blocks.1.modulation" in orig
    assert torch.equal(orig["blocks.0.norm3.weight"], sd["blocks.0.norm2.weight"])
    if i2v:
        assert torch.equal(orig["blocks.1.cross_attn.k_img.weight"], sd["blocks.1.attn2.add_k_proj.weight"])
        assert torch.equal(orig["img_emb.proj.3.bias"], sd["condition_embedder.image_embedder.ff.net.2.bias"])
    assert_same(keys.to_diffusers(orig, "wan", prefix=""), sd)
    # independent reference: diffusers' own single-file converter maps our original layout back
    ref = convert_wan_transformer_to_diffusers({k: v.clone() for k, v in orig.items()})
    assert_same(ref, sd)


def test_flux_full_weights_round_trip_fused():
    sd = {k: v.clone() for k, v in tiny_flux().state_dict().items()}
    orig = keys.to_original(sd, "flux", prefix="")
    qkv = orig["double_blocks.0.img_attn.qkv.weight"]
    assert qkv.shape == (96, 32)
    assert torch.equal(qkv[32:64], sd["transformer_blocks.0.attn.to_k.weight"])
    lin1 = orig["single_blocks.0.linear1.bias"]
    assert lin1.shape == (32 * 3 + 128,)
    assert torch.equal(lin1[96:], sd["single_transformer_blocks.0.proj_mlp.bias"])
    assert torch.equal(
        orig["single_blocks.0.norm.query_norm.scale"], sd["single_transformer_blocks.0.attn.norm_q.weight"]
    )
    ada = orig["final_layer.adaLN_modulation.1.weight"]
    assert torch.equal(ada[:32], sd["norm_out.linear.weight"][32:])  # (shift, scale) vs (scale, shift)
    assert not any(k.startswith(("transformer_blocks", "single_transformer_blocks")) for k in orig)
    assert_same(keys.to_diffusers(orig, "flux", prefix=""), sd)


@pytest.mark.parametrize("i2v", [False, True])
def test_wan_lora_round_trip_exact(i2v):
    sd = random_lora(tiny_wan(i2v), vary=True)
    comfy = keys.to_comfy_keys(sd, "wan")
    assert "diffusion_model.blocks.0.self_attn.q.lora_down.weight" in comfy
    assert "diffusion_model.blocks.1.ffn.0.lora_up.weight" in comfy
    assert ("diffusion_model.blocks.0.cross_attn.k_img.alpha" in comfy) == i2v
    assert_same(keys.from_any(comfy, "wan"), sd)
    # detection works without arch, and peft-style lora_A/B names in the original layout are accepted
    alt = {k.replace("lora_down", "lora_A").replace("lora_up", "lora_B"): v for k, v in comfy.items()}
    assert_same(keys.from_any(alt), sd)


def test_wan_comfy_lora_matches_diffusers_own_reader():
    """diffusers' own reader of original-layout Wan LoRAs agrees with our converter on every delta."""
    # diffusers' reader honours .alpha only inside blocks (it raises on alphas of head/embeddings)
    sd = {k: v for k, v in random_lora(tiny_wan(True), vary=True).items() if k.startswith("transformer.blocks.")}
    comfy = keys.to_comfy_keys(sd, "wan")
    # clones: diffusers' reader scales some of the tensors it is given in place
    ref = _convert_non_diffusers_wan_lora_to_diffusers({k: v.clone() for k, v in comfy.items()})
    ours, theirs = lora_deltas(sd), lora_deltas(ref)
    assert set(theirs) == set(ours) and len(theirs) == 2 * 12  # attn1 4 + attn2 6 (I2V) + ffn 2
    for t in theirs:
        torch.testing.assert_close(theirs[t], ours[t], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("vary", [False, True])
def test_flux_lora_fused_round_trip(vary):
    sd = random_lora(tiny_flux(), vary=vary)
    comfy = keys.to_comfy_keys(sd, "flux")
    A = comfy["diffusion_model.single_blocks.0.linear1.lora_down.weight"]
    B = comfy["diffusion_model.single_blocks.0.linear1.lora_up.weight"]
    assert B.shape[0] == 3 * 32 + 128 and A.shape[0] == B.shape[1]
    ref, fused = lora_deltas(sd), lora_deltas(comfy)
    members = ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"]
    expect = torch.cat([ref[f"single_transformer_blocks.0.{m}"] for m in members])
    tol = 1e-6 if vary else 1e-12  # unequal scales are folded into float32 B: one rounding
    torch.testing.assert_close(fused["single_blocks.0.linear1"], expect, rtol=tol, atol=tol)
    back = keys.from_any(comfy, "flux")
    if not vary:  # equal scales: the tensors themselves come back bit for bit
        assert_same(back, sd)
    else:  # different alpha/rank per slice: scales folded into B, deltas equal
        got = lora_deltas(back)
        assert sorted(got) == sorted(ref)
        for t in ref:
            torch.testing.assert_close(got[t], ref[t], rtol=1e-6, atol=1e-6)


def test_flux_partial_qkv_lora_and_dense_fused_lora():
    sd = {k: v for k, v in random_lora(tiny_flux()).items() if "attn.to_k." not in k}
    comfy = keys.to_comfy_keys(sd, "flux")
    B = comfy["diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight"]
    assert B[32:64].abs().sum() == 0  # k slice untouched
    assert_same(keys.from_any(comfy, "flux"), sd)
    # a LoRA trained on the fused layer (dense B) splits into exact per-slice LoRAs of the full rank
    g = torch.Generator().manual_seed(3)
    dense = {
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight": torch.randn(5, 32, generator=g),
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight": torch.randn(96, 5, generator=g),
        "diffusion_model.double_blocks.0.img_attn.qkv.alpha": torch.tensor(10.0),
    }
    split = keys.from_any(dense, "flux")
    d = lora_deltas(split)
    full = lora_deltas(dense)["double_blocks.0.img_attn.qkv"]
    torch.testing.assert_close(torch.cat([d[f"transformer_blocks.0.attn.to_{c}"] for c in "qkv"]), full)


def test_deltas_diff_keys_round_trip():
    g = torch.Generator().manual_seed(0)
    sd = {
        "transformer.blocks.0.scale_shift_table.diff": torch.randn(1, 6, 24, generator=g),
        "transformer.blocks.0.norm2.diff": torch.randn(24, generator=g),
        "transformer.blocks.0.attn1.to_q.diff_b": torch.randn(24, generator=g),
    }
    comfy = keys.to_comfy_keys(sd, "wan")
    assert sorted(comfy) == [
        "diffusion_model.blocks.0.modulation.diff",
        "diffusion_model.blocks.0.norm3.diff",
        "diffusion_model.blocks.0.self_attn.q.diff_b",
    ]
    assert_same(keys.from_any(comfy, "wan"), sd)
    fsd = {
        "transformer.single_transformer_blocks.0.attn.norm_k.diff": torch.randn(16, generator=g),
        "transformer.norm_out.linear.diff_b": torch.randn(64, generator=g),
    }
    fc = keys.to_comfy_keys(fsd, "flux")
    assert "diffusion_model.single_blocks.0.norm.key_norm.scale.diff" in fc
    assert_same(keys.from_any(fc, "flux"), fsd)


def test_unknown_keys_are_listed_not_dropped():
    sd = random_lora(tiny_wan(), rank=2)
    sd["transformer.blocks.0.attn1.to_zz.lora_A.weight"] = torch.zeros(2, 24)
    with pytest.raises(ValueError, match=r"to_zz\.lora_A\.weight"):
        keys.to_comfy_keys(sd, "wan")
    comfy = keys.to_comfy_keys(random_lora(tiny_wan(), rank=2), "wan")
    comfy["diffusion_model.blocks.0.self_attn.qq.lora_down.weight"] = torch.zeros(2, 24)
    with pytest.raises(ValueError, match=r"1 key\(s\).*self_attn\.qq"):
        keys.from_any(comfy, "wan")
    with pytest.raises(ValueError, match="architecture"):
        keys.detect_arch({"foo.bar": torch.zeros(1)})


def test_check_against_model_lists_mismatches():
    model = tiny_wan()
    sd = random_lora(model, rank=2)
    keys.check_against_model(keys.from_any(sd), model.state_dict(), prefix="")  # matches: no error
    comfy = keys.to_comfy_keys(sd)
    orig_model = keys.to_original(model.state_dict(), "wan", prefix="diffusion_model.")
    keys.check_against_model(comfy, orig_model)
    comfy["diffusion_model.blocks.0.self_attn.q.lora_up.weight"] = torch.zeros(25, 2)
    comfy["diffusion_model.blocks.7.self_attn.q.lora_up.weight"] = torch.zeros(24, 2)
    comfy["diffusion_model.blocks.7.self_attn.q.lora_down.weight"] = torch.zeros(2, 24)
    with pytest.raises(ValueError, match=r"2 LoRA key\(s\).*blocks\.0\.self_attn\.q: LoRA delta \(25, 24\).*blocks\.7"):
        keys.check_against_model(comfy, orig_model)
