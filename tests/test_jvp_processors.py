"""JVP through unmodified tiny diffusers transformers with ``enable_jvp_attention`` (docs/math.md §5), for every model
of the pipeline table (tests/flow_models.py) at the inputs its own pipeline gives it (RoPE ids, joint text / image
layouts, and text masks with padded tokens for the models in ``MASKED``; the others attend without a mask): against
forward AD through the float64 model with math SDPA, and against central differences in float64. Stock equality
outside JVP passes; refusals in one line; the float32 time-embedding switch (§4.1)."""

import copy
import inspect
import warnings

import pytest
import torch
from flow_models import CASES, case, record_inputs
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_leaves, tree_map

from rcm_diffusers.attention import (
    JVPAttentionMode,
    check_jvp_servable,
    disable_jvp_attention,
    enable_jvp_attention,
    time_embedding_fp32,
)
from rcm_diffusers.attention.function import STATS, has_tangent

WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=32,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)
# every transformer class of the table once (Wan 2.2's experts are Wan 2.1's class, SD3 PAG runs SD3's), plus Wan
# I2V's image branch
MODELS = [c.name for c in CASES if c.name not in ("Wan 2.2", "SD3 PAG")] + ["Wan 2.1 I2V"]


def _get(args, kwargs, key):
    return kwargs[key] if isinstance(key, str) else args[key]


def _put(args, kwargs, key, value):
    if isinstance(key, str):
        kwargs[key] = value
    else:
        args[key] = value


def _wan_i2v():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**WAN, image_dim=8, added_kv_proj_dim=24).eval()
    g = torch.Generator().manual_seed(1)
    kwargs = dict(
        hidden_states=torch.randn(1, 4, 2, 4, 4, generator=g),
        timestep=torch.tensor([400.0]),
        encoder_hidden_states=torch.randn(1, 512, 16, generator=g),  # the last 512 context tokens are text
        encoder_hidden_states_image=torch.randn(1, 3, 8, generator=g),
    )
    return model, (), kwargs, "hidden_states", "timestep", False


_CACHE = {}


def make_case(name):
    """``(model, call(model, x, t) -> flat output, x, t)`` at the first transformer call of the case's pipeline."""
    if name not in _CACHE:
        if name == "Wan 2.1 I2V":
            _CACHE[name] = _wan_i2v()
        else:
            c = case(name)
            if not c.available:
                pytest.skip(f"diffusers without {c.pipeline}")
            model, args, kwargs = record_inputs(c)
            # HiDream's eval-mode expert routing is not differentiable (refused, see below); training mode: same outputs
            model.train(name == "HiDream")
            _CACHE[name] = (model, args, kwargs, c.x_arg, c.t_arg, c.list_x)
    model, args, kwargs, x_key, t_key, list_x = _CACHE[name]
    model = copy.deepcopy(model)
    x, t = _get(args, kwargs, x_key), _get(args, kwargs, t_key)
    x = torch.stack(x) if list_x else x
    takes_return_dict = "return_dict" in inspect.signature(model.forward).parameters

    def call(m, x_, t_):
        dtype = max((p.dtype for p in m.parameters()), key=lambda d: torch.finfo(d).bits)  # see FLOAT32_MODULES
        a, k = tree_map(
            lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v,
            (list(args), dict(kwargs)),
        )
        _put(a, k, x_key, list(x_.unbind(0)) if list_x else x_)
        _put(a, k, t_key, t_)
        if takes_return_dict:
            k["return_dict"] = False
        out = m(*a, **k)
        return torch.cat(
            [o.reshape(-1) for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.is_floating_point()]
        )

    return model, call, x.float(), t.float()


def tangents(x, t, seed=2):
    """A random x tangent; a t tangent of 0.3 t, or 0.3 where the model takes a time near 0 (Z-Image and Lumina 2 take
    1 - r, 0.012 at the first rCM step)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(x.shape, generator=g), 0.3 * torch.where(t.abs() < 0.5, torch.ones_like(t), t)


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


#: models whose pipeline inputs (padded text) make their JVP pass attend under a mask that masks some keys
MASKED = {
    "Qwen-Image",
    "Chroma",
    "SanaVideo",
    "HunyuanVideo-1.5",
    "HunyuanVideo",
    "LTX-Video",
    "Krea 2",
    "NucleusMoE-Image",
    "HunyuanImage-2.1",
    "Lumina-Next",
    "PRX",
    "Sana PAG",
    "Qwen-Image 2.1",
    "PRX pixel",
}

#: submodules that cast their input to float32 themselves (Kandinsky 5's time embedding feeds ``time.float()`` to its
#: Linear layers): the float64 model keeps them in float32, their output cast to float64
FLOAT32_MODULES = {"Kandinsky 5 T2I": ["time_embeddings"], "Kandinsky 5 T2V": ["time_embeddings"]}


def as_float64(model, name):
    """``model.double()``, but for the ``FLOAT32_MODULES`` of case ``name``."""
    model = model.double()
    for path in FLOAT32_MODULES.get(name, []):
        sub = model.get_submodule(path).float()
        sub.register_forward_hook(lambda _m, _args, out: out.double())
    return model


class CountSDPA(torch.overrides.TorchFunctionMode):
    """Counts PyTorch SDPA calls (whichever code calls them), those whose inputs carry a tangent, and of these the ones
    under a mask that masks some key."""

    def __init__(self):
        super().__init__()
        self.calls = self.with_tangent = self.masked = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            bound = {**dict(zip(("query", "key", "value", "attn_mask"), args)), **(kwargs or {})}
            self.calls += 1
            if has_tangent(bound["query"], bound["key"], bound["value"]):
                self.with_tangent += 1
                m = bound.get("attn_mask")
                self.masked += m is not None and bool((~m).any() if m.dtype == torch.bool else (m < -1e3).any())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", MODELS)
def test_jvp_matches_forward_ad_through_math_sdpa_in_float64(name):
    """The tangent of the whole model, in x and t at once, against ``torch.func.jvp`` of the float64 model with the
    stock attention on the math SDPA backend (the reference that holds the score matrix). Ours runs in float32; the
    same stock forward AD in float32 sets the round-off scale: ours is within 2 times its error plus 1e-6 of the
    largest entry (measured: ours / float32 math at most 1.32). Every SDPA call that carries a tangent took the fused
    kernel."""
    model, call, x, t = make_case(name)
    dx, dt = tangents(x, t)
    ref = as_float64(copy.deepcopy(model), name)
    with sdpa_kernel(SDPBackend.MATH):
        with CountSDPA() as count:
            y_r, ty_r = torch.func.jvp(
                lambda a, b: call(ref, a, b), (x.double(), t.double()), (dx.double(), dt.double())
            )
        y_32, ty_32 = torch.func.jvp(lambda a, b: call(copy.deepcopy(model), a, b), (x, t), (dx, dt))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enable_jvp_attention(model)
    # the float32 time-embedding switch (§4.1) finds the model's time embedding
    assert not [w for w in caught if "no time-embedding module" in str(w.message)]
    calls = STATS["fused_calls"]
    y, ty = torch.func.jvp(lambda a, b: call(model, a, b), (x, t), (dx, dt))
    assert STATS["fused_calls"] - calls == count.with_tangent > 0
    assert (count.masked > 0) == (name in MASKED)  # with and without masks
    for ours, f32, want in ((y, y_32, y_r), (ty, ty_32, ty_r)):
        assert rel(ours, want) <= 2 * rel(f32, want) + 1e-6, (rel(ours, want), rel(f32, want))
    assert ty.abs().max() > 1e-3


# Central differences of the float64 models carry the float32 round-off of what the models compute in float32 inside
# (norms, RoPE, the sinusoidal time embedding) divided by the step, on top of the O(h^2) truncation. Bound:
#   max |tangent - difference quotient| <= rtol max |tangent| + 8 u max |output| / h,   u = 2^-24 (float32 round-off)
# x (step 1e-3): rtol 1e-4 for the truncation (measured: every error within the round-off term). t (step 1e-4 of a
# tangent 0.3 t, or 0.3 near 0): the time embedding takes sin / cos of 1000 t in float32, whose argument is rounded to
# 6.1e-5 (the float32 spacing at 1000); differenced over 2 x 1e-4 x 0.3 x 1000 = 0.06 that is 1e-3 of the embedding's
# derivative: rtol 5e-3 (measured: at most 8.9e-4 beyond the round-off term; every error at most 0.24 of its bound).
FD_STEPS = {"x": (1e-3, 1e-4), "t": (1e-4, 5e-3)}
U32 = 2.0**-24


#: (model, tangent) pairs whose float64 difference quotient measures round-off inside the model, not a derivative;
#: their forward-AD check above still runs
_KANDINSKY = "its attention rounds the RoPE-rotated q and k to bfloat16, whatever the model's dtype"
NO_CENTRAL_DIFFERENCES = {
    ("Kandinsky 5 T2I", "x"): _KANDINSKY,
    ("Kandinsky 5 T2I", "t"): _KANDINSKY,
    ("Kandinsky 5 T2V", "x"): _KANDINSKY,
    ("Kandinsky 5 T2V", "t"): _KANDINSKY,
    # a step small enough for 1e4 cycles (truncation) sees the float32 rounding of the phase (4e-3 at 2 pi 1e4)
    ("Stable Audio 3", "t"): "its time features run up to 1e4 cycles per unit time, their phase computed in float32",
}


def test_models_without_central_differences_round_inside():
    """The reasons of NO_CENTRAL_DIFFERENCES, in the stock code: Kandinsky 5's RoPE returns bfloat16, Stable Audio 3's
    time features take float32 phases up to 2 pi 1e4 t. Fails once diffusers changes them, to put the checks back."""
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5AttnProcessor
    from diffusers.models.transformers.transformer_stable_audio3 import StableAudio3ExpoFourierFeatures

    assert "return x_out.reshape(*x.shape).to(torch.bfloat16)" in inspect.getsource(Kandinsky5AttnProcessor.__call__)
    assert "args = timestep.float() * freqs" in inspect.getsource(StableAudio3ExpoFourierFeatures.forward)
    assert StableAudio3ExpoFourierFeatures(16).max_freq == 10000.0
    assert {name for name, _ in NO_CENTRAL_DIFFERENCES} == {
        c.name for c in CASES if c.pipeline.startswith(("Kandinsky5", "StableAudio3"))
    }


@pytest.mark.parametrize("name", [n for n in MODELS if (n, "x") not in NO_CENTRAL_DIFFERENCES])
def test_jvp_matches_central_differences_in_float64(name):
    """x-tangent and t-tangent separately against central differences of the float64 model (FD_STEPS), but for the
    pairs of NO_CENTRAL_DIFFERENCES."""
    model, call, x, t = make_case(name)
    model = enable_jvp_attention(as_float64(model, name))
    x, t = x.double(), t.double()
    dx, dt = (v.double() for v in tangents(x, t))
    with torch.no_grad():
        scale = call(model, x, t).abs().max()
    checked = 0
    for wrt, tx, tt in (("x", dx, torch.zeros_like(dt)), ("t", torch.zeros_like(dx), dt)):
        if (name, wrt) in NO_CENTRAL_DIFFERENCES:
            continue
        checked += 1
        h, rtol = FD_STEPS[wrt]
        _, ty = torch.func.jvp(lambda a, b: call(model, a, b), (x, t), (tx, tt))
        with torch.no_grad():
            fd = (call(model, x + h * tx, t + h * tt) - call(model, x - h * tx, t - h * tt)) / (2 * h)
        err, bound = (ty - fd).abs().max(), rtol * ty.abs().max() + 8 * U32 * scale / h
        assert ty.abs().max() > 1e-3 * scale  # the tangent is not lost in the round-off term
        assert err <= bound, (name, wrt, float(err), float(bound))
    assert checked > 0


@pytest.mark.parametrize("name", ["Wan 2.1", "FLUX.1", "Qwen-Image"])
def test_same_outputs_and_grads_as_stock_outside_jvp(name):
    stock, call, x, _t = make_case(name)
    t = _t
    ours = enable_jvp_attention(copy.deepcopy(stock))
    results = []
    for m in (stock, ours):
        xg = x.clone().requires_grad_()
        y = call(m, xg, t)
        (y * torch.linspace(-1, 1, y.numel())).sum().backward()
        results.append((y.detach(), xg.grad, [p.grad for p in m.parameters()]))
    (y_s, gx_s, gp_s), (y_o, gx_o, gp_o) = results
    # the stock forward runs unchanged: bit for bit
    assert torch.equal(y_o, y_s) and torch.equal(gx_o, gx_s)
    assert all(torch.equal(a, b) for a, b in zip(gp_o, gp_s) if a is not None)
    assert sum(a is not None for a in gp_o) == sum(b is not None for b in gp_s) > 10


def test_enable_disable_round_trip():
    model, call, x, t = make_case("FLUX.1")
    procs = {n: type(p) for n, p in model.attn_processors.items()}
    with torch.no_grad():
        y0 = call(model, x, t)
        enable_jvp_attention(model)
        enable_jvp_attention(model, backend="torch")  # idempotent: one wrapper, the backend updated
        assert model._rcm_jvp["backend"] == "torch"
        assert {n: type(p) for n, p in model.attn_processors.items()} == procs  # the stock processors stay
        disable_jvp_attention(model)
        assert "forward" not in model.__dict__ and "forward" not in model.time_text_embed.__dict__
        assert torch.equal(call(model, x, t), y0)


def test_models_it_cannot_serve_are_refused_in_one_line():
    from diffusers.models.attention_dispatch import attention_backend
    from diffusers.models.attention_processor import XFormersAttnProcessor

    model, call, x, t = make_case("Wan 2.1")
    with pytest.raises(ValueError, match=r"needs a torch.nn.Module .*, got dict"):
        check_jvp_servable({})
    m = copy.deepcopy(model)
    for (
        proc
    ) in m.attn_processors.values():  # as set_attention_backend("flash") leaves them (flash-attn not needed here)
        proc._attention_backend = "flash"
    with pytest.raises(
        ValueError,
        match=r"attention backend 'flash' at blocks.0.attn1 has no forward-mode rule.*"
        r"reset_attention_backend\(\)",
    ) as e:
        enable_jvp_attention(m)
    assert "\n" not in str(e.value)
    sd3, *_ = make_case("SD3")
    sd3.set_attn_processor(XFormersAttnProcessor())
    with pytest.raises(ValueError, match="XFormersAttnProcessor at .* calls a kernel without a forward-mode rule"):
        enable_jvp_attention(sd3)
    # the global backend is checked at each JVP pass
    enable_jvp_attention(model)
    dx, dt = tangents(x, t)
    with attention_backend("_native_math"):  # an SDPA backend: served
        torch.func.jvp(lambda a, b: call(model, a, b), (x, t), (dx, dt))
    from diffusers.models import attention_dispatch as D

    active = D._AttentionBackendRegistry._active_backend
    D._AttentionBackendRegistry._active_backend = D.AttentionBackendName("flash")
    try:
        with pytest.raises(ValueError, match="active attention backend is 'flash'"):
            torch.func.jvp(lambda a, b: call(model, a, b), (x, t), (dx, dt))
    finally:
        D._AttentionBackendRegistry._active_backend = active


def test_wan_i2v_text_of_other_than_512_tokens_is_refused():
    model, *_ = make_case("Wan 2.1 I2V")
    enable_jvp_attention(model)
    x = torch.randn(1, 4, 1, 4, 4)
    with pytest.raises(ValueError, match="max_sequence_length=512"):
        model(
            hidden_states=x,
            timestep=torch.tensor([500.0]),
            encoder_hidden_states=torch.randn(1, 6, 16),
            encoder_hidden_states_image=torch.randn(1, 3, 8),
            return_dict=False,
        )


def test_mode_intercepts_only_calls_with_tangents():
    model, call, x, t = make_case("Z-Image")  # its caption refiner attends without a tangent
    with JVPAttentionMode() as mode:
        with torch.no_grad():
            call(model, x, t)
        assert mode.calls == 0
        with CountSDPA() as count:
            torch.func.jvp(lambda a: call(model, a, t), (x,), (torch.ones_like(x),))
    assert mode.calls == count.with_tangent > 0 and count.calls > count.with_tangent


def test_hidream_eval_mode_experts_are_refused_in_one_line():
    model, call, x, t = make_case("HiDream")
    enable_jvp_attention(model.eval())
    with pytest.raises(ValueError, match=r"eval\(\) mode route tokens through moe_infer .* call model.train\(\)"):
        torch.func.jvp(lambda a: call(model, a, t), (x,), (torch.ones_like(x),))


def _embed(model, t, text):
    dtype = next(model.parameters()).dtype
    return model.condition_embedder(t, text.to(dtype))[:2]  # temb, timestep_proj


def test_time_embedding_runs_in_float32_during_jvp():
    """bf16 Wan: with the switch, the time embedding (value and t-tangent) is the float32 computation
    with the bf16 weights, rounded to bf16 once at the end; without it, it is the bf16 computation."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**{**WAN, "num_layers": 1}).to(torch.bfloat16)
    ref = copy.deepcopy(model).float()  # same (bf16-valued) weights, float32 arithmetic
    text = torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(2))
    t, dt = torch.tensor([437.3]), torch.tensor([1.0])
    (r, tr) = torch.func.jvp(lambda s: _embed(ref, s, text), (t,), (dt,))
    (s, ts) = torch.func.jvp(lambda s: _embed(model, s, text), (t,), (dt,))
    enable_jvp_attention(model)
    (o, to) = torch.func.jvp(lambda s: _embed(model, s, text), (t,), (dt,))
    for ours, stock, want in ((o, s, r), (to, ts, tr)):
        for a, b, w in zip(ours, stock, want):
            assert a.dtype == torch.bfloat16
            assert torch.equal(a, w.to(torch.bfloat16))
            assert (b != w.to(torch.bfloat16)).float().mean() > 0.05  # the stock path rounds on the way
    with torch.no_grad():  # no tangent: stock path untouched; inside the context manager: float32
        plain = _embed(model, t, text)
        assert all(torch.equal(a, b) for a, b in zip(plain, s))
        with time_embedding_fp32(model):
            forced = _embed(model, t, text)
        assert all(torch.equal(a, b) for a, b in zip(forced, o))
        assert all(torch.equal(a, b) for a, b in zip(_embed(model, t, text), s))
    # as from_pretrained(torch_dtype=bf16) leaves it: time_embedder float32, the rest bf16
    model.condition_embedder.time_embedder.float()
    (m, tm) = torch.func.jvp(lambda s: _embed(model, s, text), (t,), (dt,))
    assert all(torch.equal(a, w.to(torch.bfloat16)) for a, w in zip((*m, *tm), (*r, *tr)))
