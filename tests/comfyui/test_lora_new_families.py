"""Stock ComfyUI's LoRA loader on the trainer's Qwen-Image, FLUX.2 and HunyuanVideo-1.5 LoRAs (``rcm-lora convert
--format comfyui``; a HunyuanVideo-1.5 file in diffusers names maps to nothing there), and the pack's RCMLoraLoader
on the three families.

In process: a tiny model of the family is built through ComfyUI's own ``comfy.sd.load_diffusion_model_state_dict``
(model detection from a state dict in ComfyUI's layout), the same weights go into the diffusers model (diffusers'
single-file converter for FLUX.2, the names as they are for Qwen-Image, ``_hy15_comfy_to_diffusers`` for
HunyuanVideo-1.5, whose strict load pairs every weight), a peft LoRA of the trainer's default
targets is saved as the trainer exports it and converted with ``rcm-lora``, then applied with
``comfy.sd.load_lora_for_models``. Every LoRA key must be consumed (ComfyUI logs "lora key not loaded" for misses)
and each patched weight, read back in diffusers names, must equal W + alpha/r B @ A of the diffusers model.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest
import torch
from comfyui_harness import COMFYUI_PATHS, SKIP_REASON, have_comfyui, import_comfy
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(not (COMFYUI_PATHS and have_comfyui()), reason=SKIP_REASON)

HIDDEN, TEXT = 256, 64  # 2 heads of 128: ComfyUI's FLUX.2 detection takes heads = hidden / 128
# tests/train_helpers.py tiny_qwen_transformer's config, in ComfyUI's QwenImageTransformer2DModel arguments
QWEN_CONFIG = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=16,  # train_helpers.TEXT_DIM
    axes_dims_rope=(8, 4, 4),
)
RANK, ALPHA = 2, 4.0


def _random_like(meta_sd: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: 0.05 * torch.randn(v.shape, generator=g) for k, v in meta_sd.items()}


def _peft_lora(model) -> dict:
    """The trainer's export of a LoRA of the family's default targets (random A and B, alpha 4 on rank 2)."""
    from peft import LoraConfig, get_peft_model_state_dict

    from rcm_diffusers.distill.adapters import default_lora_targets

    torch.manual_seed(1)
    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=default_lora_targets(model), init_lora_weights=False)
    model.add_adapter(cfg)
    return {f"transformer.{k}": v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def _expected(dsd: dict, lora: dict) -> dict:
    """diffusers weights with every LoRA pair merged: W + alpha/r B @ A (float64)."""
    out = {k: v.double() for k, v in dsd.items()}
    for k, A in lora.items():
        if k.endswith(".lora_A.weight"):
            t = k[len("transformer.") : -len(".lora_A.weight")]
            out[f"{t}.weight"] += ALPHA / RANK * (lora[k.replace("lora_A", "lora_B")].double() @ A.double())
    return out


def _convert(tmp_path, lora: dict, alpha_pattern: dict | None = None) -> dict:
    """``lora`` saved as the trainer saves it (peft's config in diffusers' header), converted with rcm-lora."""
    from rcm_diffusers.lora import cli

    src, dst = tmp_path / "pytorch_lora_weights.safetensors", tmp_path / "comfy.safetensors"
    header = {"r": RANK, "lora_alpha": ALPHA, **({"alpha_pattern": alpha_pattern} if alpha_pattern else {})}
    save_file(lora, src, {"lora_adapter_metadata": json.dumps(header)})
    assert cli.main(["convert", str(src), str(dst), "--format", "comfyui"]) == 0
    return load_file(dst)


def _comfy_model(comfy_sd: dict, family: str):
    """ComfyUI's ModelPatcher of ``comfy_sd``: FLUX.2 through its loader and model detection; Qwen-Image through its
    own classes with the tiny config given (its detection fixes 24 heads of 128 and a 3584-wide text input)."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.sd
    import comfy.supported_models

    if family == "flux2":
        return comfy.sd.load_diffusion_model_state_dict(dict(comfy_sd))
    cfg = comfy.supported_models.QwenImage(dict(image_model="qwen_image", **QWEN_CONFIG))
    cfg.set_inference_dtype(torch.float32, None)
    model = cfg.get_model({})
    model.load_model_weights(dict(comfy_sd), "")
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def _apply_in_comfyui(comfy_sd: dict, lora: dict, caplog, family: str):
    """ComfyUI's model of ``comfy_sd``, the LoRA through load_lora_for_models; its patched weights (float64)."""
    import comfy.lora
    import comfy.sd

    model = _comfy_model(comfy_sd, family)
    with caplog.at_level(logging.WARNING):
        patched, _ = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0.0)
    misses = [r.getMessage() for r in caplog.records if "not loaded" in r.getMessage().lower()]
    assert not misses, misses
    base = {f"diffusion_model.{k}": v for k, v in comfy_sd.items()}
    out = {k: v.double() for k, v in comfy_sd.items()}
    for key, patches in patched.patches.items():
        w = comfy.lora.calculate_weight(patches, base[key].double().clone(), key, intermediate_dtype=torch.float64)
        out[key[len("diffusion_model.") :]] = w
    return model, patched, out


def _flux2_models():
    """ComfyUI's tiny FLUX.2 (its own class, the config its detection gives) and the same weights in diffusers."""
    import comfy.ops
    from comfy.ldm.flux.model import Flux
    from diffusers import Flux2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    meta = Flux(
        image_model="flux2",
        in_channels=128,
        out_channels=128,
        vec_in_dim=None,
        context_in_dim=TEXT,
        hidden_size=HIDDEN,
        mlp_ratio=3.0,
        num_heads=HIDDEN // 128,
        depth=1,
        depth_single_blocks=1,
        axes_dim=[32, 32, 32, 32],
        theta=2000,
        patch_size=1,
        qkv_bias=False,
        guidance_embed=True,
        txt_ids_dims=[3],
        global_modulation=True,
        mlp_silu_act=True,
        ops_bias=False,
        default_ref_method="index",
        ref_index_scale=10.0,
        device="meta",
        operations=comfy.ops.disable_weight_init,
    )
    comfy_sd = _random_like(meta.state_dict(), 0)
    d = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=128,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=128,
        num_attention_heads=HIDDEN // 128,
        joint_attention_dim=TEXT,
        timestep_guidance_channels=256,
        mlp_ratio=3.0,
        axes_dims_rope=(32, 32, 32, 32),
        guidance_embeds=True,
    )
    d.load_state_dict(convert_flux2_transformer_checkpoint_to_diffusers(dict(comfy_sd)), strict=True)
    return comfy_sd, d, lambda sd: convert_flux2_transformer_checkpoint_to_diffusers(dict(sd))


def _qwen_models():
    """ComfyUI's tiny Qwen-Image (its module names are diffusers'; it loads the diffusers weights as they are)."""
    from train_helpers import tiny_qwen_transformer

    d = tiny_qwen_transformer()
    assert d.config.joint_attention_dim == QWEN_CONFIG["joint_attention_dim"]
    comfy_sd = {k: v.detach().clone() for k, v in d.state_dict().items()}
    return comfy_sd, d, dict


@pytest.mark.parametrize("family", ["flux2", "qwen_image"])
def test_stock_loraloader_takes_every_key_and_applies_w_plus_ba(tmp_path, caplog, family):
    import_comfy()
    import comfy.model_base

    comfy_sd, d, to_diffusers = _flux2_models() if family == "flux2" else _qwen_models()
    dsd = {k: v.detach().clone() for k, v in d.state_dict().items()}
    lora = _peft_lora(d)
    converted = _convert(tmp_path, lora)
    assert {k for k in converted if not k.endswith(".alpha")} == set(lora)  # pass-through names, plus .alpha

    model, patched, got = _apply_in_comfyui(comfy_sd, converted, caplog, family)
    cls = {"flux2": comfy.model_base.Flux2, "qwen_image": comfy.model_base.QwenImage}[family]
    assert isinstance(model.model, cls)  # ComfyUI's detection took the tiny model for the family
    targets = {k[: -len(".lora_A.weight")] for k in lora if k.endswith(".lora_A.weight")}
    assert len(patched.patches) > 0
    got_d = to_diffusers(got)
    want = _expected(dsd, lora)
    for t in targets:
        k = t[len("transformer.") :] + ".weight"
        torch.testing.assert_close(got_d[k].double(), want[k], rtol=1e-6, atol=1e-7)
    for k in want:  # nothing else moved
        torch.testing.assert_close(got_d[k].double(), want[k], rtol=1e-6, atol=1e-7)

    # the file as the trainer writes it (no .alpha: ComfyUI reads no peft header) maps too, at scale 1 instead of
    # alpha / r: why convert adds .alpha
    _, raw_patched, raw = _apply_in_comfyui(comfy_sd, lora, caplog, family)
    assert set(raw_patched.patches) == set(patched.patches)
    raw_d = to_diffusers(raw)
    for k, A in lora.items():
        if k.endswith(".lora_A.weight"):
            w = k[len("transformer.") : -len(".lora_A.weight")] + ".weight"
            want_raw = dsd[w].double() + lora[k.replace("lora_A", "lora_B")].double() @ A.double()
            torch.testing.assert_close(raw_d[w].double(), want_raw, rtol=1e-6, atol=1e-7)


# ComfyUI's HunyuanVideo-1.5 arguments of a tiny text-to-video model (its detection would fix heads of 128); the
# diffusers model of HY15_DIFFUSERS has the same shapes. ComfyUI's token refiner always has 2 blocks and 4x MLPs.
HY15_COMFY = dict(
    image_model="hunyuan_video",
    in_channels=9,
    out_channels=4,
    vec_in_dim=None,
    context_in_dim=16,
    hidden_size=64,
    mlp_ratio=4.0,
    num_heads=2,
    depth=2,
    depth_single_blocks=0,
    axes_dim=[8, 12, 12],
    theta=256,
    patch_size=[1, 1, 1],
    qkv_bias=True,
    guidance_embed=False,
    byt5=True,
    meanflow=False,
    use_cond_type_embedding=True,
    vision_in_dim=8,
    meanflow_sum=True,
)
HY15_DIFFUSERS = dict(
    in_channels=9,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=32,
    num_layers=2,
    num_refiner_layers=2,
    mlp_ratio=4.0,
    patch_size=1,
    patch_size_t=1,
    text_embed_dim=16,
    text_embed_2_dim=1472,  # ComfyUI's ByT5 mapper takes 1472 features
    image_embed_dim=8,
    rope_axes_dim=(8, 12, 12),
    task_type="t2v",
)
# ComfyUI parameter names -> diffusers ones for what is no LoRA target (norms, embeddings): with
# rcm_diffusers.lora.names.HUNYUAN15_PAIRS / HUNYUAN15_FUSED this maps every weight of the model
HY15_OTHER = [
    ("double_blocks.{i}.img_attn.norm.query_norm", "transformer_blocks.{i}.attn.norm_q"),
    ("double_blocks.{i}.img_attn.norm.key_norm", "transformer_blocks.{i}.attn.norm_k"),
    ("double_blocks.{i}.txt_attn.norm.query_norm", "transformer_blocks.{i}.attn.norm_added_q"),
    ("double_blocks.{i}.txt_attn.norm.key_norm", "transformer_blocks.{i}.attn.norm_added_k"),
    ("txt_in.individual_token_refiner.blocks.{i}.norm1", "context_embedder.token_refiner.refiner_blocks.{i}.norm1"),
    ("txt_in.individual_token_refiner.blocks.{i}.norm2", "context_embedder.token_refiner.refiner_blocks.{i}.norm2"),
    ("byt5_in.layernorm", "context_embedder_2.norm"),
    ("vision_in.proj.0", "image_embedder.norm_in"),
    ("vision_in.proj.4", "image_embedder.norm_out"),
    ("cond_type_embedding", "cond_type_embed"),
]


def _hy15_comfy_to_diffusers(comfy_sd: dict) -> dict:
    """ComfyUI HunyuanVideo-1.5 weights in diffusers names: fused q/k/v split in three, the final AdaLN projection's
    halves swapped (ComfyUI (shift, scale), diffusers (scale, shift))."""
    import re

    from rcm_diffusers.lora.names import HUNYUAN15_FUSED, HUNYUAN15_PAIRS, HUNYUAN15_SWAP_ROWS

    def rx(t):
        return re.compile("^" + re.escape(t).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")

    single = [(rx(c), d) for d, c in HUNYUAN15_PAIRS] + [(rx(c), d) for c, d in HY15_OTHER]
    fused = [(rx(f), ms) for f, ms in HUNYUAN15_FUSED]
    out = {}
    for key, v in comfy_sd.items():
        module, _, leaf = key.rpartition(".")
        hit = next(((m, ms) for r, ms in fused if (m := r.match(module))), None)
        if hit:
            m, ms = hit
            for d, part in zip(ms, v.chunk(3, dim=0)):
                out[f"{d.replace('{i}', m.group('i'))}.{leaf}"] = part
            continue
        if "." not in key:  # a parameter of the top module
            module, leaf = key, ""
        hit = next(((m, d) for r, d in single if (m := r.match(module))), None)
        assert hit is not None, f"no diffusers name for {key}"
        m, d = hit
        d = d.replace("{i}", m.group("i")) if "i" in m.groupdict() else d
        if d in HUNYUAN15_SWAP_ROWS:
            a, b = v.chunk(2, dim=0)
            v = torch.cat([b, a], dim=0)
        out[f"{d}.{leaf}" if leaf else d] = v
    return out


def _hy15_models():
    """ComfyUI's tiny HunyuanVideo-1.5 (its own classes) and the same weights in diffusers' model."""
    import comfy.ops
    from comfy.ldm.hunyuan_video.model import HunyuanVideo
    from diffusers import HunyuanVideo15Transformer3DModel

    cfg = {k: v for k, v in HY15_COMFY.items() if k != "image_model"}
    meta = HunyuanVideo(device="meta", operations=comfy.ops.disable_weight_init, **cfg)
    comfy_sd = _random_like(meta.state_dict(), 0)
    d = HunyuanVideo15Transformer3DModel(**HY15_DIFFUSERS)
    d.load_state_dict(_hy15_comfy_to_diffusers(comfy_sd), strict=True)  # every weight of both models paired
    return comfy_sd, d, _hy15_comfy_to_diffusers


def _hy15_comfy_model(comfy_sd: dict):
    import comfy.model_patcher
    import comfy.supported_models

    cfg = comfy.supported_models.HunyuanVideo15(dict(HY15_COMFY))
    cfg.set_inference_dtype(torch.float32, None)
    model = cfg.get_model({})
    model.load_model_weights(dict(comfy_sd), "")
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


HY15_EXTRA_TARGETS = ["norm_out.linear", "norm1.linear", "norm1_context.linear", "proj_in", "proj_out"]


@pytest.mark.parametrize("alphas", ["same", "per_module"])
def test_hunyuanvideo15_lora_through_stock_loader_equals_diffusers_fused(tmp_path, caplog, monkeypatch, alphas):
    """A HunyuanVideo-1.5 LoRA of the trainer's default targets (plus the modulation, final-layer and text-input
    projections) converted with rcm-lora: stock ComfyUI takes every key, and every patched weight of its model, read
    back in diffusers names, equals W + alpha/r B @ A of the diffusers model; q/k/v through one fused LoRA each.
    ``per_module``: q, k and v with different alphas (one scale each inside the fused LoRA)."""
    import_comfy()
    import comfy.model_base
    from peft import LoraConfig, get_peft_model_state_dict

    from rcm_diffusers.distill.adapters import default_lora_targets

    comfy_sd, d, to_diffusers = _hy15_models()
    monkeypatch.setattr(sys.modules[__name__], "_comfy_model", lambda sd, family: _hy15_comfy_model(sd))
    dsd = {k: v.detach().clone() for k, v in d.state_dict().items()}
    torch.manual_seed(1)
    alpha_pattern = {"to_k": 2.0, "add_v_proj": 8.0} if alphas == "per_module" else {}
    cfg = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        alpha_pattern=alpha_pattern,
        target_modules=default_lora_targets(d) + HY15_EXTRA_TARGETS,
        init_lora_weights=False,
    )
    d.add_adapter(cfg)
    lora = {f"transformer.{k}": v.detach().clone() for k, v in get_peft_model_state_dict(d).items()}
    scale = {}
    for k in lora:
        if k.endswith(".lora_A.weight"):
            t = k[len("transformer.") : -len(".lora_A.weight")]
            scale[t] = next((a for p, a in alpha_pattern.items() if t.endswith(p)), ALPHA) / RANK
    assert sorted(set(scale.values())) == ([1.0, 2.0, 4.0] if alpha_pattern else [2.0])
    converted = _convert(tmp_path, lora, alpha_pattern)
    fused = [k for k in converted if k.endswith("qkv.lora_A.weight")]
    assert len(fused) == 2 * 2 + 2  # img/txt q/k/v in each of 2 blocks, the 2 refiner blocks
    assert all(converted[k].shape[0] == 3 * RANK for k in fused)

    model, patched, got = _apply_in_comfyui(comfy_sd, converted, caplog, "hunyuan_video15")
    assert isinstance(model.model, comfy.model_base.HunyuanVideo15)
    n_modules = len({k.rsplit(".", 2)[0] for k in converted if k.endswith(".lora_A.weight")})
    assert len(patched.patches) == n_modules == len(scale) - 2 * len(fused)  # three LoRAs in one per fused qkv
    got_d = to_diffusers(got)
    want = {k: v.double() for k, v in dsd.items()}
    for t, s in scale.items():
        B, A = lora[f"transformer.{t}.lora_B.weight"].double(), lora[f"transformer.{t}.lora_A.weight"].double()
        want[f"{t}.weight"] += s * (B @ A)
    moved = 0
    for k in want:
        torch.testing.assert_close(got_d[k].double(), want[k], rtol=1e-6, atol=1e-7)
        moved += not torch.equal(want[k], dsd[k].double())
    assert moved == len(scale)


def _hy15_forward_pair(comfy_module, d, seed: int = 3):
    """One text-to-video forward of ComfyUI's HunyuanVideo-1.5 module and of diffusers' model on the same inputs: all
    text tokens valid (ComfyUI's attention_mask then stays None), ByT5 tokens, no image condition (diffusers' zero
    image embeds are masked out; ComfyUI gets no clip_fea), timestep 500 in both (HunyuanVideo's time factor is 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, HY15_COMFY["in_channels"], 2, 4, 4, generator=g)
    text = torch.randn(1, 5, HY15_COMFY["context_in_dim"], generator=g)
    byt5 = torch.randn(1, 3, 1472, generator=g)
    t = torch.tensor([500.0])
    with torch.no_grad():
        ours = comfy_module(x, t, text, txt_byt5=byt5, transformer_options={})
        theirs = d(
            hidden_states=x,
            timestep=t,
            encoder_hidden_states=text,
            encoder_attention_mask=torch.ones(1, 5),
            encoder_hidden_states_2=byt5,
            encoder_attention_mask_2=torch.ones(1, 3),
            image_embeds=torch.zeros(1, 2, HY15_DIFFUSERS["image_embed_dim"]),
            return_dict=False,
        )[0]
    return ours, theirs


def test_hunyuanvideo15_comfyui_output_with_converted_lora_equals_diffusers_with_lora(tmp_path, caplog, monkeypatch):
    """The end-to-end check: ComfyUI's HunyuanVideo-1.5 with the weights its stock loader patched from the converted
    LoRA gives the output of diffusers' model with the peft LoRA active (and without LoRA both give the same too)."""
    import_comfy()
    import comfy.ops
    from comfy.ldm.hunyuan_video.model import HunyuanVideo

    comfy_sd, d, _ = _hy15_models()
    d.eval()
    net = HunyuanVideo(
        operations=comfy.ops.disable_weight_init, **{k: v for k, v in HY15_COMFY.items() if k != "image_model"}
    )
    net.load_state_dict(comfy_sd, strict=True)
    base_c, base_d = _hy15_forward_pair(net, d)
    scale = float(base_d.abs().mean())
    torch.testing.assert_close(base_c, base_d, rtol=1e-4, atol=1e-4 * scale)

    monkeypatch.setattr(sys.modules[__name__], "_comfy_model", lambda sd, family: _hy15_comfy_model(sd))
    lora = _peft_lora(d)  # active in d from here on
    converted = _convert(tmp_path, lora)
    _, _, got = _apply_in_comfyui(comfy_sd, converted, caplog, "hunyuan_video15")
    net.load_state_dict({k: v.float() for k, v in got.items()}, strict=True)
    lora_c, lora_d = _hy15_forward_pair(net, d)
    assert float((lora_d - base_d).abs().mean()) > 0.05 * scale  # the LoRA moves the output
    torch.testing.assert_close(lora_c, lora_d, rtol=1e-4, atol=1e-4 * scale)


def test_stock_comfyui_maps_none_of_a_hunyuanvideo15_diffusers_lora():
    """ComfyUI's HunyuanVideo-1.5 is a HunyuanVideo: its LoRA map takes the original names (double_blocks.N.img_attn_qkv
    ...), so no key of a diffusers-named HunyuanVideo-1.5 LoRA is found in it."""
    import_comfy()
    import types

    import comfy.lora
    import comfy.model_base
    import comfy.ops
    from comfy.ldm.hunyuan_video.model import HunyuanVideo
    from test_train_hunyuan15 import tiny_hunyuan15_transformer

    cfg = dict(
        image_model="hunyuan_video",
        in_channels=65,
        out_channels=32,
        vec_in_dim=None,
        context_in_dim=TEXT,
        hidden_size=HIDDEN,
        mlp_ratio=4.0,
        num_heads=HIDDEN // 128,
        depth=2,
        depth_single_blocks=0,
        axes_dim=[16, 56, 56],
        theta=256,
        patch_size=[1, 1, 1],
        qkv_bias=True,
        guidance_embed=False,
        byt5=False,
        meanflow=False,
        use_cond_type_embedding=True,
        vision_in_dim=None,
        meanflow_sum=False,
    )
    meta = HunyuanVideo(device="meta", operations=comfy.ops.disable_weight_init, **cfg)
    sd = {f"diffusion_model.{k}": v for k, v in meta.state_dict().items()}

    class HunyuanVideo15Like(comfy.model_base.HunyuanVideo15):  # what model_lora_keys_unet reads: state dict, config
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.model_config = types.SimpleNamespace(unet_config=cfg)

        def state_dict(self, *a, **k):
            return sd

    key_map = comfy.lora.model_lora_keys_unet(HunyuanVideo15Like(), {})
    assert "transformer.double_blocks.0.img_attn_qkv" in key_map  # its diffusion-pipe names
    lora = _peft_lora(tiny_hunyuan15_transformer())
    assert not comfy.lora.load_lora(lora, key_map, log_missing=False)


def _loras_folder(tmp_path):
    import folder_paths

    folder = tmp_path / "loras"
    folder.mkdir()
    folder_paths.add_model_folder_path("loras", str(folder), is_default=True)
    return folder


@pytest.mark.parametrize("family", ["flux2", "qwen_image", "hunyuan_video15"])
def test_rcm_lora_loader_node_on_the_new_families(tmp_path, family):
    """RCMLoraLoader on ComfyUI's own FLUX.2 / Qwen-Image / HunyuanVideo-1.5 model with the trainer's diffusers-named
    LoRA file: every patched weight, read back in diffusers names, equals W + alpha/r B @ A; LoRAs of another family
    and of another model size are refused in one line naming the file."""
    import_comfy()
    import comfy.lora

    from comfy_nodes import nodes as pack

    models = {"flux2": _flux2_models, "qwen_image": _qwen_models, "hunyuan_video15": _hy15_models}
    comfy_sd, d, to_diffusers = models[family]()
    model = _hy15_comfy_model(comfy_sd) if family == "hunyuan_video15" else _comfy_model(comfy_sd, family)
    dsd = {k: v.detach().clone() for k, v in d.state_dict().items()}
    lora = _peft_lora(d)
    folder = _loras_folder(tmp_path)
    header = {"lora_adapter_metadata": json.dumps({"r": RANK, "lora_alpha": ALPHA})}
    save_file(lora, folder / "trainer.safetensors", header)

    (patched,) = pack._lora_loader(model, "trainer.safetensors", 1.0)
    base = {f"diffusion_model.{k}": v for k, v in comfy_sd.items()}
    got = {k: v.double() for k, v in comfy_sd.items()}
    for key, patches in patched.patches.items():
        got[key[len("diffusion_model.") :]] = comfy.lora.calculate_weight(
            patches, base[key].double().clone(), key, intermediate_dtype=torch.float64
        )
    got_d, want = to_diffusers(got), _expected(dsd, lora)
    moved = 0
    for k in want:
        torch.testing.assert_close(got_d[k].double(), want[k], rtol=1e-6, atol=1e-7)
        moved += not torch.equal(want[k], dsd[k].double())
    assert moved == sum(k.endswith(".lora_A.weight") for k in lora) > 0

    # the rcm-lora ComfyUI file of the same LoRA gives the same patches
    converted = _convert(tmp_path, lora)
    save_file(converted, folder / "converted.safetensors")
    (patched2,) = pack._lora_loader(model, "converted.safetensors", 1.0)
    assert set(patched2.patches) == set(patched.patches)

    # a FLUX.1 LoRA (its single-block MLP input, which FLUX.2 has not) and one of each other new family
    other = {
        "flux": {"transformer.single_transformer_blocks.0.proj_mlp": 8},
        "flux2": {"transformer.transformer_blocks.0.ff.linear_in": 8},
        "hunyuan_video15": {"transformer.context_embedder.token_refiner.refiner_blocks.0.ff.net.2": 8},
        "qwen_image": {"transformer.transformer_blocks.0.img_mlp.net.2": 8},
    }
    names = {"flux": "Flux", "flux2": "FLUX.2", "qwen_image": "Qwen-Image", "hunyuan_video15": "HunyuanVideo-1.5"}
    for fam, targets in other.items():
        if fam == family:
            continue
        sd = {}
        for t, n in targets.items():
            sd[f"{t}.lora_A.weight"], sd[f"{t}.lora_B.weight"] = torch.zeros(RANK, n), torch.zeros(n, RANK)
        save_file(sd, folder / f"{fam}.safetensors")
        with pytest.raises(ValueError) as e:
            pack._lora_loader(model, f"{fam}.safetensors", 1.0)
        msg = str(e.value)
        assert msg.startswith(f"rCM LoRA Loader, lora_name='{fam}.safetensors': this LoRA is for {names[fam]} ")
        assert f"but the model is {names[family]}" in msg and "\n" not in msg and msg.count(fam) == 1

    # the same family, another width: refused, naming the module and both shapes
    small = {k: (v[:, :-1] if k.endswith("lora_A.weight") else v[:-1]).contiguous() for k, v in lora.items()}
    save_file(small, folder / "other_size.safetensors", header)
    with pytest.raises(ValueError, match=r"other_size.safetensors'.*do not match this .* model: .* vs .*weight") as e:
        pack._lora_loader(model, "other_size.safetensors", 1.0)
    assert "\n" not in str(e.value)
