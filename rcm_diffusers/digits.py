"""The embedded digits benchmark: data, class-conditional tiny Wan teacher, evaluator, samplers, report.

A small but real distillation problem that runs on a CPU with nothing downloaded:

- **Data**: scikit-learn's 8x8 handwritten digits (1797 images, 10 classes, shipped with the
  package), a fixed stratified 75/25 train / held-out split (``SPLIT_SEED``), pixels ``0..16``
  scaled to ``[-1, 1]``, stored as Wan latents ``[B, C=1, T=1, H=8, W=8]``. No upsampling: with
  patch ``(1, 2, 2)`` the 8x8 image is 16 tokens on a 4x4 grid, enough for attention to matter,
  and 16x16 would make every teacher/student call 4x dearer on 2 CPU cores for the same content.
- **Teacher**: ``WanTransformer3DModel`` (~0.94M parameters, dim 128, 4 layers), rectified flow
  (``x_r = (1 - r) x0 + r eps``, target ``v = eps - x0``, docs/math.md §1), conditioned through
  ``encoder_hidden_states`` = a learned ``[TEXT_LEN, TEXT_DIM]`` embedding per class; row
  ``NULL_CLASS`` (= 10) is the null embedding for CFG. The table ships beside the model
  (``class_embeddings.safetensors``) in a diffusers ``WanPipeline`` directory.
- **Evaluator**: a seeded MLP classifier on the train split; class accuracy of samples, Fréchet
  distance in its 64-d hidden features against the held-out split, within-class diversity
  relative to real held-out digits.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

__all__ = [
    "ASSETS", "TEACHER_DIR", "TEACHER2_DIR", "CLASSIFIER_PATH", "NUM_CLASSES", "NULL_CLASS", "TEXT_LEN", "TEXT_DIM", "SPLIT_SEED",
    "load_digits_split", "to_pixels", "teacher_config", "build_teacher", "init_class_embeddings", "train_rectified_flow",
    "save_teacher", "load_teacher", "load_student", "write_latent_dataset_for", "DigitClassifier",
    "train_classifier", "load_classifier", "frechet_distance", "within_class_diversity", "Evaluator",
    "sample_teacher", "sample_student", "timed", "save_grid", "write_report", "atomic_write_text",
    "ABLATIONS", "run_overrides", "run_state",
]

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
TEACHER_DIR = os.path.join(ASSETS, "digits_teacher")
#: the two-expert teacher (Wan 2.2 layout: transformer = high-noise, transformer_2 = low-noise expert, boundary_ratio)
TEACHER2_DIR = os.path.join(ASSETS, "digits_teacher_2expert")
CLASSIFIER_PATH = os.path.join(ASSETS, "digits_classifier.safetensors")
NUM_CLASSES = 10
NULL_CLASS = 10
TEXT_LEN, TEXT_DIM = 4, 32
SPLIT_SEED = 0
HELD_OUT_FRACTION = 0.25


# ----------------------------------------------------------------------------- data


def load_digits_split(seed: int = SPLIT_SEED) -> dict[str, torch.Tensor]:
    """sklearn digits, stratified 75/25 split by ``seed``: ``x_train/x_test`` ``[N, 1, 1, 8, 8]`` in
    ``[-1, 1]`` (``x = pixel / 8 - 1``), ``y_train/y_test`` int64 labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.images.astype(np.float32) / 8.0 - 1.0)[:, None, None]  # [N, C=1, T=1, 8, 8]
    y = d.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=HELD_OUT_FRACTION, random_state=seed, stratify=y)
    t = torch.from_numpy
    return {"x_train": t(x_tr), "y_train": t(y_tr), "x_test": t(x_te), "y_test": t(y_te)}


def to_pixels(x: torch.Tensor) -> torch.Tensor:
    """Model-space latents ``[B, 1, 1, 8, 8]`` (or ``[B, 64]``) -> flat ``[B, 64]`` float32 clipped to ``[-1, 1]``."""
    return x.reshape(x.shape[0], -1).float().clamp(-1, 1)


# ----------------------------------------------------------------------------- teacher


def teacher_config(**overrides) -> dict:
    """The tiny Wan config of the digits teacher (1 channel, one latent frame, patch (1, 2, 2))."""
    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=1, out_channels=1,
               text_dim=TEXT_DIM, freq_dim=64, ffn_dim=256, num_layers=4, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32)
    cfg.update(overrides)
    return cfg


def build_teacher(seed: int = 0, **overrides):
    """A freshly initialised ``WanTransformer3DModel`` with :func:`teacher_config` (seeded)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(**teacher_config(**overrides))


def init_class_embeddings(seed: int = 0) -> nn.Parameter:
    """Learnable ``[NUM_CLASSES + 1, TEXT_LEN, TEXT_DIM]`` table, N(0, 1); row ``NULL_CLASS`` is the CFG null."""
    g = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(NUM_CLASSES + 1, TEXT_LEN, TEXT_DIM, generator=g))


def train_rectified_flow(model, class_embeddings, x: torch.Tensor, y: torch.Tensor, *, steps: int, batch_size: int, lr: float,
                         warmup: int, ema: float, p_uncond: float, generator: torch.Generator, r_range=(0.0, 1.0),
                         desc: str = "teacher"):
    """Class-conditional rectified flow (docs/math.md §1): ``x_r = (1 - r) x0 + r eps``, ``r ~ U[r_lo, r_hi)``, loss
    ``||v(x_r, r) - (eps - x0)||^2``, class dropped to ``NULL_CLASS`` with ``p_uncond``; AdamW (0.9, 0.99), linear
    warm-up then cosine decay, gradient clipping at 1, EMA with decay ``min(ema, (1 + k) / (10 + k))``. The class
    table trains when it requires grad. Returns ``(ema_model, ema_class_embeddings)``."""
    import copy
    import math as _m

    from tqdm.auto import tqdm

    emb = class_embeddings
    ema_model, ema_emb = copy.deepcopy(model).requires_grad_(False), emb.detach().clone()
    params = list(model.parameters()) + ([emb] if emb.requires_grad else [])
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / warmup) * 0.5 * (1 + _m.cos(_m.pi * min(k, steps) / steps)))
    lo, hi = r_range
    bar = tqdm(range(steps), desc=desc)
    for step in bar:
        idx = torch.randint(len(x), (batch_size,), generator=generator)
        x0, yb = x[idx], y[idx].clone()
        yb[torch.rand(batch_size, generator=generator) < p_uncond] = NULL_CLASS
        eps = torch.randn(x0.shape, generator=generator)
        r = lo + (hi - lo) * torch.rand(batch_size, generator=generator)
        x_r = (1 - r.view(-1, 1, 1, 1, 1)) * x0 + r.view(-1, 1, 1, 1, 1) * eps
        v = model(x_r, r * 1000.0, emb[yb], return_dict=False)[0]
        loss = (v - (eps - x0)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        decay = min(ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, pm in zip(ema_model.parameters(), model.parameters()):
                pe.lerp_(pm, 1 - decay)
            ema_emb.lerp_(emb.detach(), 1 - decay)
        bar.set_postfix(loss=f"{loss.item():.4f}")
    return ema_model.eval(), ema_emb


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file and ``os.replace``."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def save_teacher(out_dir: str, transformer, class_embeddings: torch.Tensor, extra_meta: dict | None = None,
                 transformer_2=None, boundary_ratio: float | None = None) -> str:
    """Write a diffusers ``WanPipeline`` directory (transformer + teacher scheduler, no VAE/text encoder) plus
    ``class_embeddings.safetensors`` (``prompt_embeds`` ``[10, L, D]``, ``negative_prompt_embeds`` ``[1, L, D]``);
    with ``transformer_2`` and ``boundary_ratio`` the Wan 2.2 two-expert layout. Built in ``out_dir.tmp`` and
    renamed into place."""
    from diffusers import WanPipeline
    from safetensors.torch import save_file

    from .schedulers import TrigFlowEulerScheduler

    out_dir = out_dir.rstrip("/")
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer.float().eval(),
                       scheduler=TrigFlowEulerScheduler(),
                       transformer_2=None if transformer_2 is None else transformer_2.float().eval(), boundary_ratio=boundary_ratio)
    pipe.save_pretrained(tmp, safe_serialization=True)
    emb = class_embeddings.detach().float().cpu()
    save_file({"prompt_embeds": emb[:NUM_CLASSES].contiguous(), "negative_prompt_embeds": emb[NULL_CLASS:].contiguous()},
              os.path.join(tmp, "class_embeddings.safetensors"), metadata={"null_class": str(NULL_CLASS)})
    atomic_write_text(os.path.join(tmp, "digits_meta.json"), json.dumps(extra_meta or {}, indent=1, default=str))
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def load_teacher(path: str = TEACHER_DIR, device="cpu"):
    """``(transformer, class_embeddings [11, L, D])`` from a :func:`save_teacher` directory (eval mode, float32); a
    two-expert directory gives a ``rcm_diffusers.experts.WanExpertSwitch`` (the pipeline's expert rule per sample)."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    from .experts import LOW, WanExpertSwitch, pipeline_boundary_ratio

    tr = WanTransformer3DModel.from_pretrained(path, subfolder="transformer", torch_dtype=torch.float32).to(device).eval()
    b = pipeline_boundary_ratio(path)
    if b is not None:
        tr2 = WanTransformer3DModel.from_pretrained(path, subfolder=LOW, torch_dtype=torch.float32).to(device).eval()
        tr = WanExpertSwitch(tr, tr2, b).eval()
    e = load_file(os.path.join(path, "class_embeddings.safetensors"))
    return tr, torch.cat([e["prompt_embeds"], e["negative_prompt_embeds"]]).to(device)


def load_student(path: str = TEACHER_DIR, lora_dir: str | None = None, device="cpu"):
    """Teacher transformer with the rCM student LoRA of ``lora_dir`` (``training/rcm.py`` output) fused in,
    or a full-fine-tune ``student_transformer`` directory; returns ``(transformer, class_embeddings)``."""
    from diffusers import WanPipeline, WanTransformer3DModel

    if lora_dir and os.path.isdir(os.path.join(lora_dir, "student_transformer")):
        _, emb = load_teacher(path, device)
        tr = WanTransformer3DModel.from_pretrained(os.path.join(lora_dir, "student_transformer")).to(device).eval()
        return tr, emb
    tr, emb = load_teacher(path, device)
    if lora_dir:
        pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=tr, scheduler=None)
        pipe.load_lora_weights(lora_dir, adapter_name="student")
        pipe.fuse_lora()
        pipe.unload_lora_weights()
        tr = pipe.transformer.eval()
    return tr, emb


def write_latent_dataset_for(out_dir: str, x: torch.Tensor, y: torch.Tensor, class_embeddings: torch.Tensor) -> str:
    """The train split in the trainer's latent format (``rcm_diffusers.data``, docs/math.md §8): ``latents`` ``[N,1,1,8,8]``,
    ``prompt_index``/``label`` per sample, tables ``prompt_embeds`` (per class) and ``negative_prompt_embeds`` (null)."""
    from .data import write_latent_dataset

    emb = class_embeddings.detach().float().cpu()
    return write_latent_dataset(
        out_dir, {"latents": x.float(), "prompt_index": y.long().clone(), "label": y.long().clone()}, family="wan",
        tables={"prompt_embeds": emb[:NUM_CLASSES].contiguous(), "negative_prompt_embeds": emb[NULL_CLASS:].contiguous()},
        table_index={"prompt_embeds": "prompt_index", "negative_prompt_embeds": None},
        extra_meta={"source": "sklearn.datasets.load_digits", "split_seed": SPLIT_SEED, "scaling": "pixel/8 - 1"})


# ----------------------------------------------------------------------------- evaluator


class DigitClassifier(nn.Module):
    """MLP ``64 -> 256 -> 64 (features) -> 10`` on flat ``[-1, 1]`` pixels; ``features`` feeds the FD."""

    def __init__(self, hidden: int = 256, feat: int = 64):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, hidden), nn.SiLU(), nn.Linear(hidden, feat), nn.SiLU())
        self.head = nn.Linear(feat, NUM_CLASSES)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(to_pixels(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def train_classifier(x: torch.Tensor, y: torch.Tensor, seed: int = 0, epochs: int = 60, noise_std: float = 0.1) -> DigitClassifier:
    """Seeded Adam training (batch 64, lr 2e-3, Gaussian pixel noise ``noise_std`` for robustness); a few seconds."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    clf = DigitClassifier()
    opt = torch.optim.Adam(clf.parameters(), lr=2e-3, weight_decay=1e-4)
    xf = to_pixels(x)
    for _ in range(epochs):
        perm = torch.randperm(len(xf), generator=g)
        for i in range(0, len(xf), 64):
            idx = perm[i:i + 64]
            xb = xf[idx] + noise_std * torch.randn(len(idx), 64, generator=g)
            loss = nn.functional.cross_entropy(clf(xb), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return clf.eval()


def load_classifier(path: str = CLASSIFIER_PATH) -> DigitClassifier:
    """The shipped evaluator classifier (``training/train_teacher_digits.py`` writes it)."""
    from safetensors.torch import load_file

    clf = DigitClassifier()
    clf.load_state_dict(load_file(path))
    return clf.eval()


def frechet_distance(f1: np.ndarray, f2: np.ndarray) -> float:
    """``||mu1 - mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^(1/2))`` of two feature sets ``[N, d]`` (float64; the trace of
    the matrix root is computed as ``sum sqrt(eig(S1^(1/2) S2 S1^(1/2)))``, which is symmetric PSD)."""
    f1, f2 = np.asarray(f1, np.float64), np.asarray(f2, np.float64)
    mu1, mu2 = f1.mean(0), f2.mean(0)
    s1, s2 = np.cov(f1, rowvar=False), np.cov(f2, rowvar=False)
    w, q = np.linalg.eigh(s1)
    r1 = (q * np.sqrt(np.clip(w, 0, None))) @ q.T
    m = r1 @ s2 @ r1
    tr_sqrt = np.sqrt(np.clip(np.linalg.eigvalsh((m + m.T) / 2), 0, None)).sum()
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * tr_sqrt)


def within_class_diversity(feats: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per class, the mean pairwise Euclidean distance of its feature vectors (NaN for fewer than 2)."""
    out = np.full(NUM_CLASSES, np.nan)
    for c in range(NUM_CLASSES):
        f = np.asarray(feats, np.float64)[np.asarray(labels) == c]
        if len(f) >= 2:
            d = np.sqrt(((f[:, None] - f[None]) ** 2).sum(-1))
            out[c] = d.sum() / (len(f) * (len(f) - 1))
    return out


class Evaluator:
    """Metrics of generated digits against the held-out split, in the classifier's feature space.

    ``fd``: Fréchet distance to held-out real; ``accuracy``: classifier predicts the conditioned class;
    ``diversity``: mean over classes of (within-class mean pairwise feature distance of samples / of real).
    """

    def __init__(self, classifier: DigitClassifier | None = None, x_ref: torch.Tensor | None = None, y_ref: torch.Tensor | None = None):
        if x_ref is None:
            s = load_digits_split()
            x_ref, y_ref = s["x_test"], s["y_test"]
        self.clf = classifier if classifier is not None else load_classifier()
        self.f_ref = self.features(x_ref)
        self.y_ref = y_ref.numpy()
        self.div_ref = within_class_diversity(self.f_ref, self.y_ref)

    @torch.no_grad()
    def features(self, x: torch.Tensor) -> np.ndarray:
        return self.clf.features(x.cpu()).double().numpy()

    @torch.no_grad()
    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return float((self.clf(x.cpu()).argmax(-1) == y.cpu()).float().mean())

    def fd_to(self, x: torch.Tensor) -> float:
        """FD between samples ``x`` and another set, e.g. the 100-NFE teacher's samples (distillation fidelity)."""
        return frechet_distance(self.features(x), self.f_ref)

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        f = self.features(x)
        div = within_class_diversity(f, y.cpu().numpy()) / self.div_ref
        return {"fd": frechet_distance(f, self.f_ref), "accuracy": self.accuracy(x, y), "diversity": float(np.nanmean(div))}


# ----------------------------------------------------------------------------- samplers


def _velocity(transformer, class_embeddings, labels, guidance_scale: float, time_input: str = "float"):
    """``v(x, r)`` with CFG ``v_u + s (v_c - v_u)`` (docs/math.md §2.2); one batched call for both branches; the network
    sees ``network_timestep(r, 1000, time_input)``."""
    from .models import network_timestep

    cond = class_embeddings[labels]
    null = class_embeddings[NULL_CLASS:].expand_as(cond)

    def v(x, r):
        B = x.shape[0]
        ts = network_timestep(torch.full((B,), float(r), dtype=torch.float64), 1000.0, time_input).float().to(x.device)
        if guidance_scale == 1.0:
            return transformer(x, ts, cond, return_dict=False)[0].float()
        out = transformer(torch.cat([x, x]), torch.cat([ts, ts]), torch.cat([cond, null]), return_dict=False)[0].float()
        v_c, v_u = out[:B], out[B:]
        return v_u + guidance_scale * (v_c - v_u)

    return v


@torch.no_grad()
def sample_teacher(transformer, class_embeddings, labels: torch.Tensor, steps: int, solver: str = "euler",
                   guidance_scale: float = 1.0, seed: int = 0, shift: float = 1.0, sigma_max: float = 5000.0,
                   batch_size: int = 500) -> torch.Tensor:
    """Teacher ODE samples ``[B, 1, 1, 8, 8]`` with ``TrigFlowEulerScheduler`` / ``TrigFlowUniPCScheduler`` (docs/math.md §2.2),
    starting from ``noise`` drawn by ``torch.Generator().manual_seed(seed)``. NFE = steps x (2 with CFG, else 1)."""
    from .schedulers import TrigFlowEulerScheduler, TrigFlowUniPCScheduler

    cls = {"euler": TrigFlowEulerScheduler, "unipc": TrigFlowUniPCScheduler}[solver]
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(len(labels), 1, 1, 8, 8, generator=g)
    outs = []
    for i in range(0, len(labels), batch_size):
        sch = cls(sigma_max=sigma_max, shift=shift)
        sch.set_timesteps(steps)
        x = noise[i:i + batch_size]
        v = _velocity(transformer, class_embeddings, labels[i:i + batch_size], guidance_scale)
        for k, ts in enumerate(sch.timesteps):
            x = sch.step(v(x, sch.rf_times[k]), ts, x).prev_sample
        outs.append(x)
    return torch.cat(outs)


@torch.no_grad()
def sample_student(transformer, class_embeddings, labels: torch.Tensor, steps: int, seed: int = 0, sigma_max: float = 80.0,
                   mid_t=None, guidance_scale: float = 1.0, batch_size: int = 500, time_input: str = "bf16") -> torch.Tensor:
    """Few-step rCM samples with ``RCMScheduler`` (docs/math.md §2.1): ``x = r_0 noise``, then ``steps`` x0-and-renoise moves
    with fresh noise from the same seeded generator. NFE = steps (x 2 with CFG). ``time_input``: the time the student
    saw in training (``RCMConfig.time_input``)."""
    from .sampling import DEFAULT_MID_T
    from .schedulers import RCMScheduler

    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(len(labels), 1, 1, 8, 8, generator=g)
    outs = []
    for i in range(0, len(labels), batch_size):
        sch = RCMScheduler(sigma_max=sigma_max, mid_t=list(mid_t or DEFAULT_MID_T), time_input=time_input)
        sch.set_timesteps(steps)
        sch.set_generator(g)
        x = sch.scale_initial_noise(noise[i:i + batch_size])
        v = _velocity(transformer, class_embeddings, labels[i:i + batch_size], guidance_scale, time_input)
        for k, ts in enumerate(sch.timesteps):
            x = sch.step(v(x, sch.rf_times[k]), ts, x).prev_sample
        outs.append(x)
    return torch.cat(outs)


def timed(fn, *args, **kwargs):
    """``(result, seconds, peak_mb)``: wall clock of ``fn``; peak memory is CUDA's ``max_memory_allocated`` on GPU,
    else the process's resident-set high-water mark (``ru_maxrss``, process-wide, not per call)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out, dt, peak


# ----------------------------------------------------------------------------- report


def save_grid(path: str, rows: list[tuple[str, torch.Tensor]], per_class: int = 1, scale: int = 4) -> str:
    """PNG grid: one row per ``(name, samples [10 * per_class, ...])`` (samples ordered class-major), columns =
    classes (``per_class`` images each); a label strip on the left. Written atomically."""
    from PIL import Image, ImageDraw

    cell, pad, label_w = 8 * scale, 2, 150
    ncol = NUM_CLASSES * per_class
    W = label_w + ncol * (cell + pad)
    H = len(rows) * (cell + pad) + pad
    img = Image.new("L", (W, H), 255)
    draw = ImageDraw.Draw(img)
    for ri, (name, x) in enumerate(rows):
        y0 = pad + ri * (cell + pad)
        draw.text((2, y0 + cell // 3), name[:24], fill=0)
        pix = ((1 - (to_pixels(x).numpy() + 1) / 2) * 255).clip(0, 255).astype(np.uint8)  # ink dark on white
        for j in range(min(ncol, len(pix))):
            tile = Image.fromarray(pix[j].reshape(8, 8)).resize((cell, cell), Image.NEAREST)
            img.paste(tile, (label_w + j * (cell + pad), y0))
    tmp = path + ".tmp.png"
    img.save(tmp)
    os.replace(tmp, path)
    return path


@dataclass
class Row:
    """One line of the benchmark table."""

    method: str
    steps: int
    nfe: int
    fd: float
    accuracy: float
    diversity: float
    ms_per_sample: float
    peak_mb: float
    fd_vs_teacher: float = math.nan


def write_report(path: str, rows: list[Row], header: str = "") -> str:
    """Markdown table (NFE, FD, accuracy, diversity, ms/sample, peak memory) written atomically; returns the table."""
    lines = ["| method | steps | NFE | FD ↓ | FD vs teacher-100 ↓ | accuracy ↑ | diversity (real = 1) | ms/sample | peak MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        fdt = "—" if math.isnan(r.fd_vs_teacher) else f"{r.fd_vs_teacher:.2f}"
        lines.append(f"| {r.method} | {r.steps} | {r.nfe} | {r.fd:.2f} | {fdt} | {r.accuracy:.3f} | {r.diversity:.2f} | "
                     f"{r.ms_per_sample:.2f} | {r.peak_mb:.0f} |")
    table = "\n".join(lines) + "\n"
    atomic_write_text(path, (header + "\n\n" if header else "") + table)
    return table


# ----------------------------------------------------------------------------- demo runs (training/demo_digits.py)

# Trainer overrides of the issue-5 ablations, applied on top of the rCM config (same iterations, same data):
# sCM-only drops the fake score, so every iteration is a student sCM step; DMD-only zeroes the sCM term and
# the tangent warm-up, because during the warm-up DMD is off by design (docs/math.md §4.3) and with scm_weight 0 those
# iterations would be empty student steps (no loss, yet they consume the lr warm-up and the EMA schedule).
ABLATIONS = {"scm-only": {"use_dmd": False}, "dmd-only": {"scm_weight": 0.0, "tangent_warmup": 0}}

# config keys that do not change what a run trains (a finished run that differs only in these is reused)
_RUN_NEUTRAL = {"output_dir", "resume", "progress", "log_every", "checkpoint_every", "checkpoints_total_limit",
                "report_to", "exit_after_step", "sample_every", "sample_steps"}


def run_overrides(variant: str) -> list[str]:
    """``--key value`` trainer arguments of a demo variant: ``"rcm"`` (none) or a key of :data:`ABLATIONS`."""
    if variant == "rcm":
        return []
    if variant not in ABLATIONS:
        raise ValueError(f"unknown variant {variant!r}; use rcm or one of {sorted(ABLATIONS)}")
    return [a for k, v in ABLATIONS[variant].items() for a in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))]


def run_state(run_dir: str, config: dict | None = None) -> str:
    """``"missing"``, ``"partial"`` (started, no final export) or ``"finished"`` (``final.json`` and the student
    LoRA or transformer written); raises ``ValueError`` naming the keys when ``config`` (a ``RCMConfig`` as dict)
    differs from the run's ``env.json`` in anything that changes the training."""
    env = os.path.join(run_dir, "env.json")
    if not os.path.exists(env):
        return "missing" if not os.path.exists(os.path.join(run_dir, "final.json")) else "partial"
    if config is not None:
        with open(env) as f:
            old = json.load(f).get("config", {})
        diff = sorted(k for k in set(config) | set(old) if k not in _RUN_NEUTRAL and old.get(k) != config.get(k))
        if diff:
            raise ValueError(f"{run_dir} holds a run with a different config ({', '.join(f'{k}: {old.get(k)!r} -> {config.get(k)!r}' for k in diff)}); "
                             "pass --force to retrain it, or choose another --out")
    exported = any(os.path.exists(os.path.join(run_dir, f)) for f in ("pytorch_lora_weights.safetensors", "student_transformer"))
    return "finished" if os.path.exists(os.path.join(run_dir, "final.json")) and exported else "partial"
