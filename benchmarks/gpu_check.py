"""The one GPU check of docs/benchmarks.md (driven by ``benchmarks/gpu_check.sh``), budget-guarded, one JSON out.

1. JVP attention (``benchmarks/jvp_attention.py``): fused Triton kernel vs SDPA forward vs
   ``torch.func.jvp`` through math SDPA, S 1k-32k, H 12/40, D 128, bf16, error vs float64 at each shape.
2. 5 rCM training iterations of the Wan2.1-T2V-1.3B architecture (random init, bf16, LoRA rank 64,
   gradient checkpointing, fd_type 0) on a 480p x 81-frame latent (16 x 21 x 60 x 104 = 32 760 tokens)
   and 512 text tokens, through ``training/rcm.py``: time per iteration and peak CUDA memory, next to
   ``rcm_diffusers.distill.memory.predict_training`` for the same setup.

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


def train_check(smoke: bool, steps: int, timeout: float, work: str) -> dict:
    arch = "wan2.1-t2v-1.3b"
    if smoke:
        over, shape, text, rank, dtype = dict(num_layers=1, num_attention_heads=2), (16, 2, 8, 8), 16, 4, "float32"
    else:
        over, shape, text, rank, dtype = {}, (16, 21, 60, 104), 512, 64, "bfloat16"
    cfg = arch_config(arch, **over)
    t0 = time.perf_counter()
    pipe = save_random_pipeline(arch, os.path.join(work, "pipe"), dtype=real_arch.DTYPES[dtype], **over)
    data = real_arch.make_data(os.path.join(work, "data"), "wan", shape, text, cfg["text_dim"], 0)
    setup_s = time.perf_counter() - t0
    args = SimpleNamespace(rank=rank, dtype=dtype, steps=steps, family="wan")
    out = os.path.join(work, "run")
    ycfg = os.path.join(work, "train.yaml")
    real_arch.write_train_config(ycfg, args, pipe, data, out, fd_type=0, gc=True)
    r = real_arch.run_child([sys.executable, os.path.join(REPO, "training", "rcm.py"), "--config", ycfg], os.path.join(work, "train.log"), timeout)
    mpath = os.path.join(out, "metrics.jsonl")
    recs = [json.loads(ln) for ln in open(mpath)] if os.path.exists(mpath) else []
    tokens = shape[1] * shape[2] * shape[3] // 4
    setup = TrainSetup.from_config(cfg, "WanTransformer3DModel", tokens=tokens, text_tokens=text, lora_rank=rank, weight_dtype=dtype,
                                   gradient_checkpointing=True, fd_type=0)
    res = {"arch": arch, "overrides": over, "latent": [1, *shape], "tokens": tokens, "text_tokens": text, "lora_rank": rank,
           "dtype": dtype, "setup_s": setup_s, **{k: v for k, v in r.items() if k != "log"},
           "steps": [{k: rec.get(k) for k in ("step", "net", "step_time", "peak_mem_mb", "loss_scm", "loss_dmd", "loss_fake")} for rec in recs],
           "predicted": predict_training(setup, device="cuda" if torch.cuda.is_available() and not smoke else "cpu")}
    if r["rc"] != 0:
        res["log_tail"] = open(os.path.join(work, "train.log")).read()[-3000:]
    return res


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
    res["train"] = train_check(smoke, 2 if smoke else a.steps, max(left - 10, 30), a.work)
    res["total_s"] = time.time() - t0
    dump()
    tr = res["train"]
    print(f"\ntraining: rc {tr['rc']}, iterations {[round(s['step_time'], 2) for s in tr['steps']]} s, peak "
          f"{max([s['peak_mem_mb'] for s in tr['steps']] or [0]) / 1024:.2f} GiB measured vs {tr['predicted']['total_gib']:.2f} GiB predicted")
    if tr["rc"] != 0:
        raise SystemExit(f"training check failed:\n{tr.get('log_tail', '')}")


if __name__ == "__main__":
    main()
