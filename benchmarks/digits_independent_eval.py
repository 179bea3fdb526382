"""Independent evaluation of two-expert digits students (``make demo-experts`` runs) through the stock ``WanPipeline``.

For every run ``RUNS/{method}-s{seed}`` (method ``two-experts`` or ``one-lora-both``), the EMA student is loaded into
``WanPipeline.from_pretrained(teacher)`` with ``rcm_diffusers.load_rcm_lora`` (``reuse_for_both`` for
``one-lora-both``), exactly as a user would, and samples ``--n`` digits (classes cycle 0..9) at 1, 2 and 4 steps on
the same noise (``--seed``) as the two-expert teacher at 50 stock Euler steps (and, unless ``--no-teacher100``, a
100-step sanity row that says whether 50 steps has converged).

The samples are measured in this script's own feature spaces; it owes nothing to the project's evaluator or classifier
(``rcm_diffusers.digits.evaluate`` is not used), so it is a cross-check of the numbers ``make demo-experts`` reports:

- a small CNN trained here (own seed, shift/noise augmentation) on the 75 % train split of sklearn digits: Fréchet
  distance in its penultimate 64-d ReLU features (FD_cnn) and its class accuracy on the samples;
- PCA(16) of the raw 0..16 pixels fitted on the same train split: Fréchet distance in that space (FD_pca).

The real reference is the held-out 25 % (stratified, ``random_state=0``, the split the teacher never trained on). Also
reported: within-class pixel spread relative to the real held-out digits, the latent range and the fraction of latent
values outside [-1, 1] (clipped before the pixel conversion). From the project only the teacher loader (for the class
embeddings) and ``load_rcm_lora`` are used.

    python benchmarks/digits_independent_eval.py --runs OUT --seed 4242

writes ``OUT/independent_4242/results.json`` (and ``samples_*.pt``) and prints a mean ± sd table over the training
seeds and a per-seed table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings

import numpy as np
import torch
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

TEACHER = os.path.join(REPO, "rcm_diffusers", "digits", "assets", "digits_teacher_2expert")
RUNS = os.path.join(REPO, "outputs", "digits_experts")  # training/demo_experts_digits.py's default --out
METHODS = {"two-experts": False, "one-lora-both": True}  # -> reuse_for_both
STUDENT_STEPS = (1, 2, 4)
TEACHER_STEPS = 50


# ------------------------------------------------------------------ real data (own code)
def real_split():
    """sklearn digits as 0..16 pixel images, split 75/25 stratified with ``random_state=0``: x_tr, x_te, y_tr, y_te."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    img = d.images.astype(np.float32)  # 0..16
    return train_test_split(img, d.target, test_size=0.25, random_state=0, stratify=d.target)


def latents_to_pixels(lat: torch.Tensor) -> np.ndarray:
    """[B,1,1,8,8] model latents (x = pixel/8 - 1) -> [B,8,8] pixels in 0..16 (latent clipped to [-1,1])."""
    x = lat.reshape(lat.shape[0], 8, 8).float().clamp(-1, 1)
    return ((x + 1.0) * 8.0).numpy()


# ------------------------------------------------------------------ own classifier: small CNN
class SmallCNN(nn.Module):
    """Two 3x3 conv layers, a max-pool, a 64-d ReLU feature layer and a 10-class head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 32 x 4 x 4
        )
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(512, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def feats(self, px):
        """Penultimate 64-d features of ``px`` ([B,8,8] pixels in 0..16)."""
        x = torch.as_tensor(px, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
        return self.fc(self.conv(x))

    def forward(self, px):
        return self.head(self.feats(px))


def train_cnn(x, y, seed=31337, epochs=40):
    """Train :class:`SmallCNN` on pixels ``x`` / labels ``y`` (Adam, batch 32, +-1 px shift and pixel noise)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    m = SmallCNN()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=1e-4)
    X = torch.tensor(x) / 1.0
    Y = torch.tensor(y, dtype=torch.long)
    for _ in range(epochs):
        perm = torch.randperm(len(X), generator=g)
        for i in range(0, len(X), 32):
            idx = perm[i : i + 32]
            xb = X[idx]
            # augmentation: random +-1 px shift and pixel noise (0..16 scale)
            sx, sy = torch.randint(-1, 2, (2,), generator=g).tolist()
            xb = torch.roll(xb, shifts=(sx, sy), dims=(1, 2))
            xb = (xb + 1.0 * torch.randn(xb.shape, generator=g)).clamp(0, 16)
            loss = nn.functional.cross_entropy(m(xb), Y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return m.eval()


# ------------------------------------------------------------------ Fréchet distance (own code)
def fd(a, b):
    """Fréchet distance between Gaussians fitted to feature sets ``a`` and ``b`` ([N, D] each)."""
    from scipy import linalg

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    mu = a.mean(0) - b.mean(0)
    sa, sb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean, _ = linalg.sqrtm(sa @ sb, disp=False)
    covmean = covmean.real
    return float(mu @ mu + np.trace(sa) + np.trace(sb) - 2.0 * np.trace(covmean))


# ------------------------------------------------------------------ sampling through the stock pipeline
def make_pipe(teacher):
    """The teacher folder as a user loads it: ``WanPipeline.from_pretrained`` with its own scheduler."""
    from diffusers import WanPipeline

    import rcm_diffusers  # noqa: F401  (the teacher folder's scheduler class lives there)

    pipe = WanPipeline.from_pretrained(teacher, vae=None, text_encoder=None, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def stock_sample(pipe, emb, labels, steps, seed):
    """Latents [B,1,1,8,8] from ``pipe`` for class ``labels`` at ``steps`` steps, no CFG, generator ``seed``."""
    g = torch.Generator().manual_seed(seed)
    out = pipe(
        prompt_embeds=emb[labels],
        height=64,
        width=64,
        num_frames=1,
        num_inference_steps=steps,
        guidance_scale=1.0,
        output_type="latent",
        generator=g,
    ).frames
    return out.float()


def parse_args(argv=None):
    """Command-line options; a missing ``--runs`` folder or an unknown method ends here in one line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--runs",
        default=RUNS,
        help="folder of a `make demo-experts` run (training/demo_experts_digits.py --out) holding "
        "two-experts-s{K} / one-lora-both-s{K} subfolders (default: outputs/digits_experts)",
    )
    p.add_argument(
        "--teacher",
        default=TEACHER,
        help="two-expert teacher pipeline folder the students were distilled from "
        "(default: the shipped rcm_diffusers/digits/assets/digits_teacher_2expert)",
    )
    p.add_argument("--seeds", default="0,1,2", help="training seeds whose runs to evaluate, comma-separated")
    p.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)} (default: both)"
    )
    p.add_argument("--n", type=int, default=1000, help="samples per row (classes cycle 0..9)")
    p.add_argument("--seed", type=int, default=4242, help="pipeline generator (noise) seed, the same for every row")
    p.add_argument(
        "--out", default=None, help="where samples_*.pt and results.json go (default: RUNS/independent_SEED)"
    )
    p.add_argument("--no-teacher100", action="store_true", help="skip the 100-step teacher sanity row")
    a = p.parse_args(argv)
    if not os.path.isdir(a.runs):
        sys.exit(f"error: --runs folder not found: {a.runs}")
    a.seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = [m for m in a.methods if m not in METHODS]
    if unknown:
        sys.exit(f"error: unknown --methods {', '.join(unknown)} (choose from {', '.join(METHODS)})")
    if a.out is None:
        a.out = os.path.join(a.runs, f"independent_{a.seed}")
    return a


def print_tables(results, tm, floor, methods):
    """Mean ± sd over training seeds per method and step count, then one line per run and step count."""
    print(
        "\nteacher@50 (stock TrigFlowEuler): FD_cnn %.3f  FD_pca %.3f  acc %.4f"
        % (tm["fd_cnn"], tm["fd_pca"], tm["acc"])
    )
    print("floor (real train vs held-out): FD_cnn %.3f  FD_pca %.3f" % (floor["fd_cnn"], floor["fd_pca"]))
    print("teacher within-class pixel spread / real: %.3f" % tm["div_px"])
    print("| method | steps | FD_cnn | FD_cnn / teacher | FD_pca / teacher | acc | spread/real |")
    print("|---|---|---|---|---|---|---|")
    for method in methods:
        for k in STUDENT_STEPS:
            rs = [r for r in results["rows"] if r["method"] == method and r["steps"] == k]
            if not rs:
                continue

            def ms(key, fmt):
                v = np.array([r[key] for r in rs])
                return f"{v.mean():{fmt}} ± {v.std(ddof=1):{fmt}}" if len(v) > 1 else f"{v[0]:{fmt}}"

            print(
                f"| {method} | {k} | {ms('fd_cnn', '.3f')} | {ms('fd_cnn_ratio', '.2f')} | "
                f"{ms('fd_pca_ratio', '.2f')} | {ms('acc', '.4f')} | {ms('div_px', '.3f')} |"
            )
    print("\nper seed:")
    print("| method | seed | steps | FD_cnn | ratio | FD_pca | pca ratio | acc | spread/real |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        print(
            f"| {r['method']} | s{r['seed']} | {r['steps']} | {r['fd_cnn']:.3f} | {r['fd_cnn_ratio']:.2f} | "
            f"{r['fd_pca']:.3f} | {r['fd_pca_ratio']:.2f} | {r['acc']:.4f} | {r['div_px']:.3f} |"
        )


def main(argv=None):
    """Train the CNN and PCA, sample the teacher and every student run, write results.json, print the tables."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    out_dir = args.out
    os.makedirs(out_dir, exist_ok=True)
    logging.captureWarnings(True)
    warnings.simplefilter("always")
    t0 = time.time()

    # --- real data and own feature spaces
    from sklearn.decomposition import PCA

    x_tr, x_te, y_tr, y_te = real_split()
    cnn = train_cnn(x_tr, y_tr)
    with torch.no_grad():
        test_acc = float((cnn(x_te).argmax(-1).numpy() == y_te).mean())
        f_te = cnn.feats(x_te).numpy()
        f_tr = cnn.feats(x_tr).numpy()
    pca = PCA(n_components=16, random_state=0).fit(x_tr.reshape(len(x_tr), 64))
    p_te = pca.transform(x_te.reshape(len(x_te), 64))
    p_tr = pca.transform(x_tr.reshape(len(x_tr), 64))
    real_div = [np.sqrt(x_te[y_te == c].reshape(-1, 64).var(0).sum()) for c in range(10)]
    floor = {"fd_cnn": fd(f_tr, f_te), "fd_pca": fd(p_tr, p_te)}
    print(f"[{time.time() - t0:.0f}s] CNN held-out acc {test_acc:.4f}; real-train vs held-out FD: {floor}", flush=True)

    def metrics(lat, labels):
        """CNN FD / accuracy, PCA FD, pixel spread / real and latent range of the samples ``lat``."""
        px = latents_to_pixels(lat)
        with torch.no_grad():
            f = cnn.feats(px).numpy()
            acc = float((cnn.head(torch.tensor(f)).argmax(-1).numpy() == labels.numpy()).mean())
        p = pca.transform(px.reshape(len(px), 64))
        div = np.mean([np.sqrt(px[labels.numpy() == c].reshape(-1, 64).var(0).sum()) / real_div[c] for c in range(10)])
        return {
            "div_px": float(div),
            "fd_cnn": fd(f, f_te),
            "fd_pca": fd(p, p_te),
            "acc": acc,
            "lat_min": float(lat.min()),
            "lat_max": float(lat.max()),
            "frac_clipped": float((lat.abs() > 1).float().mean()),
        }

    from rcm_diffusers import load_rcm_lora
    from rcm_diffusers.digits.teacher import load_teacher

    _, emb = load_teacher(args.teacher)
    labels = torch.arange(args.n) % 10
    results = {"floor": floor, "cnn_test_acc": test_acc, "seed": args.seed, "n": args.n, "rows": []}

    # --- teacher reference (stock scheduler of the folder)
    pipe = make_pipe(args.teacher)
    print("teacher scheduler:", type(pipe.scheduler).__name__, dict(pipe.scheduler.config), flush=True)
    lat = stock_sample(pipe, emb, labels, TEACHER_STEPS, args.seed)
    torch.save(lat, os.path.join(out_dir, "samples_teacher50.pt"))
    tm = metrics(lat, labels)
    results["teacher"] = tm
    print(f"[{time.time() - t0:.0f}s] teacher@50: {tm}", flush=True)
    # sanity: is the 50-step reference converged? (same noise, 100 steps)
    if not args.no_teacher100:
        lat100 = stock_sample(pipe, emb, labels, 100, args.seed)
        results["teacher100"] = metrics(lat100, labels)
        results["teacher50_vs_100_rms"] = float((lat100 - lat).pow(2).mean().sqrt())
        print(
            f"[{time.time() - t0:.0f}s] teacher@100: {results['teacher100']}; "
            f"rms(50-100) {results['teacher50_vs_100_rms']:.4f}",
            flush=True,
        )

    for method in args.methods:
        for s in args.seeds:
            d = os.path.join(args.runs, f"{method}-s{s}", "ema")
            if not os.path.isdir(d):
                print(f"skip {method}-s{s}: no EMA student folder {d}", flush=True)
                continue
            pipe = make_pipe(args.teacher)
            files = load_rcm_lora(pipe, d, reuse_for_both=METHODS[method])
            sch = pipe.scheduler
            print(f"{method}-s{s}: files {files}; scheduler {type(sch).__name__} {dict(sch.config)}", flush=True)
            for k in STUDENT_STEPS:
                lat = stock_sample(pipe, emb, labels, k, args.seed)
                ts = [float(t) for t in pipe.scheduler.timesteps]
                torch.save(lat, os.path.join(out_dir, f"samples_{method}-s{s}_k{k}.pt"))
                m = metrics(lat, labels)
                m.update(method=method, seed=s, steps=k, timesteps=ts)
                m["fd_cnn_ratio"] = m["fd_cnn"] / tm["fd_cnn"]
                m["fd_pca_ratio"] = m["fd_pca"] / tm["fd_pca"]
                results["rows"].append(m)
                print(
                    f"[{time.time() - t0:.0f}s] {method} s{s} k{k}: FD {m['fd_cnn']:.3f} (x{m['fd_cnn_ratio']:.2f}) "
                    f"FDpca {m['fd_pca']:.3f} (x{m['fd_pca_ratio']:.2f}) acc {m['acc']:.4f} t={ts}",
                    flush=True,
                )

    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)

    print_tables(results, tm, floor, args.methods)
    print(f"\ntotal {time.time() - t0:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
