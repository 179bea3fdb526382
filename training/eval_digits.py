"""Evaluate the digits teacher and rCM students: ``python training/eval_digits.py [--student RUN_DIR] [--out DIR]``.

Rows: the teacher at 50 steps (Euler, UniPC; 100 NFE with CFG) and at ``--teacher_steps`` (Euler, UniPC),
then each student (``--student`` = a ``training/rcm.py`` output dir holding the LoRA, or
``name=DIR`` for several, e.g. ``--student rcm=outputs/digits --student scm=outputs/digits-scm``) with
``RCMScheduler`` at ``--student_steps``. A LoRA student named in ``--user_rows`` (default: all) also gets the rows a
diffusers user gets from the stock ``WanPipeline`` call with no knowledge of our config: "user call" =
``WanPipeline.from_pretrained(teacher)`` + ``load_rcm_lora(pipe, DIR)`` (the LoRA and the scheduler the run wrote),
"from_config defaults" = the same LoRA with ``RCMScheduler.from_config(pipe.scheduler.config)``; both sampled by
``pipe(...)`` itself (its noise and its scheduler loop). Columns: NFE, FD to held-out real, FD to the 100-NFE teacher's
samples (distillation fidelity), class accuracy, within-class diversity, ms/sample, peak memory.
Writes ``report.md``, ``results.json`` and ``samples.png`` (rows = methods/steps, columns = classes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqdm.auto import tqdm  # noqa: E402

from rcm_diffusers import RCMScheduler  # noqa: E402
from rcm_diffusers import digits as D  # noqa: E402
from rcm_diffusers.sampling import parse_mid_t  # noqa: E402


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v.strip()]


def _pipe_sample(pipe, scheduler, class_embeddings, labels, steps, seed):
    pipe.scheduler = scheduler
    return D.sample_pipeline(pipe, class_embeddings, labels, steps, seed)


def _user_rows_note(models) -> str:
    dflt = [m[1].config for k, m in models.items() if isinstance(k, tuple) and k[0] == "from_config defaults"]
    if not dflt:
        return ""
    return (
        '"user call" rows: the stock WanPipeline after load_rcm_lora(pipe, DIR) (the LoRA and the scheduler/ the run '
        "wrote), sampled by pipe(...) itself (unscaled initial noise, the scheduler's per-sample re-noising); "
        '"from_config defaults": the same with RCMScheduler.from_config(pipe.scheduler.config) (sigma_max '
        f"{dflt[0].rcm_sigma_max:g}, mid_t {parse_mid_t(dflt[0].mid_t)}, time input {dflt[0].time_input}), "
        "what the LoRA gives without the scheduler the run wrote. "
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default=D.TEACHER_DIR, help="teacher pipeline directory (default: the shipped one)")
    p.add_argument(
        "--student",
        action="append",
        default=[],
        help="[name=]DIR of a training/rcm.py run (LoRA or student_transformer)",
    )
    p.add_argument("--out", default="outputs/digits", help="directory for report.md, results.json, samples.png")
    p.add_argument("--samples", type=int, default=1000, help="samples per row (classes cycle 0..9)")
    p.add_argument(
        "--guidance_scale",
        default="1",
        help="CFG scales s of the teacher rows, comma-separated (v_u + s (v_c - v_u)); 1 = off; "
        "the first is the reference",
    )
    p.add_argument(
        "--student_guidance_scale",
        type=float,
        default=1.0,
        help="CFG of student rows (1: the student distils the guided teacher)",
    )
    p.add_argument("--teacher_steps", default="1,2,4,8", help="few-step teacher rows (Euler and UniPC)")
    p.add_argument("--student_steps", default="1,2,4")
    p.add_argument("--ref_steps", type=int, default=50, help="steps of the reference teacher rows")
    p.add_argument("--shift", type=float, default=1.0, help="flow shift of the teacher grid")
    p.add_argument("--sigma_max", type=float, default=80.0, help="student sampler sigma_max")
    p.add_argument(
        "--mid_t",
        default="",
        help="student intermediate TrigFlow angles, e.g. 1.5,1.4,1.0, or per step count "
        "'2: 1.0; 4: 1.5, 1.4, 0.8' (default docs/math.md §2.1)",
    )
    p.add_argument(
        "--time_input",
        default="bf16",
        choices=["bf16", "float"],
        help="time the student network sees; use the time_input it was trained with (RCMConfig.time_input)",
    )
    p.add_argument(
        "--user_rows",
        default="all",
        help="comma-separated student names that also get the stock-pipeline rows (user call, from_config "
        "defaults); 'all' (default) or '' for none",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--title", default="Digits benchmark")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    os.makedirs(a.out, exist_ok=True)
    try:
        mid_t = parse_mid_t(a.mid_t) if a.mid_t.strip() else None
    except ValueError as e:
        p.error(f"--mid_t: {e}")

    ev = D.Evaluator()
    labels = torch.arange(a.samples) % D.NUM_CLASSES
    jobs = []  # (method, steps, nfe, model key, callable(transformer, emb))
    for s in [float(v) for v in a.guidance_scale.split(",")]:
        for solver in ("euler", "unipc"):
            for n in [a.ref_steps] + _ints(a.teacher_steps):
                jobs.append(
                    (
                        f"teacher {solver}" + (f" cfg {s:g}" if s != 1 else ""),
                        n,
                        n * (1 if s == 1.0 else 2),
                        "teacher",
                        lambda tr, e, n=n, solver=solver, s=s: D.sample_teacher(
                            tr, e, labels, n, solver, s, a.seed, shift=a.shift
                        ),
                    )
                )
    students, user = [], [v for v in a.user_rows.split(",") if v.strip()]
    for spec in a.student:
        name, _, path = spec.rpartition("=")
        name = name or "rcm"
        students.append((name, path))
        ss = a.student_guidance_scale
        for n in _ints(a.student_steps):
            jobs.append(
                (
                    f"student {name}",
                    n,
                    n * (1 if ss == 1.0 else 2),
                    path,
                    lambda tr, e, n=n, ss=ss: D.sample_student(
                        tr, e, labels, n, a.seed, a.sigma_max, mid_t, ss, time_input=a.time_input
                    ),
                )
            )
        if (user == ["all"] or name in user) and not os.path.isdir(os.path.join(path, "student_transformer")):
            for how in ("user call", "from_config defaults"):
                for n in _ints(a.student_steps):
                    jobs.append(
                        (
                            f"student {name}: {how}",
                            n,
                            n,
                            (how, path),
                            lambda pipe, sch, e, n=n: _pipe_sample(pipe, sch, e, labels, n, a.seed),
                        )
                    )

    models = {"teacher": D.load_teacher(a.teacher)}
    for _, path in students:
        models[path] = D.load_student(a.teacher, path)
        if any(key == ("user call", path) for *_, key, _ in jobs):
            pipe, stock = D.load_student_pipeline(a.teacher, path)  # load_rcm_lora: the LoRA and the run's scheduler
            models["user call", path] = (pipe, pipe.scheduler, models[path][1])
            models["from_config defaults", path] = (pipe, RCMScheduler.from_config(stock), models[path][1])
    rows, grid, ref = [], [], None
    for method, n, nfe, key, fn in tqdm(jobs, desc="eval"):
        x, sec, peak = D.timed(fn, *models[key])
        m = ev.evaluate(x, labels)
        if ref is None:
            ref = ev.features(x)  # first job: the reference teacher (Euler, ref_steps)
        fdt = D.frechet_distance(ev.features(x), ref)
        rows.append(
            D.Row(
                method,
                n,
                nfe,
                m["fd"],
                m["accuracy"],
                m["diversity"],
                1000 * sec / a.samples,
                peak,
                fdt,
                fd_pixel=m["fd_pixel"],
            )
        )
        label = (
            method
            if not isinstance(key, tuple)
            else f"{method.split(':')[0]} {'user' if key[0] == 'user call' else 'dflt'}"
        )
        grid.append((f"{label} / {n}", torch.cat([x[labels == c][:1] for c in range(D.NUM_CLASSES)])))
        tqdm.write(
            f"{method:>28} {n:>3} steps: FD {m['fd']:.2f}  pixel FD {m['fd_pixel']:.3f}  acc {m['accuracy']:.3f}  "
            f"div {m['diversity']:.2f}  "
            f"{1000 * sec / a.samples:.2f} ms/sample"
        )

    peak_note = (
        "CUDA max allocated"
        if torch.cuda.is_available()
        else "process RSS high-water mark (CPU; cumulative, not per row)"
    )
    header = (
        f"# {a.title}\n\n{a.samples} samples per row (classes 0-9 in turn), seed {a.seed}; FD and diversity in the "
        f"feature space of the shipped digits classifier against the {len(ev.y_ref)} held-out real digits "
        f"(train split vs held-out: FD {ev.fd_to(D.load_digits_split()['x_train']):.2f}). "
        f"Teacher grid shift {a.shift:g}, "
        f"sigma_max 5000; student RCMScheduler sigma_max {a.sigma_max:g}, mid_t {mid_t or 'default'}, "
        f"time input {a.time_input}. "
        f"{_user_rows_note(models)}"
        "FD vs teacher-100 = FD to the first row's samples. "
        f"Peak MB: {peak_note}; "
        f"{torch.get_num_threads()} CPU thread(s)."
    )
    table = D.write_report(os.path.join(a.out, "report.md"), rows, header)
    D.save_grid(os.path.join(a.out, "samples.png"), grid)
    D.atomic_write_text(os.path.join(a.out, "results.json"), json.dumps([asdict(r) for r in rows], indent=1))
    print(table)
    return rows


if __name__ == "__main__":
    main()
