"""Fine-tune the digits teacher into Wan 2.2-style experts:
``python training/train_experts_digits.py [--boundary 0.875]``.

The shipped one-network teacher (``rcm_diffusers/digits/assets/digits_teacher``) is copied twice; the
high-noise expert is fine-tuned on RF times ``r >= boundary`` only, the low-noise expert on ``r < boundary``
(same rectified-flow loss as ``train_teacher_digits.py``, docs/math.md §1; the class table stays frozen so
the shipped latent dataset serves both teachers). The result is a diffusers ``WanPipeline`` folder with
``transformer`` (high noise), ``transformer_2`` (low noise) and ``boundary_ratio`` -- the layout of
Wan2.2-T2V-A14B-Diffusers, ~7 MB, and that teacher's ODE pairs for the regression term
(``digits_ode_pairs_2expert``; ``--pairs_only`` writes just those). Seeded; one CPU thread gives the same file on
any run.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rcm_diffusers import digits as D  # noqa: E402


def finetune_expert(model, emb, x_tr, y_tr, r_lo: float, r_hi: float, a, seed: int, desc: str):
    """``digits.train_rectified_flow`` on ``r ~ U[r_lo, r_hi)`` with the class table frozen; returns the EMA copy."""
    ema, _ = D.train_rectified_flow(
        model.train().requires_grad_(True),
        emb,
        x_tr,
        y_tr,
        steps=a.steps,
        batch_size=a.batch_size,
        lr=a.lr,
        warmup=a.warmup,
        ema=a.ema,
        p_uncond=a.p_uncond,
        generator=torch.Generator().manual_seed(seed),
        r_range=(r_lo, r_hi),
        desc=desc,
    )
    return ema


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=D.TEACHER_DIR, help="one-network teacher to start both experts from")
    p.add_argument("--out", default=D.TEACHER2_DIR, help="two-expert pipeline directory to write")
    p.add_argument(
        "--boundary",
        type=float,
        default=0.875,
        help="boundary_ratio: RF time of the switch (Wan2.2 T2V A14B: 0.875, I2V: 0.9)",
    )
    p.add_argument("--steps", type=int, default=800, help="fine-tuning steps per expert")
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--ema", type=float, default=0.998, help="EMA decay of the shipped weights")
    p.add_argument("--p_uncond", type=float, default=0.1, help="probability of the null class (CFG training)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: reproducible and fastest on a busy 2-core box)"
    )
    p.add_argument("--eval_samples", type=int, default=1000, help="samples for the closing FD check (0 = skip)")
    p.add_argument(
        "--pairs_out",
        default="auto",
        help="the two-expert teacher's ODE pairs for the regression term (noise -> 32-step UniPC sample through both "
        "experts, 8192 of them); 'auto' = the shipped digits_ode_pairs_2expert when --out is the shipped two-expert "
        "teacher, else none; '' = skip",
    )
    p.add_argument(
        "--pairs_only", action="store_true", help="only write --pairs_out from the existing teacher at --out"
    )
    a = p.parse_args(argv)
    if a.pairs_out == "auto":  # pairs belong to the teacher they come from
        a.pairs_out = D.ODE_PAIRS2_DIR if os.path.abspath(a.out) == os.path.abspath(D.TEACHER2_DIR) else ""
    if not 0.0 < a.boundary < 1.0:
        p.error(f"--boundary must lie in (0, 1), got {a.boundary}")
    if a.threads:
        torch.set_num_threads(a.threads)

    if a.pairs_only:
        if not a.pairs_out:
            p.error("--pairs_only needs --pairs_out")
        print(f"ODE pairs of {a.out} -> {D.write_ode_pairs(a.pairs_out, a.out)}")
        return
    data = D.load_digits_split()
    x_tr, y_tr = data["x_train"], data["y_train"]
    base, emb = D.load_teacher(a.base)
    emb = emb.detach()
    t0 = time.perf_counter()
    high = finetune_expert(copy.deepcopy(base), emb, x_tr, y_tr, a.boundary, 1.0, a, a.seed + 11, "high-noise expert")
    low = finetune_expert(copy.deepcopy(base), emb, x_tr, y_tr, 0.0, a.boundary, a, a.seed + 12, "low-noise expert")
    train_s = time.perf_counter() - t0
    meta = {
        "base": os.path.relpath(a.base, os.path.dirname(a.out)),
        "boundary_ratio": a.boundary,
        "steps_per_expert": a.steps,
        "batch_size": a.batch_size,
        "lr": a.lr,
        "ema": a.ema,
        "p_uncond": a.p_uncond,
        "seed": a.seed,
        "train_seconds": round(train_s, 1),
        "threads": torch.get_num_threads(),
        "split_seed": D.SPLIT_SEED,
    }
    D.save_teacher(a.out, high, emb, extra_meta=meta, transformer_2=low, boundary_ratio=a.boundary)
    print(f"two experts, {a.steps} steps each in {train_s:.0f} s -> {a.out}")
    if a.pairs_out:
        print(f"ODE pairs (regression term) -> {D.write_ode_pairs(a.pairs_out, a.out)}")
    if a.eval_samples:
        ev = D.Evaluator()
        labels = torch.arange(a.eval_samples) % D.NUM_CLASSES
        for name, path in (("one-network teacher", a.base), ("two-expert teacher", a.out)):
            tr, e = D.load_teacher(path)
            x = D.sample_teacher(tr, e, labels, steps=50, solver="euler", seed=1234)
            print(f"{name}, 50 Euler steps: {ev.evaluate(x, labels)}")


if __name__ == "__main__":
    main()
