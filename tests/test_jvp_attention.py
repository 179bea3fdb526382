"""JVP attention kernels (docs/math.md §5) against a float64 reference built from plain matmul/softmax
and ``torch.func.jvp``: torch backend, and the Triton kernel (interpreted on CPU)."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernel runs in its CPU interpreter; must precede @triton.jit
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch.autograd import forward_ad  # noqa: E402

from rcm_diffusers.attention import attention, jvp_attention, select_backend  # noqa: E402
from rcm_diffusers.attention.function import STATS  # noqa: E402

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton"))]
# error / max|reference| allowed per input dtype (bf16: P~ and H~ are rounded to bf16 before the PV products)
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def reference(q, k, v, t_q, t_k, t_v, scale=None):
    """float64 ``(O, tO, LSE)`` from plain matmul + softmax, tangent by torch.func.jvp."""
    q, k, v, t_q, t_k, t_v = (x.double() for x in (q, k, v, t_q, t_k, t_v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    def attn(q, k, v):
        S = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
        return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(S, dim=-1), v)

    o, t_o = torch.func.jvp(attn, (q, k, v), (t_q, t_k, t_v))
    lse = torch.logsumexp(torch.einsum("bqhd,bkhd->bhqk", q, k) * scale, dim=-1)
    return o, t_o, lse


def rand(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen, device="cpu").to(DEV, dtype)


def inputs(B, Lq, Lk, H, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [rand(B, L, H, D, dtype=dtype, gen=g) for L in (Lq, Lk, Lk, Lq, Lk, Lk)]  # q k v tq tk tv


def rel_err(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [16, 32, 64, 128])
def test_matches_float64_reference(backend, dtype, D):
    # Lq != Lk, neither a multiple of the 16-row tiles, 3 K/V tiles so the running max rescales
    q, k, v, tq, tk, tv = inputs(2, 19, 37, 2, D, dtype, seed=D)
    o, t_o, lse = jvp_attention(q, k, v, tq, tk, tv, backend=backend, return_lse=True)
    o_r, t_o_r, lse_r = reference(q, k, v, tq, tk, tv)
    assert o.dtype == t_o.dtype == dtype and lse.shape == (2, 2, 19)
    assert rel_err(o, o_r) < RTOL[dtype]
    assert rel_err(t_o, t_o_r) < RTOL[dtype]
    assert (lse.double() - lse_r).abs().max() < 10 * RTOL[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Lq, Lk", [(33, 7), (1, 40), (21, 21)])
def test_lengths_fp16_and_scale(backend, Lq, Lk):
    q, k, v, tq, tk, tv = inputs(1, Lq, Lk, 3, 64, torch.float16, seed=Lq + Lk)
    o, t_o = jvp_attention(q, k, v, tq, tk, tv, scale=0.3, backend=backend)
    o_r, t_o_r, _ = reference(q, k, v, tq, tk, tv, scale=0.3)
    assert rel_err(o, o_r) < RTOL[torch.float16] and rel_err(t_o, t_o_r) < RTOL[torch.float16]


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_tangents_and_strided_views(backend):
    """None tangents count as zero (cross-attention: text K/V carry none); tangents may be
    non-contiguous views with strides unlike their primal."""
    q, k, v, tq, tk, tv = inputs(2, 24, 17, 2, 32, torch.float32, seed=7)
    zeros = torch.zeros_like(k)
    tq_view = tq.transpose(1, 2).contiguous().transpose(1, 2)  # [B, S, H, D] view, head-major storage
    o, t_o = jvp_attention(q, k, v, tq_view, None, None, backend=backend)
    o_r, t_o_r, _ = reference(q, k, v, tq, zeros, zeros)
    assert tq_view.stride() != tq.stride()
    assert rel_err(o, o_r) < 1e-5 and rel_err(t_o, t_o_r) < 1e-5


def test_torch_backend_chunking_is_exact():
    from rcm_diffusers.attention.torch_backend import jvp_attention_torch

    q, k, v, tq, tk, tv = inputs(1, 29, 11, 2, 16, torch.float32, seed=3)
    o, t_o, _ = jvp_attention_torch(q, k, v, tq, tk, tv, chunk=8)  # 4 query chunks, last one short
    o_r, t_o_r, _ = reference(q, k, v, tq, tk, tv)
    assert rel_err(o, o_r) < 1e-5 and rel_err(t_o, t_o_r) < 1e-5


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
@pytest.mark.parametrize("block", [(16, 32), (32, 16)])
def test_triton_tile_shapes(block):
    from rcm_diffusers.attention.triton_kernel import jvp_attention_triton

    q, k, v, tq, tk, tv = inputs(1, 45, 50, 1, 48, torch.float32, seed=11)  # D=48 pads to 64
    o, t_o, lse = jvp_attention_triton(q, k, v, tq, tk, tv, block=block)
    o_r, t_o_r, lse_r = reference(q, k, v, tq, tk, tv)
    assert rel_err(o, o_r) < 1e-5 and rel_err(t_o, t_o_r) < 1e-5
    assert (lse.double() - lse_r).abs().max() < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_ad_runs_the_primal_once(backend):
    """torch.func.jvp and forward_ad dual tensors through ``attention``: one fused call, no recompute."""
    q, k, v, tq, tk, tv = inputs(2, 13, 9, 2, 16, torch.float32, seed=5)
    o_r, t_o_r, _ = reference(q, k, v, tq, tk, tv)
    before = dict(STATS)
    o, t_o = torch.func.jvp(lambda a, b, c: attention(a, b, c, backend=backend), (q, k, v), (tq, tk, tv))
    assert STATS["fused_calls"] == before["fused_calls"] + 1
    assert STATS["jvp_recomputes"] == before["jvp_recomputes"]
    assert rel_err(o, o_r) < 1e-5 and rel_err(t_o, t_o_r) < 1e-5

    _, t_o_q, _ = reference(q, k, v, tq, torch.zeros_like(k), torch.zeros_like(v))
    with forward_ad.dual_level():
        out = attention(forward_ad.make_dual(q, tq), k, v, backend=backend)
        t_dual = forward_ad.unpack_dual(out).tangent
    assert rel_err(t_dual, t_o_q) < 1e-5
    assert STATS["jvp_recomputes"] == before["jvp_recomputes"]


def test_primal_gradient_inside_jvp_and_plain_path():
    """The primal of a JVP pass back-propagates like SDPA; without tangents ``attention`` is SDPA."""
    q, k, v, tq, tk, tv = inputs(1, 11, 6, 2, 16, torch.float64, seed=9)
    w = torch.randn(1, 11, 2, 16, dtype=torch.float64)

    def ref_attn(q, k, v):
        S = torch.einsum("bqhd,bkhd->bhqk", q, k) * 16**-0.5
        return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(S, dim=-1), v)

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, _ = torch.func.jvp(lambda a, b, c: attention(a, b, c), tuple(leaves), (tq, tk, tv))
    grads = torch.autograd.grad((o * w).sum(), leaves)
    leaves_r = [x.clone().requires_grad_() for x in (q, k, v)]
    grads_r = torch.autograd.grad((ref_attn(*leaves_r) * w).sum(), leaves_r)
    for g, g_r in zip(grads, grads_r):
        assert (g - g_r).abs().max() < 1e-12

    before = STATS["fused_calls"]
    assert (attention(q, k, v) - ref_attn(q, k, v)).abs().max() < 1e-12
    assert STATS["fused_calls"] == before


def test_backend_selection():
    q = torch.zeros(1, 4, 1, 64)
    assert select_backend(q) == ("triton" if q.is_cuda and HAS_TRITON else "torch")
    assert select_backend(q.double()) == "torch"
    assert select_backend(torch.zeros(1, 4, 1, 8)) == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        select_backend(q, "flash")


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda t: {"t_q": t["t_q"][:, :-1]}, "tangent of q must have the shape"),
        (lambda t: {"t_k": t["t_k"].double()}, "tangent of k has dtype"),
        (lambda t: {"t_v": t["t_v"].to("meta")}, "tangent of v is on meta"),
        (lambda t: {"v": t["v"][:, :-1]}, r"k \(1, 5, 2, 16\) and v"),
        (lambda t: {"q": t["q"][0]}, "must be a 4-D tensor"),
        (lambda t: {"k": t["k"].half()}, "q, k, v must share dtype"),
        (lambda t: {"q": t["q"].int()}, "unsupported dtype"),
    ],
)
def test_bad_input_raises(change, match):
    q, k, v, tq, tk, tv = inputs(1, 3, 5, 2, 16, torch.float32, seed=0)
    args = dict(q=q, k=k, v=v, t_q=tq, t_k=tk, t_v=tv)
    args.update(change(args))
    with pytest.raises(ValueError, match=match):
        jvp_attention(**args, backend="torch")


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
def test_triton_rejects_what_it_cannot_compute():
    q, k, v, tq, tk, tv = inputs(1, 3, 5, 2, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="head dims 16..256"):
        jvp_attention(q, k, v, tq, tk, tv, backend="triton")
    q, k, v, tq, tk, tv = inputs(1, 3, 5, 2, 16, torch.float64, seed=0)
    with pytest.raises(ValueError, match="float64"):
        jvp_attention(q, k, v, tq, tk, tv, backend="triton")


def test_benchmark_smoke_mode(capsys):
    """benchmarks/jvp_attention.py --smoke runs on CPU, prints the markdown table, and its
    torch.func.jvp row calls the fused kernel exactly once per iteration."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "jvp_attention.py"
    spec = importlib.util.spec_from_file_location("bench_jvp_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--smoke"])
    out = capsys.readouterr().out
    assert "| H | S | method | median ms |" in out
    assert [r["method"] for r in rows[:4]] == ["sdpa_fwd", "fused_jvp", "func_jvp_ours", "func_jvp_math"]
    assert len(rows) == 8 and all(r["ms"] > 0 for r in rows)
    assert all(r["note"] == "fused calls/iter 1" for r in rows if r["method"] == "func_jvp_ours")


# ----------------------------------------------------------------------------- masks and SDPA's arguments


def masked_reference(q, k, v, t_q, t_k, t_v, bias):
    """float64 ``(O, tO)`` of ``softmax(scale Q K^T + bias) V`` (a row with every key masked: 0, as SDPA), tangent by
    torch.func.jvp; ``bias`` additive, broadcastable to ``[B, H, Lq, Lk]``."""
    q, k, v, t_q, t_k, t_v = (x.double() for x in (q, k, v, t_q, t_k, t_v))
    bias = bias.double()

    def attn(q, k, v):
        S = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5 + bias
        alive = torch.isfinite(S).any(-1, keepdim=True)
        P = torch.where(alive, torch.softmax(torch.where(alive, S, 0.0), dim=-1), 0.0)
        return torch.einsum("bhqk,bkhd->bqhd", P, v)

    return torch.func.jvp(attn, (q, k, v), (t_q, t_k, t_v))


def _masks(B, H, Lq, Lk, g):
    """(name, mask, additive bias): key padding (bool, [B, 1, 1, Lk]), a full boolean mask with a row masked
    completely, an additive float mask broadcast over the batch with -inf and finite entries."""
    pad = torch.ones(B, 1, 1, Lk, dtype=torch.bool)
    pad[0, ..., -3:] = False
    full = torch.rand(B, H, Lq, Lk, generator=g) > 0.3
    full[..., 0] = True
    full[1, 0, 2] = False  # a query with every key masked
    add = torch.randn(1, 1, Lq, Lk, generator=g)
    add[..., 1] = float("-inf")
    as_bias = lambda m: torch.zeros(m.shape).masked_fill(~m, float("-inf"))  # noqa: E731
    return [("key padding", pad, as_bias(pad)), ("full with a dead row", full, as_bias(full)), ("additive", add, add)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masks_match_float64_reference(backend, dtype):
    """Boolean and additive masks (broadcast over batch, heads or query rows), a query whose keys are all masked
    (output and tangent 0, as SDPA), Lq != Lk over several 16-wide tiles."""
    B, Lq, Lk, H, D = 2, 19, 37, 2, 32
    q, k, v, tq, tk, tv = inputs(B, Lq, Lk, H, D, dtype, seed=21)
    for name, mask, bias in _masks(B, H, Lq, Lk, torch.Generator().manual_seed(4)):
        o, t_o = jvp_attention(q, k, v, tq, tk, tv, backend=backend, attn_mask=mask.to(DEV))
        o_r, t_o_r = masked_reference(q, k, v, tq, tk, tv, bias.to(DEV))
        assert rel_err(o, o_r) < RTOL[dtype] and rel_err(t_o, t_o_r) < RTOL[dtype], name
        if name.startswith("full"):
            assert o[1, 2, 0].abs().max() == 0 and t_o[1, 2, 0].abs().max() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_sdpa_arguments_match_forward_ad_through_math_sdpa(backend):
    """``sdpa_jvp`` (SDPA's layout and arguments) against torch.func.jvp of math SDPA in float64: masks, is_causal,
    a scale, grouped-query heads, 3-D inputs; the primal runs once per call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rcm_diffusers.attention import sdpa_jvp

    g = torch.Generator().manual_seed(8)

    def r(*s):
        return torch.randn(*s, generator=g).to(DEV)

    B, H, Lq, Lk, D = 2, 4, 21, 21, 16
    cases = [
        ("bool mask", dict(attn_mask=(torch.rand(B, 1, Lq, Lk, generator=g) > 0.4).to(DEV)), (B, H), (B, H)),
        ("float mask", dict(attn_mask=r(1, H, 1, Lk)), (B, H), (B, H)),
        ("causal + scale", dict(is_causal=True, scale=0.2), (B, H), (B, H)),
        ("gqa", dict(enable_gqa=True), (B, H), (B, 2)),
        ("3-D", {}, (B * H,), (B * H,)),
    ]
    for name, kw, qlead, kvlead in cases:
        q, tq = r(*qlead, Lq, D), r(*qlead, Lq, D)
        k, v, tk, tv = (r(*kvlead, Lk, D) for _ in range(4))
        with sdpa_kernel(SDPBackend.MATH):
            o_r, t_r = torch.func.jvp(
                lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
                    a,
                    b,
                    c,
                    **{n: (x.double() if torch.is_tensor(x) and x.is_floating_point() else x) for n, x in kw.items()},
                ),
                (q.double(), k.double(), v.double()),
                (tq.double(), tk.double(), tv.double()),
            )
        before = dict(STATS)
        o, t = torch.func.jvp(lambda a, b, c: sdpa_jvp(a, b, c, **kw, backend=backend), (q, k, v), (tq, tk, tv))
        assert STATS["fused_calls"] == before["fused_calls"] + 1 and STATS["jvp_recomputes"] == before["jvp_recomputes"]
        assert o.shape == q.shape and rel_err(o, o_r) < 1e-5 and rel_err(t, t_r) < 1e-5, name


def test_sdpa_refusals_are_one_line():
    from rcm_diffusers.attention import sdpa_jvp

    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="dropout_p=0.1 in a JVP pass; run the model in eval"):
        sdpa_jvp(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="either attn_mask or is_causal"):
        sdpa_jvp(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="2 query heads and 3 key/value heads"):
        torch.func.jvp(lambda a: sdpa_jvp(a, torch.randn(1, 3, 4, 16), torch.randn(1, 3, 4, 16)), (q,), (q,))
    with pytest.raises(ValueError, match="does not broadcast to"):
        torch.func.jvp(lambda a: sdpa_jvp(a, q, q, attn_mask=torch.ones(3, 4, dtype=torch.bool)), (q,), (q,))
    with pytest.raises(ValueError, match="boolean or floating point"):
        torch.func.jvp(lambda a: sdpa_jvp(a, q, q, attn_mask=torch.ones(4, 4, dtype=torch.long)), (q,), (q,))
    with pytest.raises(ValueError, match="mask carries a tangent"):
        torch.func.jvp(lambda a, m: sdpa_jvp(a, q, q, attn_mask=m), (q, torch.zeros(4, 4)), (q, torch.ones(4, 4)))
