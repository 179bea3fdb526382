"""Digits students trained on a low-precision frozen base (``base_dtype``), each sampled on every base.

    python benchmarks/digits_lowmem.py --out outputs/lowmem --seeds 0,1,2   # train what is missing, then the table
    python benchmarks/digits_lowmem.py --out outputs/lowmem --seeds 0 --max_steps 30   # a quick try

Per training format (``weight_dtype`` = the base as loaded, float32 for digits; ``fp8``; ``int8``,
rcm_diffusers.distill.lowmem) and training seed, one ``training/rcm.py`` run of ``training/configs/digits.yaml``
with ``--base_dtype FORMAT`` (through ``benchmarks/digits_sweep.py``: one process, one thread, ``OUT/FORMAT-sSEED``).
Each run's EMA LoRA then samples on three bases: the teacher as loaded, and the teacher whose block Linear weights
went through the fp8 / int8 round trip (``lowmem.dequantized_weight``: what ``FrozenLinear`` computes with, and what a
user of a quantized base runs), with the LoRA merged in float32 on top. ``RCMScheduler`` at 1 / 2 / 4 steps with the
run's sampler (``sigma_max``, ``mid_t``, time input), 1000 samples, noise 1234. Writes ``OUT/lowmem.md`` (mean ± sd
over seeds of FD and its ratio to the weight_dtype-trained student on the base as loaded, the goal's reference) and
``OUT/lowmem.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rcm_diffusers import digits as D  # noqa: E402
from rcm_diffusers.distill.lowmem import BASE_DTYPES, dequantized_weight, frozen_linears  # noqa: E402


def quantized_base(teacher_dir: str, fmt: str):
    """The digits teacher with every frozen Linear weight inside its blocks replaced by its ``fmt`` round trip (the
    trainer's ``FrozenLinear`` set: ``lowmem.frozen_linears`` of the blocks); ``weight_dtype`` = as loaded."""
    tr, emb = D.load_teacher(teacher_dir)
    if fmt != "weight_dtype":
        with torch.no_grad():
            for block in tr.blocks:
                for _, _, _, lin in frozen_linears(block.requires_grad_(False)):
                    lin.weight.copy_(dequantized_weight(lin.weight, fmt))
    return tr, emb


def student_on(teacher_dir: str, base_fmt: str, lora_dir: str):
    """``quantized_base`` with the LoRA of ``lora_dir`` loaded by diffusers and merged (``fuse_lora``)."""
    from diffusers import WanPipeline

    tr, emb = quantized_base(teacher_dir, base_fmt)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=tr, scheduler=None)
    pipe.load_lora_weights(lora_dir, adapter_name="student")
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    return pipe.transformer.eval(), emb


def ms(v, d=2):
    return f"{statistics.mean(v):.{d}f} ± {statistics.stdev(v):.{d}f}" if len(v) > 1 else f"{v[0]:.{d}f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO, "outputs", "lowmem"), help="folder of the runs and the table")
    p.add_argument("--seeds", default="0,1,2", help="training seeds, comma-separated")
    p.add_argument("--formats", default=",".join(BASE_DTYPES), help="training base formats, comma-separated")
    p.add_argument("--steps", default="1,2,4", help="student step counts")
    p.add_argument("--samples", type=int, default=1000, help="evaluation samples (classes cycle 0..9)")
    p.add_argument("--max_steps", type=int, default=0, help="training iterations (0 = digits.yaml's)")
    a = p.parse_args(argv)
    formats = [f for f in a.formats.split(",") if f]
    if any(f not in BASE_DTYPES for f in formats):
        p.error(f"--formats: a comma-separated subset of {', '.join(BASE_DTYPES)}")
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    steps = [int(s) for s in a.steps.split(",") if s.strip()]
    torch.set_num_threads(1)
    for fmt in formats:
        for seed in seeds:
            run = os.path.join(a.out, f"{fmt}-s{seed}")
            if not os.path.exists(os.path.join(run, "final.json")):
                extra = ["--max_steps", str(a.max_steps)] if a.max_steps else []
                print(f"[lowmem] training {run}", flush=True)
                subprocess.run(
                    [sys.executable, os.path.join(REPO, "benchmarks", "digits_sweep.py"), "--name", f"{fmt}-s{seed}"]
                    + ["--out", a.out, "--steps", "1", "--samples", "10", "--"]
                    + ["--seed", str(seed), "--base_dtype", fmt, *extra],
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
    ev, labels = D.Evaluator(), torch.arange(a.samples) % D.NUM_CLASSES
    tr, emb = D.load_teacher(D.TEACHER_DIR)
    teacher = ev.evaluate(D.sample_teacher(tr, emb, labels, 50, "euler", 1.0, 1234), labels)
    print(f"[lowmem] teacher, 50 Euler steps: FD {teacher['fd']:.3f}", flush=True)
    rows, t0 = [], time.perf_counter()
    for fmt in formats:
        for seed in seeds:
            run = os.path.join(a.out, f"{fmt}-s{seed}")
            cfg = json.load(open(os.path.join(run, "env.json")))["config"]
            for base in BASE_DTYPES:
                model, e = student_on(D.TEACHER_DIR, base, os.path.join(run, "ema"))
                for n in steps:
                    x = D.sample_student(
                        model,
                        e,
                        labels,
                        n,
                        1234,
                        float(cfg["sigma_max"]),
                        cfg.get("mid_t") or None,
                        time_input=cfg.get("time_input", "float"),
                    )
                    m = ev.evaluate(x, labels)
                    rows.append({"trained": fmt, "sampled": base, "seed": seed, "steps": n, **m})
                    print(f"[lowmem] trained {fmt} seed {seed}, sampled on {base}, {n} steps: FD {m['fd']:.3f}")
    ref = {  # the goal's reference; nan when weight_dtype was not trained
        n: statistics.mean(
            [r["fd"] for r in rows if (r["trained"], r["sampled"], r["steps"]) == ("weight_dtype", "weight_dtype", n)]
            or [float("nan")]
        )
        for n in steps
    }
    lines = [
        f"# Digits students on a low-precision base ({time.strftime('%Y-%m-%d')})",
        "",
        f"Teacher (as loaded), 50 Euler steps: FD {teacher['fd']:.2f}. {a.samples} samples per row, noise 1234, EMA; "
        f"mean ± sd over training seeds {a.seeds}; ratio = FD / the weight_dtype-trained student's on the base as "
        "loaded.",
        "",
        "| trained on | sampled on | FD " + " / ".join(map(str, steps)) + " steps | ratio | pixel FD | accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for fmt in formats:
        for base in BASE_DTYPES:
            sel = {n: [r for r in rows if (r["trained"], r["sampled"], r["steps"]) == (fmt, base, n)] for n in steps}
            if not all(sel.values()):
                continue
            lines.append(
                f"| {fmt} | {base} | "
                + " / ".join(ms([r["fd"] for r in sel[n]]) for n in steps)
                + " | "
                + " / ".join(f"{statistics.mean(r['fd'] for r in sel[n]) / ref[n]:.3f}" for n in steps)
                + " | "
                + " / ".join(f"{statistics.mean(r['fd_pixel'] for r in sel[n]):.3f}" for n in steps)
                + " | "
                + " / ".join(f"{statistics.mean(r['accuracy'] for r in sel[n]):.3f}" for n in steps)
                + " |"
            )
    text = "\n".join(lines) + "\n"
    D.atomic_write_text(os.path.join(a.out, "lowmem.md"), text)
    D.atomic_write_text(os.path.join(a.out, "lowmem.json"), json.dumps({"teacher": teacher, "rows": rows}, indent=1))
    print(text + f"[lowmem] evaluation {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
