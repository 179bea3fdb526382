"""Tiny random builds of the flow-matching pipelines of diffusers (no downloads), shared by the pipeline table
(tests/test_flow_pipelines.py) and the JVP attention tests (tests/test_jvp_processors.py).

Each ``FlowCase`` builds its stock pipeline with the transformer (and what its ``__call__`` cannot do without) at
toy sizes, text encoders and VAEs left out where the pipeline takes ``prompt_embeds`` and ``output_type="latent"``
(LongCat-Image, which needs a prompt even with embeddings, gets a stub for its text encoder's output; Qwen-Image 2.1,
which reads its processor when built, a stub processor). Parameters a model creates as zeros (adaLN modulations,
gates) are made random where they would hide the attention (``_unzero``).
``record_inputs`` runs the pipeline once and keeps the transformer's first call, so the JVP tests differentiate the
model at the inputs its own pipeline gives it (masks, RoPE ids, joint text / image layouts included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import diffusers
import torch

TEXT = 16  # text width of every tiny model


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=_g(seed))


@dataclass
class FlowCase:
    """One stock pipeline: ``build()`` -> pipeline, ``kwargs()`` -> its call arguments except ``num_inference_steps``
    and ``generator``; ``out``: the output field; ``x_arg`` / ``t_arg``: the transformer's latent and time inputs
    (keyword name, or position in the call's args); ``list_x``: the latent comes as a list of per-sample tensors."""

    name: str
    pipeline: str
    build: Callable
    kwargs: Callable
    out: str = "images"
    x_arg: str | int = "hidden_states"
    t_arg: str | int = "timestep"
    list_x: bool = False
    batch_arg: str = "num_images_per_prompt"
    #: the pipeline cannot repeat a given text mask per prompt: batches of two are two prompts
    batch_by_prompt: bool = False

    @property
    def available(self) -> bool:
        """The installed diffusers has the pipeline, and it imports (a pipeline module that needs a newer
        transformers fails on first access)."""
        try:
            return getattr(diffusers, self.pipeline, None) is not None
        except (ImportError, RuntimeError):
            return False

    def batch_kwargs(self, size: int) -> dict:
        """Call arguments for ``size`` samples of the case's prompt."""
        if not self.batch_by_prompt:
            return {**self.kwargs(), self.batch_arg: size}
        return {
            k: (v.repeat(size, *[1] * (v.dim() - 1)) if isinstance(v, torch.Tensor) and "prompt" in k else v)
            for k, v in self.kwargs().items()
        }


# ----------------------------------------------------------------------------- builders


def _flux2():
    torch.manual_seed(0)
    tr = diffusers.Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT,
        timestep_guidance_channels=256,
        axes_dims_rope=[4, 4, 4, 4],
    ).eval()
    return diffusers.Flux2Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        transformer=tr,
    )


def _flux2_kwargs():
    return dict(prompt_embeds=_randn(1, 6, TEXT), height=32, width=32, guidance_scale=1.0, output_type="latent")


def _qwen():
    torch.manual_seed(0)
    tr = diffusers.QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    ).eval()
    sched = diffusers.FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, shift_terminal=0.02, time_shift_type="exponential"
    )
    return diffusers.QwenImagePipeline(scheduler=sched, vae=None, text_encoder=None, tokenizer=None, transformer=tr)


def _qwen_kwargs():
    mask = torch.ones(1, 6, dtype=torch.long)
    mask[0, 4:] = 0  # two padded text tokens: the joint attention takes a mask
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        prompt_embeds_mask=mask,
        height=32,
        width=32,
        true_cfg_scale=1.0,
        output_type="latent",
    )


def _zimage():
    torch.manual_seed(0)
    tr = diffusers.ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=32,
        n_layers=1,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=TEXT,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=[8, 4, 4],
        axes_lens=[256, 32, 32],
    ).eval()
    with torch.no_grad():  # created with torch.empty
        tr.x_pad_token.fill_(1.0)
        tr.cap_pad_token.fill_(1.0)
    sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    return diffusers.ZImagePipeline(scheduler=sched, vae=None, text_encoder=None, tokenizer=None, transformer=tr)


def _zimage_kwargs():
    return dict(prompt_embeds=[_randn(6, TEXT)], height=32, width=32, guidance_scale=0.0, output_type="latent")


def _sd3():
    torch.manual_seed(0)
    tr = diffusers.SD3Transformer2DModel(
        sample_size=32,
        patch_size=1,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=TEXT,
        pooled_projection_dim=TEXT,
        out_channels=4,
    ).eval()
    sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    return diffusers.StableDiffusion3Pipeline(
        transformer=tr,
        scheduler=sched,
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
    )


def _sd3_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        pooled_prompt_embeds=_randn(1, TEXT, seed=1),
        height=32,
        width=32,
        guidance_scale=1.0,
        output_type="latent",
    )


def _chroma():
    torch.manual_seed(0)
    tr = diffusers.ChromaTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT,
        axes_dims_rope=[4, 4, 8],
        approximator_hidden_dim=32,
        approximator_layers=1,
        approximator_num_channels=16,
    ).eval()
    sched = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    return diffusers.ChromaPipeline(scheduler=sched, vae=None, text_encoder=None, tokenizer=None, transformer=tr)


def _chroma_kwargs():
    mask = torch.ones(1, 6, dtype=torch.bool)
    mask[0, 4:] = False
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        prompt_attention_mask=mask,
        height=32,
        width=32,
        guidance_scale=1.0,
        output_type="latent",
    )


def _cogview4():
    torch.manual_seed(0)
    tr = diffusers.CogView4Transformer2DModel(
        patch_size=2,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        out_channels=4,
        text_embed_dim=TEXT,
        time_embed_dim=8,
        condition_dim=4,
    ).eval()
    sched = diffusers.FlowMatchEulerDiscreteScheduler(
        base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True, time_shift_type="linear"
    )
    return diffusers.CogView4Pipeline(tokenizer=None, text_encoder=None, vae=None, transformer=tr, scheduler=sched)


def _cogview4_kwargs():
    return dict(prompt_embeds=_randn(1, 6, TEXT), height=32, width=32, guidance_scale=1.0, output_type="latent")


def _hidream():
    torch.manual_seed(0)
    tr = diffusers.HiDreamImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_channels=[TEXT, TEXT],
        text_emb_dim=TEXT,
        num_routed_experts=4,
        num_activated_experts=2,
        axes_dims_rope=(4, 2, 2),
        max_resolution=(32, 32),
        llama_layers=(0, 1),
    ).eval()
    sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = diffusers.HiDreamImagePipeline(
        scheduler=sched,
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
        text_encoder_4=None,
        tokenizer_4=None,
        transformer=tr,
    )
    pipe.default_sample_size = 4  # the pipeline rescales every request to this area (x 8 pixels)
    return pipe


def _hidream_kwargs():
    return dict(
        prompt_embeds_t5=_randn(1, 6, TEXT),
        prompt_embeds_llama3=_randn(2, 1, 6, TEXT, seed=1),
        pooled_prompt_embeds=_randn(1, TEXT, seed=2),
        height=32,
        width=32,
        guidance_scale=1.0,
        output_type="latent",
    )


def _wan(two_experts=False):
    from tiny import tiny_wan_pipeline, tiny_wan_transformer

    pipe = tiny_wan_pipeline()
    if two_experts:  # Wan 2.2 A14B: a high-noise and a low-noise expert, switched at boundary_ratio
        pipe = diffusers.WanPipeline(
            tokenizer=None,
            text_encoder=None,
            vae=pipe.vae,
            transformer=tiny_wan_transformer(seed=1),
            transformer_2=tiny_wan_transformer(seed=2),
            scheduler=pipe.scheduler,
            boundary_ratio=0.9,
        )
    return pipe


def _wan_kwargs():
    from tiny import wan_embeds

    return dict(prompt_embeds=wan_embeds(), height=16, width=16, num_frames=5, guidance_scale=1.0, output_type="latent")


def _skyreels():
    torch.manual_seed(0)
    tr = diffusers.SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=TEXT,
        freq_dim=32,
        ffn_dim=32,
        num_layers=1,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).eval()
    from tiny import tiny_wan_vae

    sched = diffusers.UniPCMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True, prediction_type="flow_prediction")
    return diffusers.SkyReelsV2Pipeline(
        tokenizer=None, text_encoder=None, transformer=tr, vae=tiny_wan_vae(), scheduler=sched
    )


def _skyreels_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, TEXT), height=16, width=16, num_frames=5, guidance_scale=1.0, output_type="latent"
    )


def _sana_video():
    torch.manual_seed(0)
    tr = diffusers.SanaVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=12,
        num_layers=1,
        num_cross_attention_heads=2,
        cross_attention_head_dim=12,
        cross_attention_dim=24,
        caption_channels=TEXT,
        mlp_ratio=2.5,
        dropout=0.0,
        attention_bias=False,
        sample_size=8,
        patch_size=(1, 2, 2),
        norm_elementwise_affine=False,
        norm_eps=1e-6,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).eval()
    sched = diffusers.DPMSolverMultistepScheduler(
        flow_shift=8.0, use_flow_sigmas=True, prediction_type="flow_prediction"
    )
    return diffusers.SanaVideoPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=tr, scheduler=sched)


def _sana_video_kwargs():
    mask = torch.ones(1, 6, dtype=torch.long)
    mask[0, 4:] = 0
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        prompt_attention_mask=mask,
        height=32,
        width=32,
        frames=5,
        guidance_scale=1.0,
        use_resolution_binning=False,
        output_type="latent",
    )


def _hunyuan15():
    torch.manual_seed(0)
    tr = diffusers.HunyuanVideo15Transformer3DModel(
        in_channels=9,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=TEXT,
        text_embed_2_dim=TEXT,
        image_embed_dim=12,
        rope_axes_dim=(2, 2, 4),
        target_size=16,
        task_type="t2v",
    ).eval()
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLHunyuanVideo15(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(16, 16),
        layers_per_block=1,
        spatial_compression_ratio=4,
        temporal_compression_ratio=2,
        downsample_match_channel=False,
        upsample_match_channel=False,
    ).eval()
    from diffusers.guiders import ClassifierFreeGuidance

    return diffusers.HunyuanVideo15Pipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=tr,
        vae=vae,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=None,
        tokenizer_2=None,
        guider=ClassifierFreeGuidance(guidance_scale=1.0),
    )


def _hunyuan15_kwargs():
    mask = torch.ones(1, 6, dtype=torch.long)
    mask[0, 4:] = 0
    mask2 = torch.ones(1, 3, dtype=torch.long)
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        prompt_embeds_mask=mask,
        prompt_embeds_2=_randn(1, 3, TEXT, seed=1),
        prompt_embeds_mask_2=mask2,
        height=16,
        width=16,
        num_frames=5,
        output_type="latent",
    )


def _ltx2():
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    torch.manual_seed(0)
    tr = diffusers.LTX2VideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=1,
        qk_norm="rms_norm_across_heads",
        caption_channels=TEXT,
        rope_double_precision=False,
        rope_type="split",
    ).eval()
    torch.manual_seed(0)
    connectors = LTX2TextConnectors(
        caption_channels=TEXT,
        text_proj_in_factor=2,
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32,
        rope_theta=10000.0,
        rope_double_precision=False,
        causal_temporal_positioning=False,
        rope_type="split",
    ).eval()
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(8,),
        decoder_block_out_channels=(8,),
        layers_per_block=(1,),
        decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False),
        downsample_type=("spatial",),
        upsample_residual=(False,),
        upsample_factor=(1,),
        timestep_conditioning=False,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    ).eval()
    torch.manual_seed(0)
    audio_vae = diffusers.AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=8,
    ).eval()
    pipe = diffusers.LTX2Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=None,
        tokenizer=None,
        connectors=connectors,
        transformer=tr,
        vocoder=None,
    )
    # latents of a 32 x 32, 9-frame video as 2 x 2 x 2 tokens (the VAE is only read for its latent statistics)
    pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio = 16, 8
    return pipe


def _ltx2_kwargs():
    mask = torch.ones(1, 6, dtype=torch.long)
    mask[0, :2] = 0  # left padding, as Gemma's tokenizer
    return dict(
        prompt_embeds=_randn(1, 6, 2 * TEXT),
        prompt_attention_mask=mask,
        height=32,
        width=32,
        num_frames=9,
        frame_rate=8.0,
        guidance_scale=1.0,
        stg_scale=0.0,
        modality_scale=1.0,
        guidance_rescale=0.0,
        audio_guidance_scale=1.0,
        audio_stg_scale=0.0,
        audio_modality_scale=1.0,
        audio_guidance_rescale=0.0,
        output_type="latent",
    )


def _flux1():
    from tiny import tiny_flux_pipeline

    return tiny_flux_pipeline()


def _flux1_kwargs():
    from tiny import flux_embeds

    pe, pp = flux_embeds()
    return dict(
        prompt_embeds=pe, pooled_prompt_embeds=pp, height=16, width=16, guidance_scale=1.0, output_type="latent"
    )


def _unzero(model, seed=5, scale=0.1):
    """Fill the parameters a model creates as zeros (adaLN modulations, output layers, attention gates) with small
    random values: at their zero init the model's output, or its attention's share of it, would not depend on the
    inputs."""
    g = _g(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return model


def _mask(n=6, pad=2, left=False, dtype=torch.long):
    m = torch.ones(1, n, dtype=dtype)
    m[0, :pad] = 0 if left else m[0, :pad]
    m[0, n - pad :] = m[0, n - pad :] if left else 0
    return m


def _flux2_klein():
    torch.manual_seed(0)
    tr = diffusers.Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT,
        timestep_guidance_channels=256,
        axes_dims_rope=[4, 4, 4, 4],
        guidance_embeds=False,
    ).eval()
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLFlux2(  # the pipeline reads its batch-norm statistics even for latent output
        sample_size=32,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()
    sched = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0)
    return diffusers.Flux2KleinPipeline(scheduler=sched, vae=vae, text_encoder=None, tokenizer=None, transformer=tr)


def _flux2_klein_kwargs():
    return dict(prompt_embeds=_randn(1, 6, TEXT), height=8, width=8, guidance_scale=1.0, output_type="latent")


def _aura():
    torch.manual_seed(0)
    tr = diffusers.AuraFlowTransformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=4,
        num_mmdit_layers=1,
        num_single_dit_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=TEXT,
        out_channels=4,
        pos_embed_max_size=256,
    ).eval()
    return diffusers.AuraFlowPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=None,
        transformer=tr,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=1.73),
    )


def _aura_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        prompt_attention_mask=_mask(),
        height=32,
        width=32,
        guidance_scale=1.0,
        output_type="latent",
    )


def _lumina2():
    torch.manual_seed(0)
    tr = diffusers.Lumina2Transformer2DModel(
        sample_size=4,
        patch_size=2,
        in_channels=4,
        hidden_size=16,
        num_layers=1,
        num_attention_heads=2,
        num_kv_heads=1,
        multiple_of=16,
        ffn_dim_multiplier=None,
        norm_eps=1e-5,
        scaling_factor=1.0,
        axes_dim_rope=[4, 2, 2],
        cap_feat_dim=TEXT,
    ).eval()
    return diffusers.Lumina2Pipeline(
        transformer=tr,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=6.0),
        vae=None,
        text_encoder=None,
        tokenizer=None,
    )


def _lumina2_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        prompt_attention_mask=_mask(),
        height=32,
        width=32,
        guidance_scale=1.0,
        output_type="latent",
    )


def _hunyuan():
    torch.manual_seed(0)
    tr = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=10,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=1,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=TEXT,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 4, 4),
    ).eval()
    pipe = diffusers.HunyuanVideoPipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=tr,
        vae=None,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=None,
        tokenizer_2=None,
    )
    pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal = 8, 4
    return pipe


def _hunyuan_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        pooled_prompt_embeds=_randn(1, 8, seed=1),
        prompt_attention_mask=_mask(),
        height=16,
        width=16,
        num_frames=5,
        guidance_scale=1.0,
        output_type="latent",
    )


def _ltx():
    torch.manual_seed(0)
    tr = diffusers.LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=1,
        caption_channels=TEXT,
    ).eval()
    pipe = diffusers.LTXPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        transformer=tr,
    )
    return pipe


def _ltx_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        prompt_attention_mask=_mask(),
        height=64,
        width=64,
        num_frames=9,
        guidance_scale=1.0,
        output_type="latent",
    )


def _mochi():
    torch.manual_seed(0)
    tr = diffusers.MochiTransformer3DModel(
        patch_size=2,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        pooled_projection_dim=16,
        in_channels=12,
        out_channels=None,
        qk_norm="rms_norm",
        text_embed_dim=TEXT,
        time_embed_dim=4,
        activation_fn="swiglu",
        max_sequence_length=16,
    ).eval()
    tr.pos_frequencies.data.zero_()  # created with torch.empty
    return diffusers.MochiPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        transformer=tr,
    )


def _mochi_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        prompt_attention_mask=_mask(),
        height=16,
        width=16,
        num_frames=7,
        guidance_scale=1.0,
        output_type="latent",
    )


def _krea2():
    torch.manual_seed(0)
    tr = diffusers.Krea2Transformer2DModel(
        in_channels=16,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        timestep_embed_dim=32,
        text_hidden_dim=TEXT,
        num_text_layers=2,
        text_num_attention_heads=2,
        text_num_key_value_heads=2,
        text_intermediate_size=32,
        num_layerwise_text_blocks=1,
        num_refiner_text_blocks=1,
        axes_dims_rope=(4, 2, 2),
    ).eval()
    return diffusers.Krea2Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        transformer=tr,
    )


def _krea2_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, 2, TEXT),
        prompt_embeds_mask=_mask(dtype=torch.bool),
        height=32,
        width=32,
        guidance_scale=0.0,
        output_type="latent",
    )


def _longcat():
    torch.manual_seed(0)
    tr = diffusers.LongCatImageTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT,
        pooled_projection_dim=TEXT,
        axes_dims_rope=[4, 6, 6],
    ).eval()
    pipe = diffusers.LongCatImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_processor=None,
        transformer=tr,
    )
    # its prompt_embeds path still takes len(prompt) (None without a prompt): the text encoder's output is stubbed
    pipe._encode_prompt = lambda prompt: _randn(len(prompt), 6, TEXT)
    return pipe


def _longcat_kwargs():
    return dict(prompt="p", height=32, width=32, guidance_scale=1.0, enable_prompt_rewrite=False, output_type="latent")


def _ovis():
    torch.manual_seed(0)
    tr = diffusers.OvisImageTransformer2DModel(
        patch_size=1,
        in_channels=64,
        out_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    return diffusers.OvisImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        transformer=tr,
    )


def _ovis_kwargs():
    return dict(prompt_embeds=_randn(1, 6, TEXT), height=32, width=32, guidance_scale=1.0, output_type="latent")


def _nucleus():
    torch.manual_seed(0)
    tr = diffusers.NucleusMoEImageTransformer2DModel(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        joint_attention_dim=TEXT,
        axes_dims_rope=(8, 4, 4),
        mlp_ratio=2.0,
        moe_enabled=True,
        dense_moe_strategy="leave_first_three_and_last_block_dense",
        num_experts=4,
        moe_intermediate_dim=16,
        capacity_factors=8.0,
    ).eval()
    return diffusers.NucleusMoEImagePipeline(
        transformer=tr,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=None,
        text_encoder=None,
        processor=None,
    )


def _nucleus_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        prompt_embeds_mask=_mask(),
        height=32,
        width=32,
        guidance_scale=1.0,
        output_type="latent",
    )


def _ernie():
    torch.manual_seed(0)
    tr = diffusers.ErnieImageTransformer2DModel(
        hidden_size=32,
        num_attention_heads=2,
        num_layers=1,
        ffn_hidden_size=32,
        in_channels=4,
        out_channels=4,
        patch_size=1,
        text_in_dim=TEXT,
        rope_axes_dim=(8, 4, 4),
    ).eval()
    _unzero(tr)
    return diffusers.ErnieImagePipeline(
        transformer=tr,
        vae=None,
        text_encoder=None,
        tokenizer=None,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        pe=None,
        pe_tokenizer=None,
    )


def _ernie_kwargs():
    return dict(
        prompt_embeds=[_randn(6, TEXT)], height=64, width=64, guidance_scale=1.0, use_pe=False, output_type="latent"
    )


def _hunyuan_image():
    torch.manual_seed(0)
    tr = diffusers.HunyuanImageTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=(1, 1),
        text_embed_dim=TEXT,
        text_embed_2_dim=TEXT,
        rope_axes_dim=(4, 4),
    ).eval()
    return diffusers.HunyuanImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=tr,
    )


def _hunyuan_image_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        prompt_embeds_mask=_mask(),
        prompt_embeds_2=_randn(1, 3, TEXT, seed=1),
        prompt_embeds_mask_2=torch.ones(1, 3, dtype=torch.long),
        height=64,
        width=64,
        output_type="latent",
    )


def _kandinsky5(video=False):
    torch.manual_seed(0)
    tr = diffusers.Kandinsky5Transformer3DModel(
        in_visual_dim=4,
        in_text_dim=TEXT,
        in_text_dim2=8,
        time_dim=16,
        out_visual_dim=4,
        patch_size=(1, 2, 2),
        model_dim=32,
        ff_dim=32,
        num_text_blocks=1,
        num_visual_blocks=1,
        axes_dims=(8, 4, 4),
        visual_cond=video,
    ).eval()
    _unzero(tr)
    cls = diffusers.Kandinsky5T2VPipeline if video else diffusers.Kandinsky5T2IPipeline
    pipe = cls(
        transformer=tr,
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    if not video:
        pipe.resolutions = [(32, 32)]
    return pipe


def _kandinsky5_kwargs(video=False):
    kw = dict(
        prompt_embeds_qwen=_randn(1, 6, TEXT),
        prompt_embeds_clip=_randn(1, 8, seed=1),
        prompt_cu_seqlens=torch.tensor([0, 6], dtype=torch.int32),
        height=32,
        width=32,
        guidance_scale=1.0,
        output_type="latent",
    )
    return {**kw, "num_frames": 5} if video else kw


def _lumina():
    torch.manual_seed(0)
    tr = diffusers.LuminaNextDiT2DModel(
        sample_size=4,
        patch_size=2,
        in_channels=4,
        hidden_size=16,
        num_layers=1,
        num_attention_heads=2,
        num_kv_heads=1,
        multiple_of=16,
        learn_sigma=True,
        qk_norm=True,
        cross_attention_dim=TEXT,
    ).eval()
    _unzero(tr)
    return diffusers.LuminaPipeline(
        transformer=tr,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=None,
        tokenizer=None,
    )


def _lumina_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        prompt_attention_mask=_mask(),
        height=32,
        width=32,
        guidance_scale=1.0,
        output_type="latent",
    )


def _prx():
    torch.manual_seed(0)
    tr = diffusers.PRXTransformer2DModel(
        in_channels=4,
        patch_size=2,
        context_in_dim=TEXT,
        hidden_size=32,
        mlp_ratio=2.0,
        num_heads=2,
        depth=1,
        axes_dim=[8, 8],
    ).eval()
    _unzero(tr)
    return diffusers.PRXPipeline(
        transformer=tr,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        text_encoder=None,
        tokenizer=None,
        vae=None,
    )


def _prx_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        prompt_attention_mask=_mask(),
        height=32,
        width=32,
        guidance_scale=1.0,
        use_resolution_binning=False,
        output_type="latent",
    )


def _sana_pag():
    torch.manual_seed(0)
    tr = diffusers.SanaTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=TEXT,
        sample_size=32,
        patch_size=1,
    ).eval()
    return diffusers.SanaPAGPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=None,
        transformer=tr,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        pag_applied_layers="transformer_blocks.0",
    )


def _sana_pag_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        prompt_attention_mask=_mask(),
        height=32,
        width=32,
        guidance_scale=1.0,
        pag_scale=0.0,
        use_resolution_binning=False,
        output_type="latent",
    )


def _bria():
    torch.manual_seed(0)
    tr = diffusers.BriaTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT,
        axes_dims_rope=[4, 6, 6],
    ).eval()
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(4,),
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=1,
    ).eval()
    return diffusers.BriaPipeline(
        transformer=tr,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
    )


def _bria_kwargs():
    return dict(prompt_embeds=_randn(1, 6, TEXT), height=16, width=16, guidance_scale=1.0, output_type="latent")


def _glm():
    torch.manual_seed(0)
    tr = diffusers.GlmImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        text_embed_dim=TEXT,
        time_embed_dim=8,
        condition_dim=4,
        prior_vq_quantizer_codebook_size=32,
    ).eval()
    return diffusers.GlmImagePipeline(
        tokenizer=None,
        processor=None,
        text_encoder=None,
        vision_language_encoder=None,
        vae=None,
        transformer=tr,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(
            base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True, time_shift_type="linear"
        ),
    )


def _glm_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        prior_token_ids=torch.tensor([[3, 7, 11, 19]]),
        height=32,
        width=32,
        guidance_scale=1.0,
        output_type="latent",
    )


class _ChatProcessorStub:
    """What QwenImage21Pipeline.__init__ reads of its Qwen processor (the length of the system-prompt tokens and the
    image-pad token id); prompts are given as embeddings, so nothing else is read."""

    class tokenizer:
        @staticmethod
        def encode(text):
            return [1]

    @staticmethod
    def apply_chat_template(messages, tokenize=True, return_dict=False):
        return [[0] * 8]


def _qwen21():
    torch.manual_seed(0)
    tr = diffusers.QwenImage21Transformer2DModel(
        patch_size=1,
        in_channels=16,
        out_channels=16,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        context_in_dim=TEXT,
        mlp_ratio=2,
        axes_dims_rope=(8, 4, 4),
    ).eval()
    return diffusers.QwenImage21Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=None,
        text_encoder=None,
        processor=_ChatProcessorStub(),
        transformer=tr,
    )


def _qwen21_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        prompt_embeds_mask=_mask(),
        height=64,
        width=64,
        true_cfg_scale=1.0,
        output_type="latent",
    )


def _sd3_pag():
    base = _sd3()
    return diffusers.StableDiffusion3PAGPipeline(
        transformer=base.transformer,
        scheduler=base.scheduler,
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
        pag_applied_layers="transformer_blocks.0",
    )


def _sd3_pag_kwargs():
    return {**_sd3_kwargs(), "pag_scale": 0.0}


def _prx_pixel():
    torch.manual_seed(0)
    tr = diffusers.PRXTransformer2DModel(
        in_channels=3,
        patch_size=2,
        context_in_dim=TEXT,
        hidden_size=32,
        mlp_ratio=2.0,
        num_heads=2,
        depth=1,
        axes_dim=[8, 8],
        bottleneck_size=8,
    ).eval()
    _unzero(tr)
    return diffusers.PRXPixelPipeline(
        transformer=tr, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), text_encoder=None, tokenizer=None
    )


def _prx_pixel_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        prompt_attention_mask=_mask(),
        height=16,
        width=16,
        guidance_scale=1.0,
        use_resolution_binning=False,
        output_type="latent",
    )


def _easyanimate():
    torch.manual_seed(0)
    tr = diffusers.EasyAnimateTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        patch_size=2,
        sample_width=8,
        sample_height=8,
        num_layers=1,
        mmdit_layers=1,
        time_embed_dim=16,
        text_embed_dim=TEXT,
    ).eval()
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLMagvit(
        in_channels=3,
        latent_channels=4,
        out_channels=3,
        block_out_channels=(8, 8),
        down_block_types=("SpatialDownBlock3D", "SpatialTemporalDownBlock3D"),
        up_block_types=("SpatialUpBlock3D", "SpatialTemporalUpBlock3D"),
        layers_per_block=1,
        norm_num_groups=4,
    ).eval()
    return diffusers.EasyAnimatePipeline(
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        transformer=tr,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


def _easyanimate_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        prompt_attention_mask=_mask(),
        height=16,
        width=16,
        num_frames=5,
        guidance_scale=1.0,
        output_type="latent",
    )


def _stable_audio3():
    from diffusers.pipelines.stable_audio_3.modeling_stable_audio_3 import StableAudio3DurationEmbedder

    torch.manual_seed(0)
    tr = diffusers.StableAudio3DiTModel(
        io_channels=4,
        patch_size=1,
        embed_dim=32,
        depth=1,
        num_heads=2,
        cond_token_dim=TEXT,
        global_cond_dim=16,
        local_add_cond_dim=5,
        timestep_features_dim=16,
        ff_mult=2.0,
        num_memory_tokens=2,
        use_differential_attention=False,
    ).eval()
    torch.manual_seed(0)
    vae = diffusers.AutoencoderSAME(
        audio_channels=2,
        patch_size=4,
        encoder_channels=8,
        encoder_c_mults=(1,),
        encoder_strides=(2,),
        encoder_transformer_depths=(1,),
        latent_dim=4,
        use_differential_attention=False,
        dim_heads=8,
        ff_mult=2,
        sampling_rate=64,
    ).eval()
    torch.manual_seed(0)
    dur = StableAudio3DurationEmbedder(output_dim=16, fourier_dim=8).eval()
    return diffusers.StableAudio3Pipeline(
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        duration_embedder=dur,
        transformer=tr,
        # the transformer takes the time in [0, 1] as the scheduler's timesteps
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1),
    )


def _stable_audio3_kwargs():
    return dict(
        prompt_embeds=_randn(1, 6, TEXT),
        encoder_attention_mask=_mask(),
        duration=1.0,
        guidance_scale=1.0,
        output_type="latent",
    )


CASES = [
    FlowCase("Wan 2.1", "WanPipeline", _wan, _wan_kwargs, out="frames", batch_arg="num_videos_per_prompt"),
    FlowCase(
        "Wan 2.2", "WanPipeline", lambda: _wan(True), _wan_kwargs, out="frames", batch_arg="num_videos_per_prompt"
    ),
    FlowCase("FLUX.1", "FluxPipeline", _flux1, _flux1_kwargs),
    FlowCase("FLUX.2", "Flux2Pipeline", _flux2, _flux2_kwargs),
    FlowCase("Qwen-Image", "QwenImagePipeline", _qwen, _qwen_kwargs),
    FlowCase("Z-Image", "ZImagePipeline", _zimage, _zimage_kwargs, x_arg=0, t_arg=1, list_x=True),
    FlowCase("SD3", "StableDiffusion3Pipeline", _sd3, _sd3_kwargs),
    FlowCase("Chroma", "ChromaPipeline", _chroma, _chroma_kwargs, batch_by_prompt=True),
    FlowCase("CogView4", "CogView4Pipeline", _cogview4, _cogview4_kwargs),
    FlowCase(
        "SkyReels V2",
        "SkyReelsV2Pipeline",
        _skyreels,
        _skyreels_kwargs,
        out="frames",
        batch_arg="num_videos_per_prompt",
    ),
    FlowCase(
        "SanaVideo",
        "SanaVideoPipeline",
        _sana_video,
        _sana_video_kwargs,
        out="frames",
        x_arg=0,
        batch_arg="num_videos_per_prompt",
    ),
    FlowCase(
        "HunyuanVideo-1.5", "HunyuanVideo15Pipeline", _hunyuan15, _hunyuan15_kwargs, out="frames", batch_by_prompt=True
    ),
    FlowCase("LTX-2", "LTX2Pipeline", _ltx2, _ltx2_kwargs, out="frames", batch_by_prompt=True),
    FlowCase("FLUX.2 [klein]", "Flux2KleinPipeline", _flux2_klein, _flux2_klein_kwargs),
    FlowCase("AuraFlow", "AuraFlowPipeline", _aura, _aura_kwargs, x_arg=0),
    FlowCase("Lumina 2", "Lumina2Pipeline", _lumina2, _lumina2_kwargs),
    FlowCase(
        "HunyuanVideo",
        "HunyuanVideoPipeline",
        _hunyuan,
        _hunyuan_kwargs,
        out="frames",
        batch_arg="num_videos_per_prompt",
    ),
    FlowCase("LTX-Video", "LTXPipeline", _ltx, _ltx_kwargs, out="frames", batch_by_prompt=True),
    FlowCase("Mochi", "MochiPipeline", _mochi, _mochi_kwargs, out="frames", batch_by_prompt=True),
    FlowCase("HiDream", "HiDreamImagePipeline", _hidream, _hidream_kwargs, x_arg="hidden_states", t_arg="timesteps"),
    FlowCase("Krea 2", "Krea2Pipeline", _krea2, _krea2_kwargs),
    FlowCase("LongCat-Image", "LongCatImagePipeline", _longcat, _longcat_kwargs),
    FlowCase("Ovis-Image", "OvisImagePipeline", _ovis, _ovis_kwargs),
    FlowCase("NucleusMoE-Image", "NucleusMoEImagePipeline", _nucleus, _nucleus_kwargs),
    FlowCase("ERNIE-Image", "ErnieImagePipeline", _ernie, _ernie_kwargs),
    FlowCase("HunyuanImage-2.1", "HunyuanImagePipeline", _hunyuan_image, _hunyuan_image_kwargs, batch_by_prompt=True),
    FlowCase(
        "Kandinsky 5 T2I", "Kandinsky5T2IPipeline", _kandinsky5, _kandinsky5_kwargs, out="image", batch_by_prompt=True
    ),
    FlowCase(
        "Kandinsky 5 T2V",
        "Kandinsky5T2VPipeline",
        lambda: _kandinsky5(True),
        lambda: _kandinsky5_kwargs(True),
        out="frames",
        batch_by_prompt=True,
    ),
    FlowCase("Lumina-Next", "LuminaPipeline", _lumina, _lumina_kwargs),
    FlowCase("PRX", "PRXPipeline", _prx, _prx_kwargs),
    FlowCase("Sana PAG", "SanaPAGPipeline", _sana_pag, _sana_pag_kwargs, x_arg=0),
    FlowCase("Bria", "BriaPipeline", _bria, _bria_kwargs),
    FlowCase("GLM-Image", "GlmImagePipeline", _glm, _glm_kwargs),
    FlowCase("Qwen-Image 2.1", "QwenImage21Pipeline", _qwen21, _qwen21_kwargs),
    FlowCase("SD3 PAG", "StableDiffusion3PAGPipeline", _sd3_pag, _sd3_pag_kwargs, batch_by_prompt=True),
    FlowCase("PRX pixel", "PRXPixelPipeline", _prx_pixel, _prx_pixel_kwargs),
    FlowCase("EasyAnimate", "EasyAnimatePipeline", _easyanimate, _easyanimate_kwargs, out="frames", x_arg=0, t_arg=1),
    FlowCase(
        "Stable Audio 3",
        "StableAudio3Pipeline",
        _stable_audio3,
        _stable_audio3_kwargs,
        out="audios",
        x_arg=0,
        t_arg=1,
        batch_arg="num_waveforms_per_prompt",
    ),
]


def case(name: str) -> FlowCase:
    return next(c for c in CASES if c.name == name)


def record_inputs(c: FlowCase):
    """``(transformer, args, kwargs)`` of the transformer's first call in an rCM run of the case's pipeline (2 steps:
    Mochi's pipeline cannot run 1)."""
    from rcm_diffusers import RCMScheduler

    pipe = c.build()
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config)
    seen = []

    def hook(_m, args, kwargs):
        if not seen:
            seen.append((args, kwargs))

    h = pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    import inspect

    params = inspect.signature(type(pipe).__call__).parameters
    with torch.no_grad():
        pipe(num_inference_steps=2, generator=_g(0), **{k: v for k, v in c.kwargs().items() if k in params})
    h.remove()
    return pipe.transformer, *seen[0]
