"""Benchmark of JVP attention (docs/math.md §5) on one GPU: time, TFLOP/s and peak memory.

Rows per shape (B=1, D=128, bf16, self-attention of length S):
  sdpa_fwd      F.scaled_dot_product_attention forward (flash on H100/H200), 2 matmuls
  fused_jvp     rcm_diffusers jvp_attention: O, tO, LSE in one pass, 6 matmuls
  func_jvp_ours torch.func.jvp through rcm_diffusers.attention.attention (the path every SDPA call of a
                JVP pass takes; shows the forward-AD protocol adds no second primal)
  func_jvp_math torch.func.jvp through math SDPA (materialises S x S; stops after its first OOM)
TFLOP/s counts 2 matmuls for sdpa_fwd and 6 for the JVP rows (4 B H S^2 D flops per 2 matmuls).
Time is the median over --reps CUDA-event timings after warm-up (and Triton autotuning).

    python benchmarks/jvp_attention.py                # the H200 run, budgeted under 8 minutes
    python benchmarks/jvp_attention.py --smoke        # tiny CPU run (torch backend), checks the plumbing
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rcm_diffusers.attention import attention, jvp_attention
from rcm_diffusers.attention.function import STATS


def _bhsd(x):
    return x.transpose(1, 2)


def sdpa_fwd(q, k, v, t_q, t_k, t_v):
    return F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v))


def fused_jvp(q, k, v, t_q, t_k, t_v):
    return jvp_attention(q, k, v, t_q, t_k, t_v)


def func_jvp_ours(q, k, v, t_q, t_k, t_v):
    return torch.func.jvp(attention, (q, k, v), (t_q, t_k, t_v))


def func_jvp_math(q, k, v, t_q, t_k, t_v):
    def math_attn(q, k, v):
        return F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v)).transpose(1, 2)

    with sdpa_kernel(SDPBackend.MATH):
        return torch.func.jvp(math_attn, (q, k, v), (t_q, t_k, t_v))


METHODS = {
    "sdpa_fwd": (sdpa_fwd, 2),
    "fused_jvp": (fused_jvp, 6),
    "func_jvp_ours": (func_jvp_ours, 6),
    "func_jvp_math": (func_jvp_math, 6),
}


def time_ms(fn, args, reps: int, cuda: bool) -> float:
    """Median wall time in ms: CUDA events on GPU, perf_counter on CPU."""
    fn(*args)  # warm-up (and Triton autotune on first shape)
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(*args)
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def check_error(args) -> float:
    """max |tO_fused - tO_fp32 reference| / max |tO_ref| on the first rows (a sanity check of the run)."""
    q, k, v, t_q, t_k, t_v = args
    n = min(q.shape[1], 512)
    _, t_o = jvp_attention(q[:, :n], k, v, t_q[:, :n], t_k, t_v)
    _, t_ref = jvp_attention(*(x.float() for x in (q[:, :n], k, v, t_q[:, :n], t_k, t_v)), backend="torch")
    return ((t_o.float() - t_ref).abs().max() / t_ref.abs().max()).item()


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny CPU shapes, float32, torch backend")
    p.add_argument("--seqs", type=int, nargs="*", default=[1024, 4096, 8192, 16384, 32760])
    p.add_argument("--heads", type=int, nargs="*", default=[12, 40])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=420.0, help="start no new shape after this many seconds")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.smoke
    if a.smoke:
        a.seqs, a.heads, a.head_dim, a.reps = [64, 96], [2], 32, 2
    if not cuda and not a.smoke:
        sys.exit("no CUDA device: run with --smoke for the CPU plumbing check")
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    t_start, rows, oom = time.time(), [], set()
    for H in a.heads:
        for S in a.seqs:
            if time.time() - t_start > a.budget_s:
                print(f"<!-- budget reached, skipped H={H} S={S} -->")
                continue
            g = torch.Generator(device=dev).manual_seed(S + H)
            args = [torch.randn(1, S, H, a.head_dim, device=dev, dtype=dtype, generator=g) for _ in range(6)]
            err = check_error(args)
            base_ms = None
            for name, (fn, n_matmul) in METHODS.items():
                row = dict(H=H, S=S, method=name, ms=float("nan"), tflops=float("nan"), peak_gib=float("nan"), err=err)
                if name == "func_jvp_math" and H in oom:
                    row["note"] = "skipped (OOM at a shorter S)"
                    rows.append(row)
                    continue
                try:
                    if cuda:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    calls = STATS["fused_calls"]
                    row["ms"] = time_ms(fn, args, a.reps, cuda)
                    if name == "func_jvp_ours":  # fused kernel runs once per call: no second primal
                        row["note"] = f"fused calls/iter {(STATS['fused_calls'] - calls) / (a.reps + 1):.0f}"
                    if cuda:
                        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                except torch.OutOfMemoryError:
                    oom.add(H)
                    row["note"] = "OOM"
                    if cuda:
                        torch.cuda.empty_cache()
                flops = n_matmul * 2 * H * S * S * a.head_dim
                row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
                if name == "sdpa_fwd":
                    base_ms = row["ms"]
                row["x_sdpa"] = row["ms"] / base_ms if base_ms else float("nan")
                rows.append(row)
            del args
    dev_name = torch.cuda.get_device_name() if cuda else "CPU (smoke)"
    print(
        f"\nJVP attention, {dev_name}, B=1, D={a.head_dim}, {str(dtype).replace('torch.', '')}, "
        f"torch {torch.__version__}\n"
    )
    print("| H | S | method | median ms | TFLOP/s | x sdpa_fwd | peak GiB | tO rel err | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['H']} | {r['S']} | {r['method']} | {r['ms']:.3f} | {r['tflops']:.1f} "
            f"| {r.get('x_sdpa', float('nan')):.2f} "
            f"| {r['peak_gib']:.2f} | {r['err']:.1e} | {r.get('note', '')} |"
        )
    return rows


if __name__ == "__main__":
    main()
