"""Model adapters: call a diffusers transformer as a rectified-flow velocity ``v(x_r, r, **cond)``.

Each supported transformer takes its time in its own scale (docs/math.md §1): the Wan transformer
is called with ``r * 1000``; the Flux, FLUX.2 and Qwen-Image transformers with ``r`` (they multiply by 1000 inside:
FluxPipeline, Flux2Pipeline and QwenImagePipeline pass ``timestep / 1000``).
``TrigFlowDenoiser(velocity_fn(transformer))`` then gives the TrigFlow ``F(x_t, t)`` used
by every loss and sampler of the package.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = [
    "TIMESTEP_SCALE",
    "CFG_NORM_RESCALE",
    "TIME_INPUTS",
    "timestep_scale",
    "network_timestep",
    "velocity_fn",
    "denoiser",
    "compute_dtype",
    "transformer_blocks",
]

#: timestep passed to the transformer = r * TIMESTEP_SCALE[class name]
TIMESTEP_SCALE = {
    "WanTransformer3DModel": 1000.0,
    "WanVACETransformer3DModel": 1000.0,
    "WanExpertSwitch": 1000.0,  # rcm_diffusers.distill.experts: Wan 2.2's two experts as one module
    "FluxTransformer2DModel": 1.0,
    "QwenImageTransformer2DModel": 1.0,  # QwenImagePipeline passes timestep / 1000; its Timesteps embed at scale 1000
    "HunyuanVideo15Transformer3DModel": 1000.0,  # HunyuanVideo15Pipeline passes the scheduler's timestep (sigma * 1000)
    "Flux2Transformer2DModel": 1.0,  # Flux2Pipeline passes timestep / 1000 (and guidance as is); x 1000 inside
}


#: transformers whose pipeline rescales the guided velocity per token to the conditional one's norm
#: (QwenImagePipeline's true CFG; ``distill.losses.guided_norm_rescaled``)
CFG_NORM_RESCALE = ("QwenImageTransformer2DModel",)


#: how the time reaches the network: "bf16" = rounded to bfloat16 as the official rCM code feeds it
#: (``(1000 r).to(bfloat16)`` in training and sampling), "float" = the exact value
TIME_INPUTS = ("bf16", "float")


def network_timestep(r: torch.Tensor, scale: float, time_input: str = "float") -> torch.Tensor:
    """The transformer's ``timestep`` argument ``r * scale``; ``time_input="bf16"`` rounds ``1000 r`` to
    bfloat16 (and back to ``r``'s dtype) as the official rCM networks see it, ``"float"`` keeps it exact.

    The rounding is always of ``1000 r`` (the time the network embeds), whatever the argument's scale:
    Flux takes ``r`` and multiplies by 1000 inside, so it gets ``bf16(1000 r) / 1000`` -- the value
    ``RCMScheduler(time_input="bf16")`` hands it through FluxPipeline's ``timesteps / 1000``.
    The rounding is a plain cast, so under ``torch.func.jvp`` the time tangent passes through the
    same cast, as in the official JVP path (docs/math.md, time input and §4.1)."""
    if time_input not in TIME_INPUTS:
        raise ValueError(f"time_input must be one of {TIME_INPUTS}, got {time_input!r}")
    if time_input == "bf16":
        ts = (r * 1000.0).to(torch.bfloat16).to(r.dtype)
        return ts if scale == 1000.0 else ts / (1000.0 / scale)
    return r * scale


def _base_model(transformer):
    """Unwrap peft / accelerate / torch.compile wrappers to the diffusers model class."""
    m = transformer
    for attr in ("module", "_orig_mod"):
        while hasattr(m, attr) and not hasattr(m, "config"):
            m = getattr(m, attr)
    if hasattr(m, "get_base_model"):
        m = m.get_base_model()
    return m


def model_class_name(transformer) -> str:
    """Class name of the diffusers model under any wrapper, FSDP2's dynamic ``FSDP<Class>`` subclass included."""
    cls = type(_base_model(transformer))
    for c in cls.__mro__:
        if not c.__module__.startswith("torch.distributed"):
            return c.__name__
    return cls.__name__


def timestep_scale(transformer) -> float:
    """The factor between RF time ``r`` and the transformer's ``timestep`` argument."""
    name = model_class_name(transformer)
    if name not in TIMESTEP_SCALE:
        raise ValueError(
            f"unsupported transformer class {name!r}; supported: {sorted(TIMESTEP_SCALE)}. "
            "Add its timestep scale to rcm_diffusers.models.TIMESTEP_SCALE."
        )
    return TIMESTEP_SCALE[name]


def velocity_fn(transformer, time_input: str = "float") -> Callable[..., torch.Tensor]:
    """Return ``v(x_r, r, **cond)`` for a Wan, Flux or Qwen-Image transformer; the network sees
    ``network_timestep(r, scale, time_input)``.

    Wan conditions: ``encoder_hidden_states`` (text), optional ``encoder_hidden_states_image``
    (I2V CLIP tokens) and ``condition`` (I2V mask + first-frame latents, concatenated on the
    channel dim after ``x_r``, as WanImageToVideoPipeline does).
    Flux conditions: ``encoder_hidden_states``, ``pooled_projections``, ``txt_ids``, ``img_ids``,
    optional ``guidance``; ``x_r`` is the packed latent ``[B, L, C]``.
    Qwen-Image conditions: ``encoder_hidden_states``, ``encoder_hidden_states_mask`` (``None`` when no text token
    is padding, as QwenImagePipeline.encode_prompt leaves it) and ``img_shapes`` (``[[(1, h/2, w/2)]] * B``);
    ``x_r`` is the packed latent ``[B, L, 4C]``. Its output is the flow-matching velocity ``eps - x0`` (the
    pipeline's FlowMatchEulerDiscreteScheduler steps ``x + (sigma_next - sigma) v``), the same convention as Flux.
    FLUX.2 conditions: ``encoder_hidden_states``, ``txt_ids`` ``[B, L, 4]``, ``img_ids`` ``[B, h w, 4]`` (the (t, h, w,
    l) position ids of Flux2Pipeline), optional ``guidance`` (float32 ``[B]``, the guidance-distilled embedding's
    value; no pooled text); ``x_r`` is the patchified latent flattened to tokens ``[B, h w, 4C]``; output ``eps - x0``
    as Flux.
    """
    scale = timestep_scale(transformer)
    if time_input not in TIME_INPUTS:
        raise ValueError(f"time_input must be one of {TIME_INPUTS}, got {time_input!r}")
    name = model_class_name(transformer)

    if name.startswith("Wan"):

        def v_wan(x_r, r, encoder_hidden_states, encoder_hidden_states_image=None, condition=None, **kw):
            if condition is not None:
                x_r = torch.cat([x_r, condition.to(x_r.dtype)], dim=1)
            ts = _batch_timestep(r, x_r, scale, time_input, x_r.device)
            return transformer(
                hidden_states=x_r,
                timestep=ts,
                encoder_hidden_states=encoder_hidden_states,
                encoder_hidden_states_image=encoder_hidden_states_image,
                return_dict=False,
                **kw,
            )[0]

        return v_wan

    if name == "HunyuanVideo15Transformer3DModel":
        return _v_hunyuan15(transformer, scale, time_input)

    if name == "QwenImageTransformer2DModel":

        def v_qwen(x_r, r, encoder_hidden_states, img_shapes, encoder_hidden_states_mask=None, **kw):
            ts = _batch_timestep(r, x_r, scale, time_input, x_r.device, x_r.dtype)
            return transformer(
                hidden_states=x_r,
                timestep=ts,
                encoder_hidden_states=encoder_hidden_states,
                encoder_hidden_states_mask=encoder_hidden_states_mask,
                img_shapes=img_shapes,
                return_dict=False,
                **kw,
            )[0]

        return v_qwen

    # FLUX.1 and FLUX.2: the same call, FLUX.2 without pooled text (its transformer takes no pooled_projections)
    pooled = name != "Flux2Transformer2DModel"

    def v_flux(x_r, r, encoder_hidden_states, txt_ids, img_ids, pooled_projections=None, guidance=None, **kw):
        if pooled:
            kw["pooled_projections"] = pooled_projections
        ts = _batch_timestep(r, x_r, scale, time_input, x_r.device, x_r.dtype)
        return transformer(
            hidden_states=x_r,
            timestep=ts,
            guidance=guidance,
            encoder_hidden_states=encoder_hidden_states,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
            **kw,
        )[0]

    return v_flux


def _batch_timestep(r, x_r, scale: float, time_input: str, device, dtype=None) -> torch.Tensor:
    """``network_timestep(r)`` on ``device`` (and in ``dtype`` when given), one per sample of ``x_r``: a scalar ``r``
    is expanded over the batch."""
    ts = network_timestep(r, scale, time_input).to(device=device, dtype=dtype)
    return ts.expand(x_r.shape[0]) if ts.dim() == 0 else ts


#: HunyuanVideo15Pipeline.vision_num_semantic_tokens: the (all-zero, in text-to-video) image tokens it passes
HUNYUAN15_IMAGE_TOKENS = 729
#: HunyuanVideo-1.5's context tokens besides the Qwen2.5-VL prompt: 256 ByT5 tokens (HunyuanVideo15Pipeline's
#: tokenizer_2_max_length) and the 729 image tokens (all zero and masked in text-to-video), in every joint attention
HUNYUAN15_CONTEXT_EXTRA = 256 + HUNYUAN15_IMAGE_TOKENS


def _v_hunyuan15(transformer, scale: float, time_input: str):
    """HunyuanVideo-1.5 text-to-video as HunyuanVideo15Pipeline calls it: ``x_r`` ``[B, C, F, H, W]`` concatenated on
    the channel dim with the zero condition latents ``[B, C, F, H, W]`` and zero mask ``[B, 1, F, H, W]``
    (``prepare_cond_latents_and_mask``), ``image_embeds`` zeros ``[B, 729, image_embed_dim]`` (the transformer then
    masks those tokens out), ``timestep = r * 1000`` in the latents' dtype; conditions ``encoder_hidden_states`` /
    ``encoder_attention_mask`` (Qwen2.5-VL) and ``encoder_hidden_states_2`` / ``encoder_attention_mask_2`` (ByT5),
    the masks as the pipeline passes them (float, 1 = token). The output is the flow-matching velocity ``eps - x0``
    (FlowMatchEulerDiscreteScheduler steps ``x + (sigma_next - sigma) v``)."""
    image_dim = _base_model(transformer).config.image_embed_dim

    def v_hunyuan15(
        x_r, r, encoder_hidden_states, encoder_attention_mask, encoder_hidden_states_2, encoder_attention_mask_2, **kw
    ):
        B, C, T, H, W = x_r.shape
        zeros = x_r.new_zeros(B, C + 1, T, H, W)  # condition latents and mask, both zero for text-to-video
        image_embeds = x_r.new_zeros(B, HUNYUAN15_IMAGE_TOKENS, image_dim)
        ts = _batch_timestep(r, x_r, scale, time_input, x_r.device, x_r.dtype)
        return transformer(
            hidden_states=torch.cat([x_r, zeros], dim=1),
            image_embeds=image_embeds,
            timestep=ts,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            encoder_hidden_states_2=encoder_hidden_states_2,
            encoder_attention_mask_2=encoder_attention_mask_2,
            return_dict=False,
            **kw,
        )[0]

    return v_hunyuan15


def compute_dtype(module) -> torch.dtype:
    """The dtype a transformer computes in, by diffusers' ``ModelMixin.dtype`` rule: its first floating parameter
    outside ``_keep_in_fp32_modules``. ``from_pretrained(torch_dtype=torch.bfloat16)`` keeps those modules in float32,
    and Wan registers one of them (``scale_shift_table``) first, so the first parameter alone says float32. Looks
    through DDP / accelerate wrappers (``.module``) and defers to a ``dtype`` property where the module has one
    (diffusers models, the two-expert switch); float32 for a module without floating parameters."""
    inner = getattr(module, "module", module)
    if isinstance(getattr(type(inner), "dtype", None), property):
        return inner.dtype
    keep = getattr(inner, "_keep_in_fp32_modules", None) or ()
    last = None
    for name, p in inner.named_parameters():
        if not p.is_floating_point():
            continue
        last = p.dtype
        if not any(k in name for k in keep):
            return p.dtype
    return last or torch.float32


def denoiser(transformer, model_dtype: torch.dtype | None = None, time_input: str = "float"):
    """``TrigFlowDenoiser`` around a diffusers transformer (docs/math.md §1); inputs are cast to ``model_dtype``
    (default ``compute_dtype(transformer)``)."""
    from .trigflow import TrigFlowDenoiser

    dtype = model_dtype or compute_dtype(transformer)
    return TrigFlowDenoiser(velocity_fn(transformer, time_input), model_dtype=dtype)


#: the repeated transformer blocks of the supported families, by class name
BLOCK_CLASSES = (
    "WanTransformerBlock",
    "FluxTransformerBlock",
    "FluxSingleTransformerBlock",
    "QwenImageTransformerBlock",
    "Flux2TransformerBlock",
    "Flux2SingleTransformerBlock",
    "HunyuanVideo15TransformerBlock",
)


def named_transformer_blocks(net: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, block)`` of the transformer blocks (``BLOCK_CLASSES``) of one diffusers transformer, in the order its
    forward runs them, named as in its ``named_modules()`` (e.g. ``blocks.3``, ``single_transformer_blocks.0``)."""
    return [(n, m) for n, m in net.named_modules() if type(m).__name__ in BLOCK_CLASSES]


def transformer_blocks(net: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of one diffusers transformer, in the order its forward runs them."""
    return [m for _, m in named_transformer_blocks(net)]
