"""JVP through unmodified tiny diffusers Wan (T2V, I2V) and Flux transformers with our processors
(docs/math.md §5): vs a float64 math-attention reference, vs finite differences, and stock equality
(outputs, gradients) outside JVP passes. Plus the float32 time-embedding switch (docs/math.md §4.1)."""

import copy

import pytest
import torch
from diffusers import FluxTransformer2DModel, WanTransformer3DModel
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from torch.nn.attention import SDPBackend, sdpa_kernel

from rcm_diffusers.attention import (
    FluxJVPAttnProcessor,
    WanJVPAttnProcessor,
    disable_jvp_attention,
    enable_jvp_attention,
    time_embedding_fp32,
)
from rcm_diffusers.attention.function import STATS

WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
    text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
)


def make_case(kind):
    """(model, call(model, x, t), x, t, dx, dt) with fixed random weights and inputs."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "flux":
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
        )
        cond = dict(
            encoder_hidden_states=torch.randn(1, 5, 32, generator=g), pooled_projections=torch.randn(1, 32, generator=g),
            txt_ids=torch.zeros(5, 3), img_ids=torch.randint(0, 4, (16, 3), generator=g).float(),
        )
        x, t, dt = torch.randn(1, 16, 4, generator=g), torch.tensor([0.4]), torch.tensor([0.3])
    else:
        i2v = kind == "wan_i2v"
        model = WanTransformer3DModel(**WAN, **(dict(image_dim=8, added_kv_proj_dim=24) if i2v else {}))
        # Wan I2V processors take the last 512 context tokens as text
        cond = dict(encoder_hidden_states=torch.randn(1, 512 if i2v else 6, 16, generator=g))
        if i2v:
            cond["encoder_hidden_states_image"] = torch.randn(1, 3, 8, generator=g)
        x, t, dt = torch.randn(1, 4, 2, 4, 4, generator=g), torch.tensor([400.0]), torch.tensor([300.0])

    def call(m, x, t):
        dtype = next(m.parameters()).dtype
        c = {k: (v.to(dtype) if k not in ("txt_ids", "img_ids") else v) for k, v in cond.items()}
        return m(hidden_states=x, timestep=t, **c, return_dict=False)[0]

    dx = torch.randn(x.shape, generator=g)
    return model, call, x, t, dx, dt


CASES = ["wan_t2v", "wan_i2v", "flux"]


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("kind", CASES)
def test_jvp_matches_float64_math_attention(kind):
    model, call, x, t, dx, dt = make_case(kind)
    ref = copy.deepcopy(model).double()  # stock processors, float64, math SDPA (which has a forward-AD rule)
    with sdpa_kernel(SDPBackend.MATH):
        y_r, ty_r = torch.func.jvp(lambda a, b: call(ref, a, b), (x.double(), t.double()), (dx.double(), dt.double()))
    enable_jvp_attention(model)
    calls = STATS["fused_calls"]
    y, ty = torch.func.jvp(lambda a, b: call(model, a, b), (x, t), (dx, dt))
    assert STATS["fused_calls"] > calls  # the fused path, not a math fallback, gave the tangent
    assert rel(y, y_r) < 1e-5 and rel(ty, ty_r) < 1e-5
    assert ty.abs().max() > 1e-3


@pytest.mark.parametrize("kind", CASES)
def test_jvp_matches_finite_differences(kind):
    """x-tangent and t-tangent separately against central differences in float64. Wan and Flux cast
    the timestep (sinusoidal embedding) and Wan its LayerNorm inputs to float32 inside, which bounds
    the difference quotient's accuracy near 1e-4; the exact check is the float64 reference test."""
    model, call, x, t, dx, dt = make_case(kind)
    model = enable_jvp_attention(model.double())
    x, t, dx, dt = x.double(), t.double(), dx.double(), dt.double()
    for tx, tt, h in ((dx, torch.zeros_like(dt), 3e-3), (torch.zeros_like(dx), dt, 1e-4)):
        _, ty = torch.func.jvp(lambda a, b: call(model, a, b), (x, t), (tx, tt))
        with torch.no_grad():
            fd = (call(model, x + h * tx, t + h * tt) - call(model, x - h * tx, t - h * tt)) / (2 * h)
        assert ty.abs().max() > 1e-3
        assert rel(ty, fd) < 1e-3


@pytest.mark.parametrize("kind", CASES)
def test_same_outputs_and_grads_as_stock_outside_jvp(kind):
    stock, call, x, t, _, _ = make_case(kind)
    ours = enable_jvp_attention(copy.deepcopy(stock))
    results = []
    for m in (stock, ours):
        xg = x.clone().requires_grad_()
        y = call(m, xg, t)
        (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        results.append((y.detach(), xg.grad, [p.grad for p in m.parameters()]))
    (y_s, gx_s, gp_s), (y_o, gx_o, gp_o) = results
    assert (y_o - y_s).abs().max() <= 1e-6 and (gx_o - gx_s).abs().max() <= 1e-6
    assert max((a - b).abs().max().item() for a, b in zip(gp_o, gp_s) if a is not None) <= 1e-6
    assert sum(a is not None for a in gp_o) == sum(b is not None for b in gp_s) > 10


@pytest.mark.parametrize("kind, stock_cls, jvp_cls", [("wan_i2v", WanAttnProcessor, WanJVPAttnProcessor), ("flux", FluxAttnProcessor, FluxJVPAttnProcessor)])
def test_enable_disable_round_trip(kind, stock_cls, jvp_cls):
    model, call, x, t, _, _ = make_case(kind)
    with torch.no_grad():
        y0 = call(model, x, t)
        enable_jvp_attention(model)
        assert all(type(p) is jvp_cls for p in model.attn_processors.values())
        enable_jvp_attention(model)  # idempotent
        disable_jvp_attention(model)
        assert all(type(p) is stock_cls for p in model.attn_processors.values())
        assert "forward" not in model.__dict__ and torch.equal(call(model, x, t), y0)


def test_unsupported_processor_raises():
    from diffusers.models.attention_processor import AttnProcessor2_0

    model, *_ = make_case("wan_t2v")
    model.set_attn_processor(AttnProcessor2_0())
    with pytest.raises(ValueError, match="no JVP processor for AttnProcessor2_0"):
        enable_jvp_attention(model)


def _embed(model, t, text):
    dtype = next(model.parameters()).dtype
    return model.condition_embedder(t, text.to(dtype))[:2]  # temb, timestep_proj


def test_time_embedding_runs_in_float32_during_jvp():
    """bf16 Wan: with the switch, the time embedding (value and t-tangent) is the float32 computation
    with the bf16 weights, rounded to bf16 once at the end; without it, it is the bf16 computation."""
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
