"""QAD on the digits problem under the arithmetic ComfyUI runs (docs/benchmarks.md):
``python benchmarks/qad_digits.py [--out DIR]``.

Per format (``--formats``, default NVFP4 and FP8 E4M3) and training seed (``--seeds``, default 0 1 2):
one ``training/qad.py`` run with ``training/configs/qad-digits.yaml`` and ``--target comfyui`` (NVFP4: weights +
activations with a calibrated static ``input_scale``; FP8: weights + activations with a calibrated ``input_scale``),
and a naive post-training quantization of the teacher under the same target and the same calibration (the QAD
run's own starting point, no training). Both are exported and reloaded with ``quant.export.comfy_runtime_copy``
(the forward ComfyUI runs for that file on a GPU with kernels for the format), then sampled on the teacher's Euler
grid (``--sample_steps``, shift 1) from the same seeded noise as the fp32 teacher with CFG ``s``: seed ``1234 + k``
for training seed ``k`` (paired: one noise per training seed). PTQ keeps the teacher's CFG (2 NFE per step), QAD has
CFG folded (1 NFE per step). Measure: FD to the teacher's samples of the same noise (teacher fidelity) and
``gap recovered = 1 - FD_T(QAD) / FD_T(PTQ)`` per seed; mean and sd over seeds. The noise floor of FD_T is
reported as FD between teacher sample sets of two different noises (unpaired). Defaults: 400 iterations after a
20-batch block-wise warm start, power EMA 0.1; each run gives two rows, its last weights and its EMA export.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rcm_diffusers import digits as D  # noqa: E402
from rcm_diffusers.distill import launch as R  # noqa: E402
from rcm_diffusers.distill import qad_student as Q  # noqa: E402
from rcm_diffusers.distill.config import QADConfig, load_config  # noqa: E402
from rcm_diffusers.distill.data import LatentDataset  # noqa: E402
from rcm_diffusers.quant.export import comfy_runtime_copy, export_quantized  # noqa: E402

CONFIG = os.path.join(REPO, "training", "configs", "qad-digits.yaml")


def run_args(
    out: str,
    fmt: str,
    seed: int,
    steps: int,
    warm: int,
    target: str,
    lr: float | None = None,
    guidance: float | None = None,
    ema_rate: float = 0.0,
) -> list[str]:
    """``training/qad.py`` arguments of one cell; ``lr`` / ``guidance`` (a constant CFG scale folded into the student)
    override the config's when given; ``ema_rate > 0`` also exports the power-EMA weights (``ema/``)."""
    extra = ([] if lr is None else ["--lr", str(lr)]) + ([] if guidance is None else ["--guidance", str(guidance)])
    extra += ["--ema_rate", str(ema_rate)]
    return [
        "--config",
        CONFIG,
        "--output_dir",
        out,
        "--format",
        fmt,
        "--target",
        target,
        "--seed",
        str(seed),
        "--max_steps",
        str(steps),
        "--warm_start_batches",
        str(warm),
        "--progress",
        "false",
        "--overwrite",
        "true",
        *extra,
    ]


def run_name(a, fmt: str, seed: int) -> str:
    """Run folder name: format, target and seed, plus a tag for each setting that differs from the first version of
    this benchmark (lr from the config, CFG 1.5, no warm start, 200 iterations, no EMA), so a finished run is reused
    only for the settings it was trained with (the folders of earlier runs keep their names)."""
    tags = [
        f"lr{a.lr:g}" if a.lr is not None else "",
        f"s{a.guidance_scale:g}" if a.guidance_scale != 1.5 else "",
        f"warm{a.warm_start_batches}" if a.warm_start_batches else "",
        f"it{a.steps}" if a.steps != 200 else "",
        f"ema{a.ema_rate:g}" if a.ema_rate else "",
    ]
    return "-".join([fmt, a.target, *[t for t in tags if t], f"seed{seed}"])


def train(args: list[str]) -> float:
    """One ``training/qad.py`` run (one CPU process); returns its wall-clock seconds."""
    t0 = time.perf_counter()
    cmd = R.cpu_launch_command(os.path.join(REPO, "training", "qad.py"), args)
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    return time.perf_counter() - t0


def export_ptq(teacher, args: list[str], path: str) -> None:
    """Naive PTQ: the QAD run's starting point (same student build and activation calibration), exported untrained."""
    cfg = load_config(args, config_cls=QADConfig)
    student, layers = Q.build_student(teacher, cfg)
    if any(m.static_act for m in layers.values()):
        data = LatentDataset(os.path.join(REPO, cfg.data_dir))
        Q.calibrate(
            student,
            Q.fixed_batches(data, cfg, cfg.calibration_batches, 1, "cpu", torch.float32, None),
            Q.training_times(cfg),
            cfg,
        )
    export_quantized(student, path, layout="diffusers", arch="wan")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/qad-digits-bench")
    p.add_argument("--formats", nargs="+", default=["nvfp4", "fp8_e4m3"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds; sampling noise 1234 + seed")
    p.add_argument("--target", default="comfyui", help="QAD / PTQ arithmetic (comfyui or fake)")
    p.add_argument("--steps", type=int, default=400, help="QAD iterations per run")
    p.add_argument("--warm_start_batches", type=int, default=20, help="block-wise warm-start batches (0 = off)")
    p.add_argument("--sample_steps", type=int, default=16, help="Euler steps of every row")
    p.add_argument(
        "--guidance_scale",
        type=float,
        default=1.5,
        help="CFG s of the teacher reference, folded into the QAD "
        "students and kept by PTQ (1 = no CFG: isolates the quantization gap from the cost of folding CFG)",
    )
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--lr", type=float, default=None, help="QAD learning rate (default: the config's, 2e-5)")
    p.add_argument(
        "--ema_rate",
        type=float,
        default=0.1,
        help="power-EMA rate s of the QAD weights (0 = off); adds a "
        "row per format for the EMA export, from the same runs",
    )
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(a.out, exist_ok=True)
    ev = D.Evaluator()
    teacher, emb = D.load_teacher()
    labels = torch.arange(a.samples) % D.NUM_CLASSES

    def feats(model, g, seed):
        return ev.features(D.sample_teacher(model, emb, labels, a.sample_steps, "euler", g, 1234 + seed))

    s = a.guidance_scale
    ref = {sd: feats(teacher, s, sd) for sd in a.seeds}
    out = {
        "args": vars(a),
        "noise_unpaired_teacher": [
            D.frechet_distance(ref[x], ref[y]) for x, y in zip(a.seeds, a.seeds[1:] + a.seeds[:1])
        ],
    }
    print(f"noise floor (teacher, unpaired noises): {np.round(out['noise_unpaired_teacher'], 3)}", flush=True)
    variants = [("", "")] + ([("+ema", "ema")] if a.ema_rate else [])
    for fmt in a.formats:
        out[fmt] = {"ptq": [], "qad": [], "gap_recovered": [], "train_seconds": []}  # training time: on the base row
        for tag, _ in variants[1:]:
            out[fmt + tag] = {"ptq": [], "qad": [], "gap_recovered": []}
        for sd in a.seeds:
            run = os.path.join(a.out, run_name(a, fmt, sd))
            args = run_args(run, fmt, sd, a.steps, a.warm_start_batches, a.target, a.lr, a.guidance_scale, a.ema_rate)
            if not os.path.exists(os.path.join(run, "final.json")):
                out[fmt]["train_seconds"].append(train(args))
            ptq_path = os.path.join(run, "ptq_quantized_transformer.safetensors")
            export_ptq(teacher, args, ptq_path)
            f_ptq = D.frechet_distance(feats(comfy_runtime_copy(teacher, ptq_path), s, sd), ref[sd])
            for tag, sub in variants:
                rows = out[fmt + tag]
                path = os.path.join(run, sub, "quantized_transformer.safetensors")
                f_qad = D.frechet_distance(feats(comfy_runtime_copy(teacher, path), 1.0, sd), ref[sd])
                rows["ptq"].append(f_ptq)
                rows["qad"].append(f_qad)
                rows["gap_recovered"].append(1 - f_qad / f_ptq)
                print(
                    f"{fmt}{tag} seed {sd}: FD vs teacher PTQ {f_ptq:.4f} QAD {f_qad:.4f} gap recovered "
                    f"{100 * (1 - f_qad / f_ptq):.0f}%",
                    flush=True,
                )
    lines = [
        f"| format (target {a.target}) | naive PTQ FD vs teacher | QAD FD vs teacher "
        "| gap recovered (per seed) | mean ± sd |",
        "|---|---:|---:|---|---:|",
    ]
    for fmt in [f + tag for f in a.formats for tag, _ in variants]:
        r = out[fmt]
        g = 100 * np.array(r["gap_recovered"])
        lines.append(
            f"| {fmt} | {np.mean(r['ptq']):.3f} ± {np.std(r['ptq'], ddof=1) if len(a.seeds) > 1 else 0:.3f} | "
            f"{np.mean(r['qad']):.3f} ± {np.std(r['qad'], ddof=1) if len(a.seeds) > 1 else 0:.3f} | "
            f"{', '.join(f'{x:.0f}%' for x in g)} | {g.mean():.0f}% ± {g.std(ddof=1) if len(g) > 1 else 0:.0f} |"
        )
    table = "\n".join(lines) + "\n"
    D.atomic_write_text(os.path.join(a.out, "report.md"), table)
    D.atomic_write_text(os.path.join(a.out, "results.json"), json.dumps(out, indent=1))
    print(table)
    return out


if __name__ == "__main__":
    main()
