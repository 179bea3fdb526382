"""HunyuanVideo-1.5 attention with key-padding masks (docs/math.md §5, docs/training.md).

diffusers' HunyuanVideo-1.5 hands its attention a per-token padding mask of the context (Qwen2.5-VL, ByT5 and image
tokens; the video tokens are always valid) and turns it into a dense ``[B, 1, L, L]`` mask ``m_i & m_j`` over all L
joint tokens before attention (the double-stream blocks in ``HunyuanVideo15AttnProcessor2_0``; the token refiner in
``HunyuanVideo15IndividualTokenRefiner.forward``, which ``AttnProcessor2_0`` then repeats over the heads). PyTorch's
SDPA saves such a mask for the backward as an additive mask in the activation dtype, ``2 L^2`` bytes per block in bf16
(24 GiB per block at 720p x 121), and each forward builds two more ``L^2``-byte bool masks.

The row of that mask for a valid query token ``i`` is the key mask ``m`` itself, so attention with the key mask
broadcast over the query rows (``[B, 1, 1, L]``) gives the same output on every valid token. Only the padded context
tokens' own outputs differ (the dense mask leaves them nothing to attend to; here they attend to the valid tokens).
Those outputs never reach the model's output: a padded token is never attended as a key by any later block, the refiner
output of a padded prompt token is replaced by zeros, and the transformer returns the video tokens only. The
transformer output, its gradients and its JVP are therefore the same (``tests/test_hunyuan15_attention.py``).

``enable_key_padding_mask(transformer)`` installs the two processors below. Both compute attention through
``torch.nn.functional.scaled_dot_product_attention`` (the double-stream blocks through diffusers'
``dispatch_attention_fn``, as the stock processor), so ``enable_jvp_attention``'s interception of JVP passes applies
unchanged; the projections are called as modules, so peft LoRA layers on them take part as usual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "HunyuanVideo15KeyPaddingAttnProcessor",
    "HunyuanVideo15RefinerKeyPaddingAttnProcessor",
    "enable_key_padding_mask",
    "disable_key_padding_mask",
]

MODEL = "HunyuanVideo15Transformer3DModel"
#: the stock processors this module replaces, by the kind of attention they serve
_STOCK = {"double": "HunyuanVideo15AttnProcessor2_0", "refiner": "AttnProcessor2_0"}


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, L, heads * d]`` -> ``[B, L, heads, d]``."""
    return x.unflatten(2, (heads, -1))


class HunyuanVideo15KeyPaddingAttnProcessor:
    """Joint attention of a HunyuanVideo-1.5 double-stream block (video tokens with RoPE, then the context tokens) with
    the context's padding mask as a key mask ``[B, 1, 1, L]`` (video keys always valid). ``stock``: the processor it
    replaced, put back by ``disable_key_padding_mask``."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, stock=None):
        self.stock = stock
        self._attention_backend = getattr(stock, "_attention_backend", None)
        self._parallel_config = getattr(stock, "_parallel_config", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.embeddings import apply_rotary_emb

        H = attn.heads
        # video stream: projections, per-head RMS norm of q and k, RoPE
        q = attn.norm_q(_heads(attn.to_q(hidden_states), H))
        k = attn.norm_k(_heads(attn.to_k(hidden_states), H))
        v = _heads(attn.to_v(hidden_states), H)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        n_video = q.shape[1]
        if encoder_hidden_states is not None:  # context stream: its own projections and norms, appended after
            cq = _heads(attn.add_q_proj(encoder_hidden_states), H)
            ck = _heads(attn.add_k_proj(encoder_hidden_states), H)
            cv = _heads(attn.add_v_proj(encoder_hidden_states), H)
            if attn.norm_added_q is not None:
                cq = attn.norm_added_q(cq)
            if attn.norm_added_k is not None:
                ck = attn.norm_added_k(ck)
            q, k, v = torch.cat([q, cq], dim=1), torch.cat([k, ck], dim=1), torch.cat([v, cv], dim=1)
        mask = None if attention_mask is None else self.key_mask(attention_mask, q.shape[0], q.shape[1])
        out = dispatch_attention_fn(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).to(q.dtype)
        if encoder_hidden_states is None:
            return out, None
        video, context = out[:, :n_video], out[:, n_video:]
        if getattr(attn, "to_out", None) is not None:
            video = attn.to_out[1](attn.to_out[0](video))
        if getattr(attn, "to_add_out", None) is not None:
            context = attn.to_add_out(context)
        return video, context

    @staticmethod
    def key_mask(attention_mask: torch.Tensor, batch: int, tokens: int) -> torch.Tensor:
        """The ``[B, 1, 1, tokens]`` bool key mask of a ``[B, n]`` padding mask of the last ``n`` (context) tokens;
        the tokens before them (video) are valid."""
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] > tokens:
            raise ValueError(
                f"HunyuanVideo-1.5 key-padding attention takes a [B, context tokens] padding mask for {batch} samples "
                f"of {tokens} tokens, got {list(attention_mask.shape)}"
            )
        context = attention_mask.to(torch.bool)
        video = context.new_ones(batch, tokens - context.shape[1])
        return torch.cat([video, context], dim=1)[:, None, None, :]


class HunyuanVideo15RefinerKeyPaddingAttnProcessor:
    """Self-attention of a HunyuanVideo-1.5 token refiner block on the prompt tokens, with the prompt's padding mask
    as a key mask ``[B, 1, 1, T]``. The refiner passes its dense ``[B, 1, T, T]`` mask ``m_i & m_j``, whose diagonal
    is ``m``; only that diagonal is read (no per-head copy of the dense mask is made). ``stock``: the processor it
    replaced."""

    def __init__(self, stock=None):
        self.stock = stock

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs):
        if encoder_hidden_states is not None:
            raise ValueError("the HunyuanVideo-1.5 token refiner's attention is self-attention (no context)")
        H = attn.heads
        q, k, v = (_heads(f(hidden_states), H).transpose(1, 2) for f in (attn.to_q, attn.to_k, attn.to_v))
        mask = None if attention_mask is None else self.key_mask(attention_mask, q.shape[0], q.shape[2])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).flatten(2).to(q.dtype)
        return attn.to_out[1](attn.to_out[0](out))

    @staticmethod
    def key_mask(attention_mask: torch.Tensor, batch: int, tokens: int) -> torch.Tensor:
        """``[B, 1, 1, T]``: the diagonal of the refiner's ``[B, 1, T, T]`` mask ``m_i & m_j``, which is ``m``."""
        if attention_mask.dim() != 4 or tuple(attention_mask.shape) != (batch, 1, tokens, tokens):
            raise ValueError(
                f"HunyuanVideo-1.5 token refiner attention takes the refiner's [B, 1, T, T] mask ({batch}, 1, "
                f"{tokens}, {tokens}), got {list(attention_mask.shape)}"
            )
        return attention_mask.diagonal(dim1=-2, dim2=-1).to(torch.bool).contiguous()[:, :, None, :]


_OURS = (HunyuanVideo15KeyPaddingAttnProcessor, HunyuanVideo15RefinerKeyPaddingAttnProcessor)


def _kind(name: str) -> str:
    if name.startswith("transformer_blocks."):
        return "double"
    if name.startswith("context_embedder.token_refiner."):
        return "refiner"
    raise ValueError(f"{MODEL}: unexpected attention module {name}; key-padding masks know its blocks and refiner")


def _refiner_attention_plain(attn, name: str) -> None:
    """The refiner processor computes what ``AttnProcessor2_0`` does for the refiner's ``Attention`` as diffusers
    builds it (no spatial / group / q-k norm, no residual, no output rescale); refuse any other."""
    odd = [
        n
        for n, bad in (
            ("spatial_norm", getattr(attn, "spatial_norm", None) is not None),
            ("group_norm", getattr(attn, "group_norm", None) is not None),
            ("norm_q", getattr(attn, "norm_q", None) is not None),
            ("norm_k", getattr(attn, "norm_k", None) is not None),
            ("residual_connection", bool(getattr(attn, "residual_connection", False))),
            ("rescale_output_factor", getattr(attn, "rescale_output_factor", 1.0) != 1.0),
        )
        if bad
    ]
    if odd:
        raise ValueError(f"{MODEL}: the refiner attention {name} has {', '.join(odd)}, which key-padding masks do not")


def enable_key_padding_mask(transformer):
    """Run a diffusers ``HunyuanVideo15Transformer3DModel`` (peft-wrapped or not) with key-padding masks in place of
    its dense ``[B, 1, L, L]`` attention masks: the double-stream blocks get ``HunyuanVideo15KeyPaddingAttnProcessor``,
    the token refiner ``HunyuanVideo15RefinerKeyPaddingAttnProcessor``. The transformer's output is the same (see the
    module docstring); a block's saved activations no longer grow with ``L^2``. Refuses (``ValueError``, one line)
    another model class and attention processors it does not know (it replaces only diffusers' stock ones). Calling it
    again is a no-op. Returns ``transformer``."""
    from .processors import _base

    model = _base(transformer)
    name = type(model).__name__
    if name != MODEL:
        raise ValueError(f"key-padding attention masks are implemented for {MODEL}, not {name}")
    procs = model.attn_processors
    new = {}
    for key, proc in procs.items():
        kind = _kind(key)
        if isinstance(proc, _OURS):
            new[key] = proc
            continue
        if type(proc).__name__ != _STOCK[kind]:
            raise ValueError(
                f"{MODEL}: attention processor {type(proc).__name__} at {key} is not diffusers' stock "
                f"{_STOCK[kind]}; key-padding masks replace only the stock processors"
            )
        if kind == "double":
            new[key] = HunyuanVideo15KeyPaddingAttnProcessor(proc)
        else:
            _refiner_attention_plain(model.get_submodule(key.rsplit(".", 1)[0]), key)
            new[key] = HunyuanVideo15RefinerKeyPaddingAttnProcessor(proc)
    model.set_attn_processor(new)
    return transformer


def disable_key_padding_mask(transformer):
    """Undo ``enable_key_padding_mask``: the processors it replaced."""
    from .processors import _base

    model = _base(transformer)
    model.set_attn_processor({k: (p.stock if isinstance(p, _OURS) else p) for k, p in model.attn_processors.items()})
    return transformer
