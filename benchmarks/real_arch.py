"""The real Wan2.1-T2V-1.3B / FLUX.1-dev architectures end to end on CPU with random weights (docs/benchmarks.md).

For one architecture (``rcm_diffusers/arch_configs``) at its real width, with a tiny latent and
real-length text (512 tokens of dim 4096), every run is a fresh subprocess so its peak RSS is its own:

* ``pipeline``: a 4-step ``RCMScheduler`` run of the stock diffusers pipeline (WanPipeline / FluxPipeline),
* ``fd0-gc``, ``fd0``, ``fd2-gc``, ``fd2``: ``training/rcm.py`` in shared-base LoRA mode for ``--steps``
  iterations (student sCM+DMD, fake score, student again), ``fd_type`` 0 (exact JVP through
  ``rcm_diffusers.attention``, torch backend on CPU) or 2 (finite difference), gradient checkpointing on/off;
  ``fd0-sac``, ``fd2-sac``: gradient checkpointing with ``--checkpointing_policy selective``.

Prints a markdown table (peak RSS, time per step, parameters trainable / frozen) and writes ``--out`` JSON
with the memory model's prediction (``rcm_diffusers.distill.memory``) next to each measurement.

    python benchmarks/real_arch.py --arch wan2.1-t2v-1.3b --dtype float32 --runs pipeline,fd0-gc,fd0,fd2-gc,fd2
    python benchmarks/real_arch.py --arch flux.1-dev --num_layers 2 --num_single_layers 2 --runs pipeline,fd0-gc
    python benchmarks/real_arch.py --smoke          # CI: a 1-block cut of the same code path, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rcm_diffusers.arch import arch_config, arch_meta, save_random_pipeline  # noqa: E402

TEXT_TOKENS, TEXT_DIM = 512, 4096
TRAIN_RUNS = {
    "fd0-gc": (0, True),
    "fd0": (0, False),
    "fd2-gc": (2, True),
    "fd2": (2, False),
    "fd0-sac": (0, "selective"),
    "fd2-sac": (2, "selective"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def latent_shape(family: str, frames: int, hw: int) -> tuple[int, ...]:
    """Per-sample dataset latent: Wan ``[16, T, h, w]``, Flux ``[16, h, w]``."""
    return (16, frames, hw, hw) if family == "wan" else (16, hw, hw)


def make_data(root: str, family: str, shape, text_tokens: int, text_dim: int, pooled_dim: int, n: int = 2) -> str:
    from rcm_diffusers.distill.data import write_latent_dataset

    if os.path.exists(os.path.join(root, "meta.json")):
        return root
    g = torch.Generator().manual_seed(0)
    tables = {"prompt_embeds": torch.randn(n, text_tokens, text_dim, generator=g)}
    index = {"prompt_embeds": "prompt_index"}
    if family == "wan":
        tables["negative_prompt_embeds"] = torch.randn(1, text_tokens, text_dim, generator=g)
        index["negative_prompt_embeds"] = None
    else:
        tables["pooled_prompt_embeds"] = torch.randn(n, pooled_dim, generator=g)
        index["pooled_prompt_embeds"] = "prompt_index"
    return write_latent_dataset(
        root,
        {"latents": torch.randn(n, *shape, generator=g), "prompt_index": torch.arange(n)},
        family=family,
        tables=tables,
        table_index=index,
    )


def run_child(cmd: list[str], log: str, timeout: float) -> dict:
    """Run ``cmd``; its own peak RSS (``wait4`` rusage, so only this child) and wall time."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": REPO}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                p.kill()
                pid, status, ru = os.wait4(p.pid, 0)
                break
            time.sleep(0.5)
    rc = os.waitstatus_to_exitcode(status)
    return {"rc": rc, "wall_s": time.perf_counter() - t0, "peak_rss_gib": ru.ru_maxrss / 2**20, "log": log}


def child_pipeline(args) -> None:
    """(in a subprocess) 4-step RCMScheduler run of the stock pipeline on the saved random transformer."""
    import diffusers

    from rcm_diffusers import RCMScheduler

    dtype = DTYPES[args.dtype]
    meta = json.load(open(os.path.join(args.pretrained, "model_index.json")))
    tcls = getattr(diffusers, meta["transformer"][1])
    t0 = time.perf_counter()
    tr = tcls.from_pretrained(args.pretrained, subfolder="transformer", torch_dtype=dtype)
    load_s = time.perf_counter() - t0
    pipe_cls = getattr(diffusers, meta["_class_name"])
    sched = RCMScheduler(sigma_max=80.0)
    data = torch.load if False else None  # noqa: F841 (kept simple: embeddings drawn here)
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(1, args.text_tokens, args.text_dim, generator=g).to(dtype)
    times = []

    def on_step(pipe, i, t, kw):
        times.append(time.perf_counter())
        return kw

    t0 = time.perf_counter()
    if meta["_class_name"].startswith("Wan"):
        pipe = pipe_cls(tokenizer=None, text_encoder=None, vae=None, transformer=tr, scheduler=sched)
        pipe.set_progress_bar_config(disable=True)
        out = pipe(
            prompt_embeds=emb,
            negative_prompt_embeds=emb,
            guidance_scale=1.0,
            num_inference_steps=4,
            height=args.hw * 8,
            width=args.hw * 8,
            num_frames=4 * (args.frames - 1) + 1,
            output_type="latent",
            generator=torch.Generator().manual_seed(1),
            callback_on_step_end=on_step,
        ).frames
    else:
        pooled = torch.randn(1, tr.config.pooled_projection_dim, generator=g).to(dtype)
        pipe = pipe_cls(
            scheduler=sched,
            vae=None,
            text_encoder=None,
            tokenizer=None,
            text_encoder_2=None,
            tokenizer_2=None,
            transformer=tr,
        )
        pipe.set_progress_bar_config(disable=True)
        out = pipe(
            prompt_embeds=emb,
            pooled_prompt_embeds=pooled,
            guidance_scale=3.5,
            num_inference_steps=4,
            height=args.hw * 8,
            width=args.hw * 8,
            output_type="latent",
            generator=torch.Generator().manual_seed(1),
            callback_on_step_end=on_step,
        ).images
    steps = [b - a for a, b in zip([t0] + times[:-1], times)]
    res = {
        "load_s": load_s,
        "step_s": steps,
        "out_shape": list(out.shape),
        "out_finite": bool(torch.isfinite(out.float()).all()),
        "out_std": float(out.float().std()),
    }
    print("RESULT " + json.dumps(res))


def param_counts(arch: str, overrides: dict, rank: int) -> dict:
    """Frozen base and trainable (student + fake LoRA) parameter counts, on the meta device."""
    from rcm_diffusers.arch import build_transformer
    from rcm_diffusers.distill.adapters import add_rcm_adapters, lora_parameters

    m = build_transformer(arch, device="meta", **overrides)
    base = sum(p.numel() for p in m.parameters())
    add_rcm_adapters(m, rank, None, with_fake=True)
    return {
        "frozen": base,
        "student": sum(p.numel() for p in lora_parameters(m, "student").values()),
        "fake": sum(p.numel() for p in lora_parameters(m, "fake").values()),
    }


def write_train_config(path: str, args, pretrained: str, data: str, out: str, fd_type: int, gc: bool) -> None:
    bf16 = args.dtype == "bfloat16"
    # the run folder is this benchmark's scratch: a rerun replaces it (the trainer refuses a used folder otherwise)
    cfg = {
        "pretrained": pretrained,
        "data_dir": data,
        "output_dir": out,
        "overwrite": True,
        "mode": "shared",
        "lora_rank": args.rank,
        "weight_dtype": args.dtype,
        "mixed_precision": "bf16" if bf16 else "no",
        "gradient_checkpointing": bool(gc),
        "checkpointing_policy": gc if isinstance(gc, str) else "full",
        "fd_type": fd_type,
        "batch_size": 1,
        "max_steps": args.steps,
        # iteration 0: student sCM + DMD, 1: fake score, 2: student sCM + DMD with 2 simulation steps
        "tangent_warmup": 0,
        "student_update_freq": 2,
        "max_simulation_steps": 4,
        "dmd_weight": 0.01,
        "guidance_scale": 5.0 if args.family == "wan" else 1.0,
        "lr": 1e-5,
        "fake_lr": 2e-6,
        "ema_rate": 0.1,
        "max_grad_norm": 1.0,
        "checkpoint_every": 0,
        "log_every": 1,
        "progress": False,
        "report_to": "none",
        "sample_every": 0,
    }
    if args.family == "flux":
        cfg["flux_guidance"] = 3.5
    import yaml

    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="wan2.1-t2v-1.3b", help="architecture name in rcm_diffusers/arch_configs")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="weight dtype (bfloat16 also trains with bf16 autocast)",
    )
    ap.add_argument(
        "--runs", default="pipeline,fd0-gc,fd0,fd2-gc,fd2", help="comma list of: pipeline, " + ", ".join(TRAIN_RUNS)
    )
    ap.add_argument("--steps", type=int, default=3, help="training iterations per training run")
    ap.add_argument("--rank", type=int, default=32, help="LoRA rank of student and fake score")
    ap.add_argument(
        "--num_layers", type=int, default=0, help="cut the transformer to this many (double) blocks (0 = real depth)"
    )
    ap.add_argument("--num_single_layers", type=int, default=-1, help="Flux: single blocks (-1 = real depth)")
    ap.add_argument("--frames", type=int, default=2, help="latent frames (Wan)")
    ap.add_argument("--hw", type=int, default=8, help="latent height = width")
    ap.add_argument("--text_tokens", type=int, default=TEXT_TOKENS, help="prompt-embedding length")
    ap.add_argument("--work", default="/tmp/rcm_real_arch", help="scratch directory (random weights, data, runs)")
    ap.add_argument("--out", default="", help="write the results JSON here")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    ap.add_argument(
        "--smoke", action="store_true", help="CI: 1 block, 2 heads, short text, 1 step, runs pipeline,fd0-gc,fd2"
    )
    ap.add_argument("--_child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--pretrained", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    meta = arch_meta(args.arch)
    args.family = "wan" if meta["class_name"].startswith("Wan") else "flux"
    overrides = {}
    if args.num_layers:
        overrides["num_layers"] = args.num_layers
    if args.family == "flux" and args.num_single_layers >= 0:
        overrides["num_single_layers"] = args.num_single_layers
    if args.smoke:
        overrides.update(num_layers=1, num_attention_heads=2)
        if args.family == "flux":
            overrides.update(num_single_layers=1, axes_dims_rope=[16, 56, 56])
        args.text_tokens, args.steps, args.rank = 16, 1, 4
        if args.runs == ap.get_default("runs"):
            args.runs = "pipeline,fd0-gc,fd2"
    cfg = arch_config(args.arch, **overrides)
    args.text_dim = cfg.get("text_dim", cfg.get("joint_attention_dim"))
    if args._child == "pipeline":
        return child_pipeline(args)

    from rcm_diffusers.distill.memory import TrainSetup, predict_training

    tag = f"{args.arch}-{args.dtype}" + "".join(
        f"-{k}{v}" for k, v in sorted(overrides.items()) if k != "axes_dims_rope"
    )
    work = os.path.join(args.work, tag)
    os.makedirs(work, exist_ok=True)
    t0 = time.perf_counter()
    pretrained = save_random_pipeline(args.arch, os.path.join(work, "pipe"), dtype=DTYPES[args.dtype], **overrides)
    print(f"random {args.arch} {overrides or ''} saved in {time.perf_counter() - t0:.0f}s", flush=True)
    shape = latent_shape(args.family, args.frames, args.hw)
    data = make_data(
        os.path.join(work, f"data-{args.text_tokens}"),
        args.family,
        shape,
        args.text_tokens,
        args.text_dim,
        cfg.get("pooled_projection_dim", 0),
    )
    counts = param_counts(args.arch, overrides, args.rank)
    tokens = (args.frames * args.hw * args.hw // 4) if args.family == "wan" else args.hw * args.hw // 4
    results = {
        "arch": args.arch,
        "overrides": overrides,
        "dtype": args.dtype,
        "latent": [1, *shape],
        "tokens": tokens,
        "text_tokens": args.text_tokens,
        "lora_rank": args.rank,
        "params": counts,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "runs": {},
    }
    for run in [r for r in args.runs.split(",") if r]:
        log = os.path.join(work, f"{run}.log")
        if run == "pipeline":
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--_child",
                "pipeline",
                "--pretrained",
                pretrained,
                "--arch",
                args.arch,
                "--dtype",
                args.dtype,
                "--frames",
                str(args.frames),
                "--hw",
                str(args.hw),
                "--text_tokens",
                str(args.text_tokens),
            ]
            cmd += [
                x for k, v in overrides.items() if k in ("num_layers", "num_single_layers") for x in (f"--{k}", str(v))
            ]
            r = run_child(cmd, log, args.timeout)
            line = [ln for ln in open(log) if ln.startswith("RESULT ")]
            r.update(json.loads(line[-1][7:]) if line else {"error": open(log).read()[-2000:]})
        elif run in TRAIN_RUNS:
            fd, gc = TRAIN_RUNS[run]
            out = os.path.join(work, f"run-{run}")
            import shutil

            shutil.rmtree(out, ignore_errors=True)
            ycfg = os.path.join(work, f"{run}.yaml")
            write_train_config(ycfg, args, pretrained, data, out, fd, gc)
            r = run_child(
                [sys.executable, os.path.join(REPO, "training", "rcm.py"), "--config", ycfg], log, args.timeout
            )
            mpath = os.path.join(out, "metrics.jsonl")
            recs = [json.loads(ln) for ln in open(mpath)] if os.path.exists(mpath) else []
            r["steps"] = [
                {
                    k: rec.get(k)
                    for k in (
                        "step",
                        "net",
                        "step_time",
                        "peak_mem_mb",
                        "loss_scm",
                        "loss_dmd",
                        "loss_fake",
                        "grad_norm",
                    )
                }
                for rec in recs
            ]
            r["final"] = os.path.exists(os.path.join(out, "final.json"))
            r["losses_finite"] = all(
                math.isfinite(v) for rec in recs for k, v in rec.items() if k.startswith("loss") and v is not None
            )
            setup = TrainSetup.from_config(
                cfg,
                meta["class_name"],
                tokens=tokens,
                text_tokens=args.text_tokens,
                batch=1,
                lora_rank=args.rank,
                weight_dtype=args.dtype,
                gradient_checkpointing=bool(gc),
                fd_type=fd,
                checkpointing_policy=gc if isinstance(gc, str) else "full",
            )
            r["predicted"] = predict_training(setup, device="cpu")
            if r["rc"] != 0:
                r["error"] = open(log).read()[-3000:]
            shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)
        else:
            raise SystemExit(f"unknown run {run!r}; choose from pipeline, {', '.join(TRAIN_RUNS)}")
        results["runs"][run] = r
        print(f"{run}: rc {r['rc']}, peak RSS {r['peak_rss_gib']:.2f} GiB, wall {r['wall_s']:.0f}s", flush=True)
        if args.out:
            with open(args.out + ".tmp", "w") as f:
                json.dump(results, f, indent=1)
            os.replace(args.out + ".tmp", args.out)
    print(table(results))
    bad = [
        k
        for k, r in results["runs"].items()
        if r["rc"] != 0 or not (r.get("out_finite", True) and r.get("losses_finite", True))
    ]
    if bad:
        raise SystemExit(f"failed runs: {bad} (logs under {work})")
    return results


def table(res: dict) -> str:
    p = res["params"]
    lines = [
        f"{res['arch']} {res['overrides'] or ''} {res['dtype']}, latent {res['latent']} ({res['tokens']} tokens), "
        f"text {res['text_tokens']}, LoRA rank {res['lora_rank']}: frozen {p['frozen'] / 1e9:.3f} B, "
        f"trainable {p['student'] / 1e6:.1f} M (student) + {p['fake'] / 1e6:.1f} M (fake)",
        "",
        "| run | peak RSS (GiB) | predicted (GiB) | predicted activations (GiB) "
        "| s / step (per iteration) | wall (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in res["runs"].items():
        if name == "pipeline":
            steps = ", ".join(f"{s:.1f}" for s in r.get("step_s", []))
            lines.append(f"| pipeline 4-step | {r['peak_rss_gib']:.2f} | | | {steps} | {r['wall_s']:.0f} |")
        else:
            steps = ", ".join(f"{s['net'][0]} {s['step_time']:.1f}" for s in r.get("steps", []))
            pred = r.get("predicted", {}).get("total_gib", float("nan"))
            act = r.get("predicted", {}).get("activations", float("nan")) / 2**30
            lines.append(
                f"| train {name} | {r['peak_rss_gib']:.2f} | {pred:.2f} | {act:.3f} | {steps} | {r['wall_s']:.0f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
