"""Precomputed-latent datasets (docs/math.md §8) and the model inputs built from them.

On-disk format (a directory; training never runs a VAE or text encoder)::

    meta.json            {"format": "rcm-latents", "version": 1, "family": "wan" | "wan_i2v" | "flux",
                          "num_samples": N, "shards": [{"file": "shard-00000.safetensors", "num_samples": n}, ...],
                          "tables": {"prompt_embeds": "prompt_index", "negative_prompt_embeds": null, ...}}
    shard-XXXXX.safetensors   per-sample tensors, leading dim = samples in the shard
    tables.safetensors        (optional) shared tensors looked up by an index field

Per-sample keys (float tensors are stored in the dtype written, cast to float32 on load):

- ``latents``: clean latents ``x0``: Wan ``[C, T, H, W]`` (VAE-normalised as the pipeline does),
  Flux ``[C, H, W]`` (unpacked, after the VAE shift/scale; packed into tokens at load).
- ``prompt_embeds`` ``[L, D]`` (Wan: T5 hidden states padded to the pipeline's length;
  Flux: T5 hidden states), or ``prompt_index`` (int64) into a ``prompt_embeds`` table.
- ``negative_prompt_embeds`` ``[L, D]`` for CFG (usually one table row shared by all samples).
- Flux: ``pooled_prompt_embeds`` ``[768]`` (+ ``negative_pooled_prompt_embeds`` for CFG).
- Wan I2V: ``condition`` ``[4 + C, T, H, W]`` (first-frame mask + image latents, as
  WanImageToVideoPipeline builds them) and optionally ``image_embeds`` ``[257, 1280]`` (CLIP).
- anything else (e.g. ``label``) is carried through untouched.

A table listed in ``meta["tables"]`` with index ``null`` has one row broadcast to every sample.
For tiny label-conditioned models (e.g. digits) write one ``prompt_embeds`` row per class and a
``prompt_index`` per sample.

Batches are a pure function of ``(seed, step, rank, world)`` (``batch_indices``), so resuming
needs only the step counter and no process can drift from the others.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["write_latent_dataset", "LatentDataset", "batch_indices", "step_seed", "step_generator", "sample_generators",
           "step_noise", "model_inputs",
           "pack_flux_latents", "unpack_flux_latents"]

FORMAT = "rcm-latents"


def _atomic_save(tensors: dict, path: str) -> None:
    tmp = path + ".tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
    os.replace(tmp, path)


def write_latent_dataset(out_dir: str, samples: dict[str, torch.Tensor], *, family: str,
                         tables: dict[str, torch.Tensor] | None = None, table_index: dict[str, str | None] | None = None,
                         shard_size: int = 4096, extra_meta: dict | None = None) -> str:
    """Write the docs/math.md §8 latent format: per-sample tensors ``samples`` (leading dim N) sharded, and
    shared ``tables`` looked up by ``table_index[name]`` (or broadcast when ``None``)."""
    if "latents" not in samples:
        raise ValueError("a latent dataset needs a 'latents' entry [N, ...]")
    N = samples["latents"].shape[0]
    for k, v in samples.items():
        if v.shape[0] != N:
            raise ValueError(f"sample field {k!r} has {v.shape[0]} rows, latents has {N}")
    tables = tables or {}
    table_index = table_index or {k: None for k in tables}
    for k, idx in table_index.items():
        if k not in tables:
            raise ValueError(f"table_index names {k!r} but no such table was given")
        if idx is not None and idx not in samples:
            raise ValueError(f"table {k!r} is indexed by {idx!r}, which is not a sample field")
    os.makedirs(out_dir, exist_ok=True)
    shards = []
    for s, start in enumerate(range(0, N, shard_size)):
        name = f"shard-{s:05d}.safetensors"
        _atomic_save({k: v[start:start + shard_size] for k, v in samples.items()}, os.path.join(out_dir, name))
        shards.append({"file": name, "num_samples": min(shard_size, N - start)})
    meta = {"format": FORMAT, "version": 1, "family": family, "num_samples": N, "shards": shards,
            "tables": table_index, **(extra_meta or {})}
    if tables:
        _atomic_save(tables, os.path.join(out_dir, "tables.safetensors"))
        meta["tables_file"] = "tables.safetensors"
    tmp = os.path.join(out_dir, "meta.json.tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "meta.json"))
    return out_dir


class LatentDataset:
    """Reader of the docs/math.md §8 format; ``get(indices)`` returns a batch dict of float32 tensors."""

    def __init__(self, root: str):
        path = os.path.join(root, "meta.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{root} is not an rcm latent dataset (no meta.json); create one with training/prepare_data.py")
        with open(path) as f:
            self.meta = json.load(f)
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{path}: format {self.meta.get('format')!r}, expected {FORMAT!r}")
        self.root = root
        self.family = self.meta["family"]
        self.num_samples = int(self.meta["num_samples"])
        self._starts = np.cumsum([0] + [s["num_samples"] for s in self.meta["shards"]])
        self._files = [safe_open(os.path.join(root, s["file"]), framework="pt") for s in self.meta["shards"]]
        self.tables = {}
        if self.meta.get("tables_file"):
            with safe_open(os.path.join(root, self.meta["tables_file"]), framework="pt") as f:
                self.tables = {k: f.get_tensor(k) for k in f.keys()}
        self.table_index = self.meta.get("tables") or {}

    def __len__(self):
        return self.num_samples

    def keys(self):
        return list(self._files[0].keys()) + list(self.tables)

    def get(self, indices) -> dict[str, torch.Tensor]:
        """Rows ``indices`` of every field, tables resolved; ids in ``batch["index"]``."""
        indices = [int(i) for i in indices]
        rows = {}
        for i in indices:
            s = int(np.searchsorted(self._starts, i, side="right") - 1)
            f, j = self._files[s], i - int(self._starts[s])
            for k in f.keys():
                rows.setdefault(k, []).append(f.get_slice(k)[j:j + 1])
        batch = {k: torch.cat(v) for k, v in rows.items()}
        for name, idx in self.table_index.items():
            tab = self.tables[name]
            batch[name] = tab[batch[idx].long()] if idx is not None else tab[:1].expand(len(indices), *tab.shape[1:])
        batch = {k: (v.float() if v.is_floating_point() else v) for k, v in batch.items()}
        batch["index"] = torch.tensor(indices, dtype=torch.long)
        return batch


def step_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed mixed from ``(seed, *keys)`` (e.g. step, rank) by numpy's SeedSequence."""
    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, *[int(k) for k in keys]]).generate_state(2, np.uint64)[0] >> 1)


def step_generator(seed: int, step: int, rank: int, stream: int = 0, device="cpu") -> torch.Generator:
    """Per-(step, rank, stream) generator: noise depends on nothing but these numbers."""
    return torch.Generator(device=device).manual_seed(step_seed(seed, step, rank, stream))


SAMPLE_STREAM = 0x5A3D  # keeps the per-sample seeds apart from the per-(step, rank, stream) ones


def sample_generators(seed: int, step: int, first: int, count: int, device="cpu"):
    """``rng.SampleGenerators`` of the ``count`` samples at global positions ``first, first + 1, ...`` of ``step``'s
    global batch (the rows ``batch_indices`` reads): each sample's noise depends on ``(seed, step, position)`` only,
    not on how the global batch is split over processes and micro-batches."""
    from ..rng import SampleGenerators

    return SampleGenerators(torch.Generator(device=device).manual_seed(step_seed(seed, step, SAMPLE_STREAM, first + j))
                            for j in range(count))


def step_noise(noise_seeding: str, seed: int, step: int, rank: int, batch: int, device="cpu"):
    """The generator of ``rank``'s ``batch`` samples at ``step``: ``"rank"`` = one ``step_generator(seed, step, rank)``
    drawn for the whole batch; ``"sample"`` = ``sample_generators`` of the rank's rows (``batch`` per rank)."""
    if noise_seeding == "rank":
        return step_generator(seed, step, rank, device=device)
    if noise_seeding == "sample":
        return sample_generators(seed, step, rank * batch, batch, device=device)
    raise ValueError(f"noise_seeding {noise_seeding!r}: use 'rank' or 'sample'")


def batch_indices(num_samples: int, batch_size: int, step: int, rank: int, world: int, seed: int) -> list[int]:
    """Sample ids of ``rank``'s batch at ``step``: the global stream is a fresh permutation per epoch
    (seeded by ``(seed, epoch)``); step ``k`` takes global rows ``[k*B*world, (k+1)*B*world)``."""
    gbs = batch_size * world
    start = step * gbs + rank * batch_size
    out = []
    for pos in range(start, start + batch_size):
        epoch, j = divmod(pos, num_samples)
        perm = np.random.default_rng(step_seed(seed, 0x5EED, epoch)).permutation(num_samples)
        out.append(int(perm[j]))
    return out


# ----------------------------------------------------------------------------- model inputs


def pack_flux_latents(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W] -> [B, (H/2)(W/2), 4C]`` as FluxPipeline packs them."""
    B, C, H, W = latents.shape
    x = latents.view(B, C, H // 2, 2, W // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // 2) * (W // 2), C * 4)


def unpack_flux_latents(tokens: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """Inverse of ``pack_flux_latents`` for latent size ``H x W``."""
    B, L, D = tokens.shape
    x = tokens.view(B, H // 2, W // 2, D // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(B, D // 4, H, W)


def _flux_img_ids(H: int, W: int) -> torch.Tensor:
    ids = torch.zeros(H // 2, W // 2, 3)
    ids[..., 1] = torch.arange(H // 2)[:, None]
    ids[..., 2] = torch.arange(W // 2)[None, :]
    return ids.reshape(-1, 3)


def model_inputs(family: str, batch: dict, device, model_dtype, flux_guidance: float | None = None):
    """``(x0, cond, uncond)``: float64 clean latents in the model's layout (Flux: packed tokens) and
    the condition kwargs of ``rcm_diffusers.models.velocity_fn`` (``uncond`` is ``None`` without negatives)."""
    def md(x):
        return x.to(device=device, dtype=model_dtype)

    x0 = batch["latents"].to(device=device, dtype=torch.float64)
    neg = batch.get("negative_prompt_embeds")
    if family in ("wan", "wan_i2v"):
        cond = {"encoder_hidden_states": md(batch["prompt_embeds"])}
        if family == "wan_i2v":
            cond["condition"] = md(batch["condition"])
            if "image_embeds" in batch:
                n_txt = batch["prompt_embeds"].shape[1]
                if n_txt != 512:  # diffusers' Wan I2V attention takes the last 512 context tokens as text
                    raise ValueError(f"Wan I2V with image embeddings needs prompt_embeds of exactly 512 tokens (the WanPipeline "
                                     f"padding), got {n_txt}: re-run training/prepare_data.py with --max_sequence_length 512")
                cond["encoder_hidden_states_image"] = md(batch["image_embeds"])
        uncond = None if neg is None else {**cond, "encoder_hidden_states": md(neg)}
        return x0, cond, uncond
    if family == "flux":
        H, W = x0.shape[-2:]
        x0 = pack_flux_latents(x0)
        L = batch["prompt_embeds"].shape[1]
        cond = {"encoder_hidden_states": md(batch["prompt_embeds"]), "pooled_projections": md(batch["pooled_prompt_embeds"]),
                "txt_ids": md(torch.zeros(L, 3)), "img_ids": md(_flux_img_ids(H, W))}
        if flux_guidance is not None:
            cond["guidance"] = torch.full((x0.shape[0],), float(flux_guidance), device=device, dtype=torch.float32)
        uncond = None
        if neg is not None:
            uncond = {**cond, "encoder_hidden_states": md(neg),
                      "pooled_projections": md(batch.get("negative_pooled_prompt_embeds", batch["pooled_prompt_embeds"]))}
        return x0, cond, uncond
    raise ValueError(f"unknown data family {family!r}; expected 'wan', 'wan_i2v' or 'flux'")


def video_noise_multiplier(x0: torch.Tensor, family: str) -> float:
    """``sqrt(latent frames)`` for Wan video latents ``[B, C, T, H, W]``, 1 otherwise (docs/math.md §3)."""
    return math.sqrt(x0.shape[2]) if family.startswith("wan") and x0.dim() == 5 else 1.0
