"""diffusers attention processors for Wan and Flux whose attention has a forward-AD rule (docs/math.md §5),
and a float32 switch for the time embedding in JVP passes (docs/math.md §4.1).

Outside a JVP pass each processor calls diffusers' ``dispatch_attention_fn`` with the same
arguments as the stock processor, so outputs and gradients are the stock ones. When the query,
key or value carries a forward-mode tangent, attention goes through ``attention`` (one fused
primal + tangent pass). ``enable_jvp_attention`` / ``disable_jvp_attention`` swap them in and out.
"""

from __future__ import annotations

import contextlib

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb as _flux_rotary
from diffusers.models.transformers import transformer_flux, transformer_wan

from .function import attention, has_tangent

__all__ = [
    "WanJVPAttnProcessor",
    "FluxJVPAttnProcessor",
    "enable_jvp_attention",
    "disable_jvp_attention",
    "time_embedding_fp32",
]

WAN_TEXT_TOKENS = 512  # Wan I2V: the last 512 context tokens are text, the ones before are image


class _JVPAttend:
    """Route one attention call: stock dispatch without tangents, fused JVP attention with them."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, backend: str = "auto", stock=None):
        self.backend = backend
        self.stock = stock  # the processor this one replaced, put back by disable_jvp_attention
        if stock is not None:
            self._attention_backend = getattr(stock, "_attention_backend", None)
            self._parallel_config = getattr(stock, "_parallel_config", None)

    def _attend(self, q, k, v, attn_mask=None, parallel_config=None):
        if not has_tangent(q, k, v):
            return dispatch_attention_fn(
                q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False,
                backend=self._attention_backend, parallel_config=parallel_config,
            )
        if attn_mask is not None:
            raise ValueError("JVP attention takes no attention mask; Wan and Flux call attention without one")
        if parallel_config is not None:
            raise NotImplementedError("JVP attention under context parallelism is not implemented (docs/math.md §5, Ulysses)")
        return attention(q, k, v, backend=self.backend)


def _wan_rotary(x, freqs_cos, freqs_sin):
    """Wan RoPE on interleaved pairs ``(x[2i], x[2i+1])``: rotate each by the angle of its frequency."""
    x_even, x_odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class WanJVPAttnProcessor(_JVPAttend):
    """Wan attention (self-attn with RoPE, text cross-attn, I2V image-context branch) with a JVP rule.

    Same computation as diffusers' ``WanAttnProcessor``; attention by ``_attend`` (docs/math.md §5).
    """

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        context_img = None
        if attn.add_k_proj is not None:  # I2V: split image tokens off the front of the context
            n_img = encoder_hidden_states.shape[1] - WAN_TEXT_TOKENS
            if n_img <= 0:  # the stock processor would silently take text tokens for image tokens
                raise ValueError(f"Wan I2V attention takes the last {WAN_TEXT_TOKENS} context tokens as text and the ones before as "
                                 f"image tokens (as diffusers' WanAttnProcessor), but the context has {encoder_hidden_states.shape[1]} "
                                 f"tokens: encode prompts padded to max_sequence_length={WAN_TEXT_TOKENS} (the WanPipeline default)")
            context_img = encoder_hidden_states[:, :n_img]
            encoder_hidden_states = encoder_hidden_states[:, n_img:]

        q, k, v = transformer_wan._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (x.unflatten(2, (attn.heads, -1)) for x in (q, k, v))
        if rotary_emb is not None:
            q, k = _wan_rotary(q, *rotary_emb), _wan_rotary(k, *rotary_emb)

        out_img = None
        if context_img is not None:
            k_img, v_img = transformer_wan._get_added_kv_projections(attn, context_img)
            k_img = attn.norm_added_k(k_img).unflatten(2, (attn.heads, -1))
            v_img = v_img.unflatten(2, (attn.heads, -1))
            out_img = self._attend(q, k_img, v_img).flatten(2, 3).type_as(q)

        parallel = self._parallel_config if encoder_hidden_states is None else None
        group = getattr(self, "cp_group", None) if encoder_hidden_states is None else None
        if group is not None:  # Ulysses (attention/ulysses.py installs cp_group and its all_to_all as cp_exchange):
            a2a = self.cp_exchange  # token shards -> head shards, attend, and back
            q, k, v = (a2a(x, group, 2, 1) for x in (q, k, v))
            out = a2a(self._attend(q, k, v, attention_mask, parallel), group, 1, 2).flatten(2, 3).type_as(q)
        else:
            out = self._attend(q, k, v, attention_mask, parallel).flatten(2, 3).type_as(q)
        if out_img is not None:
            out = out + out_img
        return attn.to_out[1](attn.to_out[0](out))


class FluxJVPAttnProcessor(_JVPAttend):
    """Flux attention (joint text+image blocks and single blocks, RoPE) with a JVP rule.

    Same computation as diffusers' ``FluxAttnProcessor``; attention by ``_attend`` (docs/math.md §5).
    """

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        q, k, v, eq, ek, ev = transformer_flux._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        q, k, v = (x.unflatten(-1, (-1, attn.head_dim)) for x in (q, k, v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if attn.added_kv_proj_dim is not None:  # joint block: text tokens first, then image tokens
            eq, ek, ev = (x.unflatten(-1, (-1, attn.head_dim)) for x in (eq, ek, ev))
            eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
            q, k, v = torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1), torch.cat([ev, v], dim=1)
        if image_rotary_emb is not None:
            q = _flux_rotary(q, image_rotary_emb, sequence_dim=1)
            k = _flux_rotary(k, image_rotary_emb, sequence_dim=1)

        out = self._attend(q, k, v, attention_mask, self._parallel_config).flatten(2, 3).to(q.dtype)
        if encoder_hidden_states is None:
            return out
        n_txt = encoder_hidden_states.shape[1]
        txt, img = out[:, :n_txt], out[:, n_txt:]
        img = attn.to_out[1](attn.to_out[0](img.contiguous()))
        return img, attn.to_add_out(txt.contiguous())


_JVP_PROCESSOR_FOR = {"WanAttnProcessor": WanJVPAttnProcessor, "FluxAttnProcessor": FluxJVPAttnProcessor}
_TIME_EMBEDDING = ("condition_embedder", "time_text_embed")  # Wan, Flux


def _base(transformer):
    from ..models import _base_model

    return _base_model(transformer)


def _parts(transformer) -> list:
    """The diffusers models behind ``transformer``: both experts of a ``WanExpertSwitch``, else the one model."""
    model = _base(transformer)
    experts = getattr(model, "experts", None)  # duck-typed: the switch lives with the trainer (distill.experts)
    return list(experts.values()) if isinstance(experts, dict) else [model]


def enable_jvp_attention(transformer, backend: str = "auto", fp32_time_embedding: bool = True):
    """Install ``WanJVPAttnProcessor`` / ``FluxJVPAttnProcessor`` on every attention of ``transformer``
    so ``torch.func.jvp`` runs through it (docs/math.md §5); with ``fp32_time_embedding`` the time embedding
    runs in float32 whenever its input carries a tangent (docs/math.md §4.1). Returns ``transformer``."""
    for model in _parts(transformer):
        _enable(model, backend, fp32_time_embedding)
    return transformer


def _enable(model, backend: str, fp32_time_embedding: bool) -> None:
    new = {}
    for name, proc in model.attn_processors.items():
        if isinstance(proc, _JVPAttend):
            proc.backend = backend
            new[name] = proc
            continue
        cls = _JVP_PROCESSOR_FOR.get(type(proc).__name__)
        if cls is None:
            raise ValueError(
                f"no JVP processor for {type(proc).__name__} at {name}; supported: {sorted(_JVP_PROCESSOR_FOR)}"
            )
        new[name] = cls(backend, stock=proc)
    model.set_attn_processor(new)
    if fp32_time_embedding:
        _install_fp32(model, jvp_only=True)


def disable_jvp_attention(transformer):
    """Put back the processors ``enable_jvp_attention`` replaced and the stock time embedding."""
    for model in _parts(transformer):
        procs = {n: (p.stock if isinstance(p, _JVPAttend) and p.stock is not None else p) for n, p in model.attn_processors.items()}
        model.set_attn_processor(procs)
        _remove_fp32(model)
    return transformer


def _time_embedding(model):
    for name in _TIME_EMBEDDING:
        if isinstance(getattr(model, name, None), torch.nn.Module):
            return getattr(model, name)
    raise ValueError(f"{type(model).__name__} has none of the time-embedding modules {_TIME_EMBEDDING}")


def _install_fp32(model, jvp_only: bool):
    """Replace the time embedding's forward by one that runs with float32 weights, autocast off,
    and casts floating outputs back to the weights' dtype; ``jvp_only``: only when an input has a tangent."""
    module = _time_embedding(model)
    if "_rcm_fp32" in module.__dict__:
        module._rcm_fp32["jvp_only"] = jvp_only
        return
    state = {"jvp_only": jvp_only, "inside": False}
    stock_forward = module.forward

    def forward(*args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        # the model dtype: diffusers may keep parts (Wan's time_embedder) in float32 already
        dtype = next((p.dtype for p in module.parameters() if p.dtype != torch.float32), torch.float32)
        if state["inside"] or dtype == torch.float32 or (state["jvp_only"] and not has_tangent(*tensors)):
            return stock_forward(*args, **kwargs)

        def up(x):
            return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        weights = {n: up(p) for n, p in module.named_parameters()}
        weights.update({n: up(b) for n, b in module.named_buffers()})
        state["inside"] = True
        try:
            with torch.autocast(tensors[0].device.type, enabled=False):
                out = torch.func.functional_call(module, weights, tuple(up(a) for a in args), {k: up(v) for k, v in kwargs.items()})
        finally:
            state["inside"] = False

        def down(x):
            return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        return tuple(down(o) for o in out) if isinstance(out, tuple) else down(out)

    module.forward = forward
    module._rcm_fp32 = state


def _remove_fp32(model):
    module = _time_embedding(model)
    if "_rcm_fp32" in module.__dict__:
        del module.forward, module._rcm_fp32


@contextlib.contextmanager
def time_embedding_fp32(transformer):
    """Within the block every call of the transformer's time embedding runs in float32 (docs/math.md §4.1),
    e.g. for the finite-difference passes of ``fd_type`` 1 and 2, which carry no tangent."""
    saved = []
    for model in _parts(transformer):
        module = _time_embedding(model)
        saved.append((model, module, dict(module._rcm_fp32) if "_rcm_fp32" in module.__dict__ else None))
        _install_fp32(model, jvp_only=False)
    try:
        yield transformer
    finally:
        for model, module, before in saved:
            if before is None:
                _remove_fp32(model)
            else:
                module._rcm_fp32.update(before)
