"""The one GPU check of docs/benchmarks.md (driven by ``benchmarks/gpu_check.sh``), budget-guarded, one JSON out.

1. JVP attention (``benchmarks/jvp_attention.py``): fused Triton kernel vs SDPA forward vs
   ``torch.func.jvp`` through math SDPA, S 1k-32k, H 12/40, D 128, bf16, error vs float64 at each shape.
2. 5 rCM training iterations of the Wan2.1-T2V-1.3B architecture (random init, bf16, LoRA rank 64,
   gradient checkpointing, fd_type 0) on a 480p x 81-frame latent (16 x 21 x 60 x 104 = 32 760 tokens)
   and 512 text tokens, through ``training/rcm.py``: time per iteration and peak CUDA memory, next to
   ``rcm_diffusers.distill.memory.predict_training`` for the same setup.
3. Ulysses context parallelism (``rcm_diffusers.attention.ulysses``) with a group of one rank (NCCL on the GPU):
   a 2-layer Wan2.1-1.3B-wide transformer's output, exact sCM tangent (``torch.func.jvp``) and a weight gradient
   with the CP hooks, all-to-alls and gather installed against the same model without them. With one rank every
   exchange is a copy, so they agree up to the attention kernel's choice on other strides; this checks that the
   collectives and their forward-mode rule run on CUDA (multi-rank CP was tested on CPU processes only).
4. Gradient checkpointing policies: 3 rCM iterations with ``full`` and with ``selective`` checkpointing on a 480p x 33
   latent (14 040 tokens), peak CUDA memory next to the memory model's total for each (as far as the budget allows).
5. One card (``rcm_diffusers.distill.lowmem``): the real Wan2.1-T2V-14B width (D 5120, F 13824, random init, bf16)
   cut to 4 blocks, 480p x 33 latent (14 040 tokens), LoRA rank 16, 3 rCM iterations (fd_type 0, GC full) each with
   the bf16 base, the fp8 base, and the fp8 base with 3 of the 4 blocks swapped to pinned host memory and the block
   inputs offloaded: peak CUDA memory against ``memory.predict_training`` (without its 1 GiB runtime overhead, which
   ``max_memory_allocated`` does not count), and the step-time ratios against ``memory.step_time`` on the measured
   card (matrix rate from the bf16 run, device-memory and pinned host -> device bandwidths measured here); plus the
   CUDA checks of ``benchmarks/lowmem_probe.py`` (diffusers' group offloading with LoRA adapters).
   ``--only one_card`` runs this section alone with the whole budget.

6. Utilisation (computed right after section 4, before section 5 takes the rest of the budget): the FLOPs
   ``rcm_diffusers.distill.cost`` counts for each timed iteration of sections 2 and 4 (its passes at this
   architecture and token count) over its measured time and the card's dense bf16 peak (``cost.gpu_peak``): the
   model-FLOP utilisation ``cost.DEFAULT_UTILISATION`` assumes; iteration 0 (kernel compilation and autotuning)
   left out. Beside it, what a plain bf16 8192^3 matrix product reaches on the card.

``--smoke`` (and any machine without CUDA): the same code at tiny sizes on CPU (CI runs it; section 5 then trains the
swapped run only, unless ``--only one_card``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import jvp_attention  # noqa: E402
import real_arch  # noqa: E402

from rcm_diffusers.arch import arch_config, save_random_pipeline  # noqa: E402
from rcm_diffusers.distill.memory import TrainSetup, predict_training  # noqa: E402


def train_check(smoke: bool, steps: int, timeout: float, work: str, frames: int = 21, policy: str = "full") -> dict:
    """``steps`` rCM iterations through training/rcm.py with gradient checkpointing ``policy`` on a 480p latent of
    ``frames`` latent frames (smoke: tiny), next to the memory model's prediction for the same setup."""
    arch = "wan2.1-t2v-1.3b"
    if smoke:
        over, shape, text, rank, dtype = dict(num_layers=1, num_attention_heads=2), (16, 2, 8, 8), 16, 4, "float32"
    else:
        over, shape, text, rank, dtype = {}, (16, frames, 60, 104), 512, 64, "bfloat16"
    cfg = arch_config(arch, **over)
    t0 = time.perf_counter()
    pipe = save_random_pipeline(arch, os.path.join(work, "pipe"), dtype=real_arch.DTYPES[dtype], **over)
    data = real_arch.make_data(os.path.join(work, "data"), "wan", shape, text, cfg["text_dim"], 0)
    setup_s = time.perf_counter() - t0
    args = SimpleNamespace(rank=rank, dtype=dtype, steps=steps, family="wan")
    out = os.path.join(work, "run")
    ycfg = os.path.join(work, "train.yaml")
    real_arch.write_train_config(ycfg, args, pipe, data, out, fd_type=0, gc=policy)
    r = real_arch.run_child(
        [sys.executable, os.path.join(REPO, "training", "rcm.py"), "--config", ycfg],
        os.path.join(work, "train.log"),
        timeout,
    )
    mpath = os.path.join(out, "metrics.jsonl")
    recs = [json.loads(ln) for ln in open(mpath)] if os.path.exists(mpath) else []
    tokens = shape[1] * shape[2] * shape[3] // 4
    setup = TrainSetup.from_config(
        cfg,
        "WanTransformer3DModel",
        tokens=tokens,
        text_tokens=text,
        lora_rank=rank,
        weight_dtype=dtype,
        gradient_checkpointing=True,
        checkpointing_policy=policy,
        fd_type=0,
    )
    res = {
        "arch": arch,
        "overrides": over,
        "latent": [1, *shape],
        "tokens": tokens,
        "text_tokens": text,
        "lora_rank": rank,
        "checkpointing_policy": policy,
        "dtype": dtype,
        "setup_s": setup_s,
        **{k: v for k, v in r.items() if k != "log"},
        "steps": [
            {k: rec.get(k) for k in ("step", "net", "step_time", "peak_mem_mb", "loss_scm", "loss_dmd", "loss_fake")}
            for rec in recs
        ],
        "predicted": predict_training(setup, device="cuda" if torch.cuda.is_available() and not smoke else "cpu"),
    }
    if r["rc"] != 0:
        res["log_tail"] = open(os.path.join(work, "train.log")).read()[-3000:]
    return res


def cp_check(smoke: bool) -> dict:
    """Section 3 of the module docstring: ``{"tokens", "exchanges", "err": {output, jvp, grad} relative to the largest
    entry, "tol", "ok", "seconds"}``; ``tol`` is 8 units of the weight dtype."""
    import torch.distributed as dist

    from rcm_diffusers.arch import build_transformer
    from rcm_diffusers.attention import enable_jvp_attention
    from rcm_diffusers.attention import ulysses as U
    from rcm_diffusers.distill import losses as L
    from rcm_diffusers.distill.launch import free_port
    from rcm_diffusers.models import velocity_fn
    from rcm_diffusers.trigflow import TrigFlowDenoiser

    t0 = time.perf_counter()
    cuda = torch.cuda.is_available() and not smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    over = dict(num_layers=2) if cuda else dict(num_layers=1, num_attention_heads=2)
    shape, text = ((16, 5, 60, 104), 512) if cuda else ((16, 2, 8, 8), 16)  # 7 800 / 32 video tokens
    model = build_transformer("wan2.1-t2v-1.3b", dtype=dtype, device=device, **over)
    model.requires_grad_(False)
    weight = model.blocks[0].attn1.to_q.weight
    weight.requires_grad_(True)
    enable_jvp_attention(model)
    g = torch.Generator(device).manual_seed(0)
    x_t = torch.randn(1, *shape, generator=g, device=device, dtype=torch.float64)
    F_T = torch.randn(1, *shape, generator=g, device=device, dtype=torch.float64)
    t = torch.tensor([1.1], device=device, dtype=torch.float64)
    cond = {
        "encoder_hidden_states": torch.randn(
            1, text, model.config.text_dim, generator=g, device=device, dtype=torch.float64
        ).to(dtype)
    }
    den = TrigFlowDenoiser(velocity_fn(model, "float"), dtype)

    def run() -> dict:
        def F(x, tt):
            return den.F(x, tt, **cond)

        weight.grad = None
        with torch.no_grad():
            out = F(x_t, t)
            _, jvp = L.scm_dF(F, x_t, t, F_T, fd_type=0)
        loss, _ = L.scm_loss(F, x_t, t, F_T, step=0, tangent_warmup=0, fd_type=0)
        loss.sum().backward()
        return {"output": out.double(), "jvp": jvp.double(), "grad": weight.grad.double()}

    ref = run()
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    seen, a2a = [0], U._a2a

    def counted(*a, **k):
        seen[0] += 1
        return a2a(*a, **k)

    try:
        U._a2a = counted
        U.enable_context_parallel(model, dist.new_group([0]))
        got = run()
    finally:
        U._a2a = a2a
        U.disable_context_parallel(model)
        dist.destroy_process_group()
    err = {k: float((ref[k] - got[k]).abs().max() / ref[k].abs().max()) for k in ref}
    tol = 8 * torch.finfo(dtype).eps
    return {
        "arch": "wan2.1-t2v-1.3b",
        "overrides": over,
        "latent": [1, *shape],
        "tokens": shape[1] * shape[2] * shape[3] // 4,
        "dtype": str(dtype).split(".")[-1],
        "device": device,
        "exchanges": seen[0],
        "err": err,
        "tol": tol,
        "ok": seen[0] > 0 and all(e <= tol for e in err.values()),
        "seconds": time.perf_counter() - t0,
    }


def utilisation(run: dict, ycfg: str, smoke: bool) -> dict:
    """Section 5 for one training run of ``train_check`` (its config file ``ycfg``): per timed iteration the counted
    FLOPs (``cost.iteration_passes`` x ``cost.run_pass_flops``), the achieved FLOP/s and, on a GPU of known peak, the
    utilisation; ``median`` over iterations >= 1 per role, ``overall`` = their FLOPs over their time."""
    from rcm_diffusers.distill import cost
    from rcm_diffusers.distill.config import RCMConfig

    cfg = RCMConfig.from_yaml(ycfg)
    arch = cost.Arch.from_config(arch_config(run["arch"], **run["overrides"]))
    pf = cost.run_pass_flops(cfg, arch, run["tokens"], run["text_tokens"])
    recipe = cost.Recipe.from_config(cfg)
    peak = None if smoke or not torch.cuda.is_available() else cost.gpu_peak(torch.cuda.get_device_name())
    rows = []
    for rec in run.get("steps", []):
        role, passes = cost.iteration_passes(cfg, rec["step"], recipe)
        flops = cost.iteration_flops(passes, pf) * cfg.batch_size
        rows.append(
            {
                "step": rec["step"],
                "net": role,
                "tflop": flops / 1e12,
                "seconds": rec["step_time"],
                "tflop_s": flops / rec["step_time"] / 1e12,
                "utilisation": flops / rec["step_time"] / peak if peak else None,
            }
        )
    timed = [r for r in rows if r["step"] >= 1]
    out = {"peak_tflop_s": peak / 1e12 if peak else None, "iterations": rows, "median": {}}
    for role in ("student", "fake"):
        us = sorted(r["tflop_s"] for r in timed if r["net"] == role)
        if us:
            mid = us[len(us) // 2]
            out["median"][role] = {"tflop_s": mid, "utilisation": mid * 1e12 / peak if peak else None}
    if timed:
        tf = sum(r["tflop"] for r in timed) / sum(r["seconds"] for r in timed)
        out["overall"] = {"tflop_s": tf, "utilisation": tf * 1e12 / peak if peak else None}
    return out


def matmul_rate(smoke: bool) -> dict:
    """TFLOP/s of a plain square matrix product (bf16 8192 on a GPU; float32 512 on CPU), median of 10."""
    cuda = torch.cuda.is_available() and not smoke
    n, dtype, dev = (8192, torch.bfloat16, "cuda") if cuda else (512, torch.float32, "cpu")
    a, b = torch.randn(n, n, dtype=dtype, device=dev), torch.randn(n, n, dtype=dtype, device=dev)
    times = []
    for k in range(13):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if cuda:
            torch.cuda.synchronize()
        if k >= 3:
            times.append(time.perf_counter() - t0)
    sec = sorted(times)[len(times) // 2]
    return {"n": n, "dtype": str(dtype).split(".")[-1], "tflop_s": 2 * n**3 / sec / 1e12}


def _bandwidths(cuda: bool, nbytes: int) -> dict:
    """Pinned host -> device and device -> device copy rates (bytes/s; a device copy reads and writes each byte)."""
    if not cuda:
        return {"h2d": None, "hbm": None}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev, dev2 = (
        torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
        torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
    )
    out = {}
    for name, (dst, src, factor) in {"h2d": (dev, host, 1), "hbm": (dev2, dev, 2)}.items():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = factor * 5 * nbytes / (time.perf_counter() - t0)
    return out


def one_card_check(smoke: bool, budget_s: float, work: str, runs=("bf16", "fp8", "fp8_swap_offload")) -> dict:
    """Section 5 of the module docstring: ``{"runs": {name: {rc, steps, peak_gib, predicted_gib, ...}}, "bandwidth",
    "slowdown": {name: {"measured", "predicted"}}, "probe", "seconds"}``."""
    from rcm_diffusers.distill.memory import GiB, passes_per_iteration, step_time

    t0 = time.perf_counter()
    cuda = torch.cuda.is_available() and not smoke
    if cuda:
        arch, over, shape, text, rank, dtype, swap = (
            "wan2.1-t2v-14b",
            dict(num_layers=4),
            (16, 9, 60, 104),
            512,
            16,
            "bfloat16",
            3,
        )
    else:
        arch, over, shape, text, rank, dtype, swap = (
            "wan2.1-t2v-1.3b",
            dict(num_layers=3, num_attention_heads=2),
            (16, 2, 8, 8),
            16,
            4,
            "float32",
            2,
        )
    cfg = arch_config(arch, **over)
    pipe = save_random_pipeline(arch, os.path.join(work, "pipe"), dtype=real_arch.DTYPES[dtype], **over)
    data = real_arch.make_data(os.path.join(work, "data"), "wan", shape, text, cfg["text_dim"], 0)
    res = {
        "arch": arch,
        "overrides": over,
        "latent": [1, *shape],
        "tokens": shape[1] * shape[2] * shape[3] // 4,
        "text_tokens": text,
        "lora_rank": rank,
        "dtype": dtype,
        "blocks_to_swap": swap,
        "bandwidth": _bandwidths(cuda, 1 << 30),
        "runs": {},
    }
    options = {
        "bf16": {},
        "fp8": {"base_dtype": "fp8"},
        "fp8_swap_offload": {"base_dtype": "fp8", "blocks_to_swap": swap, "activation_offload": True},
    }
    setups = {}
    for name in runs:
        left = budget_s - (time.perf_counter() - t0)
        if left < 45:
            res["runs"][name] = {"skipped": f"{left:.0f} s of the budget left"}
            continue
        args = SimpleNamespace(rank=rank, dtype=dtype, steps=3, family="wan")
        out = os.path.join(work, name)
        ycfg = os.path.join(work, f"{name}.yaml")
        real_arch.write_train_config(ycfg, args, pipe, data, out, fd_type=0, gc="full")
        extra = [x for k, v in options[name].items() for x in (f"--{k}", str(v).lower())]
        r = real_arch.run_child(
            [sys.executable, os.path.join(REPO, "training", "rcm.py"), "--config", ycfg, *extra],
            os.path.join(work, f"{name}.log"),
            left - 10,
        )
        mpath = os.path.join(out, "metrics.jsonl")
        recs = [json.loads(ln) for ln in open(mpath)] if os.path.exists(mpath) else []
        s = TrainSetup.from_config(
            cfg,
            "WanTransformer3DModel",
            tokens=res["tokens"],
            text_tokens=text,
            lora_rank=rank,
            weight_dtype=dtype,
            gradient_checkpointing=True,
            fd_type=0,
            student_update_freq=2,
            max_simulation_steps=4,
            **options[name],
        )
        setups[name] = s
        pred = predict_training(s, device="cuda" if cuda else "cpu")
        run = {
            **{k: v for k, v in r.items() if k != "log"},
            "options": options[name],
            "steps": [{k: rec.get(k) for k in ("step", "net", "step_time", "peak_mem_mb")} for rec in recs],
            "predicted_gib": pred["total_gib"],
            "predicted_without_overhead_gib": (pred["total"] - pred["overhead"]) / GiB,
            "predicted_host_gib": pred["host"] / GiB,
        }
        if recs:
            run["peak_gib"] = max(rec["peak_mem_mb"] or 0 for rec in recs) / 1024
            run["mean_step_s"] = sum(rec["step_time"] for rec in recs) / len(recs)
        if r["rc"] != 0:
            run["log_tail"] = open(os.path.join(work, f"{name}.log")).read()[-3000:]
        res["runs"][name] = run
    base = res["runs"].get("bf16", {})
    bw = res["bandwidth"]
    if cuda and base.get("mean_step_s") and bw["h2d"]:
        s0 = setups["bf16"]
        p = passes_per_iteration(s0)
        L = len(s0.block_linears)
        from rcm_diffusers.distill.memory import PASS_COST, block_flops

        flops = L * block_flops(s0) * sum(p[k] * PASS_COST[k] for k in ("nograd", "jvp", "grad")) / base["mean_step_s"]
        card = {"flops": flops, "hbm": bw["hbm"]}
        res["achieved_flops"] = flops
        ref = step_time(s0, card, bw["h2d"])["total"]
        res["slowdown"] = {
            n: {
                "measured": r["mean_step_s"] / base["mean_step_s"],
                "predicted": step_time(setups[n], card, bw["h2d"])["total"] / ref,
            }
            for n, r in res["runs"].items()
            if r.get("mean_step_s")
        }
    if cuda:
        import lowmem_probe

        res["probe"] = lowmem_probe.main(["--cuda"])
    res["seconds"] = time.perf_counter() - t0
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU sizes (CI); implied without CUDA")
    ap.add_argument("--out", default="gpu_check.json", help="JSON written here (atomically, after each part)")
    ap.add_argument(
        "--budget-s", type=float, default=450.0, help="whole run; the JVP benchmark gets at most 45 %% of it"
    )
    ap.add_argument("--steps", type=int, default=5, help="training iterations")
    ap.add_argument("--work", default="/tmp/rcm_gpu_check", help="scratch directory")
    ap.add_argument("--only", default="", choices=["", "one_card"], help="run one section alone, with the whole budget")
    a = ap.parse_args(argv)
    smoke = a.smoke or not torch.cuda.is_available()
    t0 = time.time()
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "smoke": smoke,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not smoke else "cpu",
    }

    def dump():
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out + ".tmp", "w") as f:
            json.dump(res, f, indent=1, default=float)
        os.replace(a.out + ".tmp", a.out)

    if a.only == "one_card":
        res["one_card"] = oc = one_card_check(smoke, a.budget_s - 10, os.path.join(a.work, "one_card"))
        dump()
        _print_one_card(oc)
        if any(r.get("rc", 0) != 0 for r in oc["runs"].values()):
            raise SystemExit("one-card check failed:\n" + "\n".join(r.get("log_tail", "") for r in oc["runs"].values()))
        return
    jvp_args = ["--smoke"] if smoke else ["--budget-s", str(0.45 * a.budget_s), "--reps", "5"]
    res["jvp_attention"] = jvp_attention.main(jvp_args)
    res["jvp_s"] = time.time() - t0
    dump()
    left = a.budget_s - (time.time() - t0)
    res["train"] = train_check(smoke, 2 if smoke else a.steps, max(left - 50, 30), a.work)
    dump()
    res["context_parallel_1"] = cp_check(smoke)
    dump()
    # section 4: memory of the checkpointing policies, 480p x 33 frames (14 040 tokens), 3 iterations each
    res["checkpointing"] = {}
    for policy in ("full", "selective"):
        left = a.budget_s - (time.time() - t0)
        if left < 60:
            res["checkpointing"][policy] = {"skipped": f"{left:.0f} s of the budget left"}
            continue
        res["checkpointing"][policy] = train_check(
            smoke,
            2 if smoke else 3,
            left - 20 if policy == "selective" else left / 2,
            os.path.join(a.work, policy),
            frames=9,
            policy=policy,
        )
        dump()
    # section 6: utilisation of the timed iterations (arithmetic on the runs above, plus one matrix product)
    runs = {"train": (res["train"], os.path.join(a.work, "train.yaml"))}
    runs.update(
        {
            f"checkpointing {p}": (r, os.path.join(a.work, p, "train.yaml"))
            for p, r in res["checkpointing"].items()
            if "steps" in r
        }
    )
    res["utilisation"] = {"matmul": matmul_rate(smoke)}
    for name, (r, ycfg) in runs.items():
        if r.get("rc") == 0 and os.path.exists(ycfg):
            res["utilisation"][name] = utilisation(r, ycfg, smoke)
    dump()
    # section 5: one card (fp8 base, block swap, activation offload) at the 14B width, as far as the budget allows
    left = a.budget_s - (time.time() - t0)
    res["one_card"] = one_card_check(
        smoke,
        left - 10,
        os.path.join(a.work, "one_card"),
        runs=("fp8_swap_offload",) if smoke else ("bf16", "fp8", "fp8_swap_offload"),
    )
    res["total_s"] = time.time() - t0
    dump()
    _print_one_card(res["one_card"])
    from rcm_diffusers.distill.cost import DEFAULT_UTILISATION

    util = res["utilisation"]
    mm = util["matmul"]
    print(f"matrix product ({mm['dtype']} {mm['n']}^3): {mm['tflop_s']:.3g} TFLOP/s")
    for name, u in util.items():
        if name != "matmul" and "overall" in u:
            share = u["overall"]["utilisation"]
            print(
                f"utilisation, {name}: {u['overall']['tflop_s']:.3g} TFLOP/s counted"
                + (
                    f" = {share:.0%} of the {u['peak_tflop_s']:.0f} TFLOP/s peak (the predictions assume "
                    f"{DEFAULT_UTILISATION:.0%})"
                    if share is not None
                    else " (no GPU peak: CPU smoke)"
                )
            )
    for policy, r in res["checkpointing"].items():
        if "rc" in r:
            print(
                f"checkpointing {policy}: rc {r['rc']}, peak "
                f"{max([s['peak_mem_mb'] or 0 for s in r['steps']] or [0]) / 1024:.2f} GiB "
                f"measured vs {r['predicted']['total_gib']:.2f} GiB predicted"
            )
        else:
            print(f"checkpointing {policy}: {r['skipped']}")
    cp = res["context_parallel_1"]
    print(
        f"context parallel, one rank: {cp['exchanges']} exchanges, relative differences {cp['err']} "
        f"(tolerance {cp['tol']:.2g})"
    )
    tr = res["train"]
    print(
        f"\ntraining: rc {tr['rc']}, iterations {[round(s['step_time'], 2) for s in tr['steps']]} s, peak "
        f"{max([s['peak_mem_mb'] for s in tr['steps']] or [0]) / 1024:.2f} GiB measured vs "
        f"{tr['predicted']['total_gib']:.2f} GiB predicted"
    )
    if tr["rc"] != 0:
        raise SystemExit(f"training check failed:\n{tr.get('log_tail', '')}")
    if not cp["ok"]:
        raise SystemExit(
            "context-parallel check failed: the one-rank CP model differs from the plain one beyond the tolerance"
        )


def _print_one_card(oc: dict) -> None:
    for name, r in oc["runs"].items():
        if "rc" not in r:
            print(f"one card {name}: {r['skipped']}")
            continue
        print(
            f"one card {name}: rc {r['rc']}, peak {r.get('peak_gib', 0):.2f} GiB measured vs "
            f"{r['predicted_without_overhead_gib']:.2f} GiB predicted (+ runtime overhead), mean iteration "
            f"{r.get('mean_step_s', 0):.2f} s"
            + (
                f", slowdown {oc['slowdown'][name]['measured']:.2f}x measured vs "
                f"{oc['slowdown'][name]['predicted']:.2f}x predicted"
                if name in oc.get("slowdown", {})
                else ""
            )
        )


if __name__ == "__main__":
    main()
