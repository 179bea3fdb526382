"""Module-name tables of Wan and BFL Flux: diffusers target <-> original (ComfyUI) target.

Shared by the key converter (``keys``) and the readers of outside layouts (``kohya``); kept apart so that
neither imports the other's tables.
"""

from __future__ import annotations

# (diffusers target, original target); "{i}" is a block index. A target is a module
# (suffixes weight/bias/lora_*/alpha/diff/diff_b) or, when it names a raw parameter such as
# Wan's modulation, the parameter itself (suffixes "" and diff).
WAN_PAIRS = [
    ("patch_embedding", "patch_embedding"),
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
    ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
    ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
    ("condition_embedder.image_embedder.pos_embed", "img_emb.emb_pos"),
    ("blocks.{i}.attn1.to_q", "blocks.{i}.self_attn.q"),
    ("blocks.{i}.attn1.to_k", "blocks.{i}.self_attn.k"),
    ("blocks.{i}.attn1.to_v", "blocks.{i}.self_attn.v"),
    ("blocks.{i}.attn1.to_out.0", "blocks.{i}.self_attn.o"),
    ("blocks.{i}.attn1.norm_q", "blocks.{i}.self_attn.norm_q"),
    ("blocks.{i}.attn1.norm_k", "blocks.{i}.self_attn.norm_k"),
    ("blocks.{i}.attn2.to_q", "blocks.{i}.cross_attn.q"),
    ("blocks.{i}.attn2.to_k", "blocks.{i}.cross_attn.k"),
    ("blocks.{i}.attn2.to_v", "blocks.{i}.cross_attn.v"),
    ("blocks.{i}.attn2.to_out.0", "blocks.{i}.cross_attn.o"),
    ("blocks.{i}.attn2.norm_q", "blocks.{i}.cross_attn.norm_q"),
    ("blocks.{i}.attn2.norm_k", "blocks.{i}.cross_attn.norm_k"),
    # I2V image-attention projections (Wan 2.1 I2V / FLF2V)
    ("blocks.{i}.attn2.add_k_proj", "blocks.{i}.cross_attn.k_img"),
    ("blocks.{i}.attn2.add_v_proj", "blocks.{i}.cross_attn.v_img"),
    ("blocks.{i}.attn2.norm_added_k", "blocks.{i}.cross_attn.norm_k_img"),
    # diffusers norm2 is the (affine) cross-attention norm, original norm3
    ("blocks.{i}.norm2", "blocks.{i}.norm3"),
    ("blocks.{i}.ffn.net.0.proj", "blocks.{i}.ffn.0"),
    ("blocks.{i}.ffn.net.2", "blocks.{i}.ffn.2"),
    ("blocks.{i}.scale_shift_table", "blocks.{i}.modulation"),
    ("scale_shift_table", "head.modulation"),
    ("proj_out", "head.head"),
]
WAN_PARAMS = {"blocks.{i}.scale_shift_table", "scale_shift_table", "condition_embedder.image_embedder.pos_embed"}

FLUX_PAIRS = [
    ("x_embedder", "img_in"),
    ("context_embedder", "txt_in"),
    ("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
    ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
    ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
    ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
    ("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
    ("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
    ("transformer_blocks.{i}.norm1.linear", "double_blocks.{i}.img_mod.lin"),
    ("transformer_blocks.{i}.norm1_context.linear", "double_blocks.{i}.txt_mod.lin"),
    ("transformer_blocks.{i}.attn.norm_q", "double_blocks.{i}.img_attn.norm.query_norm"),
    ("transformer_blocks.{i}.attn.norm_k", "double_blocks.{i}.img_attn.norm.key_norm"),
    ("transformer_blocks.{i}.attn.norm_added_q", "double_blocks.{i}.txt_attn.norm.query_norm"),
    ("transformer_blocks.{i}.attn.norm_added_k", "double_blocks.{i}.txt_attn.norm.key_norm"),
    ("transformer_blocks.{i}.attn.to_out.0", "double_blocks.{i}.img_attn.proj"),
    ("transformer_blocks.{i}.attn.to_add_out", "double_blocks.{i}.txt_attn.proj"),
    ("transformer_blocks.{i}.ff.net.0.proj", "double_blocks.{i}.img_mlp.0"),
    ("transformer_blocks.{i}.ff.net.2", "double_blocks.{i}.img_mlp.2"),
    ("transformer_blocks.{i}.ff_context.net.0.proj", "double_blocks.{i}.txt_mlp.0"),
    ("transformer_blocks.{i}.ff_context.net.2", "double_blocks.{i}.txt_mlp.2"),
    ("single_transformer_blocks.{i}.norm.linear", "single_blocks.{i}.modulation.lin"),
    ("single_transformer_blocks.{i}.attn.norm_q", "single_blocks.{i}.norm.query_norm"),
    ("single_transformer_blocks.{i}.attn.norm_k", "single_blocks.{i}.norm.key_norm"),
    ("single_transformer_blocks.{i}.proj_out", "single_blocks.{i}.linear2"),
    ("proj_out", "final_layer.linear"),
    ("norm_out.linear", "final_layer.adaLN_modulation.1"),
]
# RMSNorm parameters are called `weight` in diffusers and `scale` in BFL Flux.
FLUX_SCALE_NORMS = {d for d, o in FLUX_PAIRS if o.endswith(("query_norm", "key_norm"))}
# AdaLN output projection: diffusers orders (scale, shift), BFL (shift, scale): rows swap halves.
FLUX_SWAP_ROWS = {"norm_out.linear"}
# fused original module <- diffusers members, in row order; None size = hidden (in_features)
FLUX_FUSED = [
    (
        "double_blocks.{i}.img_attn.qkv",
        ["transformer_blocks.{i}.attn.to_q", "transformer_blocks.{i}.attn.to_k", "transformer_blocks.{i}.attn.to_v"],
    ),
    (
        "double_blocks.{i}.txt_attn.qkv",
        [
            "transformer_blocks.{i}.attn.add_q_proj",
            "transformer_blocks.{i}.attn.add_k_proj",
            "transformer_blocks.{i}.attn.add_v_proj",
        ],
    ),
    (
        "single_blocks.{i}.linear1",
        [
            "single_transformer_blocks.{i}.attn.to_q",
            "single_transformer_blocks.{i}.attn.to_k",
            "single_transformer_blocks.{i}.attn.to_v",
            "single_transformer_blocks.{i}.proj_mlp",
        ],
    ),
]
FLUX_MLP_RATIO = 4.0


# Qwen-Image and FLUX.2 LoRA targets (diffusers module paths, regular expressions) that stock ComfyUI's LoRA loader
# maps as ``transformer.<target>`` (comfy/lora.py ``model_lora_keys_unet``, ComfyUI 0.29 / upstream 4f874c5).
# Qwen-Image: its ``QwenImage`` branch maps ``transformer.<name>`` for every weight of ComfyUI's own Qwen-Image
# model, whose module names are diffusers' (comfy/ldm/qwen_image/model.py). FLUX.2: ``Flux2`` is a ``Flux`` there,
# so the Flux branch maps ``transformer.<diffusers name>`` through comfy/utils.py ``flux_to_diffusers``, which names
# FLUX.2's SwiGLU feed-forwards and fused single-block projections and writes q/k/v (add_q/k/v) as row slices of
# the fused ``img_attn.qkv`` (``txt_attn.qkv``). FLUX.2's shared modulation and time/guidance embedding
# (``double_stream_modulation_*``, ``single_stream_modulation``, ``time_guidance_embed``) are not in that map.
COMFYUI_AS_IS = {
    "qwen_image": (
        r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",
        r"transformer_blocks\.\d+\.(img|txt)_mlp\.net\.(0\.proj|2)",
        r"transformer_blocks\.\d+\.(img|txt)_mod\.1",
        r"img_in|txt_in|proj_out|norm_out\.linear|time_text_embed\.timestep_embedder\.linear_[12]",
    ),
    "flux2": (
        r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",
        r"transformer_blocks\.\d+\.(ff|ff_context)\.(linear_in|linear_out)",
        r"single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)",
        r"x_embedder|context_embedder|proj_out",
    ),
}


# HunyuanVideo-1.5 (diffusers HunyuanVideo15Transformer3DModel) -> the module names of ComfyUI's HunyuanVideo-1.5 model
# (comfy/ldm/hunyuan_video/model.py ``HunyuanVideo`` built from comfy/ldm/flux/layers.py blocks, upstream 4f874c5).
# ComfyUI's LoRA key map (comfy/lora.py ``model_lora_keys_unet``) takes ``diffusion_model.<name>`` for every weight of
# the model, whatever the model; its HunyuanVideo branch adds the diffusion-pipe spellings of the same weights. Its
# model fuses q/k/v in one Linear (``img_attn.qkv``, ``txt_attn.qkv``, the token refiner's ``self_attn.qkv``, rows in
# q, k, v order) where diffusers has three: ``HUNYUAN15_FUSED``. The pairing of the other names follows the module
# structure of both models (diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py pairs the original checkpoint
# with diffusers; ComfyUI's supported_models.py ``HunyuanVideo.process_unet_state_dict`` renames the original
# checkpoint to its modules).
HUNYUAN15_PAIRS = [
    ("x_embedder.proj", "img_in.proj"),
    ("image_embedder.linear_1", "vision_in.proj.1"),
    ("image_embedder.linear_2", "vision_in.proj.3"),
    ("context_embedder.proj_in", "txt_in.input_embedder"),
    ("context_embedder.time_text_embed.timestep_embedder.linear_1", "txt_in.t_embedder.in_layer"),
    ("context_embedder.time_text_embed.timestep_embedder.linear_2", "txt_in.t_embedder.out_layer"),
    ("context_embedder.time_text_embed.text_embedder.linear_1", "txt_in.c_embedder.in_layer"),
    ("context_embedder.time_text_embed.text_embedder.linear_2", "txt_in.c_embedder.out_layer"),
    (
        "context_embedder.token_refiner.refiner_blocks.{i}.attn.to_out.0",
        "txt_in.individual_token_refiner.blocks.{i}.self_attn.proj",
    ),
    (
        "context_embedder.token_refiner.refiner_blocks.{i}.ff.net.0.proj",
        "txt_in.individual_token_refiner.blocks.{i}.mlp.0",
    ),
    ("context_embedder.token_refiner.refiner_blocks.{i}.ff.net.2", "txt_in.individual_token_refiner.blocks.{i}.mlp.2"),
    (
        "context_embedder.token_refiner.refiner_blocks.{i}.norm_out.linear",
        "txt_in.individual_token_refiner.blocks.{i}.adaLN_modulation.1",
    ),
    ("context_embedder_2.linear_1", "byt5_in.fc1"),
    ("context_embedder_2.linear_2", "byt5_in.fc2"),
    ("context_embedder_2.linear_3", "byt5_in.fc3"),
    ("time_embed.timestep_embedder.linear_1", "time_in.in_layer"),
    ("time_embed.timestep_embedder.linear_2", "time_in.out_layer"),
    ("time_embed.timestep_embedder_r.linear_1", "time_r_in.in_layer"),
    ("time_embed.timestep_embedder_r.linear_2", "time_r_in.out_layer"),
    ("transformer_blocks.{i}.norm1.linear", "double_blocks.{i}.img_mod.lin"),
    ("transformer_blocks.{i}.norm1_context.linear", "double_blocks.{i}.txt_mod.lin"),
    ("transformer_blocks.{i}.attn.to_out.0", "double_blocks.{i}.img_attn.proj"),
    ("transformer_blocks.{i}.attn.to_add_out", "double_blocks.{i}.txt_attn.proj"),
    ("transformer_blocks.{i}.ff.net.0.proj", "double_blocks.{i}.img_mlp.0"),
    ("transformer_blocks.{i}.ff.net.2", "double_blocks.{i}.img_mlp.2"),
    ("transformer_blocks.{i}.ff_context.net.0.proj", "double_blocks.{i}.txt_mlp.0"),
    ("transformer_blocks.{i}.ff_context.net.2", "double_blocks.{i}.txt_mlp.2"),
    ("proj_out", "final_layer.linear"),
    ("norm_out.linear", "final_layer.adaLN_modulation.1"),
]
# diffusers' AdaLayerNormContinuous orders its output (scale, shift), ComfyUI's final layer (shift, scale)
HUNYUAN15_SWAP_ROWS = {"norm_out.linear"}
HUNYUAN15_FUSED = [
    ("double_blocks.{i}.img_attn.qkv", ["transformer_blocks.{i}.attn." + p for p in ("to_q", "to_k", "to_v")]),
    (
        "double_blocks.{i}.txt_attn.qkv",
        ["transformer_blocks.{i}.attn." + p for p in ("add_q_proj", "add_k_proj", "add_v_proj")],
    ),
    (
        "txt_in.individual_token_refiner.blocks.{i}.self_attn.qkv",
        ["context_embedder.token_refiner.refiner_blocks.{i}.attn." + p for p in ("to_q", "to_k", "to_v")],
    ),
]
