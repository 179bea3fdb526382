"""rcm-lora on the trainer's Qwen-Image, FLUX.2 and HunyuanVideo-1.5 LoRAs: which names stock ComfyUI's LoraLoader maps.

The key lists below are ComfyUI's naming rules written as data (comfy/lora.py ``model_lora_keys_unet`` of ComfyUI
0.29 / upstream 4f874c5; ComfyUI itself is not imported here, tests/comfyui/test_lora_new_families.py runs it):

- ``QwenImage``: ``transformer.<name>`` for every weight of ComfyUI's own Qwen-Image model, whose module names are
  diffusers' (comfy/ldm/qwen_image/model.py).
- ``Flux2`` is a ``Flux`` subclass: ``transformer.<diffusers name>`` for every entry of comfy/utils.py
  ``flux_to_diffusers`` (FLUX_BLOCKS below: the entries FLUX.2's diffusers model has).
- ``HunyuanVideo15`` is a ``HunyuanVideo`` subclass: ``transformer.<ComfyUI name>`` with ``_mod.lin.`` ->
  ``_mod.linear.``, ``_attn.qkv.`` -> ``_attn_qkv.``, ``_attn.proj.`` -> ``_attn_proj.``, ``mlp.0.``/``mlp.2.`` ->
  ``mlp.fc1.``/``mlp.fc2.`` (the diffusion-pipe names of the original fused layers): no diffusers name.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from train_helpers import tiny_flux2_transformer, tiny_qwen_transformer

from rcm_diffusers.lora import cli

RANK, ALPHA = 2, 4.0

# comfy/utils.py flux_to_diffusers: diffusers name -> ComfyUI (BFL) name, the ones of FLUX.2's diffusers model
FLUX_DOUBLE = {
    "attn.to_q": "img_attn.qkv",  # rows [0, h)
    "attn.to_k": "img_attn.qkv",  # rows [h, 2h)
    "attn.to_v": "img_attn.qkv",  # rows [2h, 3h)
    "attn.add_q_proj": "txt_attn.qkv",
    "attn.add_k_proj": "txt_attn.qkv",
    "attn.add_v_proj": "txt_attn.qkv",
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.linear_in": "img_mlp.0",
    "ff.linear_out": "img_mlp.2",
    "ff_context.linear_in": "txt_mlp.0",
    "ff_context.linear_out": "txt_mlp.2",
}
FLUX_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
FLUX_BASIC = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear"}


def flux2_comfyui_keys(depth: int, depth_single: int) -> set[str]:
    keys = {f"transformer.{k}" for k in FLUX_BASIC}
    keys |= {f"transformer.transformer_blocks.{i}.{k}" for i in range(depth) for k in FLUX_DOUBLE}
    keys |= {f"transformer.single_transformer_blocks.{i}.{k}" for i in range(depth_single) for k in FLUX_SINGLE}
    return keys


def qwen_comfyui_keys(model) -> set[str]:
    """``transformer.<weight name>`` of ComfyUI's Qwen-Image model = diffusers' module names."""
    return {f"transformer.{n}" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def trainer_lora(model, seed: int = 1) -> dict:
    """The trainer's export of a LoRA of the family's default targets (random A, B; alpha 4 on rank 2)."""
    from peft import LoraConfig, get_peft_model_state_dict

    from rcm_diffusers.distill.adapters import default_lora_targets

    torch.manual_seed(seed)
    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=default_lora_targets(model), init_lora_weights=False)
    model.add_adapter(cfg)
    return {f"transformer.{k}": v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def save_trainer_file(path, lora: dict) -> str:
    save_file(lora, path, {"lora_adapter_metadata": json.dumps({"r": RANK, "lora_alpha": ALPHA})})
    return str(path)


def _targets(sd) -> set[str]:
    return {k[: -len(".lora_A.weight")] for k in sd if k.endswith(".lora_A.weight")}


@pytest.mark.parametrize("family", ["qwen_image", "flux2"])
def test_convert_writes_the_names_stock_comfyui_maps(tmp_path, capsys, family):
    if family == "flux2":
        model = tiny_flux2_transformer()
        cfg = model.config
        comfy_keys = flux2_comfyui_keys(cfg.num_layers, cfg.num_single_layers)
    else:
        model = tiny_qwen_transformer()
        comfy_keys = qwen_comfyui_keys(model)
    lora = trainer_lora(model)
    src = save_trainer_file(tmp_path / "pytorch_lora_weights.safetensors", lora)
    dst = tmp_path / "comfy.safetensors"
    assert cli.main(["convert", src, str(dst), "--format", "comfyui"]) == 0
    out = load_file(dst)
    targets = _targets(out)
    assert targets == _targets(lora)
    assert targets <= comfy_keys, sorted(targets - comfy_keys)  # every LoRA key is in ComfyUI's map
    for t in targets:
        for s in ("lora_A.weight", "lora_B.weight"):
            torch.testing.assert_close(out[f"{t}.{s}"], lora[f"{t}.{s}"], rtol=0, atol=0)
        assert float(out[f"{t}.alpha"]) == ALPHA  # ComfyUI scales by .alpha / rank; it reads no peft header
    assert set(out) == {f"{t}.{s}" for t in targets for s in ("lora_A.weight", "lora_B.weight", "alpha")}
    assert "0 full deltas" in capsys.readouterr().out

    assert cli.main(["inspect", src]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["arch"] == family and info["n_lora_modules"] == len(targets) and info["problems"] == []


def test_flux2_default_targets_cover_what_comfyui_maps():
    """The trainer's FLUX.2 LoRA takes every Linear ComfyUI's FLUX.2 map names in the blocks."""
    model = tiny_flux2_transformer()
    want = {k for k in flux2_comfyui_keys(1, 1) if "blocks." in k}
    assert want <= _targets(trainer_lora(model))


def test_convert_refuses_flux2_keys_comfyui_does_not_map(tmp_path, capsys):
    lora = trainer_lora(tiny_flux2_transformer())
    A = torch.zeros(RANK, 8)
    lora["transformer.double_stream_modulation_img.linear.lora_A.weight"] = A
    lora["transformer.double_stream_modulation_img.linear.lora_B.weight"] = torch.zeros(8, RANK)
    src = save_trainer_file(tmp_path / "l.safetensors", lora)
    assert cli.main(["convert", src, str(tmp_path / "o.safetensors"), "--format", "comfyui"]) == 2
    err = capsys.readouterr().err
    assert "double_stream_modulation_img.linear.lora_A.weight" in err and "model_lora_keys_unet" in err
    assert not (tmp_path / "o.safetensors").exists()


def test_convert_to_diffusers_is_refused_as_already_diffusers(tmp_path, capsys):
    src = save_trainer_file(tmp_path / "l.safetensors", trainer_lora(tiny_qwen_transformer()))
    assert cli.main(["convert", src, str(tmp_path / "o.safetensors"), "--format", "diffusers"]) == 2
    assert "diffusers names already" in capsys.readouterr().err


def test_hunyuanvideo15_is_refused_since_stock_comfyui_maps_none_of_its_names(tmp_path, capsys):
    # the trainer's default targets of HunyuanVideo-1.5, by name (its blocks are named as FLUX.1's in diffusers)
    names = [
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.0.attn.add_q_proj",
        "transformer_blocks.0.ff.net.0.proj",
        "context_embedder.token_refiner.refiner_blocks.0.attn.to_q",
    ]
    lora = {}
    for n in names:
        lora[f"transformer.{n}.lora_A.weight"] = torch.zeros(RANK, 8)
        lora[f"transformer.{n}.lora_B.weight"] = torch.zeros(8, RANK)
    src = save_trainer_file(tmp_path / "l.safetensors", lora)
    # ComfyUI's HunyuanVideo names (the rule in the module docstring) and the diffusers ones share no key
    comfy_style = {"transformer.double_blocks.0.img_attn_qkv", "transformer.double_blocks.0.img_mlp.fc1"}
    assert not comfy_style & _targets(lora)
    assert cli.main(["convert", src, str(tmp_path / "o.safetensors"), "--format", "comfyui"]) == 2
    err = capsys.readouterr().err
    assert "HunyuanVideo-1.5" in err and "stock ComfyUI maps none of its diffusers names" in err
    assert not (tmp_path / "o.safetensors").exists()
