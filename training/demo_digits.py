"""The digits demo (``make demo``): rCM-distil the shipped digits teacher, then evaluate it in one report.

    python training/demo_digits.py                 # rCM student (training/configs/digits.yaml), then the table
    python training/demo_digits.py --ablations     # + sCM-only, DMD-only and no-regression students, same table
    python training/demo_digits.py --quality       # twice the iterations (2900), into outputs/digits-quality

Each student is one ``accelerate launch --num_processes P training/rcm.py`` run (``runs.cpu_launch_command``:
``--cpu`` for one process, accelerate's torchrun launcher and gloo for several) with ``OMP_NUM_THREADS=1`` per
process, run from the repository root; ``P`` = ``--processes`` (default: 2 when the machine has 2 or more cores,
else 1) data-parallel processes that split the config's ``batch_size`` between them (the global batch stays the
config's). The demo checks afterwards that the run had ``P`` ranks.
Run directories: ``OUT`` (rCM), ``OUT-scm-only`` (``--use_dmd false``), ``OUT-dmd-only``
(``--scm_weight 0 --tangent_warmup 0``), both without the regression term, and ``OUT-no-regression``
(``--regression_weight 0``: rCM alone; see ``rcm_diffusers.digits.ABLATIONS``). A run whose ``final.json`` and
LoRA exist is reused (unless ``--force``); an interrupted one resumes from its latest checkpoint. Then
``training/eval_digits.py`` evaluates the teacher rows and every student (live and EMA weights) once and writes
``OUT/report.md``, ``OUT/samples.png`` and ``OUT/results.json``; ``OUT/demo_timing.json`` holds the wall clock
of each phase. Any other ``--key value`` is passed to every training run (see ``training/rcm.py --help``),
e.g. ``--max_steps 30 --batch_size 8`` for a quick try.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rcm_diffusers import digits as D  # noqa: E402
from rcm_diffusers.distill import launch as R  # noqa: E402
from rcm_diffusers.distill.config import load_config  # noqa: E402
from rcm_diffusers.sampling import format_mid_t  # noqa: E402

DEFAULT_CONFIG = os.path.join(REPO, "training", "configs", "digits.yaml")
QUALITY_STEPS = 2900  # --quality: twice digits.yaml's 1450; buys 2 and 4 steps ~0.5 FD, not 1 step (docs/screens.md)


def parse_args(argv=None):
    """Demo options; unknown ``--key value`` pairs are returned as trainer overrides."""
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Trainer options not listed here (--max_steps, --batch_size, --lr, ...) go to every "
        "training run; ablation switches are applied after them.",
    )
    p.add_argument(
        "--ablations",
        action="store_true",
        help="also train the sCM-only (--use_dmd false) and DMD-only (--scm_weight 0 --tangent_warmup 0) "
        "students, both without the regression term, and rCM without it (--regression_weight 0), "
        "with the same iterations, and put them in the same report",
    )
    p.add_argument(
        "--out",
        default=None,
        help="rCM run directory, also where report.md/samples.png go (default: output_dir of the config, "
        "outputs/digits); ablations train into OUT-scm-only, OUT-dmd-only and OUT-no-regression",
    )
    p.add_argument(
        "--quality",
        action="store_true",
        help=f"the longer preset: max_steps {QUALITY_STEPS} (twice the default's; about twice the time), "
        "default run directory OUTPUT_DIR-quality; a --max_steps given here still wins",
    )
    p.add_argument("--config", default=DEFAULT_CONFIG, help="trainer YAML (default: training/configs/digits.yaml)")
    p.add_argument(
        "--force", action="store_true", help="retrain even if a finished run exists (deletes that run directory first)"
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="ablation runs trained at the same time, after the rCM run (which always trains alone so its "
        "wall clock is the default demo's); >1 writes their output to RUN/train.log",
    )
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads per process (default 1)")
    p.add_argument(
        "--processes",
        type=int,
        default=default_processes(),
        help="data-parallel CPU processes per training run (accelerate / DDP over gloo); each takes "
        "batch_size / processes samples, so the global batch is the config's (default: "
        "min(2, CPU cores))",
    )
    p.add_argument(
        "--eval_threads",
        type=int,
        default=0,
        help="torch threads of the evaluation, which runs after training on the cores training used "
        "(default 0 = threads x processes; the samples are the same to the bit for any count)",
    )
    p.add_argument("--samples", type=int, default=1000, help="evaluation samples per table row (classes cycle 0..9)")
    p.add_argument("--ref_steps", type=int, default=50, help="steps of the reference teacher rows")
    p.add_argument("--teacher_steps", default="1,2,4,8", help="few-step teacher rows (Euler and UniPC)")
    p.add_argument("--student_steps", default="1,2,4", help="student rows (RCMScheduler steps)")
    p.add_argument("--skip_eval", action="store_true", help="train only")
    p.add_argument("--dry_run", action="store_true", help="print what would run and exit")
    a, rest = p.parse_known_args(argv)
    if a.jobs < 1 or a.threads < 1 or a.processes < 1 or a.samples < 10 or a.eval_threads < 0:
        p.error("--jobs, --threads and --processes must be >= 1, --eval_threads >= 0, --samples >= 10")
    return a, rest


def default_processes() -> int:
    """Training processes of the demo: both cores of a 2-core box (DDP 1.4x one single-threaded process at the
    same global batch, docs/screens.md)."""
    return max(1, min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def plan_runs(a, overrides: list[str]) -> list[dict]:
    """One dict per student run: ``name``, ``dir`` (absolute), trainer ``args`` and the validated config."""
    if any(o.split("=")[0] in ("--output_dir", "--resume") for o in overrides):
        raise SystemExit("demo_digits: set the run directory with --out (not --output_dir); resuming is automatic")
    if a.quality:
        overrides = ["--max_steps", str(QUALITY_STEPS), *overrides]
    try:
        base_cfg = load_config(["--config", a.config, *overrides])
    except (ValueError, OSError) as e:
        raise SystemExit(f"demo_digits: {e} (trainer options: python training/rcm.py --help)") from None
    out = os.path.abspath(
        a.out
        or (
            (base_cfg.output_dir if os.path.isabs(base_cfg.output_dir) else os.path.join(REPO, base_cfg.output_dir))
            + ("-quality" if a.quality else "")
        )
    )
    split = []
    if a.processes > 1:
        if base_cfg.batch_size % a.processes:
            raise SystemExit(
                f"demo_digits: batch_size {base_cfg.batch_size} does not split over --processes {a.processes}; "
                "pass a batch_size divisible by it, or --processes 1"
            )
        split = ["--batch_size", str(base_cfg.batch_size // a.processes)]
    runs = []
    for name in ["rcm", *(D.ABLATIONS if a.ablations else [])]:
        run_dir = out if name == "rcm" else f"{out}-{name}"
        args = [
            "--config",
            os.path.abspath(a.config),
            *overrides,
            *split,
            *D.run_overrides(name),
            "--output_dir",
            run_dir,
        ]
        try:
            cfg = load_config(args)
        except ValueError as e:
            raise SystemExit(f"demo_digits: run {name!r}: {e}") from None
        runs.append({"name": name, "dir": run_dir, "args": args, "config": cfg.model_dump()})
    return runs


def launch_command(args: list[str], processes: int = 1) -> list[str]:
    """``accelerate launch`` of ``training/rcm.py`` with ``args`` on ``processes`` CPU processes (several: DDP over
    gloo on a free local port, so that runs trained side by side do not collide); ``runs.cpu_launch_command``."""
    return R.cpu_launch_command(os.path.join(REPO, "training", "rcm.py"), args, processes)


def check_processes(run: dict, processes: int) -> None:
    """A finished run must have been trained by ``processes`` processes (the noise streams and per-process batch
    depend on it); raises ``SystemExit`` saying so otherwise."""
    got = R.trained_processes(run["dir"])
    if got is not None and got != processes:
        raise SystemExit(
            f"demo_digits: {run['name']} in {run['dir']} was trained by {got} process(es), this demo asks "
            f"for {processes} (--processes): pass --force to retrain it, or --processes {got}"
        )


def _env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}


def train(runs: list[dict], a) -> dict:
    """Train the runs that are not finished (rCM alone first, then the ablations ``--jobs`` at a time); returns
    ``{name: wall seconds}`` of the runs trained here."""
    todo = []
    for r in runs:
        if a.force and os.path.isdir(r["dir"]):
            if not os.path.exists(os.path.join(r["dir"], "env.json")) and os.listdir(r["dir"]):
                raise SystemExit(
                    f"demo_digits: --force would delete {r['dir']}, which is not a training run (no env.json)"
                )
            print(f"[demo] --force: removing {r['dir']}", flush=True)
            shutil.rmtree(r["dir"])
        try:
            state = D.run_state(r["dir"], r["config"])
        except ValueError as e:
            raise SystemExit(f"demo_digits: {e}") from None
        if state == "finished":
            check_processes(r, a.processes)
            print(
                f"[demo] {r['name']}: finished run in {r['dir']} (final.json), not retraining (--force to retrain)",
                flush=True,
            )
        else:
            if state == "partial":
                print(
                    f"[demo] {r['name']}: unfinished run in {r['dir']}: resuming from its latest checkpoint", flush=True
                )
            todo.append(r)
    times = {}
    groups = [[r] for r in todo if r["name"] == "rcm"]
    rest = [r for r in todo if r["name"] != "rcm"]
    groups += [rest[i : i + a.jobs] for i in range(0, len(rest), a.jobs)]
    for group in groups:
        procs = []
        for r in group:
            cmd = launch_command(
                [*r["args"], "--resume", "latest"] + (["--progress", "false"] if len(group) > 1 else []), a.processes
            )
            print(
                f"[demo] training {r['name']} -> {r['dir']}\n  OMP_NUM_THREADS={a.threads} {' '.join(cmd)}", flush=True
            )
            if a.dry_run:
                continue
            log = None
            if len(group) > 1:
                os.makedirs(r["dir"], exist_ok=True)
                log = open(os.path.join(r["dir"], "train.log"), "a")
            procs.append(
                (
                    r,
                    subprocess.Popen(
                        cmd, cwd=REPO, env=_env(a.threads), stdout=log, stderr=subprocess.STDOUT if log else None
                    ),
                    time.perf_counter(),
                    log,
                )
            )
        for r, proc, t0, log in procs:
            rc = proc.wait()
            times[r["name"]] = time.perf_counter() - t0
            if log:
                log.close()
            if rc != 0:
                for _, other, _, _ in procs:
                    if other.poll() is None:
                        other.terminate()
                tail = ""
                if log:
                    with open(log.name) as f:
                        tail = "\n  log tail:\n" + "".join(f.readlines()[-20:])
                raise SystemExit(f"demo_digits: training {r['name']} failed (exit {rc}); run dir {r['dir']}{tail}")
            check_processes(r, a.processes)
            print(
                f"[demo] {r['name']} trained in {times[r['name']] / 60:.1f} min by {a.processes} process(es)",
                flush=True,
            )
    return times


def evaluate(runs: list[dict], a):
    """One ``training/eval_digits.py`` pass with every student (live and EMA weights) as rows, plus the stock-pipeline
    rows of the rCM run's EMA student (``--user_rows``); returns its rows."""
    students = []
    for r in runs:
        students += ["--student", f"{r['name']}={r['dir']}"]
        if r["config"]["ema_rate"] > 0:
            students += ["--student", f"{r['name']}-ema={os.path.join(r['dir'], 'ema')}"]
    title = "Digits benchmark: rCM" + (" with sCM-only, DMD-only and no-regression ablations" if len(runs) > 1 else "")
    argv = [
        *students,
        "--out",
        runs[0]["dir"],
        "--samples",
        str(a.samples),
        "--ref_steps",
        str(a.ref_steps),
        "--teacher_steps",
        a.teacher_steps,
        "--student_steps",
        a.student_steps,
        "--threads",
        str(a.eval_threads or a.threads * a.processes),
        "--title",
        title,
        "--time_input",
        runs[0]["config"].get("time_input", "bf16"),  # sample at the times the students were trained on
        "--sigma_max",
        str(runs[0]["config"].get("sigma_max", 80.0)),  # and with the sampler their config names
        "--mid_t",
        format_mid_t(runs[0]["config"].get("mid_t") or []),
        # the rCM student to use (its EMA) as a diffusers user loads it: load_rcm_lora, and without the run's scheduler
        "--user_rows",
        runs[0]["name"] + ("-ema" if runs[0]["config"]["ema_rate"] > 0 else ""),
    ]
    print(f"[demo] evaluating: python training/eval_digits.py {' '.join(argv)}", flush=True)
    if a.dry_run:
        return []
    sys.path.insert(0, os.path.join(REPO, "training"))
    import eval_digits
    import torch

    threads = torch.get_num_threads()
    try:
        return eval_digits.main(argv)
    finally:
        torch.set_num_threads(threads)  # in-process callers (tests) keep their own setting


def main(argv=None):
    """Train (rCM, with ``--ablations`` also sCM-only, DMD-only and no-regression) and evaluate; returns the report
    rows."""
    a, overrides = parse_args(argv)
    runs = plan_runs(a, overrides)
    t0 = time.perf_counter()
    train_s = train(runs, a)
    t1 = time.perf_counter()
    rows = [] if a.skip_eval else evaluate(runs, a)
    eval_s = time.perf_counter() - t1
    if a.dry_run:
        return rows
    timing = {
        "train_s": train_s,
        "eval_s": None if a.skip_eval else eval_s,
        "total_s": time.perf_counter() - t0,
        "runs": {r["name"]: r["dir"] for r in runs},
        "argv": sys.argv if argv is None else argv,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    D.atomic_write_text(os.path.join(runs[0]["dir"], "demo_timing.json"), json.dumps(timing, indent=1))
    summary = ", ".join(f"{k} {v / 60:.1f} min" for k, v in train_s.items()) or "no training (all runs finished)"
    print(
        f"[demo] done in {timing['total_s'] / 60:.1f} min (training: {summary}; evaluation {eval_s / 60:.1f} min); "
        f"report: {os.path.join(runs[0]['dir'], 'report.md')}",
        flush=True,
    )
    return rows


if __name__ == "__main__":
    main()
