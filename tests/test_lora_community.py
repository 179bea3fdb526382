"""Community LoRA layouts for Wan (and Flux): each read, converted and applied exactly, or refused.

Each layout is built here from the key rules of the code that writes it (our own code):
- ComfyUI native: ``diffusion_model.<original module>.lora_down/lora_up.weight`` + ``.alpha`` (or lora_A/B),
  read by ComfyUI's ``comfy/lora.py`` ``load_lora`` + ``comfy/weight_adapter/lora.py`` ``LoRAAdapter.load``;
- LightX2V: ModelTC/LightX2V ``tools/extract/lora_extractor.py`` ``_generate_lora_diff_key`` (``.diff``,
  ``.diff_b``, ``.modulation -> .diff_m``), lora_up/down without alpha;
- Kijai-standardized: ``blocks.N.modulation.diff`` (kijai/ComfyUI-WanVideoWrapper);
- kohya / musubi-tuner: ``networks/lora.py`` ``create_modules``: ``"lora_unet." + name`` with dots as
  underscores, ``.alpha``; Wan-Fun's ``lora_unet__`` (ComfyUI ``lora_convert.convert_lora_wan_fun``);
- diffusers/peft: ``transformer.<diffusers module>.lora_A/lora_B.weight``.
The expected weights are computed in float64 from the factors: ``W + alpha/r * up @ down`` (alpha absent:
scale 1), ``W + diff``. Stock ComfyUI registers but does not apply raw-parameter (modulation) patches;
RCMLoraLoader applies them (its object-patch path is the same ``W + diff``).
"""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_lora_keys import assert_same_effect, tiny_flux, tiny_wan

from rcm_diffusers import comfy
from rcm_diffusers.lora import cli, io, keys, merge


def original_wan():
    """Original-named tiny Wan weights (the ComfyUI single-file layout)."""
    return keys.to_original({k: v.clone() for k, v in tiny_wan().state_dict().items()}, "wan", prefix="")


def factors(base, seed=0, rank=2, blocks_only=False):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in base.items():
        if k.endswith(".weight") and v.dim() == 2 and (k.startswith("blocks.") or not blocks_only):
            m = k[: -len(".weight")]
            out[m] = (
                torch.randn(rank, v.shape[1], generator=g) * 0.3,
                torch.randn(v.shape[0], rank, generator=g) * 0.3,
            )
    return out


def expected(base, fac, alpha=None, diffs=None):
    """float64 W + alpha/r up@down (+ diffs), in original names."""
    out = {k: v.double() for k, v in base.items()}
    for m, (down, up) in fac.items():
        s = (alpha / down.shape[0]) if alpha is not None else 1.0
        out[f"{m}.weight"] = out[f"{m}.weight"] + s * up.double() @ down.double()
    for k, d in (diffs or {}).items():
        out[k] = out[k] + d.double()
    return out


def _diffs(base, seed=5):
    g = torch.Generator().manual_seed(seed)
    return {
        "blocks.0.modulation": torch.randn(1, 6, 24, generator=g) * 0.1,
        "blocks.1.modulation": torch.randn(1, 6, 24, generator=g) * 0.1,
        "head.modulation": torch.randn(1, 2, 24, generator=g) * 0.1,
        "blocks.0.self_attn.q.bias": torch.randn(24, generator=g) * 0.1,
        "blocks.1.norm3.weight": torch.randn(24, generator=g) * 0.1,
    }


def layout(name, base, fac, diffs):
    """A LoRA file's tensors in the named layout, following the writer's key rules."""
    sd = {}
    if name == "lightx2v":
        for m, (down, up) in fac.items():
            sd[f"diffusion_model.{m}.lora_down.weight"], sd[f"diffusion_model.{m}.lora_up.weight"] = down, up
        for k, d in diffs.items():
            if k.endswith(".modulation"):
                sd["diffusion_model." + k.replace(".modulation", ".diff_m")] = d
            elif k.endswith(".bias"):
                sd["diffusion_model." + k[: -len(".bias")] + ".diff_b"] = d
            else:
                sd["diffusion_model." + k[: -len(".weight")] + ".diff"] = d
    elif name == "kijai":
        for m, (down, up) in fac.items():
            sd[f"diffusion_model.{m}.lora_down.weight"], sd[f"diffusion_model.{m}.lora_up.weight"] = down, up
            sd[f"diffusion_model.{m}.alpha"] = torch.tensor(4.0)
        for k, d in diffs.items():
            suffix = ".diff_b" if k.endswith(".bias") else ".diff"
            t = k if k.endswith(".modulation") else k.rsplit(".", 1)[0]
            sd[f"diffusion_model.{t}{suffix}"] = d
    elif name in ("kohya", "wan_fun"):
        pre = "lora_unet_" if name == "kohya" else "lora_unet__"
        for m, (down, up) in fac.items():
            n = pre + m.replace(".", "_")
            sd[f"{n}.lora_down.weight"], sd[f"{n}.lora_up.weight"], sd[f"{n}.alpha"] = down, up, torch.tensor(4.0)
    elif name == "comfy_lora_AB":
        for m, (down, up) in fac.items():
            sd[f"diffusion_model.{m}.lora_A.weight"], sd[f"diffusion_model.{m}.lora_B.weight"] = down, up
            sd[f"diffusion_model.{m}.alpha"] = torch.tensor(4.0)
    return sd


CASES = {  # layout -> (alpha, carries diffs, LoRA on blocks only)
    "lightx2v": (None, True, False),
    "kijai": (4.0, True, False),
    "kohya": (4.0, False, True),
    "wan_fun": (4.0, False, True),
    "comfy_lora_AB": (4.0, False, False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_wan_layout_converts_and_merges_exactly(tmp_path, name):
    alpha, with_diffs, blocks_only = CASES[name]
    base = original_wan()
    fac = factors(base, blocks_only=blocks_only)
    diffs = _diffs(base) if with_diffs else {}
    sd = layout(name, base, fac, diffs)
    want = expected(base, fac, alpha, diffs)
    # merge into the original (ComfyUI) and the diffusers naming: every delta, modulation included
    merged, skipped = merge.merge_lora(base, sd)
    assert skipped == []
    for k in base:
        torch.testing.assert_close(merged[k].double(), want[k], rtol=1e-6, atol=1e-6)
    dbase = keys.to_diffusers(base, "wan", prefix="")
    dmerged = keys.to_original(merge.merge_lora(dbase, sd)[0], "wan", prefix="")
    for k in base:
        torch.testing.assert_close(dmerged[k].double(), want[k], rtol=1e-6, atol=1e-6)
    # convert -> ComfyUI file -> RCMLoraLoader's reader: the same deltas (bitwise; alpha outside the blocks folded
    # into lora_down, exactly for these power-of-two alpha/r), ComfyUI names, modulation as .diff
    save_file(sd, tmp_path / "in.safetensors")
    assert (
        cli.main(["convert", str(tmp_path / "in.safetensors"), str(tmp_path / "c.safetensors"), "--format", "comfyui"])
        == 0
    )
    c = comfy.load_lora_file(str(tmp_path / "c.safetensors"), "wan")
    direct = comfy.load_lora_file(str(tmp_path / "in.safetensors"), "wan")  # the original file, loaded as it is
    assert_same_effect(c, direct)
    applied = comfy_style_apply(base, c)
    for k in base:
        torch.testing.assert_close(applied[k], want[k], rtol=1e-6, atol=1e-6)
    if with_diffs:
        assert "diffusion_model.blocks.0.modulation.diff" in c and "diffusion_model.head.modulation.diff" in c
    # convert -> diffusers file: what peft can load (LoRA pairs, biases of LoRA modules); the rest listed
    info = io.save_lora(tmp_path / "d.safetensors", sd, format="diffusers")
    d = load_file(tmp_path / "d.safetensors")
    assert all(k.startswith("transformer.") for k in d)
    if with_diffs:
        assert "transformer.blocks.0.scale_shift_table.diff" in info["not_applied"]


def comfy_style_apply(base, comfy_sd):
    """Our float64 reading of ComfyUI's patch math: W + alpha/r * up @ down (reshaped to W), W + diff."""
    out = {k: v.double() for k, v in base.items()}
    for t, g in keys.lora_modules(comfy_sd).items():
        key = f"{t}.weight" if f"{t}.weight" in base else t
        if "lora_A.weight" in g:
            A, B = g["lora_A.weight"].double(), g["lora_B.weight"].double()
            s = float(g["alpha"]) / A.shape[0] if "alpha" in g else 1.0
            out[key] = out[key] + s * (B.flatten(1) @ A.flatten(1)).reshape(base[key].shape)
        if "diff" in g:
            out[key] = out[key] + g["diff"].double()
        if "diff_b" in g:
            out[f"{t}.bias"] = out[f"{t}.bias"] + g["diff_b"].double()
    return out


def test_kohya_and_diff_m_were_refused_and_unexplained_keys_are_listed(tmp_path):
    base = original_wan()
    sd = layout("kohya", base, factors(base, blocks_only=True), {})
    assert keys.detect_arch(sd) == "wan" and keys.detect_format(sd) == "original"
    assert "diffusion_model.blocks.1.cross_attn.k.lora_down.weight" in keys.to_comfy_keys(sd)
    bad = dict(sd)
    bad["lora_unet_blocks_0_self_attn_zz.lora_down.weight"] = torch.zeros(2, 24)
    bad["diffusion_model.blocks.0.self_attn.q.lora_mid.weight"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"2 key\(s\).*lora_mid.*lora_unet_blocks_0_self_attn_zz"):
        keys.to_comfy_keys(bad)
    save_file(bad, tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="self_attn_zz"):
        comfy.load_lora_file(str(tmp_path / "bad.safetensors"), "wan")


@pytest.mark.parametrize("name", sorted(CASES))
def test_diffusers_load_lora_weights_applies_converted_layouts(tmp_path, name):
    """Each layout converted to the diffusers layout: diffusers' own loader gives the expected weights."""
    from diffusers import WanPipeline

    model = tiny_wan()
    dbase = {k: v.clone() for k, v in model.state_dict().items()}
    base = keys.to_original(dbase, "wan", prefix="")
    alpha = CASES[name][0]
    fac = factors(base, seed=3, blocks_only=CASES[name][2])
    sd = layout(name, base, fac, _diffs(base))
    assert cli.main(["convert", "--format", "diffusers", *_paths(tmp_path, name, sd)]) == 0
    pipe = WanPipeline(transformer=tiny_wan(), vae=None, scheduler=None, text_encoder=None, tokenizer=None)
    pipe.load_lora_weights(str(tmp_path), weight_name=f"{name}.out.safetensors")
    pipe.fuse_lora()
    got = keys.to_original(
        {k.replace(".base_layer", ""): v for k, v in pipe.transformer.state_dict().items() if "lora_" not in k},
        "wan",
        prefix="",
    )
    want = expected(base, fac, alpha)
    for m in fac:
        torch.testing.assert_close(got[f"{m}.weight"].double(), want[f"{m}.weight"], rtol=1e-5, atol=1e-6)


def _paths(tmp_path, name, sd):
    save_file(sd, tmp_path / f"{name}.in.safetensors")
    return [str(tmp_path / f"{name}.in.safetensors"), str(tmp_path / f"{name}.out.safetensors")]


def test_flux_kohya_fused_layers():
    """sd-scripts/musubi Flux names (``lora_unet_double_blocks_0_img_attn_qkv``): fused deltas split exactly."""
    fbase = keys.to_original({k: v.clone() for k, v in tiny_flux().state_dict().items()}, "flux", prefix="")
    fac = {m: f for m, f in factors(fbase, seed=2).items() if m.startswith(("double_blocks", "single_blocks"))}
    sd = {}
    for m, (down, up) in fac.items():
        n = "lora_unet_" + m.replace(".", "_")
        sd[f"{n}.lora_down.weight"], sd[f"{n}.lora_up.weight"], sd[f"{n}.alpha"] = down, up, torch.tensor(2.0)
    assert keys.detect_arch(sd) == "flux"
    want = expected(fbase, fac, 2.0)
    merged, _ = merge.merge_lora(fbase, sd)
    for m in fac:
        torch.testing.assert_close(merged[f"{m}.weight"].double(), want[f"{m}.weight"], rtol=1e-6, atol=1e-6)
    # via the diffusers layout (q/k/v split) and back onto the fused original weights
    dbase = keys.to_diffusers(fbase, "flux", prefix="")
    back = keys.to_original(merge.merge_lora(dbase, keys.from_any(sd))[0], "flux", prefix="")
    for m in fac:
        torch.testing.assert_close(back[f"{m}.weight"].double(), want[f"{m}.weight"], rtol=1e-6, atol=1e-6)


COMFYUI_PATH = os.environ.get("COMFYUI_PATH")


@pytest.mark.skipif(
    not COMFYUI_PATH,
    reason="set COMFYUI_PATH to a ComfyUI checkout (with its requirements) "
    "to compare with stock ComfyUI's own LoRA loader",
)
@pytest.mark.parametrize("name", sorted(CASES))
def test_stock_comfyui_loader_gives_the_same_deltas(tmp_path, name):
    """Stock ComfyUI (comfy/lora.py ``model_lora_keys_unet`` + ``load_lora`` + ``calculate_weight``) on the
    *original* file: module deltas equal ours (<= 1e-6 relative); modulation deltas are the ones it drops."""
    import sys
    import types

    sys.path.insert(0, COMFYUI_PATH)
    from comfy.cli_args import args

    args.cpu = True
    import comfy.lora as clora
    import comfy.lora_convert as cconv

    alpha, with_diffs, blocks_only = CASES[name]
    base = original_wan()
    fac = factors(base, blocks_only=blocks_only)
    diffs = _diffs(base) if with_diffs else {}
    sd = cconv.convert_lora(layout(name, base, fac, diffs))

    class WanLike:  # what model_lora_keys_unet reads of a Wan BaseModel: its state dict and unet_config
        model_config = types.SimpleNamespace(unet_config={"image_model": "wan2.1"})

        def state_dict(self):
            return {f"diffusion_model.{k}": v for k, v in base.items()}

    key_map = clora.model_lora_keys_unet(WanLike(), {})
    # stock ComfyUI maps nothing of a diffusers/peft Wan LoRA
    assert not clora.load_lora(io.diffusers_loadable(sd, "wan")[0], key_map, log_missing=False)
    patches = clora.load_lora(sd, key_map, log_missing=False)
    want = expected(base, fac, alpha, diffs)
    ours = comfy_style_apply(base, keys.to_comfy_keys(sd, "wan"))  # what RCMLoraLoader reads and applies
    applied = set()
    for full, patch in patches.items():
        k = full[len("diffusion_model.") :]
        if not k.endswith((".weight", ".bias")):
            continue  # registered on a raw parameter (Kijai .modulation.diff): stock ComfyUI never applies it
        applied.add(k)
        w = clora.calculate_weight(
            [(1.0, patch, 1.0, None, None)], base[k].double().clone(), full, intermediate_dtype=torch.float64
        )
        torch.testing.assert_close(w, want[k], rtol=1e-6, atol=1e-6)
    assert applied >= {f"{m}.weight" for m in fac}
    stock_drops = sorted(k for k in diffs if k not in applied)
    assert stock_drops == sorted(k for k in diffs if k.endswith("modulation"))  # LightX2V .diff_m: not even read
    for k in base:  # RCMLoraLoader: every delta, the modulation ones stock ComfyUI drops included
        torch.testing.assert_close(ours[k], want[k], rtol=1e-6, atol=1e-6)


def test_flux_kohya_converted_loads_in_diffusers(tmp_path):
    """Flux kohya file -> diffusers layout (q/k/v split from the fused qkv/linear1 LoRAs) ->
    FluxPipeline.load_lora_weights."""
    from diffusers import FluxPipeline

    fm = tiny_flux()
    dbase = {k: v.clone() for k, v in fm.state_dict().items()}
    fbase = keys.to_original(dbase, "flux", prefix="")
    fac = {m: f for m, f in factors(fbase, seed=4).items() if m.startswith(("double_blocks", "single_blocks"))}
    sd = {}
    for m, (down, up) in fac.items():
        n = "lora_unet_" + m.replace(".", "_")
        sd[f"{n}.lora_down.weight"], sd[f"{n}.lora_up.weight"], sd[f"{n}.alpha"] = down, up, torch.tensor(2.0)
    assert cli.main(["convert", "--format", "diffusers", *_paths(tmp_path, "fk", sd)]) == 0
    pipe = FluxPipeline(
        transformer=tiny_flux(),
        scheduler=None,
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
    )
    pipe.load_lora_weights(str(tmp_path), weight_name="fk.out.safetensors")
    pipe.fuse_lora()
    got = keys.to_original(
        {k.replace(".base_layer", ""): v for k, v in pipe.transformer.state_dict().items() if "lora_" not in k},
        "flux",
        prefix="",
    )
    want = expected(fbase, fac, 2.0)
    for m in fac:
        torch.testing.assert_close(got[f"{m}.weight"].double(), want[f"{m}.weight"], rtol=1e-5, atol=1e-6)


def _wan_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 16, 1, 4, 4, generator=g),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 6, 32, generator=g),
        return_dict=False,
    )


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", ["lightx2v", "kijai"])
def test_load_full_lora_applies_every_delta_live_with_strength_and_exact_unload(tmp_path, name):
    """LightX2V / Kijai files on a live WanPipeline: stock load_lora_weights drops the norm, bias and modulation
    deltas; load_full_lora applies them all and equals merge_lora at each strength; unload is bit-exact."""
    from diffusers import WanPipeline

    from rcm_diffusers import load_full_lora

    dbase = {k: v.clone() for k, v in tiny_wan().state_dict().items()}
    base = keys.to_original(dbase, "wan", prefix="")
    fac = factors(base, seed=7)
    diffs = _diffs(base)
    g = torch.Generator().manual_seed(9)
    diffs["patch_embedding.weight"] = torch.randn(base["patch_embedding.weight"].shape, generator=g) * 0.1
    diffs["blocks.0.norm3.bias"] = torch.randn(24, generator=g) * 0.1  # bias delta of a module without a LoRA
    sd = layout(name, base, fac, diffs)
    save_file(sd, tmp_path / "l.safetensors")

    def merged_model(w):
        m = tiny_wan()
        m.load_state_dict(merge.merge_lora(dbase, sd, weight=w)[0])
        return m.eval()

    pipe = WanPipeline(transformer=tiny_wan().eval(), vae=None, scheduler=None, text_encoder=None, tokenizer=None)
    with torch.no_grad():
        y0 = pipe.transformer(**_wan_inputs())[0]
        want = {w: merged_model(w)(**_wan_inputs())[0] for w in (1.0, 0.4)}
    effect = _rel(y0, want[1.0])  # the LoRA's whole effect on the output, |y_base - y_merged| / |y_merged|

    # stock diffusers on the file converted to its layout (all it can take): the full deltas are lost
    io.save_lora(tmp_path / "d.safetensors", sd, format="diffusers")
    stock = WanPipeline(transformer=tiny_wan().eval(), vae=None, scheduler=None, text_encoder=None, tokenizer=None)
    stock.load_lora_weights(str(tmp_path), weight_name="d.safetensors")
    with torch.no_grad():
        stock_err = _rel(stock.transformer(**_wan_inputs())[0], want[1.0])
    assert stock_err > 0.05 * effect

    handle = load_full_lora(pipe, str(tmp_path / "l.safetensors"), adapter_name="distill")
    assert sorted(handle.full_deltas) == sorted(
        [  # diffusers names of the modulation, norm and patch-embedding deltas
            "blocks.0.scale_shift_table",
            "blocks.1.scale_shift_table",
            "scale_shift_table",
            "blocks.0.norm2.bias",
            "blocks.1.norm2.weight",
            "patch_embedding.weight",
        ]
    )
    errs = {}
    for w in (1.0, 0.4, 1.0):
        handle.set_weight(w)
        with torch.no_grad():
            errs[w] = _rel(pipe.transformer(**_wan_inputs())[0], want[w])
        # the full deltas are merge's own arithmetic (float32 W + w * diff): bit-identical parameters
        ref = merge.merge_lora(dbase, sd, weight=w)[0]
        params = {k.replace(".base_layer", ""): v for k, v in pipe.transformer.named_parameters()}
        for p in handle.full_deltas:
            assert torch.equal(params[p.replace(".base_layer", "")], ref[p.replace(".base_layer", "")]), p
    print(
        f"\n{name}: LoRA effect {effect:.3f}, stock load_lora_weights misses {stock_err:.3f}, "
        f"load_full_lora vs merge {max(errs.values()):.2e}"
    )
    # float32 round-off only: the unfused peft path (x W^T + (x A^T) B^T) vs the merged weight, a few ulp per layer
    assert max(errs.values()) <= 1e-6
    handle.unload()
    assert not any(pipe.get_list_adapters().values())
    after = pipe.transformer.state_dict()
    assert sorted(after) == sorted(dbase)
    for k in dbase:
        assert torch.equal(after[k], dbase[k]), k
    with torch.no_grad():
        assert torch.equal(pipe.transformer(**_wan_inputs())[0], y0)


def test_load_full_lora_into_the_second_expert():
    """Wan 2.2: a LightX2V-layout LoRA (as a dict) into ``transformer_2`` only, at strength 0.7: equals merge_lora
    there, the high-noise expert keeps its weights; unload restores the second expert bit for bit."""
    from diffusers import WanImageToVideoPipeline
    from tiny import tiny_wan_transformer

    from rcm_diffusers import load_full_lora

    pipe = WanImageToVideoPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=None,
        scheduler=None,
        image_encoder=None,
        image_processor=None,
        boundary_ratio=0.9,
        transformer=tiny_wan_transformer(seed=1, in_channels=12),
        transformer_2=tiny_wan_transformer(seed=2, in_channels=12),
    )
    d1, d2 = ({k: v.clone() for k, v in t.state_dict().items()} for t in (pipe.transformer, pipe.transformer_2))
    base2 = keys.to_original(d2, "wan", prefix="")
    sd = layout("lightx2v", base2, factors(base2, seed=11), _diffs(base2))
    g = torch.Generator().manual_seed(1)
    x = dict(
        hidden_states=torch.randn(1, 12, 1, 4, 4, generator=g),
        timestep=torch.tensor([300]),
        encoder_hidden_states=torch.randn(1, 6, 32, generator=g),
        return_dict=False,
    )
    merged = tiny_wan_transformer(seed=2, in_channels=12)
    merged.load_state_dict(merge.merge_lora(d2, sd, weight=0.7)[0])
    handle = load_full_lora(pipe, sd, adapter_name="low", weight=0.7, component="transformer_2")
    assert not any("lora" in k for k in pipe.transformer.state_dict())
    for k, v in pipe.transformer.state_dict().items():
        assert torch.equal(v, d1[k]), k
    with torch.no_grad():
        y, want = pipe.transformer_2(**x)[0], merged(**x)[0]
    assert _rel(y, want) <= 1e-6
    handle.unload()
    after = pipe.transformer_2.state_dict()
    assert sorted(after) == sorted(d2) and all(torch.equal(after[k], d2[k]) for k in d2)
