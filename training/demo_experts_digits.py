"""Two-expert digits demo (``make demo-experts``): both experts in one rCM run vs one expert's LoRA on both.

    python training/demo_experts_digits.py                  # 3 seeds x 2 methods, then the table
    python training/demo_experts_digits.py --seeds 0 --max_steps 30   # a quick try
    python training/demo_experts_digits.py --seeds 1,2 --methods two-experts   # one method's runs only

Teacher: the shipped two-expert digits teacher (``rcm_diffusers/digits/assets/digits_teacher_2expert``, Wan2.2-T2V-A14B
layout, boundary 0.875; ``training/train_experts_digits.py`` makes it). Per seed two students, same config
(``training/configs/digits-experts.yaml``), same iterations:

- ``two-experts``: ``training/rcm.py`` with both experts in one run (``--experts both``), a LoRA per expert;
- ``one-lora-both``: the "reuse one LoRA" approach: a student distilled from the low-noise expert alone
  (``--experts one --transformer_subfolder transformer_2``; that expert owns 96 % of p_G's times), its LoRA
  then applied to both experts.

Every student samples through the two-expert model with ``RCMScheduler`` (the pipeline's expert rule per step)
at ``--student_steps``; the two-experts EMA also as a user samples it (rows "two-experts: user call": the stock
``WanPipeline`` with ``load_rcm_lora``); the reference is the two-expert teacher at ``--ref_steps`` Euler steps. Writes
``OUT/report.md`` (mean ± sd over seeds of FD, FD / teacher FD and accuracy), ``OUT/results.json`` and
``OUT/samples.png``; FD is reported in the evaluator classifier's features and in raw pixels. Finished runs are
reused (also under another student sampler: ``sigma_max`` / ``mid_t`` do not change training), interrupted ones
resume; the teacher reference is cached in ``OUT``. Other ``--key value`` pairs go to every
training run (``training/rcm.py --help``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "training"))

import torch  # noqa: E402

from rcm_diffusers import digits as D  # noqa: E402
from rcm_diffusers.distill.config import load_config  # noqa: E402

CONFIG = os.path.join(REPO, "training", "configs", "digits-experts.yaml")
METHODS = {"two-experts": [], "one-lora-both": ["--experts", "one", "--transformer_subfolder", "transformer_2"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out", default=os.path.join(REPO, "outputs", "digits_experts"), help="folder of the runs and the report"
    )
    p.add_argument("--config", default=CONFIG, help="trainer YAML (default: training/configs/digits-experts.yaml)")
    p.add_argument("--seeds", default="0,1,2", help="training seeds, comma-separated")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    p.add_argument("--jobs", type=int, default=2, help="training runs at the same time (each one thread)")
    p.add_argument("--samples", type=int, default=1000, help="evaluation samples per row (classes cycle 0..9)")
    p.add_argument("--ref_steps", type=int, default=50, help="Euler steps of the two-expert teacher reference")
    p.add_argument("--student_steps", default="1,2,4", help="RCMScheduler steps of the student rows")
    p.add_argument("--skip_eval", action="store_true", help="train only")
    a, rest = p.parse_known_args(argv)
    if a.jobs < 1 or a.samples < 10:
        p.error("--jobs must be >= 1 and --samples >= 10")
    if not a.methods or any(m not in METHODS for m in a.methods.split(",")):
        p.error(f"--methods: a comma-separated subset of {', '.join(METHODS)}")
    if any(o.split("=")[0] in ("--output_dir", "--resume", "--seed") for o in rest):
        p.error("set run folders with --out and seeds with --seeds; resuming is automatic")
    return a, rest


def plan(a, overrides) -> list[dict]:
    runs = []
    for seed in [int(s) for s in a.seeds.split(",") if s.strip()]:
        for method, extra in METHODS.items():
            if method not in a.methods.split(","):
                continue
            d = os.path.join(a.out, f"{method}-s{seed}")
            args = ["--config", a.config, *overrides, *extra, "--seed", str(seed), "--output_dir", d]
            try:
                cfg = load_config(args)
            except ValueError as e:
                raise SystemExit(f"demo_experts_digits: {e}") from None
            runs.append({"method": method, "seed": seed, "dir": d, "args": args, "config": vars(cfg).copy()})
    return runs


def train(runs, a) -> dict:
    """Train the unfinished runs, ``--jobs`` at a time, the next one starting as soon as a slot frees (two-expert
    runs first: they are the longer ones); returns ``{run: wall seconds}``."""
    import time as _t

    from demo_digits import _env, launch_command

    todo = sorted(
        (r for r in runs if D.run_state(r["dir"], r["config"]) != "finished"),
        key=lambda r: r["method"] != "two-experts",
    )
    times, running = {}, []
    while todo or running:
        while todo and len(running) < a.jobs:
            r = todo.pop(0)
            os.makedirs(r["dir"], exist_ok=True)
            log = open(os.path.join(r["dir"], "train.log"), "a")
            cmd = launch_command([*r["args"], "--resume", "latest", "--progress", "false"])
            print(f"[demo-experts] training {os.path.basename(r['dir'])} (log: {log.name})", flush=True)
            running.append(
                (
                    r,
                    subprocess.Popen(cmd, cwd=REPO, env=_env(1), stdout=log, stderr=subprocess.STDOUT),
                    time.perf_counter(),
                    log,
                )
            )
        _t.sleep(2)
        for item in list(running):
            r, proc, t0, log = item
            rc = proc.poll()
            if rc is None:
                continue
            running.remove(item)
            log.close()
            times[os.path.basename(r["dir"])] = time.perf_counter() - t0
            if rc != 0:
                for _, other, _, _ in running:
                    other.terminate()
                raise SystemExit(f"demo_experts_digits: {r['dir']} failed (exit {rc}); see {log.name}")
            print(
                f"[demo-experts] {os.path.basename(r['dir'])} trained in "
                f"{times[os.path.basename(r['dir'])] / 60:.1f} min",
                flush=True,
            )
    return times


def two_expert_student(teacher_dir: str, lora_dir: str, reuse: bool):
    """The two-expert teacher with a student LoRA pair (or one LoRA on both experts) loaded through diffusers."""
    from diffusers import WanPipeline

    from rcm_diffusers.distill.experts import WanExpertSwitch
    from rcm_diffusers.lora.pipeline import load_rcm_lora

    sw, emb = D.load_teacher(teacher_dir)
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=None,
        scheduler=None,
        transformer=sw.transformer,
        transformer_2=sw.transformer_2,
        boundary_ratio=sw.boundary_ratio,
    )
    load_rcm_lora(
        pipe, lora_dir, adapter_name="student", reuse_for_both=reuse, scheduler=False
    )  # sampled by digits.sample
    return WanExpertSwitch(pipe.transformer, pipe.transformer_2, sw.boundary_ratio).eval(), emb


def teacher_reference(teacher_dir: str, labels: torch.Tensor, steps: int, out: str, seed: int = 1234) -> torch.Tensor:
    """The two-expert teacher's ``steps``-step Euler samples (noise ``seed``), cached in ``out``: on 2 cores they cost
    about as much as evaluating all the students of a seed. The cache is keyed by the teacher's files (content
    hash), the steps, the seed and the labels, so a retrained teacher or another protocol recomputes it."""
    import hashlib

    h = hashlib.sha256(f"{steps} {seed} {labels.tolist()}".encode())
    for root, _, files in sorted(os.walk(teacher_dir)):
        for f in sorted(files):
            with open(os.path.join(root, f), "rb") as fh:
                h.update(os.path.relpath(os.path.join(root, f), teacher_dir).encode() + fh.read())
    path = os.path.join(out, f"teacher_ref_{h.hexdigest()[:16]}.pt")
    if os.path.exists(path):
        return torch.load(path)
    sw, emb = D.load_teacher(teacher_dir)
    x = D.sample_teacher(sw, emb, labels, steps=steps, solver="euler", seed=seed)
    torch.save(x, path + ".tmp")
    os.replace(path + ".tmp", path)
    return x


def user_call_rows(run, teacher_dir, emb, labels, steps, teacher, ev) -> list[dict]:
    """Rows "two-experts: user call": the stock two-expert pipeline as a user loads it,
    ``WanPipeline.from_pretrained(teacher)`` + ``load_rcm_lora(pipe, RUN/ema)`` (both experts' LoRAs and the run's
    scheduler), sampled by ``pipe(...)`` itself (its expert switch, unscaled initial noise, its own re-noising). A run
    reused under another sampler (``sigma_max``, ``mid_t``, ``time_input``: they do not change training) gets its
    ``scheduler/`` folders written again with the config's, as the trainer would have written them."""
    from rcm_diffusers.schedulers import RCMScheduler

    c = run["config"]
    sched = RCMScheduler(
        sigma_max=c["sigma_max"], time_input=c["time_input"], **({"mid_t": c["mid_t"]} if c["mid_t"] else {})
    )
    for d in (run["dir"], os.path.join(run["dir"], "ema")):
        old = RCMScheduler.from_pretrained(d, subfolder="scheduler").config
        if any(old[k] != sched.config[k] for k in ("rcm_sigma_max", "mid_t", "time_input")):
            sched.save_pretrained(os.path.join(d, "scheduler"))
            print(f"[demo-experts] {d}/scheduler written with the config's sampler", flush=True)
    pipe, _ = D.load_student_pipeline(teacher_dir, os.path.join(run["dir"], "ema"))
    rows = []
    for k in steps:
        m = ev.evaluate(D.sample_pipeline(pipe, emb, labels, k, seed=1234), labels)
        rows.append(
            {
                "method": "two-experts: user call",
                "weights": "ema",
                "seed": run["seed"],
                "steps": k,
                **m,
                "fd_ratio": m["fd"] / teacher["fd"],
                "fd_pixel_ratio": m["fd_pixel"] / teacher["fd_pixel"],
            }
        )
    return rows


def evaluate(runs, a) -> list[dict]:
    torch.set_num_threads(1)
    ev = D.Evaluator()
    labels = torch.arange(a.samples) % D.NUM_CLASSES
    teacher_dir = runs[0]["config"]["pretrained"]
    teacher_dir = teacher_dir if os.path.isabs(teacher_dir) else os.path.join(REPO, teacher_dir)
    x_t = teacher_reference(teacher_dir, labels, a.ref_steps, a.out)
    teacher = ev.evaluate(x_t, labels)
    print(f"[demo-experts] two-expert teacher, {a.ref_steps} Euler steps: {teacher}", flush=True)
    rows, grid = [], [(f"teacher {a.ref_steps}", x_t[:10])]
    steps = [int(s) for s in a.student_steps.split(",") if s.strip()]
    for r in runs:
        for variant, sub in (("live", ""), ("ema", "ema")):
            model, emb = two_expert_student(
                teacher_dir, os.path.join(r["dir"], sub), reuse=r["method"] == "one-lora-both"
            )
            for k in steps:
                c = r["config"]
                x = D.sample_student(
                    model,
                    emb,
                    labels,
                    k,
                    seed=1234,
                    sigma_max=c["sigma_max"],
                    mid_t=c["mid_t"] or None,
                    time_input=c["time_input"],
                )
                m = ev.evaluate(x, labels)
                rows.append(
                    {
                        "method": r["method"],
                        "weights": variant,
                        "seed": r["seed"],
                        "steps": k,
                        **m,
                        "fd_ratio": m["fd"] / teacher["fd"],
                        "fd_pixel_ratio": m["fd_pixel"] / teacher["fd_pixel"],
                    }
                )
                if r["seed"] == runs[0]["seed"] and variant == "ema":
                    grid.append((f"{r['method']} {k}", x[:10]))
        if r["method"] == "two-experts":
            rows += user_call_rows(r, teacher_dir, emb, labels, steps, teacher, ev)
    D.save_grid(os.path.join(a.out, "samples.png"), grid)
    return teacher, rows


def report(a, teacher, rows, times) -> str:
    def ms(v, d=2):
        return f"{statistics.mean(v):.{d}f} ± {statistics.stdev(v):.{d}f}" if len(v) > 1 else f"{v[0]:.{d}f}"

    lines = [
        f"# Two-expert digits: both experts in one run vs one LoRA on both ({time.strftime('%Y-%m-%d')})",
        "",
        f"Reference: two-expert teacher, {a.ref_steps} Euler steps: FD {teacher['fd']:.2f}, "
        f"pixel FD {teacher['fd_pixel']:.3f}, "
        f"accuracy {teacher['accuracy']:.3f}. {a.samples} samples per row; mean ± sd over training seeds {a.seeds}. "
        "Pixel FD = Fréchet distance in raw pixels (a second feature space, not the classifier's).",
        "",
        "| method | weights | steps | FD ↓ | FD / teacher ↓ | pixel FD ↓ | pixel FD / teacher ↓ | accuracy ↑ "
        "| diversity (real = 1) | seeds |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = sorted({(r["method"], r["weights"], r["steps"]) for r in rows}, key=lambda k: (k[1], k[2], k[0]))
    for method, w, k in keys:
        sel = [r for r in rows if (r["method"], r["weights"], r["steps"]) == (method, w, k)]
        lines.append(
            f"| {method} | {w} | {k} | {ms([r['fd'] for r in sel])} | {ms([r['fd_ratio'] for r in sel])} | "
            f"{ms([r['fd_pixel'] for r in sel], 3)} | {ms([r['fd_pixel_ratio'] for r in sel])} | "
            f"{ms([r['accuracy'] for r in sel], 3)} | {ms([r['diversity'] for r in sel])} | {len(sel)} |"
        )
    text = "\n".join(lines) + "\n"
    D.atomic_write_text(os.path.join(a.out, "report.md"), text)
    D.atomic_write_text(
        os.path.join(a.out, "results.json"), json.dumps({"teacher": teacher, "rows": rows, "train_s": times}, indent=1)
    )
    return text


def main(argv=None):
    a, overrides = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    runs = plan(a, overrides)
    t0 = time.perf_counter()
    times = train(runs, a)
    if a.skip_eval:
        return None
    teacher, rows = evaluate(runs, a)
    print(report(a, teacher, rows, times), flush=True)
    print(
        f"[demo-experts] done in {(time.perf_counter() - t0) / 60:.1f} min: {os.path.join(a.out, 'report.md')}",
        flush=True,
    )
    return rows


if __name__ == "__main__":
    main()
