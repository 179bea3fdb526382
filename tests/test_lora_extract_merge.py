"""SVD extraction and merging on tiny random Wan / Flux models."""

import pytest
import torch
from safetensors.torch import save_file
from test_lora_keys import random_lora, tiny_flux, tiny_wan

from rcm_diffusers.lora import extract, io, keys, merge


def with_low_rank_delta(sd, r, seed=0):
    """Fine-tuned copy of `sd`: rank-r delta on every 2-D weight, plus a bias and a modulation delta."""
    g = torch.Generator().manual_seed(seed)
    ft, true = {}, {}
    for k, v in sd.items():
        if v.dim() == 2 and k.endswith(".weight"):
            d = torch.randn(v.shape[0], r, generator=g) @ torch.randn(r, v.shape[1], generator=g) * 0.1
            true[k] = d
            ft[k] = v + d
        else:
            ft[k] = v.clone()
    ft["blocks.0.attn1.to_q.bias"] = ft["blocks.0.attn1.to_q.bias"] + 0.5
    ft["blocks.1.scale_shift_table"] = ft["blocks.1.scale_shift_table"] + 0.25
    return ft, true


def test_extract_recovers_rank_r_delta_and_reports_lower_rank_error(tmp_path):
    base = {k: v.clone() for k, v in tiny_wan().state_dict().items()}
    ft, true = with_low_rank_delta(base, r=3)
    save_file(ft, tmp_path / "ft.safetensors")  # streamed from file
    lora, report = extract.extract_lora(tmp_path / "ft.safetensors", base, rank=3, progress=False)
    rep = {r.name: r for r in report}
    for k, d in true.items():
        g = keys.lora_modules(lora)[k[: -len(".weight")]]
        got = g["lora_B.weight"] @ g["lora_A.weight"] * (float(g["alpha"]) / 3)
        torch.testing.assert_close(got, d, rtol=1e-5, atol=2e-6)
        assert rep[k].rank == 3 and rep[k].rel_error < 1e-5
    assert rep["blocks.0.attn1.to_q.bias"].kind == "diff_b"
    assert torch.allclose(lora["blocks.0.attn1.to_q.diff_b"], torch.full((24,), 0.5))
    assert rep["blocks.1.scale_shift_table"].kind == "diff" and "blocks.1.scale_shift_table.diff" in lora
    assert rep["blocks.0.attn1.to_k.bias"].kind == "zero"
    # rank 1 of a rank-3 delta: error equals sqrt of the dropped singular-value energy, and is large
    _, low = extract.extract_lora(ft, base, rank=1, progress=False, nonlinear="drop")
    low = {r.name: r for r in low}
    k = "blocks.0.ffn.net.0.proj.weight"
    S = torch.linalg.svdvals(true[k].double())
    expect = float((S[1:] ** 2).sum().sqrt() / (S**2).sum().sqrt())
    assert low[k].rank == 1 and abs(low[k].rel_error - expect) < 1e-4 and low[k].rel_error > 0.2
    assert low["blocks.1.scale_shift_table"].kind == "dropped"
    # energy-chosen rank: 100% energy needs exactly the true rank 3 (or fewer on tiny dims)
    _, en = extract.extract_lora(ft, base, energy=0.999999, progress=False)
    assert {r.rank for r in en if r.kind == "lora"} == {3}
    # the extracted LoRA converts and saves in both layouts
    io.save_lora(tmp_path / "x.safetensors", lora, "wan", format="comfyui")


def test_extract_rejects_mismatched_checkpoints():
    base = tiny_wan().state_dict()
    ft = dict(base)
    ft["blocks.0.attn1.to_q.weight"] = torch.zeros(25, 24)
    del ft["proj_out.bias"]
    with pytest.raises(ValueError, match=r"1 key\(s\) in only one.*proj_out\.bias.*1 shape mismatch.*to_q"):
        extract.extract_lora(ft, base, rank=2, progress=False)


def test_merge_lora_equals_expected_weights_both_layouts():
    for model in (tiny_wan(True), tiny_flux()):
        base = {k: v.clone() for k, v in model.state_dict().items()}
        lora = random_lora(model, rank=2, vary=True)
        merged, _ = merge.merge_lora(base, lora, weight=0.7)
        for t, g in keys.lora_modules(lora).items():
            s = float(g["alpha"]) / g["lora_A.weight"].shape[0]
            expect = base[f"{t}.weight"] + 0.7 * s * g["lora_B.weight"] @ g["lora_A.weight"]
            torch.testing.assert_close(merged[f"{t}.weight"], expect, rtol=1e-5, atol=1e-5)
        # same LoRA in ComfyUI names applied to the original-layout model gives the same weights
        orig = keys.to_original(base, prefix="")
        m2, _ = merge.merge_lora(orig, keys.to_comfy_keys(lora), weight=0.7)
        back = keys.to_diffusers(m2, prefix="")
        for k in base:
            torch.testing.assert_close(back[k], merged[k], rtol=1e-5, atol=1e-5)


def test_t2v_to_i2v_transfer_touches_shared_layers_only(tmp_path):
    t2v_base = {k: v.clone() for k, v in tiny_wan(False, seed=1).state_dict().items()}
    i2v_base = {k: v.clone() for k, v in tiny_wan(True, seed=2).state_dict().items()}
    t2v_ft, _ = with_low_rank_delta(t2v_base, r=2)
    save_file(t2v_ft, tmp_path / "ft.safetensors")
    merged, untouched = merge.merge_delta(i2v_base, tmp_path / "ft.safetensors", t2v_base, weight=0.5, progress=False)
    k = "blocks.1.attn2.to_v.weight"
    torch.testing.assert_close(merged[k], i2v_base[k] + 0.5 * (t2v_ft[k] - t2v_base[k]))
    assert torch.equal(merged["blocks.0.attn2.add_k_proj.weight"], i2v_base["blocks.0.attn2.add_k_proj.weight"])
    assert "patch_embedding.weight" in untouched  # 16 vs 36 input channels
    assert set(untouched) == {k for k in i2v_base if k not in t2v_base or t2v_base[k].shape != i2v_base[k].shape}
    # the same transfer through a LoRA extracted from T2V: I2V-only layers are simply not targeted
    lora, _ = extract.extract_lora(t2v_ft, t2v_base, rank=2, progress=False, nonlinear="drop")
    via_lora, skipped = merge.merge_lora(i2v_base, lora, weight=0.5, on_missing="skip")
    assert skipped == []
    with pytest.raises(ValueError, match=r"do not match the base model: blocks\.0\.attn1\.to_q: LoRA \(25, 24\)"):
        merge.merge_lora(i2v_base, {**lora, "blocks.0.attn1.to_q.lora_B.weight": torch.zeros(25, 2)})
    torch.testing.assert_close(via_lora[k], merged[k], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="LoRA is for 'wan' but the model is 'flux'"):
        merge.merge_lora(tiny_flux().state_dict(), lora)


def test_two_experts_and_save_model(tmp_path):
    high = {k: v.clone() for k, v in tiny_wan(seed=3).state_dict().items()}
    low = {k: v.clone() for k, v in tiny_wan(seed=4).state_dict().items()}
    lh, ll = random_lora(tiny_wan(), rank=2, seed=5), random_lora(tiny_wan(), rank=2, seed=6)
    both = {
        **{"transformer." + k[len("transformer.") :]: v for k, v in lh.items()},
        **{"transformer_2." + k[len("transformer.") :]: v for k, v in ll.items()},
    }
    out = merge.merge_experts({"transformer": high, "transformer_2": low}, {"transformer": both, "transformer_2": both})
    k = "blocks.0.ffn.net.2.weight"
    assert torch.allclose(out["transformer"][k], merge.merge_lora(high, lh)[0][k])
    assert torch.allclose(out["transformer_2"][k], merge.merge_lora(low, ll)[0][k])
    assert not torch.allclose(out["transformer"][k], out["transformer_2"][k])
    cfg = dict(tiny_wan().config)
    merge.save_model(out["transformer"], tmp_path / "dir", layout="diffusers", config=cfg)
    from diffusers import WanTransformer3DModel

    loaded = WanTransformer3DModel.from_pretrained(tmp_path / "dir")
    assert torch.equal(loaded.state_dict()[k], out["transformer"][k])
    f = merge.save_model(out["transformer_2"], tmp_path / "comfy.safetensors", layout="comfyui")
    from safetensors.torch import load_file

    assert torch.equal(load_file(f)["blocks.0.ffn.2.weight"], out["transformer_2"][k])


def test_streamed_merge_writes_sharded_diffusers_folder_and_flux_comfy_file(tmp_path):
    """merge_lora_to streams tensor by tensor; the files it writes by hand read back with safetensors/diffusers."""
    import json

    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    model = tiny_wan()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    lora = random_lora(model, rank=2)
    want, _ = merge.merge_lora(base, lora, 0.6)
    out, skipped = merge.merge_lora_to(
        tmp_path / "w",
        keys.to_original(base, prefix=""),
        lora,
        0.6,
        layout="diffusers",
        config=dict(model.config),
        max_shard_size=30_000,
        progress=False,
    )
    index = json.loads((out / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and sorted(index["weight_map"]) == sorted(base)
    loaded = WanTransformer3DModel.from_pretrained(out).state_dict()
    for k in base:
        torch.testing.assert_close(loaded[k], want[k], rtol=1e-6, atol=1e-6)
    # Flux: diffusers base -> ComfyUI file, q/k/v(/mlp) fused while streaming
    fm = tiny_flux()
    fbase = {k: v.clone() for k, v in fm.state_dict().items()}
    flora = random_lora(fm, rank=2)
    fwant = keys.to_original(merge.merge_lora(fbase, flora)[0], "flux", prefix="")
    merge.merge_lora_to(tmp_path / "f.safetensors", fbase, flora, progress=False)
    got = load_file(tmp_path / "f.safetensors")
    assert sorted(got) == sorted(fwant)
    for k in fwant:
        torch.testing.assert_close(got[k], fwant[k], rtol=1e-6, atol=1e-6)
    # Flux: original base -> diffusers folder, fused layers split while streaming (bias with its weight)
    out, _ = merge.merge_lora_to(
        tmp_path / "fd", keys.to_original(fbase, "flux", prefix=""), flora, layout="diffusers", progress=False
    )
    gotd = load_file(out / "diffusion_pytorch_model.safetensors")
    want_d = merge.merge_lora(fbase, flora)[0]
    assert sorted(gotd) == sorted(want_d)
    for k in want_d:
        torch.testing.assert_close(gotd[k], want_d[k], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="one .safetensors file"):
        merge.merge_lora_to(tmp_path / "f_dir", fbase, flora, progress=False)
