"""Tiny random Wan / Flux pipelines on the real diffusers architectures (no downloads).

Text encoders are left out (``text_encoder=None``): tests pass ``prompt_embeds`` directly.
"""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    UniPCMultistepScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

TEXT_DIM = 32


def tiny_wan_transformer(seed: int = 0, in_channels: int = 4, image_dim: int | None = None) -> WanTransformer3DModel:
    """2-layer Wan transformer; ``in_channels = 2*z + 4`` for I2V (noise + mask + first-frame latents)."""
    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=4,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        image_dim=image_dim,
        added_kv_proj_dim=None if image_dim is None else 24,
    ).eval()


def tiny_wan_vae(seed: int = 0) -> AutoencoderKLWan:
    torch.manual_seed(seed)
    return AutoencoderKLWan(
        base_dim=3,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    ).eval()


def wan_scheduler_config() -> dict:
    """The Wan 2.1 scheduler config (UniPC, flow prediction, shift 3)."""
    return dict(UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0).config)


def tiny_wan_pipeline(scheduler=None) -> WanPipeline:
    sched = scheduler or UniPCMultistepScheduler.from_config(wan_scheduler_config())
    return WanPipeline(
        tokenizer=None, text_encoder=None, vae=tiny_wan_vae(), transformer=tiny_wan_transformer(), scheduler=sched
    )


def tiny_wan_i2v_pipeline(scheduler=None, two_experts: bool = False) -> WanImageToVideoPipeline:
    """Wan 2.1-style I2V (CLIP image tokens passed as ``image_embeds``) or Wan 2.2-style two-expert I2V."""
    sched = scheduler or UniPCMultistepScheduler.from_config(wan_scheduler_config())
    z = 4
    if two_experts:
        return WanImageToVideoPipeline(
            tokenizer=None,
            text_encoder=None,
            vae=tiny_wan_vae(),
            transformer=tiny_wan_transformer(seed=1, in_channels=2 * z + 4),
            transformer_2=tiny_wan_transformer(seed=2, in_channels=2 * z + 4),
            scheduler=sched,
            image_encoder=None,
            image_processor=None,
            boundary_ratio=0.9,
        )
    return WanImageToVideoPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=tiny_wan_vae(),
        transformer=tiny_wan_transformer(seed=1, in_channels=2 * z + 4, image_dim=16),
        scheduler=sched,
        image_encoder=tiny_clip_vision(),
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
    )


def tiny_clip_vision():
    """Offline tiny CLIP vision tower; Wan reads its penultimate hidden states (dim 16 = image_dim)."""
    torch.manual_seed(3)
    cfg = CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=16,
        projection_dim=16,
    )
    return CLIPVisionModel(cfg).eval()


def flux_scheduler_config() -> dict:
    """The FLUX.1-dev scheduler config (FlowMatchEuler, dynamic shifting)."""
    return dict(
        FlowMatchEulerDiscreteScheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        ).config
    )


def tiny_flux_pipeline(scheduler=None) -> FluxPipeline:
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=TEXT_DIM,
        axes_dims_rope=[4, 4, 8],
        guidance_embeds=True,
    ).eval()
    torch.manual_seed(0)
    vae = AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(4, 4),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    ).eval()
    sched = scheduler or FlowMatchEulerDiscreteScheduler.from_config(flux_scheduler_config())
    return FluxPipeline(
        scheduler=sched,
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer,
    )


def wan_embeds(batch: int = 1, seed: int = 0, seq: int = 6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, TEXT_DIM, generator=g)


def flux_embeds(batch: int = 1, seed: int = 0, seq: int = 6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, TEXT_DIM, generator=g), torch.randn(batch, TEXT_DIM, generator=g)
