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

``--smoke`` (and any machine without CUDA): the same code at tiny sizes on CPU (CI runs it).
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
    r = real_arch.run_child([sys.executable, os.path.join(REPO, "training", "rcm.py"), "--config", ycfg], os.path.join(work, "train.log"), timeout)
    mpath = os.path.join(out, "metrics.jsonl")
    recs = [json.loads(ln) for ln in open(mpath)] if os.path.exists(mpath) else []
    tokens = shape[1] * shape[2] * shape[3] // 4
    setup = TrainSetup.from_config(cfg, "WanTransformer3DModel", tokens=tokens, text_tokens=text, lora_rank=rank, weight_dtype=dtype,
                                   gradient_checkpointing=True, checkpointing_policy=policy, fd_type=0)
    res = {"arch": arch, "overrides": over, "latent": [1, *shape], "tokens": tokens, "text_tokens": text, "lora_rank": rank,
           "checkpointing_policy": policy,
           "dtype": dtype, "setup_s": setup_s, **{k: v for k, v in r.items() if k != "log"},
           "steps": [{k: rec.get(k) for k in ("step", "net", "step_time", "peak_mem_mb", "loss_scm", "loss_dmd", "loss_fake")} for rec in recs],
           "predicted": predict_training(setup, device="cuda" if torch.cuda.is_available() and not smoke else "cpu")}
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
    cond = {"encoder_hidden_states": torch.randn(1, text, model.config.text_dim, generator=g, device=device, dtype=torch.float64).to(dtype)}
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
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
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
    return {"arch": "wan2.1-t2v-1.3b", "overrides": over, "latent": [1, *shape], "tokens": shape[1] * shape[2] * shape[3] // 4,
            "dtype": str(dtype).split(".")[-1], "device": device, "exchanges": seen[0], "err": err, "tol": tol,
            "ok": seen[0] > 0 and all(e <= tol for e in err.values()), "seconds": time.perf_counter() - t0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU sizes (CI); implied without CUDA")
    ap.add_argument("--out", default="gpu_check.json", help="JSON written here (atomically, after each part)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="whole run; the JVP benchmark gets at most 45 %% of it")
    ap.add_argument("--steps", type=int, default=5, help="training iterations")
    ap.add_argument("--work", default="/tmp/rcm_gpu_check", help="scratch directory")
    a = ap.parse_args(argv)
    smoke = a.smoke or not torch.cuda.is_available()
    t0 = time.time()
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "smoke": smoke, "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not smoke else "cpu"}

    def dump():
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out + ".tmp", "w") as f:
            json.dump(res, f, indent=1, default=float)
        os.replace(a.out + ".tmp", a.out)

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
        res["checkpointing"][policy] = train_check(smoke, 2 if smoke else 3, left - 20 if policy == "selective" else left / 2,
                                                   os.path.join(a.work, policy), frames=9, policy=policy)
        dump()
    res["total_s"] = time.time() - t0
    dump()
    for policy, r in res["checkpointing"].items():
        if "rc" in r:
            print(f"checkpointing {policy}: rc {r['rc']}, peak {max([s['peak_mem_mb'] or 0 for s in r['steps']] or [0]) / 1024:.2f} GiB "
                  f"measured vs {r['predicted']['total_gib']:.2f} GiB predicted")
        else:
            print(f"checkpointing {policy}: {r['skipped']}")
    cp = res["context_parallel_1"]
    print(f"context parallel, one rank: {cp['exchanges']} exchanges, relative differences {cp['err']} (tolerance {cp['tol']:.2g})")
    tr = res["train"]
    print(f"\ntraining: rc {tr['rc']}, iterations {[round(s['step_time'], 2) for s in tr['steps']]} s, peak "
          f"{max([s['peak_mem_mb'] for s in tr['steps']] or [0]) / 1024:.2f} GiB measured vs {tr['predicted']['total_gib']:.2f} GiB predicted")
    if tr["rc"] != 0:
        raise SystemExit(f"training check failed:\n{tr.get('log_tail', '')}")
    if not cp["ok"]:
        raise SystemExit("context-parallel check failed: the one-rank CP model differs from the plain one beyond the tolerance")


if __name__ == "__main__":
    main()
