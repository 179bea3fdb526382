"""How much one noise seed moves the digits FD ratios: the same EMA students on several noise seeds (docs/screens.md
"Evaluation noise").

    python benchmarks/digits_noise_seeds.py outputs/digits_experts/two-experts-s{0,1,2} \\
        --config training/configs/digits-experts.yaml --seeds 1234,999,2024,31,77

Each RUN is a trainer output folder (its ``ema/`` LoRA; a ``transformer_2`` folder makes it a two-expert student,
sampled through both experts with the pipeline's switch). The teacher is the run's ``pretrained`` at 50 Euler steps on
the same noise. The sampler (``sigma_max``, ``mid_t``, ``time_input``) is ``--config``'s when given, else the run's
own ``env.json``. Per noise seed: FD and pixel-FD ratios of every run at 1 / 2 / 4 steps; then, per step count, the
runs' mean ratio on each noise seed and its mean and standard deviation over the noise seeds. 1000 samples per row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "training"))

from rcm_diffusers import digits as D  # noqa: E402


def student(run: str, teacher: str):
    """The EMA student of ``run``: a two-expert switch when the run has a second expert's LoRA, else one network."""
    ema = os.path.join(run, "ema")
    if os.path.isdir(os.path.join(ema, "transformer_2")):
        from demo_experts_digits import two_expert_student

        return two_expert_student(teacher, ema, reuse=False)
    return D.load_student(teacher, ema)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="trainer output folders (each with ema/ and env.json), one teacher")
    p.add_argument("--config", default="", help="trainer YAML whose sampler settings to use (default: each run's)")
    p.add_argument("--seeds", default="1234,999,2024,31,77", help="noise seeds, comma-separated")
    p.add_argument("--steps", default="1,2,4", help="student step counts")
    p.add_argument("--samples", type=int, default=1000, help="samples per row (classes cycle 0..9)")
    a = p.parse_args(argv)
    for r in a.runs:
        if not os.path.isfile(os.path.join(r, "env.json")) or not os.path.isdir(os.path.join(r, "ema")):
            p.error(f"{r}: not a finished trainer output folder (no env.json or ema/)")
    torch.set_num_threads(1)
    cfgs = {r: json.load(open(os.path.join(r, "env.json")))["config"] for r in a.runs}
    if a.config:
        with open(a.config) as f:
            over = yaml.safe_load(f)
        for c in cfgs.values():
            c.update({k: over[k] for k in ("sigma_max", "mid_t", "time_input") if k in over})
    teachers = {c["pretrained"] for c in cfgs.values()}
    if len(teachers) != 1:
        p.error(f"the runs distil different teachers: {sorted(teachers)}")
    teacher = teachers.pop()
    teacher = teacher if os.path.isabs(teacher) else os.path.join(REPO, teacher)
    tr, emb = D.load_teacher(teacher)
    models = {r: student(r, teacher)[0] for r in a.runs}
    ev, labels = D.Evaluator(), torch.arange(a.samples) % D.NUM_CLASSES
    steps = [int(k) for k in a.steps.split(",")]
    table = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        t = ev.evaluate(D.sample_teacher(tr, emb, labels, 50, solver="euler", seed=seed), labels)
        row = {"seed": seed, "teacher_fd": t["fd"], "teacher_fd_pixel": t["fd_pixel"]}
        for r, m in models.items():
            c = cfgs[r]
            for k in steps:
                x = D.sample_student(
                    m, emb, labels, k, seed, float(c["sigma_max"]), c.get("mid_t") or None, time_input=c["time_input"]
                )
                e = ev.evaluate(x, labels)
                row[f"{r} {k}"] = [e["fd"] / t["fd"], e["fd_pixel"] / t["fd_pixel"]]
        table.append(row)
        print(json.dumps(row), flush=True)
    print("\n| steps | FD ratio per noise seed | mean ± sd | pixel FD ratio per noise seed | mean ± sd |")
    print("|---:|---|---|---|---|")
    for k in steps:
        cols = []
        for i in (0, 1):
            v = [statistics.mean(row[f"{r} {k}"][i] for r in a.runs) for row in table]
            sd = statistics.stdev(v) if len(v) > 1 else 0.0
            cols += [" / ".join(f"{x:.3f}" for x in v), f"{statistics.mean(v):.3f} ± {sd:.3f}"]
        print(f"| {k} | " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()
