"""Teacher-fidelity evaluation of QAD digits runs over several sampling seeds (the lr / alpha sweep, docs/screens.md).

``python benchmarks/qad_digits_fidelity.py RUN_DIR [RUN_DIR ...] [--seeds 1234 1235 1236] [--samples 1000]``

For each seed: the fp32 teacher with CFG ``s`` and naive PTQ NVFP4 (CFG ``s``) are sampled once (cached under
``--cache``); each run's exported ``quantized_transformer.safetensors`` is reloaded and sampled with CFG folded
(guidance 1), all from the same seeded noise on the teacher's Euler grid. Per run and seed: FD to the teacher's
samples of the same seed (the benchmark's "FD vs teacher"), and the gap recovered on that measure,
``1 - FD_T(qad) / FD_T(ptq)``. The noise floor is reported as FD between teacher sample sets of two different seeds
(unpaired) and as the seed-to-seed spread of the paired measure.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rcm_diffusers import digits as D  # noqa: E402
from rcm_diffusers.quant.export import dequantized_copy  # noqa: E402
from rcm_diffusers.quant.modules import quantize_transformer  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235, 1236])
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--sample_steps", type=int, default=16)
    p.add_argument("--guidance_scale", type=float, default=1.5)
    p.add_argument("--cache", default="outputs/qad-sweep/cache")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(a.cache, exist_ok=True)
    ev = D.Evaluator()
    teacher, emb = D.load_teacher()
    labels = torch.arange(a.samples) % D.NUM_CLASSES

    def feats(tag, model, g, seed):
        path = os.path.join(a.cache, f"{tag}-n{a.samples}-k{a.sample_steps}-g{g}-s{seed}.npy") if tag else None
        if path and os.path.exists(path):
            return np.load(path)
        f = ev.features(D.sample_teacher(model, emb, labels, a.sample_steps, "euler", g, seed))
        if path:
            np.save(path, f)
        return f

    s = a.guidance_scale
    ref = {sd: feats("teacher", teacher, s, sd) for sd in a.seeds}
    ptq = copy.deepcopy(teacher)
    quantize_transformer(ptq, "nvfp4")
    out = {
        "noise_unpaired_teacher": [
            D.frechet_distance(ref[x], ref[y]) for x, y in zip(a.seeds, a.seeds[1:] + a.seeds[:1])
        ]
    }
    out["ptq"] = [D.frechet_distance(feats("ptq_nvfp4", ptq, s, sd), ref[sd]) for sd in a.seeds]
    print(f"noise floor, teacher seed vs other seed (unpaired): {np.round(out['noise_unpaired_teacher'], 3)}")
    print(f"naive PTQ NVFP4 FD vs teacher per seed: {np.round(out['ptq'], 3)} mean {np.mean(out['ptq']):.3f}")
    ptq_mean = float(np.mean(out["ptq"]))
    for run in a.runs:
        m = dequantized_copy(teacher, os.path.join(run, "quantized_transformer.safetensors"))
        fd = [D.frechet_distance(feats(None, m, 1.0, sd), ref[sd]) for sd in a.seeds]
        gap = [1 - f / q for f, q in zip(fd, out["ptq"])]
        out[run] = {"fd_vs_teacher": fd, "gap_recovered": gap}
        print(
            f"{run}: FD vs teacher {np.round(fd, 3)} mean {np.mean(fd):.3f} sd {np.std(fd, ddof=1):.3f}; "
            f"gap recovered {100 * (1 - np.mean(fd) / ptq_mean):.0f}% "
            f"(per seed {np.round(100 * np.array(gap)).astype(int)})",
            flush=True,
        )
    if a.json:
        D.atomic_write_text(a.json, json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
