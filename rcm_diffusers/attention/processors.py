"""``enable_jvp_attention``: forward-mode AD through the attention of any diffusers transformer (docs/math.md §5),
and a float32 switch for the time embedding in JVP passes (docs/math.md §4.1).

The model keeps its stock attention processors. ``enable_jvp_attention`` wraps its ``forward``: a call whose inputs
carry a forward-mode tangent (the JVP pass of ``torch.func.jvp``) runs under ``JVPAttentionMode``
(``attention/sdpa.py``), which routes every ``scaled_dot_product_attention`` call with a tangent through our fused
kernel; any other call is the stock forward, untouched. One path for every model whose attention reaches PyTorch's
SDPA (diffusers' default "native" backend and its ``_native_*`` variants, and processors that call SDPA themselves);
attention written as plain matrix products (Sana's linear attention) has PyTorch's own forward-AD rule.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.utils._pytree import tree_leaves

from .function import has_tangent
from .sdpa import JVPAttentionMode

__all__ = ["enable_jvp_attention", "disable_jvp_attention", "time_embedding_fp32", "check_jvp_servable"]

WAN_TEXT_TOKENS = 512  # Wan I2V: the last 512 context tokens are text, the ones before are image

#: the time-embedding modules of diffusers' flow-matching transformers (LTX-2 has one per modality)
_TIME_EMBEDDING = (
    "condition_embedder",
    "time_text_embed",
    "time_guidance_embed",
    "time_condition_embed",
    "time_embed",
    "audio_time_embed",
    "t_embedder",
    "time_step_embed",
    "time_caption_embed",
    "time_embedding",  # ERNIE-Image, EasyAnimate
    "timestep_embedder",  # Ovis-Image
    "time_in",  # PRX
    "time_embeddings",  # Kandinsky 5
    "to_timestep_embed",  # Stable Audio 3
)

#: diffusers attention backends whose attention is a torch ``scaled_dot_product_attention`` call (the others run
#: kernels without a forward-mode rule: flash-attn, sage, xformers, flex, NPU / XLA ops)
SDPA_BACKENDS = ("native", "_native_math", "_native_efficient", "_native_flash", "_native_cudnn")
#: attention processors that call kernels without a forward-mode rule instead of SDPA
_FOREIGN_PROCESSORS = ("XFormers", "Flash", "Sage", "NPU", "XLA", "Flex")


def _base(transformer):
    from ..models import _base_model

    return _base_model(transformer)


def _parts(transformer) -> list:
    """The diffusers models behind ``transformer``: both experts of a ``WanExpertSwitch``, else the one model."""
    model = _base(transformer)
    experts = getattr(model, "experts", None)  # duck-typed: the switch lives with the trainer (distill.experts)
    return list(experts.values()) if isinstance(experts, dict) else [model]


def _backend_name(backend) -> str | None:
    return None if backend is None else str(getattr(backend, "value", backend))


def _active_backend() -> str | None:
    """diffusers' active attention backend (``attention_backend(...)``, ``DIFFUSERS_ATTN_BACKEND``), if it has one."""
    try:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    except ImportError:
        return None
    return _backend_name(getattr(_AttentionBackendRegistry, "_active_backend", None))


def check_jvp_servable(model) -> None:
    """Refuse (``ValueError``, one line) a model the JVP attention cannot run: not a ``torch.nn.Module``, or an
    attention whose kernel has no forward-mode rule (a non-SDPA diffusers attention backend, an xformers / flash /
    sage processor). Checked at ``enable_jvp_attention`` and, for the global backend, at each JVP pass."""
    name = type(model).__name__
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"JVP attention needs a torch.nn.Module (a diffusers transformer), got {name}")
    for sub_name, sub in model.named_modules():
        proc = getattr(sub, "processor", None)
        if proc is None:
            continue
        pname = type(proc).__name__
        backend = _backend_name(getattr(proc, "_attention_backend", None))
        if backend is not None and backend not in SDPA_BACKENDS:
            raise ValueError(
                f"{name}: attention backend {backend!r} at {sub_name} has no forward-mode rule; JVP attention "
                f"runs through torch's scaled_dot_product_attention: call {name}.reset_attention_backend() "
                f"or set_attention_backend('native')"
            )
        if any(tag in pname for tag in _FOREIGN_PROCESSORS):
            raise ValueError(
                f"{name}: attention processor {pname} at {sub_name} calls a kernel without a forward-mode "
                f"rule; JVP attention runs through torch's scaled_dot_product_attention: use the model's "
                f"default processors"
            )
    _check_active_backend(name)


def _check_active_backend(name: str) -> None:
    backend = _active_backend()
    if backend is not None and backend not in SDPA_BACKENDS:
        raise ValueError(
            f"{name}: diffusers' active attention backend is {backend!r}, which has no forward-mode rule; "
            f"JVP attention runs through torch's scaled_dot_product_attention: use 'native' for the JVP "
            f"pass (diffusers.attention_backend('native'), or unset DIFFUSERS_ATTN_BACKEND)"
        )


def _wan_i2v_inputs(model, args, kwargs) -> None:
    """diffusers' Wan I2V attention takes the last 512 context tokens as text and the ones before as image tokens;
    any other text length would silently mix them."""
    image = kwargs.get("encoder_hidden_states_image")
    text = kwargs.get("encoder_hidden_states", args[2] if len(args) > 2 else None)
    if image is not None and text is not None and text.shape[1] != WAN_TEXT_TOKENS:
        raise ValueError(
            f"Wan I2V attention takes the last {WAN_TEXT_TOKENS} context tokens as text and the ones before "
            f"as image tokens (as diffusers' WanAttnProcessor), but the text has {text.shape[1]} tokens: "
            f"encode prompts padded to max_sequence_length={WAN_TEXT_TOKENS} (the WanPipeline default)"
        )


def _hidream_moe(model) -> None:
    """HiDream's mixture-of-experts layers route eval-mode tokens through ``moe_infer`` (no_grad, NumPy indices), which
    no JVP can pass; their training-mode routing computes the same outputs differentiably."""
    if any(hasattr(m, "moe_infer") and not m.training for m in model.modules()):
        raise ValueError(
            f"{type(model).__name__}: the mixture-of-experts layers in eval() mode route tokens through "
            "moe_infer (no_grad, NumPy indices), which a JVP cannot pass; call model.train() for the JVP "
            "pass (training-mode routing computes the same outputs)"
        )


_INPUT_CHECKS = {"WanTransformer3DModel": _wan_i2v_inputs}
_JVP_CHECKS = {"HiDreamImageTransformer2DModel": _hidream_moe}


def enable_jvp_attention(transformer, backend: str = "auto", fp32_time_embedding: bool = True):
    """Make ``torch.func.jvp`` run through ``transformer`` (any diffusers transformer; peft-wrapped, or a two-expert
    switch: every expert), docs/math.md §5: each forward whose inputs carry a tangent routes every SDPA call through the
    fused JVP kernel (``backend``: ``"auto"``, ``"triton"``, ``"torch"``); other calls are the stock forward. With
    ``fp32_time_embedding`` the time embedding runs in float32 whenever its input carries a tangent (docs/math.md §4.1).
    A model it cannot serve is refused in one line (``check_jvp_servable``). Returns ``transformer``."""
    for model in _parts(transformer):
        check_jvp_servable(model)
        _install_forward(model, backend)
        if fp32_time_embedding:
            _install_fp32(model, jvp_only=True)
    return transformer


def _install_forward(model, backend: str) -> None:
    if "_rcm_jvp" in model.__dict__:
        model._rcm_jvp["backend"] = backend
        return
    state = {"backend": backend}
    stock = model.forward
    check = _INPUT_CHECKS.get(type(model).__name__)
    jvp_check = _JVP_CHECKS.get(type(model).__name__)
    name = type(model).__name__

    def forward(*args, **kwargs):
        if check is not None:
            check(model, args, kwargs)
        if not has_tangent(*[x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]):
            return stock(*args, **kwargs)
        _check_active_backend(name)
        if jvp_check is not None:
            jvp_check(model)
        with JVPAttentionMode(state["backend"]):
            return stock(*args, **kwargs)

    model.forward = forward
    model._rcm_jvp = state


def disable_jvp_attention(transformer):
    """Undo ``enable_jvp_attention``: the stock forward and the stock time embedding."""
    for model in _parts(transformer):
        if "_rcm_jvp" in model.__dict__:
            del model.forward, model._rcm_jvp
        _remove_fp32(model)
    return transformer


def _time_embeddings(model, required: bool) -> list:
    found = [getattr(model, n) for n in _TIME_EMBEDDING if isinstance(getattr(model, n, None), torch.nn.Module)]
    if not found and required:
        raise ValueError(f"{type(model).__name__} has none of the time-embedding modules {_TIME_EMBEDDING}")
    return found


def _install_fp32(model, jvp_only: bool):
    """Replace the time embedding's forward by one that runs with float32 weights, autocast off,
    and casts floating outputs back to the weights' dtype; ``jvp_only``: only when an input has a tangent."""
    modules = _time_embeddings(model, required=not jvp_only)
    if not modules:
        warnings.warn(
            f"{type(model).__name__}: no time-embedding module among {_TIME_EMBEDDING}; its time embedding "
            "keeps the model's dtype in JVP passes",
            stacklevel=3,
        )
    for module in modules:
        _install_fp32_module(module, jvp_only)


def _install_fp32_module(module, jvp_only: bool):
    if "_rcm_fp32" in module.__dict__:
        module._rcm_fp32["jvp_only"] = jvp_only
        return
    state = {"jvp_only": jvp_only, "inside": False}
    stock_forward = module.forward

    def forward(*args, **kwargs):
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        # the model dtype: diffusers may keep parts (Wan's time_embedder) in float32 already
        dtype = next((p.dtype for p in module.parameters() if p.dtype != torch.float32), torch.float32)
        low = dtype in (torch.bfloat16, torch.float16)  # float32 / float64 models: nothing to widen
        if state["inside"] or not low or not tensors or (state["jvp_only"] and not has_tangent(*tensors)):
            return stock_forward(*args, **kwargs)

        def up(x):
            return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        weights = {n: up(p) for n, p in module.named_parameters()}
        weights.update({n: up(b) for n, b in module.named_buffers()})
        state["inside"] = True
        try:
            with torch.autocast(tensors[0].device.type, enabled=False):
                out = torch.func.functional_call(
                    module, weights, tuple(up(a) for a in args), {k: up(v) for k, v in kwargs.items()}
                )
        finally:
            state["inside"] = False

        def down(x):
            return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        return tuple(down(o) for o in out) if isinstance(out, tuple) else down(out)

    module.forward = forward
    module._rcm_fp32 = state


def _remove_fp32(model):
    for module in _time_embeddings(model, required=False):
        if "_rcm_fp32" in module.__dict__:
            del module.forward, module._rcm_fp32


@contextlib.contextmanager
def time_embedding_fp32(transformer):
    """Within the block every call of the transformer's time embedding runs in float32 (docs/math.md §4.1),
    e.g. for the finite-difference passes of ``fd_type`` 1 and 2, which carry no tangent."""
    saved = []
    for model in _parts(transformer):
        for module in _time_embeddings(model, required=True):
            saved.append((module, dict(module._rcm_fp32) if "_rcm_fp32" in module.__dict__ else None))
            _install_fp32_module(module, jvp_only=False)
    try:
        yield transformer
    finally:
        for module, before in saved:
            if before is None:
                del module.forward, module._rcm_fp32
            else:
                module._rcm_fp32.update(before)
