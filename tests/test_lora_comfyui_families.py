"""rcm-lora on the trainer's Qwen-Image, FLUX.2 and HunyuanVideo-1.5 LoRAs: which names stock ComfyUI's LoraLoader maps.

The key lists below are ComfyUI's naming rules written as data (comfy/lora.py ``model_lora_keys_unet`` of ComfyUI
0.29 / upstream 4f874c5; ComfyUI itself is not imported here, tests/comfyui/test_lora_new_families.py runs it):

- ``QwenImage``: ``transformer.<name>`` for every weight of ComfyUI's own Qwen-Image model, whose module names are
  diffusers' (comfy/ldm/qwen_image/model.py).
- ``Flux2`` is a ``Flux`` subclass: ``transformer.<diffusers name>`` for every entry of comfy/utils.py
  ``flux_to_diffusers`` (FLUX_BLOCKS below: the entries FLUX.2's diffusers model has).
- ``HunyuanVideo15`` is a ``HunyuanVideo`` subclass: ``diffusion_model.<ComfyUI weight name>`` (the generic entry every
  model has; its HunyuanVideo branch adds ``transformer.<ComfyUI name>`` with ``_mod.lin.`` ->
  ``_mod.linear.``, ``_attn.qkv.`` -> ``_attn_qkv.``, ``_attn.proj.`` -> ``_attn_proj.``, ``mlp.0.``/``mlp.2.`` ->
  ``mlp.fc1.``/``mlp.fc2.``, the diffusion-pipe names): no diffusers name, and q/k/v fused in one ``qkv`` weight
  (HY15_DOUBLE, HY15_REFINER below).
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


# ComfyUI's HunyuanVideo-1.5 module names (comfy/ldm/hunyuan_video/model.py on comfy/ldm/flux/layers.py blocks) of
# each diffusers LoRA target of the trainer; q/k/v of one attention share ComfyUI's fused qkv, in rows q, k, v
HY15_DOUBLE = {
    "attn.to_q": "img_attn.qkv",
    "attn.to_k": "img_attn.qkv",
    "attn.to_v": "img_attn.qkv",
    "attn.add_q_proj": "txt_attn.qkv",
    "attn.add_k_proj": "txt_attn.qkv",
    "attn.add_v_proj": "txt_attn.qkv",
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0",
    "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0",
    "ff_context.net.2": "txt_mlp.2",
}
HY15_REFINER = {
    "attn.to_q": "self_attn.qkv",
    "attn.to_k": "self_attn.qkv",
    "attn.to_v": "self_attn.qkv",
    "attn.to_out.0": "self_attn.proj",
    "ff.net.0.proj": "mlp.0",
    "ff.net.2": "mlp.2",
}


def hy15_comfyui_name(target: str) -> str:
    parts = target.split(".")
    if parts[0] == "transformer_blocks":
        return f"double_blocks.{parts[1]}.{HY15_DOUBLE['.'.join(parts[2:])]}"
    assert parts[:3] == ["context_embedder", "token_refiner", "refiner_blocks"], target
    return f"txt_in.individual_token_refiner.blocks.{parts[3]}.{HY15_REFINER['.'.join(parts[4:])]}"


@pytest.mark.parametrize("alpha_pattern", [{}, {"to_k": 2.0, "add_v_proj": 8.0}])
def test_hunyuanvideo15_converts_to_comfyui_names_with_fused_qkv(tmp_path, capsys, alpha_pattern):
    """The trainer's HunyuanVideo-1.5 LoRA in ComfyUI's model names: one LoRA on each fused qkv whose delta is exactly
    the q, k and v deltas stacked (float64), every other module renamed with its factors as they are."""
    from test_train_hunyuan15 import tiny_hunyuan15_transformer

    model = tiny_hunyuan15_transformer()
    lora = trainer_lora(model)
    src = tmp_path / "pytorch_lora_weights.safetensors"
    save_file(
        lora,
        src,
        {"lora_adapter_metadata": json.dumps({"r": RANK, "lora_alpha": ALPHA, "alpha_pattern": alpha_pattern})},
    )
    dst = tmp_path / "comfy.safetensors"
    assert cli.main(["convert", str(src), str(dst), "--format", "comfyui"]) == 0
    assert "HunyuanVideo-1.5" in capsys.readouterr().out
    out = load_file(dst)

    def scale(t):
        return next((a for p, a in alpha_pattern.items() if t.endswith(p)), ALPHA) / RANK

    def delta(sd, t, s):
        return s * (sd[f"{t}.lora_B.weight"].double() @ sd[f"{t}.lora_A.weight"].double())

    sources = {}
    for t in _targets(lora):
        sources.setdefault("diffusion_model." + hy15_comfyui_name(t[len("transformer.") :]), []).append(t)
    assert _targets(out) == set(sources)  # every converted key is one ComfyUI's map takes: diffusion_model.<weight>
    assert set(out) == {f"{t}.{s}" for t in sources for s in ("lora_A.weight", "lora_B.weight", "alpha")}
    n_fused = 0
    for t, parts in sources.items():
        got = delta(out, t, float(out[f"{t}.alpha"]) / out[f"{t}.lora_A.weight"].shape[0])
        order = {"to_q": 0, "add_q_proj": 0, "to_k": 1, "add_k_proj": 1, "to_v": 2, "add_v_proj": 2}
        parts = sorted(parts, key=lambda p: order.get(p.rsplit(".", 1)[-1], 0))
        want = torch.cat([delta(lora, p, scale(p[len("transformer.") :])) for p in parts], dim=0)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        if len(parts) == 3:
            n_fused += 1
            assert out[f"{t}.lora_A.weight"].shape[0] == 3 * RANK
    assert n_fused == 2 * model.config.num_layers + model.config.num_refiner_layers

    assert cli.main(["inspect", str(src)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["arch"] == "hunyuan_video15" and info["n_lora_modules"] == len(sources) and info["problems"] == []
    assert cli.main(["convert", str(dst), str(tmp_path / "back.safetensors"), "--format", "diffusers"]) == 2
    assert "converts it to ComfyUI's names only" in capsys.readouterr().err
    assert cli.main(["inspect", str(dst)]) == 0  # the converted file reads back as the same family
    info = json.loads(capsys.readouterr().out)
    assert info["arch"] == "hunyuan_video15" and info["n_lora_modules"] == len(sources) and info["problems"] == []


def test_hunyuanvideo15_modules_comfyui_lacks_are_refused_in_one_line(tmp_path, capsys):
    from test_train_hunyuan15 import tiny_hunyuan15_transformer

    lora = trainer_lora(tiny_hunyuan15_transformer())
    lora["transformer.rope.lora_A.weight"] = torch.zeros(RANK, 8)
    lora["transformer.rope.lora_B.weight"] = torch.zeros(8, RANK)
    lora["transformer.transformer_blocks.0.attn.to_q.lora_B.bias"] = torch.zeros(32)
    src = save_trainer_file(tmp_path / "l.safetensors", lora)
    assert cli.main(["convert", src, str(tmp_path / "o.safetensors"), "--format", "comfyui"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "'rope'" in err and "transformer_blocks.0.attn.to_q.diff_b" in err and "HunyuanVideo-1.5" in err
    assert not (tmp_path / "o.safetensors").exists()
