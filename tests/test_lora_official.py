"""Official rCM and TurboDiffusion checkpoints: unwrap, reshape, dequantize, then convert/extract/merge.

Layouts are built here from the producing code's rules (our own code, written from reading theirs):
- NVlabs/rcm ``scripts/dcp_to_pth.py`` (``__main__``): flat ``net.<key>`` from the ``net_ema.`` entries, bf16;
  a training dump holds ``net.``, ``net_ema.``, ``net_fake_score.``.
- NVlabs/rcm ``rcm/networks/wan2pt1.py`` ``WanModel``: ``patch_embedding = nn.Linear(C*kt*kh*kw, dim)`` over
  ``"b c (t kt) (h kh) (w kw) -> b (t h w) (c kt kh kw)"`` patches.
- thu-ml/TurboDiffusion ``turbodiffusion/inference/modify_model.py`` (``replace_attention``,
  ``replace_linear_norm``) and ``turbodiffusion/ops/core.py`` ``Int8Linear``: ``int8_weight`` + ``scale``
  (one per 128x128 block, ``ops/quant/quant.hpp``: amax / 128) + ``bias``; SLA ``attn_op.local_attn.proj_l``.
"""

import json
import math

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from safetensors.torch import load_file
from test_lora_keys import tiny_wan

from rcm_diffusers.lora import checkpoint, cli, extract, keys, merge, turbodiffusion

DIM, C = 24, 16


def official_from(model_sd):
    """Original Wan names with the official Linear patch embedding: the test's own reshape."""
    orig = keys.to_original(model_sd, "wan", prefix="")
    orig["patch_embedding.weight"] = orig["patch_embedding.weight"].reshape(DIM, C * 1 * 2 * 2).clone()
    return orig


def hand_loaded(orig_sd, config):
    """WanTransformer3DModel from original-named weights, mapped by diffusers' own converter, reshaped by hand."""
    sd = {k: v.clone() for k, v in orig_sd.items()}
    w = sd["patch_embedding.weight"]
    if w.dim() == 2:  # [dim, (c kt kh kw)] -> [dim, c, kt, kh, kw]
        sd["patch_embedding.weight"] = w.view(DIM, C, 1, 2, 2)
    model = WanTransformer3DModel.from_config(config)
    model.load_state_dict(convert_wan_transformer_to_diffusers(sd), strict=True)
    return model.eval()


def forward(model):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, C, 1, 4, 4, generator=g)
    enc = torch.randn(1, 6, 32, generator=g)
    with torch.no_grad():
        return model(hidden_states=x, timestep=torch.tensor([500]), encoder_hidden_states=enc, return_dict=False)[0]


def low_rank_ft(sd, seed=0, r=2, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sd.items():
        if v.dim() >= 2 and k.endswith(".weight"):
            d = torch.randn(v.shape[0], r, generator=g) @ torch.randn(r, v[0].numel(), generator=g) * scale
            out[k] = v + d.reshape(v.shape)
        else:
            out[k] = v + 0.01 * torch.randn(v.shape, generator=g)
    return out


def test_official_rcm_pt_converts_to_diffusers_and_matches_hand_loaded_forward(tmp_path, capsys):
    model = tiny_wan()
    off = {f"net.{k}": v.to(torch.bfloat16) for k, v in official_from(model.state_dict()).items()}
    assert off["net.patch_embedding.weight"].shape == (DIM, C * 4)
    torch.save(off, tmp_path / "rcm.pt")
    (tmp_path / "cfg.json").write_text(json.dumps(dict(model.config)))
    assert (
        cli.main(
            [
                "convert",
                str(tmp_path / "rcm.pt"),
                str(tmp_path / "diff"),
                "--format",
                "diffusers",
                "--config",
                str(tmp_path / "cfg.json"),
            ]
        )
        == 0
    )
    loaded = WanTransformer3DModel.from_pretrained(tmp_path / "diff").eval()
    ref = hand_loaded({k[4:]: v for k, v in off.items()}, model.config)
    torch.testing.assert_close(forward(loaded.float()), forward(ref.float()), rtol=1e-6, atol=1e-6)
    # ComfyUI single file: Conv3d form, original names, bf16 kept
    assert cli.main(["convert", str(tmp_path / "rcm.pt"), str(tmp_path / "c.safetensors"), "--format", "comfyui"]) == 0
    c = load_file(tmp_path / "c.safetensors")
    assert (
        c["patch_embedding.weight"].shape == (DIM, C, 1, 2, 2) and c["patch_embedding.weight"].dtype == torch.bfloat16
    )
    assert torch.equal(c["patch_embedding.weight"].flatten(1), off["net.patch_embedding.weight"])
    # ... and back to the official Linear form by a merge into an official base: same bytes
    back = keys.to_diffusers(c, "wan", prefix="")
    assert torch.equal(back["patch_embedding.weight"], loaded.state_dict()["patch_embedding.weight"].bfloat16())


def test_training_dump_networks_ema_default_and_selectable(tmp_path, capsys):
    sd = official_from(tiny_wan().state_dict())
    nets = {"net": 0.0, "net_ema": 1.0, "net_fake_score": 2.0}
    dump = {f"{n}.{k}": v + off for n, off in nets.items() for k, v in sd.items()}
    torch.save(dump, tmp_path / "dump.pt")
    r = checkpoint.CheckpointReader(tmp_path / "dump.pt")
    assert r.info["network"] == "net_ema" and sorted(r.info["networks"]) == ["ema", "fake_score", "net"]
    torch.testing.assert_close(r["blocks.0.self_attn.q.weight"], sd["blocks.0.self_attn.q.weight"] + 1.0)
    for prefer, off in (("net", 0.0), ("fake_score", 2.0), ("ema", 1.0)):
        got = checkpoint.load_state_dict(tmp_path / "dump.pt", prefer=prefer)
        assert sorted(got) == sorted(sd)
        torch.testing.assert_close(got["head.head.weight"], sd["head.head.weight"] + off)
    with pytest.raises(ValueError, match="holds only"):
        torch.save({f"net.{k}": v for k, v in sd.items()}, tmp_path / "one.pt")
        checkpoint.CheckpointReader(tmp_path / "one.pt", prefer="fake_score")
    assert cli.main(["inspect", str(tmp_path / "dump.pt")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layout"].startswith("official rCM training dump") and info["ema_present"] is True
    assert info["network"] == "net_ema" and info["arch"] == "wan" and info["dtypes_stored"] == {"float32": 3 * len(sd)}
    assert "Linear" in info["patch_embedding"]
    assert cli.main(["inspect", str(tmp_path / "dump.pt"), "--network", "net"]) == 0
    assert json.loads(capsys.readouterr().out)["network"] == "net"


def test_extract_merge_transfer_official_vs_sharded_diffusers_folder(tmp_path, capsys):
    """fine-tuned = official dump (Linear patch embedding, EMA taken); base = sharded diffusers folder."""
    model = tiny_wan()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "base" / "transformer", max_shard_size="40KB")
    assert (tmp_path / "base" / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    ft = low_rank_ft(base)
    off_ft = official_from(ft)
    torch.save(
        {
            **{f"net_ema.{k}": v for k, v in off_ft.items()},
            **{f"net.{k}": torch.zeros_like(v) for k, v in off_ft.items()},
        },
        tmp_path / "ft.pt",
    )
    assert (
        cli.main(
            [
                "extract",
                "--finetuned",
                str(tmp_path / "ft.pt"),
                "--base",
                str(tmp_path / "base"),
                "--output",
                str(tmp_path / "x.safetensors"),
                "--rank",
                "2",
                "--format",
                "diffusers",
            ]
        )
        == 0
    )
    assert "took the 'net_ema' network" in capsys.readouterr().out
    x = load_file(tmp_path / "x.safetensors")
    assert x["transformer.patch_embedding.lora_A.weight"].shape == (2, C, 1, 2, 2)
    assert x["transformer.patch_embedding.lora_B.weight"].shape == (DIM, 2, 1, 1, 1)
    # diffusers applies it (peft Conv3d LoRA on the patch embedding); equals the fine-tuned model's
    # 2-D weights (the rest are biases/norms/modulation, dropped from a diffusers file)
    from diffusers import WanPipeline

    pipe = WanPipeline(
        transformer=WanTransformer3DModel.from_pretrained(tmp_path / "base" / "transformer"),
        vae=None,
        scheduler=None,
        text_encoder=None,
        tokenizer=None,
    )
    pipe.load_lora_weights(str(tmp_path), weight_name="x.safetensors")
    pipe.fuse_lora()
    got = pipe.transformer.state_dict()
    for k in ("patch_embedding.weight", "blocks.1.attn2.to_v.weight", "proj_out.weight"):
        torch.testing.assert_close(
            got.get(k, got.get(k.replace(".weight", ".base_layer.weight"))), ft[k], rtol=1e-5, atol=1e-5
        )
    # merge the ComfyUI-layout LoRA (all deltas) into the sharded folder: the fine-tuned weights
    assert (
        cli.main(
            [
                "extract",
                "--finetuned",
                str(tmp_path / "ft.pt"),
                "--base",
                str(tmp_path / "base"),
                "--output",
                str(tmp_path / "xc.safetensors"),
                "--rank",
                "2",
            ]
        )
        == 0
    )
    assert (
        cli.main(
            [
                "merge",
                "--base",
                str(tmp_path / "base"),
                "--lora",
                str(tmp_path / "xc.safetensors"),
                "--output",
                str(tmp_path / "m"),
                "--layout",
                "diffusers",
            ]
        )
        == 0
    )
    m = load_file(tmp_path / "m" / "diffusion_pytorch_model.safetensors")
    assert sorted(m) == sorted(base)
    for k in base:
        torch.testing.assert_close(m[k], ft[k], rtol=1e-5, atol=1e-5)
    # the same LoRA into the official 2-D base: the official form comes back
    torch.save({f"net.{k}": v for k, v in official_from(base).items()}, tmp_path / "base_off.pt")
    assert (
        cli.main(
            [
                "merge",
                "--base",
                str(tmp_path / "base_off.pt"),
                "--lora",
                str(tmp_path / "xc.safetensors"),
                "--output",
                str(tmp_path / "mo.safetensors"),
            ]
        )
        == 0
    )
    mo = load_file(tmp_path / "mo.safetensors")
    torch.testing.assert_close(
        mo["patch_embedding.weight"].flatten(1), off_ft["patch_embedding.weight"], rtol=1e-5, atol=1e-5
    )
    # transfer into the Conv3d folder from the official pair: the patch embedding changes too
    assert (
        cli.main(
            [
                "transfer",
                "--base",
                str(tmp_path / "base"),
                "--finetuned",
                str(tmp_path / "ft.pt"),
                "--finetuned-base",
                str(tmp_path / "base_off.pt"),
                "--weight",
                "0.5",
                "--output",
                str(tmp_path / "t.safetensors"),
            ]
        )
        == 0
    )
    t = load_file(tmp_path / "t.safetensors")
    expect = base["patch_embedding.weight"] + 0.5 * (ft["patch_embedding.weight"] - base["patch_embedding.weight"])
    torch.testing.assert_close(t["patch_embedding.weight"], expect, rtol=1e-6, atol=1e-6)
    assert "0 base parameters untouched" in capsys.readouterr().out


def _quantize_blocks(w):
    """Our own Int8Linear quantizer: per 128x128 block, scale = amax / 128, q = round(w / scale)."""
    out_f, in_f = w.shape
    q = torch.empty(out_f, in_f, dtype=torch.int8)
    s = torch.empty(math.ceil(out_f / 128), math.ceil(in_f / 128))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            s[i, j] = blk.abs().max().clamp_min(1e-8) / 128
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (
                (blk / s[i, j]).round().clamp(-128, 127).to(torch.int8)
            )
    return q, s


def test_int8_block_dequantization_exact():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=g)
    q, s = _quantize_blocks(w)
    got = turbodiffusion.dequantize_int8(q, s, torch.float32)
    for i in range(300):  # element by element, independent of the vectorized expansion
        for j in range(0, 260, 37):
            exact = q[i, j].item() * s[i // 128, j // 128].item()  # exact in float64; float32 rounds once
            assert got[i, j].item() == torch.tensor(exact, dtype=torch.float64).float().item()
    # round-to-nearest: half a step, except +amax (128 steps) clamped to 127: one step
    step = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :260]
    err = (got - w).abs()
    assert (err <= step * 1.0001).all() and (err <= step * 0.5001).float().mean() > 0.99
    assert torch.equal(turbodiffusion.dequantize_int8(q, s, torch.bfloat16), got.bfloat16())
    with pytest.raises(ValueError, match="one scale per 128x128 block"):
        turbodiffusion.dequantize_int8(q, s[:, :1])


def turbo_file(orig_sd, path):
    """modify_model.py output: no prefix, Linear patch embedding, blocks' Linears int8, SLA keys (fp32)."""
    out = {}
    for k, v in orig_sd.items():
        if k.startswith("blocks.") and k.endswith(".weight") and v.dim() == 2:
            q, s = _quantize_blocks(v)
            out[k[: -len(".weight")] + ".int8_weight"], out[k[: -len(".weight")] + ".scale"] = q, s
        else:
            out[k] = v.to(torch.bfloat16) if not k.endswith("norm_q.weight") else v.float()
    for i in range(2):
        out[f"blocks.{i}.self_attn.attn_op.local_attn.proj_l.weight"] = torch.randn(12, 12)
        out[f"blocks.{i}.self_attn.attn_op.local_attn.proj_l.bias"] = torch.randn(12)
    torch.save(out, path)
    return out


def test_turbodiffusion_file_dequantizes_sets_sla_aside_and_extracts(tmp_path, capsys):
    model = tiny_wan()
    base = {k: v.to(torch.bfloat16) for k, v in official_from(model.state_dict()).items()}
    ft = official_from(low_rank_ft(model.state_dict()))
    raw = turbo_file(ft, tmp_path / "turbo.pth")
    r = checkpoint.CheckpointReader(tmp_path / "turbo.pth")
    assert r.info["dequantized_int8"] == 2 * 10 and len(r.info["set_aside"]) == 4
    w = r["blocks.1.ffn.0.weight"]
    assert w.dtype == torch.bfloat16  # the Linear's own dtype (its bias)
    q, s = raw["blocks.1.ffn.0.int8_weight"], raw["blocks.1.ffn.0.scale"]
    assert torch.equal(w, (q.float() * s[0, 0]).bfloat16())  # tiny layers: one 128x128 block
    torch.save({f"net.{k}": v for k, v in base.items()}, tmp_path / "base.pt")
    assert cli.main(["inspect", str(tmp_path / "turbo.pth")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (
        info["layout"].startswith("TurboDiffusion") and "int8" in info["layout"] and info["dtypes_stored"]["int8"] == 20
    )
    assert (
        cli.main(
            [
                "extract",
                "--finetuned",
                str(tmp_path / "turbo.pth"),
                "--base",
                str(tmp_path / "base.pt"),
                "--output",
                str(tmp_path / "x.safetensors"),
                "--rank",
                "24",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "set aside 4 sparse-linear-attention key(s)" in out and "dequantized 20 int8" in out
    assert (
        cli.main(
            [
                "merge",
                "--base",
                str(tmp_path / "base.pt"),
                "--lora",
                str(tmp_path / "x.safetensors"),
                "--output",
                str(tmp_path / "m.safetensors"),
            ]
        )
        == 0
    )
    m = load_file(tmp_path / "m.safetensors")
    k = "blocks.0.cross_attn.o.weight"
    deq = turbodiffusion.dequantize_int8(raw["blocks.0.cross_attn.o.int8_weight"], raw["blocks.0.cross_attn.o.scale"])
    # merged = bf16(base + (deq - base)) up to the LoRA's bf16 factors: one bf16 rounding of the weight scale
    torch.testing.assert_close(m[k].float(), deq.float(), rtol=0, atol=2e-2 * deq.float().abs().max().item())
    assert not any("attn_op" in k for k in m)
    # the dequantized file converts to a loadable diffusers model
    assert cli.main(["convert", str(tmp_path / "turbo.pth"), str(tmp_path / "d"), "--format", "diffusers"]) == 0
    d = load_file(tmp_path / "d" / "diffusion_pytorch_model.safetensors")
    assert torch.equal(d["blocks.1.ffn.net.0.proj.weight"], w) and d["patch_embedding.weight"].shape == (
        DIM,
        C,
        1,
        2,
        2,
    )


def test_extract_reader_aligns_naming_lazily():
    """A diffusers-named base read in the official naming of the fine-tuned file, tensor by tensor."""
    base = {k: v.clone() for k, v in tiny_wan().state_dict().items()}
    off = checkpoint.CheckpointReader(official_from(base))
    view = checkpoint.in_layout_of(checkpoint.CheckpointReader(base), off, "wan")
    assert sorted(view.keys()) == sorted(off.keys())
    for k in off.keys():
        assert view.shape(k) == off.shape(k) and torch.equal(view[k], off[k]), k
    lora, rep = extract.extract_lora(official_from(low_rank_ft(base)), base, rank=2, progress=False)
    assert {r.name for r in rep if r.kind == "lora"} >= {"patch_embedding.weight", "blocks.0.self_attn.q.weight"}
    merged, _ = merge.merge_lora(official_from(base), lora)
    torch.testing.assert_close(
        merged["patch_embedding.weight"],
        official_from(low_rank_ft(base))["patch_embedding.weight"],
        rtol=1e-5,
        atol=1e-5,
    )


def test_single_network_dump_is_unwrapped():
    sd = official_from(tiny_wan().state_dict())
    r = checkpoint.CheckpointReader({f"net_ema.{k}": v for k, v in sd.items()})
    assert sorted(r.keys()) == sorted(sd) and r.info["network"] == "net_ema"


def test_official_layout_written_back_exactly(tmp_path):
    """diffusers folder -> official rCM .pt (net.*, Linear patch embedding) -> diffusers: the same bytes."""
    model = tiny_wan()
    base = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    model.to(torch.bfloat16).save_pretrained(tmp_path / "d")
    assert cli.main(["convert", str(tmp_path / "d"), str(tmp_path / "rcm.pt"), "--format", "rcm"]) == 0
    off = torch.load(tmp_path / "rcm.pt", weights_only=True)
    want = {f"net.{k}": v for k, v in official_from(base).items()}
    assert sorted(off) == sorted(want) and off["net.patch_embedding.weight"].shape == (DIM, C * 4)
    for k in want:
        assert off[k].dtype == torch.bfloat16 and torch.equal(off[k], want[k]), k
    assert cli.main(["convert", str(tmp_path / "rcm.pt"), str(tmp_path / "back"), "--format", "diffusers"]) == 0
    back = load_file(tmp_path / "back" / "diffusion_pytorch_model.safetensors")
    assert sorted(back) == sorted(base) and all(torch.equal(back[k], base[k]) for k in base)
    lora = tmp_path / "l.safetensors"
    from rcm_diffusers.lora import io

    io.save_lora(
        lora,
        {
            "transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(2, DIM),
            "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(DIM, 2),
        },
        "wan",
    )
    assert cli.main(["convert", str(lora), str(tmp_path / "x.pt"), "--format", "rcm"]) == 2


def test_extracted_comfyui_file_loads_in_stock_diffusers(tmp_path):
    """The default (ComfyUI-layout) LoRA extracted from an official .pt loads with stock ``load_lora_weights``, like
    other ComfyUI-layout Wan LoRAs: the patch embedding's delta is a full ``diff`` in the Conv3d form (what ComfyUI
    applies to its Conv3d weight; diffusers' Wan converter drops ``.diff`` keys and refuses a patch-embedding LoRA
    pair). Everything else equals the diffusers-format file's load; ``load_full_lora`` applies every delta of the
    file (merge's result)."""
    from diffusers import WanPipeline

    from rcm_diffusers import load_full_lora

    base = {k: v.clone() for k, v in tiny_wan().state_dict().items()}
    torch.save({f"net.{k}": v for k, v in official_from(low_rank_ft(base)).items()}, tmp_path / "ft.pt")
    torch.save(base, tmp_path / "base.pt")
    for fmt in ("comfyui", "diffusers"):
        assert (
            cli.main(
                [
                    "extract",
                    "--finetuned",
                    str(tmp_path / "ft.pt"),
                    "--base",
                    str(tmp_path / "base.pt"),
                    "--output",
                    str(tmp_path / f"x_{fmt}.safetensors"),
                    "--rank",
                    "2",
                    "--format",
                    fmt,
                ]
            )
            == 0
        )
    xc = load_file(tmp_path / "x_comfyui.safetensors")
    assert xc["diffusion_model.patch_embedding.diff"].shape == (DIM, C, 1, 2, 2)
    assert not any(k.startswith("diffusion_model.patch_embedding.lora") for k in xc)

    def pipe_with(fmt):
        model = tiny_wan()
        model.load_state_dict(base)
        pipe = WanPipeline(transformer=model.eval(), vae=None, scheduler=None, text_encoder=None, tokenizer=None)
        pipe.load_lora_weights(str(tmp_path), weight_name=f"x_{fmt}.safetensors")
        return pipe

    ref = pipe_with("diffusers")
    stock = pipe_with("comfyui")
    ref.fuse_lora()
    stock.fuse_lora()
    fused = {k.replace(".base_layer", ""): v for k, v in ref.transformer.state_dict().items() if "lora_" not in k}
    got = {k.replace(".base_layer", ""): v for k, v in stock.transformer.state_dict().items() if "lora_" not in k}
    assert sorted(got) == sorted(fused)
    for k in fused:
        if k.startswith("patch_embedding."):  # stock diffusers drops a ComfyUI file's .diff/.diff_b keys here
            assert torch.equal(got[k], base[k]) and not torch.equal(fused[k], base[k])
        else:  # the same factors, scaled by alpha/rank in the factors (stock) or in peft's scaling
            torch.testing.assert_close(got[k], fused[k], rtol=1e-6, atol=1e-6, msg=k)
    full = tiny_wan()
    full.load_state_dict(base)
    pipe = WanPipeline(transformer=full.eval(), vae=None, scheduler=None, text_encoder=None, tokenizer=None)
    load_full_lora(pipe, str(tmp_path / "x_comfyui.safetensors"))
    merged = tiny_wan()
    merged.load_state_dict(merge.merge_lora(base, xc)[0])
    y, y_merged = forward(pipe.transformer), forward(merged.eval())
    assert ((y - y_merged).norm() / y_merged.norm()).item() <= 1e-6
