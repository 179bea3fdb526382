"""Stock ComfyUI's LoRA loader on the trainer's Qwen-Image and FLUX.2 LoRAs (``rcm-lora convert --format comfyui``),
and on a HunyuanVideo-1.5 one (diffusers names, which it does not map).

In process: a tiny model of the family is built through ComfyUI's own ``comfy.sd.load_diffusion_model_state_dict``
(model detection from a state dict in ComfyUI's layout), the same weights go into the diffusers model (diffusers'
single-file converter for FLUX.2, the names as they are for Qwen-Image), a peft LoRA of the trainer's default
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


def _convert(tmp_path, lora: dict) -> dict:
    from rcm_diffusers.lora import cli

    src, dst = tmp_path / "pytorch_lora_weights.safetensors", tmp_path / "comfy.safetensors"
    save_file(lora, src, {"lora_adapter_metadata": json.dumps({"r": RANK, "lora_alpha": ALPHA})})
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
