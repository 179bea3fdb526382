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
