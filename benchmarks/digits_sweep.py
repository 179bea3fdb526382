"""Digits rCM sweep: train one student per variant, then FD ratios to the 50-step teacher (docs/screens.md).

    python benchmarks/digits_sweep.py --name base --out outputs/sweep -- --max_steps 2500 --seed 0
    python benchmarks/digits_sweep.py --name base --out outputs/sweep --eval_only

Everything after ``--`` goes to ``training/rcm.py`` (on top of ``training/configs/digits.yaml``); the run trains
into ``OUT/NAME`` (skipped when its ``final.json`` exists) with one torch thread and its log in ``OUT/NAME/train.log``.
Evaluation: the EMA and live LoRA, ``RCMScheduler`` at 1 / 2 / 4 steps (``--steps``), 1000 samples, seed 1234, the
student sampled as its run's ``env.json`` config names: the time input it was trained with (``bf16`` rounds the
transformer's timestep ``1000 r`` to bfloat16, as training fed it), ``sigma_max`` and ``mid_t``. FD to held-out real
digits and its ratio to the 50-step Euler teacher's FD, the same for the pixel FD (raw pixels, a second feature
space), class accuracy and diversity; one JSON line per run appended to ``OUT/sweep.jsonl`` with the wall clock of
training. ``--extra_ema 0.05,0.2`` trains through ``benchmarks/train_extra_ema.py`` (no resume) and evaluates each
extra power-EMA rate too (``ema-<s>`` rows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rcm_diffusers import digits as D  # noqa: E402


def teacher_fd(ev, labels, seed: int, cache: str) -> dict:
    """FD and pixel FD of the 50-step Euler teacher (no CFG), cached in ``cache``."""
    if os.path.exists(cache):
        ref = json.load(open(cache))
        if "fd_pixel" in ref:
            return ref
    tr, emb = D.load_teacher()
    m = ev.evaluate(D.sample_teacher(tr, emb, labels, 50, "euler", 1.0, seed), labels)
    ref = {"fd": m["fd"], "fd_pixel": m["fd_pixel"]}
    D.atomic_write_text(cache, json.dumps(ref))
    return ref


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True, help="variant name = run directory under --out")
    p.add_argument("--out", default="outputs/sweep", help="sweep directory")
    p.add_argument("--steps", default="1,2,4", help="student step counts")
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1234, help="evaluation seed")
    p.add_argument("--eval_only", action="store_true", help="evaluate an existing run")
    p.add_argument(
        "--extra_ema",
        default="",
        help="comma-separated extra power-EMA rates kept during training (one run, every rate)",
    )
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    run = os.path.abspath(os.path.join(a.out, a.name))
    os.makedirs(run, exist_ok=True)
    train_s = None
    if not a.eval_only and not os.path.exists(os.path.join(run, "final.json")):
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        t0 = time.perf_counter()
        if a.extra_ema:  # a fresh run: the extra shadows are not checkpointed
            cmd = [
                os.path.join(REPO, "benchmarks", "train_extra_ema.py"),
                a.extra_ema,
                "--",
                *train_args,
                "--output_dir",
                run,
                "--progress",
                "false",
                "--overwrite",
                "true",
            ]
        else:
            cmd = [
                os.path.join(REPO, "training", "rcm.py"),
                *train_args,
                "--output_dir",
                run,
                "--progress",
                "false",
                "--resume",
                "latest",
            ]
        with open(os.path.join(run, "train.log"), "w") as log:
            subprocess.run([sys.executable, *cmd], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        train_s = time.perf_counter() - t0
    with open(os.path.join(run, "env.json")) as f:
        cfg = json.load(f)["config"]
    ev = D.Evaluator()
    labels = torch.arange(a.samples) % D.NUM_CLASSES
    ref = teacher_fd(
        ev, labels, a.seed, os.path.join(os.path.abspath(a.out), f"teacher50_seed{a.seed}_n{a.samples}.json")
    )
    rec = {
        "name": a.name,
        "args": train_args,
        "train_s": train_s,
        "time_input": cfg.get("time_input", "float"),
        "teacher_fd": ref["fd"],
        "teacher_fd_pixel": ref["fd_pixel"],
    }
    emas = sorted(d for d in os.listdir(run) if d.startswith("ema-") and os.path.isdir(os.path.join(run, d)))
    for which, d in [("ema", os.path.join(run, "ema")), ("live", run)] + [(e, os.path.join(run, e)) for e in emas]:
        tr, emb = D.load_student(D.TEACHER_DIR, d)
        for n in [int(v) for v in a.steps.split(",")]:
            m = ev.evaluate(
                D.sample_student(
                    tr,
                    emb,
                    labels,
                    n,
                    a.seed,
                    float(cfg.get("sigma_max", 80.0)),
                    cfg.get("mid_t") or None,
                    time_input=rec["time_input"],
                ),
                labels,
            )
            rec[f"{which}_fd{n}"] = round(m["fd"], 3)
            rec[f"{which}_ratio{n}"] = round(m["fd"] / ref["fd"], 3)
            rec[f"{which}_pixfd{n}"] = round(m["fd_pixel"], 4)
            rec[f"{which}_pixratio{n}"] = round(m["fd_pixel"] / ref["fd_pixel"], 3)
            rec[f"{which}_acc{n}"] = round(m["accuracy"], 3)
            rec[f"{which}_div{n}"] = round(m["diversity"], 3)
    with open(os.path.join(a.out, "sweep.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
