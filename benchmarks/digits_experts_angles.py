"""Sampler angles of trained two-expert digits students (``make demo-experts`` runs), at a fixed step count.

For every run ``OUT/{method}-s{seed}`` (method ``two-experts`` or ``one-lora-both``), EMA weights, samples 1000
digits through the two-expert model with each ``mid_t`` list and prints FD and pixel FD (and their ratio to the
50-step two-expert teacher on the same noise). The sampler does not change training, so this separates the two.

    python benchmarks/digits_experts_angles.py OUT --seeds 0,1,2 --noise 999 --mid_t "1.0,0.6,0.3" "1.5,1.4,0.8"
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "training")]

from rcm_diffusers import digits as D  # noqa: E402
from rcm_diffusers.sampling import parse_mid_t  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output directory of training/demo_experts_digits.py")
    p.add_argument("--seeds", default="0,1,2", help="training seeds whose runs to sample")
    p.add_argument("--methods", default="two-experts,one-lora-both", help="run prefixes")
    p.add_argument(
        "--noise", type=int, default=999, help="noise seed of the samples (the protocol's 1234 is for results)"
    )
    p.add_argument("--steps", type=int, default=4, help="sampler steps")
    p.add_argument("--sigma_max", type=float, default=5000.0)
    p.add_argument("--mid_t", nargs="+", default=["1.0,0.6,0.3", "1.5,1.4,0.8"], help="angle lists to compare")
    p.add_argument("--json", default="", help="also write the rows here")
    a = p.parse_args(argv)
    from demo_experts_digits import two_expert_student

    torch.set_num_threads(1)
    ev, labels = D.Evaluator(), torch.arange(1000) % D.NUM_CLASSES
    tdir = os.path.join(REPO, "rcm_diffusers", "digits", "assets", "digits_teacher_2expert")
    sw, emb = D.load_teacher(tdir)
    te = ev.evaluate(D.sample_teacher(sw, emb, labels, steps=50, solver="euler", seed=a.noise), labels)
    print(f"teacher (50 Euler steps, noise {a.noise}): FD {te['fd']:.3f}, pixel FD {te['fd_pixel']:.3f}\n")
    print(
        "| method | seed | mid_t | FD | pixel FD | FD / teacher | pixel FD / teacher |\n|---|---|---|---|---|---|---|"
    )
    rows = []
    for method in a.methods.split(","):
        for seed in a.seeds.split(","):
            model, emb = two_expert_student(
                tdir, os.path.join(a.out, f"{method}-s{seed}", "ema"), reuse=method == "one-lora-both"
            )
            for mid in a.mid_t:
                x = D.sample_student(
                    model,
                    emb,
                    labels,
                    a.steps,
                    seed=a.noise,
                    sigma_max=a.sigma_max,
                    mid_t=parse_mid_t(mid),
                    time_input="float",
                )
                m = ev.evaluate(x, labels)
                rows.append({"method": method, "seed": int(seed), "mid_t": mid, **m})
                print(
                    f"| {method} | {seed} | {mid} | {m['fd']:.3f} | {m['fd_pixel']:.3f} | {m['fd'] / te['fd']:.2f} | "
                    f"{m['fd_pixel'] / te['fd_pixel']:.2f} |",
                    flush=True,
                )
    if a.json:
        D.atomic_write_text(a.json, json.dumps({"teacher": te, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
