"""Digits data and the class-conditional tiny Wan teacher: split, build, rectified-flow training, save/load, latent
dataset."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
from torch import nn

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
    cfg = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=32,
        in_channels=1,
        out_channels=1,
        text_dim=TEXT_DIM,
        freq_dim=64,
        ffn_dim=256,
        num_layers=4,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=32,
    )
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


def train_rectified_flow(
    model,
    class_embeddings,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    warmup: int,
    ema: float,
    p_uncond: float,
    generator: torch.Generator,
    r_range=(0.0, 1.0),
    desc: str = "teacher",
):
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
        opt, lambda k: min(1.0, (k + 1) / warmup) * 0.5 * (1 + _m.cos(_m.pi * min(k, steps) / steps))
    )
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


def save_teacher(
    out_dir: str,
    transformer,
    class_embeddings: torch.Tensor,
    extra_meta: dict | None = None,
    transformer_2=None,
    boundary_ratio: float | None = None,
) -> str:
    """Write a diffusers ``WanPipeline`` directory (transformer + teacher scheduler, no VAE/text encoder) plus
    ``class_embeddings.safetensors`` (``prompt_embeds`` ``[10, L, D]``, ``negative_prompt_embeds`` ``[1, L, D]``);
    with ``transformer_2`` and ``boundary_ratio`` the Wan 2.2 two-expert layout. Built in ``out_dir.tmp`` and
    renamed into place."""
    from diffusers import WanPipeline
    from safetensors.torch import save_file

    from ..schedulers import TrigFlowEulerScheduler

    out_dir = out_dir.rstrip("/")
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=None,
        transformer=transformer.float().eval(),
        scheduler=TrigFlowEulerScheduler(),
        transformer_2=None if transformer_2 is None else transformer_2.float().eval(),
        boundary_ratio=boundary_ratio,
    )
    pipe.save_pretrained(tmp, safe_serialization=True)
    emb = class_embeddings.detach().float().cpu()
    save_file(
        {"prompt_embeds": emb[:NUM_CLASSES].contiguous(), "negative_prompt_embeds": emb[NULL_CLASS:].contiguous()},
        os.path.join(tmp, "class_embeddings.safetensors"),
        metadata={"null_class": str(NULL_CLASS)},
    )
    atomic_write_text(os.path.join(tmp, "digits_meta.json"), json.dumps(extra_meta or {}, indent=1, default=str))
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def load_teacher(path: str = TEACHER_DIR, device="cpu"):
    """``(transformer, class_embeddings [11, L, D])`` from a :func:`save_teacher` directory (eval mode, float32); a
    two-expert directory gives a ``rcm_diffusers.distill.experts.WanExpertSwitch`` (the pipeline's expert rule per
    sample)."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    from ..distill.experts import LOW, WanExpertSwitch, pipeline_boundary_ratio

    tr = (
        WanTransformer3DModel.from_pretrained(path, subfolder="transformer", torch_dtype=torch.float32)
        .to(device)
        .eval()
    )
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


def load_student_pipeline(path: str = TEACHER_DIR, lora_dir: str | None = None, scheduler: bool = True, device="cpu"):
    """The teacher folder as a user loads it, ``WanPipeline.from_pretrained(path)``, with the student of ``lora_dir``
    loaded by ``rcm_diffusers.lora.pipeline.load_rcm_lora`` (not fused; with ``scheduler=True`` it also sets the
    scheduler the run wrote). Returns ``(pipe, the pipeline's own scheduler config before that call)``."""
    from diffusers import WanPipeline

    from ..lora.pipeline import load_rcm_lora

    pipe = WanPipeline.from_pretrained(path, vae=None, text_encoder=None, tokenizer=None).to(device)
    pipe.set_progress_bar_config(disable=True)
    stock = pipe.scheduler.config
    if lora_dir:
        load_rcm_lora(pipe, lora_dir, scheduler=scheduler)
    return pipe, stock


ODE_PAIRS_DIR = os.path.join(ASSETS, "digits_ode_pairs")
ODE_PAIRS2_DIR = os.path.join(ASSETS, "digits_ode_pairs_2expert")  # the two-expert teacher's


@torch.no_grad()
def write_ode_pairs(
    out_dir: str,
    teacher_dir: str = TEACHER_DIR,
    num_samples: int = 8192,
    steps: int = 32,
    seed: int = 0,
    batch_size: int = 512,
) -> str:
    """ODE pairs of a digits teacher (one network or two experts, as ``load_teacher`` loads ``teacher_dir``) for the
    regression term (docs/math.md §4.7), in the trainer's latent format:
    pair ``i`` has class ``i % 10``, ``noise`` = ``randn([1, 1, 8, 8], generator=manual_seed(seed + i))`` and
    ``latents`` = the teacher's ODE solution from it (``distill.prepare.teacher_samples``: UniPC, ``steps`` steps,
    shift 1, ``sigma_max`` 5000, no CFG), plus the class table of ``write_latent_dataset_for``."""
    from ..distill.prepare import seed_noise, teacher_samples

    tr, emb = load_teacher(teacher_dir)
    labels = torch.arange(num_samples) % NUM_CLASSES
    noise = seed_noise((1, 1, 8, 8), [seed + i for i in range(num_samples)])
    x = torch.cat(
        [
            teacher_samples(
                tr,
                "wan",
                {"prompt_embeds": emb[labels[i : i + batch_size]]},
                noise[i : i + batch_size],
                steps=steps,
                shift=1.0,
                guidance_scale=1.0,
                solver="unipc",
            )
            for i in range(0, num_samples, batch_size)
        ]
    )
    return write_latent_dataset_for(
        out_dir,
        x,
        labels,
        emb,
        extra={"noise": noise},
        shard_size=num_samples,
        meta={
            "source": "synthetic",
            "teacher": os.path.basename(teacher_dir.rstrip("/")),
            "solver": "unipc",
            "steps": steps,
            "shift": 1.0,
            "guidance_scale": 1.0,
            "sigma_max": 5000.0,
            "seed": seed,
        },
    )


def write_latent_dataset_for(
    out_dir: str,
    x: torch.Tensor,
    y: torch.Tensor,
    class_embeddings: torch.Tensor,
    extra: dict | None = None,
    meta: dict | None = None,
    shard_size: int = 4096,
) -> str:
    """Digits in the trainer's latent format (``rcm_diffusers.distill.data``, docs/math.md §8): ``latents``
    ``[N,1,1,8,8]``, ``prompt_index``/``label`` per sample (and the per-sample fields ``extra``), tables
    ``prompt_embeds`` (per class) and ``negative_prompt_embeds`` (null); ``meta`` defaults to the train split's
    description."""
    from ..distill.data import write_latent_dataset

    emb = class_embeddings.detach().float().cpu()
    return write_latent_dataset(
        out_dir,
        {"latents": x.float(), "prompt_index": y.long().clone(), "label": y.long().clone(), **(extra or {})},
        family="wan",
        shard_size=shard_size,
        tables={
            "prompt_embeds": emb[:NUM_CLASSES].contiguous(),
            "negative_prompt_embeds": emb[NULL_CLASS:].contiguous(),
        },
        table_index={"prompt_embeds": "prompt_index", "negative_prompt_embeds": None},
        extra_meta=meta
        or {"source": "sklearn.datasets.load_digits", "split_seed": SPLIT_SEED, "scaling": "pixel/8 - 1"},
    )
