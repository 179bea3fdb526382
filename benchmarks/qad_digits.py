"""QAD on the digits problem (issue 7 §6): ``python benchmarks/qad_digits.py [--out DIR] [--steps N]``.

Rows, all sampled with the teacher's Euler grid (``--sample_steps`` steps, shift 1) from the same seeded noise:
full-precision teacher with CFG s (2 NFE per step); naive post-training NVFP4 and FP8 (weights only, the
teacher's own CFG, 2 NFE per step); QAD NVFP4 and QAD NVFP4 + block-wise warm start (``training/qad.py`` with
``training/configs/qad-digits.yaml``, CFG folded: 1 NFE per step), reloaded from their exported checkpoints
(dequantized NVFP4 = exactly the fake-quant forward). Columns: FD to held-out real digits, FD to the
teacher's samples, class accuracy, NFE. ``gap recovered = (FD_ptq - FD_qad) / (FD_ptq - FD_teacher)`` on FD to real
data, and on teacher fidelity ``1 - FDvsT_qad / FDvsT_ptq`` (the goal's measure; a seed-averaged version with its
noise floor: ``benchmarks/qad_digits_fidelity.py``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rcm_diffusers import digits as D  # noqa: E402
from rcm_diffusers.quant.export import dequantized_copy  # noqa: E402
from rcm_diffusers.quant.modules import quantize_transformer  # noqa: E402


def train(out: str, steps: int, warm: int) -> float:
    """One ``training/qad.py`` run (one CPU process); returns its wall-clock seconds."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", os.path.join(REPO, "training", "qad.py"),
           "--config", os.path.join(REPO, "training", "configs", "qad-digits.yaml"), "--output_dir", out,
           "--max_steps", str(steps), "--warm_start_batches", str(warm), "--progress", "false", "--overwrite", "true"]
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    return time.perf_counter() - t0




def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/qad-digits-bench")
    p.add_argument("--steps", type=int, default=200, help="QAD iterations per run")
    p.add_argument("--warm_start_batches", type=int, default=20)
    p.add_argument("--sample_steps", type=int, default=16, help="Euler steps of every row")
    p.add_argument("--guidance_scale", type=float, default=1.5, help="CFG s of the teacher (folded into the QAD students)")
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1234)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(a.out, exist_ok=True)
    t_train = {"qad": train(os.path.join(a.out, "qad"), a.steps, 0),
               "qad_ws": train(os.path.join(a.out, "qad_ws"), a.steps, a.warm_start_batches)}

    ev = D.Evaluator()
    teacher, emb = D.load_teacher()
    labels = torch.arange(a.samples) % D.NUM_CLASSES
    ptq = {f: copy.deepcopy(teacher) for f in ("nvfp4", "fp8_e4m3")}
    for f, m in ptq.items():
        quantize_transformer(m, f)
    s, n = a.guidance_scale, a.sample_steps
    rows = [("teacher fp32, CFG", teacher, s, 2), ("naive PTQ NVFP4, CFG", ptq["nvfp4"], s, 2),
            ("naive PTQ FP8, CFG", ptq["fp8_e4m3"], s, 2),
            ("QAD NVFP4, CFG folded", dequantized_copy(teacher, os.path.join(a.out, "qad", "quantized_transformer.safetensors")), 1.0, 1),
            ("QAD NVFP4 + warm start, CFG folded",
             dequantized_copy(teacher, os.path.join(a.out, "qad_ws", "quantized_transformer.safetensors")), 1.0, 1)]
    results, ref = [], None
    for name, model, g, nfe in rows:
        x = D.sample_teacher(model, emb, labels, n, "euler", g, a.seed)
        m = ev.evaluate(x, labels)
        f = ev.features(x)
        ref = f if ref is None else ref
        results.append({"method": name, "nfe": n * nfe, "fd": m["fd"], "fd_vs_teacher": D.frechet_distance(f, ref),
                        "accuracy": m["accuracy"]})
        print(results[-1], flush=True)
    fd_t, fd_p = results[0]["fd"], results[1]["fd"]
    for r in results[3:]:
        r["gap_recovered"] = (fd_p - r["fd"]) / (fd_p - fd_t) if fd_p != fd_t else float("nan")
        r["fidelity_gap_recovered"] = 1 - r["fd_vs_teacher"] / results[1]["fd_vs_teacher"]
    lines = ["| method | NFE | FD ↓ | FD vs teacher ↓ | accuracy ↑ | NVFP4 FD gap recovered | NVFP4 fidelity gap recovered |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        gr, gf = (f"{100 * r[k]:.0f}%" if k in r else "—" for k in ("gap_recovered", "fidelity_gap_recovered"))
        lines.append(f"| {r['method']} | {r['nfe']} | {r['fd']:.2f} | {r['fd_vs_teacher']:.3f} | {r['accuracy']:.3f} | {gr} | {gf} |")
    table = "\n".join(lines) + "\n"
    D.atomic_write_text(os.path.join(a.out, "report.md"), table)
    D.atomic_write_text(os.path.join(a.out, "results.json"), json.dumps({"rows": results, "train_seconds": t_train,
                                                                        "args": vars(a)}, indent=1))
    print(table)
    return results


if __name__ == "__main__":
    main()
