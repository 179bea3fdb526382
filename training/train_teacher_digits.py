"""Train the embedded digits teacher: ``python training/train_teacher_digits.py [--steps N] [--out DIR]``.

Class-conditional rectified flow (docs/math.md §1: ``x_r = (1 - r) x0 + r eps``, ``r ~ U[0, 1)``, loss
``||v - (eps - x0)||^2``) on the sklearn digits train split with a tiny ``WanTransformer3DModel``
and a learned class-embedding table (class dropped to the null row with ``--p_uncond`` for CFG).
Seeded; writes the EMA weights as a diffusers ``WanPipeline`` directory (rcm_diffusers.digits.save_teacher),
the evaluator classifier, the train split in the trainer's latent format, and the teacher's ODE pairs for the
regression term (rcm_diffusers.digits.write_ode_pairs; ``--pairs_only`` writes just those from the teacher at
``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from safetensors.torch import save_file  # noqa: E402

from rcm_diffusers import digits as D  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=D.TEACHER_DIR, help="teacher pipeline directory to write")
    p.add_argument("--classifier_out", default=D.CLASSIFIER_PATH, help="evaluator classifier file to write ('' = skip)")
    p.add_argument(
        "--data_out",
        default=os.path.join(D.ASSETS, "digits_latents"),
        help="latent dataset of the train split ('' = skip)",
    )
    p.add_argument(
        "--pairs_out",
        default="auto",
        help="the teacher's ODE pairs (noise -> 32-step UniPC sample, 8192 of "
        "them); 'auto' = the shipped digits_ode_pairs when --out is the shipped teacher, else none; '' = skip",
    )
    p.add_argument(
        "--pairs_only", action="store_true", help="only write --pairs_out from the existing teacher at --out"
    )
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--ema", type=float, default=0.999, help="EMA decay of the shipped weights")
    p.add_argument("--p_uncond", type=float, default=0.1, help="probability of the null class (CFG training)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0 = torch default; 1 is much faster on a busy 2-core box)",
    )
    p.add_argument("--eval_samples", type=int, default=500, help="samples for the closing FD check (0 = skip)")
    a = p.parse_args(argv)
    if a.pairs_out == "auto":  # pairs belong to the teacher they come from: never the shipped ones for another teacher
        a.pairs_out = D.ODE_PAIRS_DIR if os.path.abspath(a.out) == os.path.abspath(D.TEACHER_DIR) else ""
    if a.threads:
        torch.set_num_threads(a.threads)

    if a.pairs_only:
        if not a.pairs_out:
            p.error("--pairs_only needs --pairs_out")
        print(f"ODE pairs of {a.out} -> {D.write_ode_pairs(a.pairs_out, a.out)}")
        return
    data = D.load_digits_split()
    x_tr, y_tr = data["x_train"], data["y_train"]
    if a.classifier_out:
        clf = D.train_classifier(x_tr, y_tr, seed=a.seed)
        save_file(clf.state_dict(), a.classifier_out + ".tmp")
        os.replace(a.classifier_out + ".tmp", a.classifier_out)
        print(f"classifier: held-out accuracy {D.Evaluator(clf).accuracy(data['x_test'], data['y_test']):.4f}")

    model = D.build_teacher(seed=a.seed).train()
    emb = D.init_class_embeddings(seed=a.seed)
    t0 = time.perf_counter()
    ema_model, ema_emb = D.train_rectified_flow(
        model,
        emb,
        x_tr,
        y_tr,
        steps=a.steps,
        batch_size=a.batch_size,
        lr=a.lr,
        warmup=a.warmup,
        ema=a.ema,
        p_uncond=a.p_uncond,
        generator=torch.Generator().manual_seed(a.seed + 1),
    )
    train_s = time.perf_counter() - t0

    meta = {
        "steps": a.steps,
        "batch_size": a.batch_size,
        "lr": a.lr,
        "ema": a.ema,
        "p_uncond": a.p_uncond,
        "seed": a.seed,
        "train_seconds": round(train_s, 1),
        "threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()),
        "split_seed": D.SPLIT_SEED,
    }
    D.save_teacher(a.out, ema_model, ema_emb, extra_meta=meta)
    print(f"teacher: {meta['params']} parameters, {a.steps} steps in {train_s:.0f} s -> {a.out}")
    if a.data_out:
        D.write_latent_dataset_for(a.data_out, x_tr, y_tr, ema_emb)
        print(f"latent dataset (train split) -> {a.data_out}")
    if a.pairs_out:
        print(f"ODE pairs (regression term) -> {D.write_ode_pairs(a.pairs_out, a.out)}")
    if a.eval_samples:
        tr, e = D.load_teacher(a.out)
        labels = torch.arange(a.eval_samples) % D.NUM_CLASSES
        ev = D.Evaluator()
        for s in (1.0, 2.0):
            x = D.sample_teacher(tr, e, labels, steps=50, solver="euler", guidance_scale=s, seed=1234)
            print(f"teacher 50 Euler steps, CFG {s}: {ev.evaluate(x, labels)}")


if __name__ == "__main__":
    main()
