"""Build docs/math.md §8 latent datasets with a pipeline's own VAE and text encoder (``training/prepare_data.py``).

Two sources, one output format (:func:`rcm_diffusers.distill.data.write_latent_dataset`):

- **real**: image/video + caption pairs, from a folder (``clip.gif`` + ``clip.txt``), a JSONL manifest
  (``{"file": ..., "caption": ...}`` per line) or a CSV manifest (columns ``file,caption``); media are
  encoded with ``pipe.vae.encode`` (distribution mode) and normalised as the pipeline denormalises at
  decode time: Wan and Qwen-Image ``(z - latents_mean) / latents_std``, Flux ``(z - shift_factor) * scaling_factor``,
  HunyuanVideo-1.5 ``z * scaling_factor``
  (Flux, Qwen-Image: stored unpacked ``[C, H, W]``; the trainer packs). Captions go through ``pipe.encode_prompt``
  (Qwen-Image: padded with zeros to ``max_sequence_length`` tokens, with ``prompt_embeds_mask``; HunyuanVideo-1.5:
  both encoders at the pipeline's fixed lengths, ``prompt_embeds(_2)`` with ``prompt_embeds_mask(_2)``).
- **synthetic**: teacher samples from prompts, ``TrigFlowEulerScheduler`` / ``TrigFlowUniPCScheduler``
  + CFG (docs/math.md §8: Euler 100 steps, shift 3, CFG 5). Sample ``i`` starts from
  ``randn(latent shape, generator=torch.Generator().manual_seed(seed + i))``, so it equals
  ``pipe(prompt_i, generator=..., output_type="latent")`` with the same scheduler and guidance scale. That noise
  is stored beside it (``noise``), so a synthetic dataset is also the ODE pairs of ``regression_weight``.

Shards are written as samples are encoded (:class:`ShardWriter`; ``meta.json`` last). Captions that repeat
(each unique caption at most half the samples) are stored once in a ``prompt_embeds`` table indexed by
``prompt_index``, otherwise per sample; the negative prompt is one broadcast table row. Wan I2V adds per-sample
``condition`` (mask + first-frame latents, as ``WanImageToVideoPipeline.prepare_latents`` builds them) and, with a
CLIP image encoder, ``image_embeds``.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from .data import FORMAT, PACKED, _atomic_save, pack_latents, unpack_latents

__all__ = [
    "IMAGE_EXTS",
    "VIDEO_EXTS",
    "Item",
    "read_items",
    "read_prompts",
    "load_media",
    "family_of",
    "PipelineEncoder",
    "ShardWriter",
    "seed_noise",
    "synthetic_defaults",
    "check_guider",
    "teacher_samples",
    "prepare_real",
    "prepare_synthetic",
]

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_EXTS = (".gif", ".mp4", ".webm", ".mov", ".mkv", ".avi")
_FILE_KEYS = ("file", "path", "media", "video", "image")
_TEXT_KEYS = ("caption", "text", "prompt")


@dataclass
class Item:
    """One training pair: a media file (``None`` for prompt-only lists) and its caption."""

    media: str | None
    caption: str


def _pick(row: dict, keys, what: str, where: str):
    for k in keys:
        if row.get(k) not in (None, ""):
            return row[k]
    raise ValueError(f"{where}: no {what} column/key; expected one of {list(keys)}, got {sorted(row)}")


def read_items(source: str, caption_ext: str = ".txt") -> list[Item]:
    """Media + caption pairs from a folder (each media file with a same-stem ``caption_ext`` file),
    a ``.jsonl`` or a ``.csv`` manifest (paths relative to the manifest); sorted folder order."""
    if not os.path.exists(source):
        raise FileNotFoundError(f"data source {source!r} does not exist")
    items: list[Item] = []
    if os.path.isdir(source):
        names = sorted(n for n in os.listdir(source) if n.lower().endswith(IMAGE_EXTS + VIDEO_EXTS))
        if not names:
            raise ValueError(f"{source}: no image/video files ({', '.join(IMAGE_EXTS + VIDEO_EXTS)})")
        missing = [n for n in names if not os.path.exists(os.path.join(source, os.path.splitext(n)[0] + caption_ext))]
        if missing:
            raise FileNotFoundError(
                f"{source}: {len(missing)} media file(s) without a {caption_ext} caption, e.g. "
                f"{missing[:3]}; write <name>{caption_ext} next to each or use a manifest"
            )
        for n in names:
            with open(os.path.join(source, os.path.splitext(n)[0] + caption_ext), encoding="utf-8") as f:
                items.append(Item(os.path.join(source, n), f.read().strip()))
        return items
    root = os.path.dirname(os.path.abspath(source))
    if source.endswith(".jsonl"):
        with open(source, encoding="utf-8") as f:
            rows = [(k + 1, json.loads(ln)) for k, ln in enumerate(f) if ln.strip()]
    elif source.endswith(".csv"):
        with open(source, encoding="utf-8", newline="") as f:
            rows = [(k + 2, r) for k, r in enumerate(csv.DictReader(f))]
    else:
        raise ValueError(f"{source}: expected a folder, a .jsonl or a .csv manifest")
    for line, r in rows:
        where = f"{source}:{line}"
        media = str(_pick(r, _FILE_KEYS, "file", where))
        items.append(
            Item(
                media if os.path.isabs(media) else os.path.join(root, media),
                str(_pick(r, _TEXT_KEYS, "caption", where)),
            )
        )
    for it in items:
        if not os.path.exists(it.media):
            raise FileNotFoundError(f"{source}: media file {it.media} does not exist")
    return items


def read_prompts(source: str) -> list[str]:
    """Prompts for synthetic data: a ``.txt`` file (one per line), or the captions of a folder/manifest."""
    if source.endswith(".txt") and os.path.isfile(source):
        with open(source, encoding="utf-8") as f:
            prompts = [ln.strip() for ln in f if ln.strip()]
        if not prompts:
            raise ValueError(f"{source}: no prompts (one per line)")
        return prompts
    return [it.caption for it in read_items(source)]


# ----------------------------------------------------------------------------- media


def _frames(path: str) -> list:
    """All frames of an image/video file as RGB PIL images."""
    from PIL import Image, ImageSequence, UnidentifiedImageError

    ext = os.path.splitext(path)[1].lower()
    if ext in IMAGE_EXTS + (".gif",):
        try:
            with Image.open(path) as im:
                return [f.convert("RGB") for f in ImageSequence.Iterator(im)]
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"cannot read {path}: {e}") from e
    try:
        import imageio.v3 as iio
    except ImportError as e:
        raise ValueError(
            f"cannot read {path}: {ext} video needs `pip install imageio[pyav]` (GIF and images need only Pillow)"
        ) from e
    try:
        return [Image.fromarray(np.asarray(a)).convert("RGB") for a in iio.imiter(path)]
    except Exception as e:  # noqa: BLE001 - any decoder failure is a bad file for the user
        raise ValueError(f"cannot read {path}: {e}") from e


def _fit(img, height: int, width: int, resize: str, path: str):
    from PIL import Image

    if img.size == (width, height):
        return img
    if resize == "error":
        raise ValueError(
            f"{path} is {img.size[0]}x{img.size[1]} (WxH), expected {width}x{height}; "
            "resize the data or pass --resize crop (scale + centre crop) or --resize stretch"
        )
    if resize == "stretch":
        return img.resize((width, height), Image.BICUBIC)
    s = max(width / img.size[0], height / img.size[1])
    w, h = max(width, round(img.size[0] * s)), max(height, round(img.size[1] * s))
    img = img.resize((w, h), Image.BICUBIC)
    left, top = (w - width) // 2, (h - height) // 2
    return img.crop((left, top, left + width, top + height))


def load_media(path: str, height: int, width: int, num_frames: int = 1, resize: str = "error") -> torch.Tensor:
    """Pixels ``[3, num_frames, height, width]`` in ``[-1, 1]`` (the pipelines' ``2 x - 1``): the first
    ``num_frames`` frames of a video, or an image as one frame."""
    frames = _frames(path)
    if len(frames) < num_frames:
        raise ValueError(f"{path} has {len(frames)} frame(s), --num_frames asks for {num_frames}")
    arr = np.stack([np.asarray(_fit(f, height, width, resize, path), dtype=np.float32) for f in frames[:num_frames]])
    return torch.from_numpy(arr).permute(3, 0, 1, 2) / 127.5 - 1.0


# ----------------------------------------------------------------------------- pipeline encoders


def family_of(pipe) -> str:
    """Data family of a diffusers pipeline: ``wan``, ``wan_i2v``, ``flux``, ``qwen`` or ``flux2``."""
    name = type(pipe).__name__
    if name == "WanImageToVideoPipeline":
        if getattr(pipe.config, "expand_timesteps", False):
            raise ValueError(
                "WanImageToVideoPipeline with expand_timesteps (Wan2.2 TI2V-5B) is not supported "
                "by the rCM trainer's condition format"
            )
        return "wan_i2v"
    if name.startswith("Wan"):
        return "wan"
    if name == "Flux2Pipeline":
        return "flux2"
    if name.startswith("Flux2"):  # Flux2KleinPipeline & co.: another text encoder and true CFG
        raise ValueError(f"unsupported pipeline {name}; of the FLUX.2 pipelines the trainer takes Flux2Pipeline")
    if name.startswith("Flux"):
        return "flux"
    if name == "QwenImagePipeline":
        return "qwen"
    if name == "HunyuanVideo15Pipeline":  # text-to-video only (not HunyuanVideo15ImageToVideoPipeline)
        return "hunyuan15"
    raise ValueError(
        f"unsupported pipeline {name}; expected WanPipeline, WanImageToVideoPipeline, FluxPipeline, "
        "QwenImagePipeline, Flux2Pipeline or HunyuanVideo15Pipeline"
    )


class PipelineEncoder:
    """The pipeline's own text encoder(s) and VAE, producing tensors in the docs/math.md §8 layout."""

    def __init__(
        self,
        pipe,
        height: int,
        width: int,
        num_frames: int = 1,
        max_sequence_length: int | None = None,
        device="cpu",
        dtype=torch.float32,
    ):
        self.pipe, self.family, self.device, self.dtype = pipe, family_of(pipe), torch.device(device), dtype
        self.height, self.width, self.num_frames = height, width, num_frames
        # 512 for all: what WanPipeline/FluxPipeline.__call__ pad prompts to at inference (encode_prompt's own
        # default of 226 would train on other padding than the pipeline samples with, and breaks the Wan I2V
        # split that takes the last 512 context tokens as text); QwenImagePipeline.__call__ cuts prompts there
        self.max_sequence_length = max_sequence_length or 512
        vae = pipe.vae
        if self.family == "flux":
            self.sf = 2 ** (len(vae.config.block_out_channels) - 1)
            if height % (2 * self.sf) or width % (2 * self.sf):
                raise ValueError(
                    f"Flux needs height/width divisible by {2 * self.sf} (VAE x{self.sf}, 2x2 packing); "
                    f"got {height}x{width}"
                )
            if num_frames != 1:
                raise ValueError("Flux is an image model: use --num_frames 1")
        elif self.family == "flux2":
            self.sf = 2 ** (len(vae.config.block_out_channels) - 1)  # Flux2Pipeline.vae_scale_factor
            if height % (2 * self.sf) or width % (2 * self.sf):
                raise ValueError(
                    f"FLUX.2 needs height/width divisible by {2 * self.sf} (VAE x{self.sf}, 2x2 patchify); "
                    f"got {height}x{width}"
                )
            if num_frames != 1:
                raise ValueError("FLUX.2 is an image model: use --num_frames 1")
        elif self.family == "hunyuan15":  # HunyuanVideo15Pipeline.vae_scale_factor_spatial / _temporal
            self.sf, self.tf = vae.spatial_compression_ratio, vae.temporal_compression_ratio
            if height % self.sf or width % self.sf:
                raise ValueError(f"HunyuanVideo-1.5 needs height/width divisible by {self.sf}; got {height}x{width}")
            if (num_frames - 1) % self.tf:
                raise ValueError(
                    f"HunyuanVideo-1.5 needs num_frames = {self.tf} k + 1 (1, 5, ..., 121); got {num_frames}"
                )
        elif self.family == "qwen":
            self.sf = 2 ** len(vae.temperal_downsample)  # QwenImagePipeline.vae_scale_factor
            if height % (2 * self.sf) or width % (2 * self.sf):
                raise ValueError(
                    f"Qwen-Image needs height/width divisible by {2 * self.sf} (VAE x{self.sf}, 2x2 packing); "
                    f"got {height}x{width}"
                )
            if num_frames != 1:
                raise ValueError("Qwen-Image is an image model: use --num_frames 1")
            z = vae.config.z_dim
            self.mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32).view(1, z, 1, 1, 1)
            self.std = torch.tensor(vae.config.latents_std, dtype=torch.float32).view(1, z, 1, 1, 1)
        else:
            self.sf, self.tf = vae.config.scale_factor_spatial, vae.config.scale_factor_temporal
            if height % self.sf or width % self.sf:
                raise ValueError(f"Wan needs height/width divisible by {self.sf}; got {height}x{width}")
            if (num_frames - 1) % self.tf:
                raise ValueError(f"Wan needs num_frames = {self.tf} k + 1 (1, 5, 9, ..., 81); got {num_frames}")
            z = vae.config.z_dim
            if len(vae.config.latents_mean) != z or len(vae.config.latents_std) != z:
                raise ValueError(
                    f"VAE latents_mean/std have {len(vae.config.latents_mean)}/{len(vae.config.latents_std)} entries, "
                    f"z_dim is {z}"
                )
            self.mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32).view(1, z, 1, 1, 1)
            self.std = torch.tensor(vae.config.latents_std, dtype=torch.float32).view(1, z, 1, 1, 1)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample latent shape in the dataset layout (Wan ``[C, T, h, w]``, Flux / Qwen-Image ``[C, h, w]``)."""
        h, w = self.height // self.sf, self.width // self.sf
        if self.family == "flux2":  # patchified 2 x 2: [4 C, h / 2, w / 2], the transformer's in_channels
            return (self.pipe.transformer.config.in_channels, h // 2, w // 2)
        if self.family in PACKED:
            return (self.pipe.transformer.config.in_channels // 4, h, w)
        z = self.pipe.transformer.config.out_channels
        return (z, (self.num_frames - 1) // self.tf + 1, h, w)

    @torch.no_grad()
    def encode_text(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``pipe.encode_prompt`` of ``prompts``: ``prompt_embeds`` ``[n, L, D]`` (+ Flux ``pooled_prompt_embeds``)."""
        if self.pipe.text_encoder is None or self.pipe.tokenizer is None:
            raise ValueError(
                "the pipeline has no text encoder/tokenizer; load one that has "
                "(or precompute embeddings and call write_latent_dataset)"
            )
        if self.family == "flux":
            pe, pooled, _ = self.pipe.encode_prompt(
                prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
            )
            return {"prompt_embeds": pe.float().cpu(), "pooled_prompt_embeds": pooled.float().cpu()}
        if self.family == "flux2":  # padded to max_sequence_length by its tokenizer; text_ids are rebuilt at load
            pe, _ = self.pipe.encode_prompt(
                prompt=prompts, device=self.device, max_sequence_length=self.max_sequence_length
            )
            return {"prompt_embeds": pe.float().cpu()}
        if self.family == "hunyuan15":  # both encoders at the pipeline's own fixed lengths (1000, 256), with masks
            if self.pipe.text_encoder_2 is None or self.pipe.tokenizer_2 is None:
                raise ValueError("the pipeline has no ByT5 text_encoder_2/tokenizer_2; load one that has")
            pe, mask, pe2, mask2 = self.pipe.encode_prompt(
                prompt=prompts, device=self.device, dtype=torch.float32, batch_size=len(prompts)
            )
            return {
                "prompt_embeds": pe.float().cpu(),
                "prompt_embeds_mask": mask.float().cpu(),
                "prompt_embeds_2": pe2.float().cpu(),
                "prompt_embeds_mask_2": mask2.float().cpu(),
            }
        if self.family == "qwen":
            pe, mask = self.pipe.encode_prompt(
                prompt=prompts, device=self.device, max_sequence_length=self.max_sequence_length
            )
            if mask is None:  # encode_prompt drops an all-ones mask
                mask = torch.ones(pe.shape[:2])
            pad = self.max_sequence_length - pe.shape[1]  # a fixed length, so that batches of captions stack
            pe = torch.nn.functional.pad(pe.float().cpu(), (0, 0, 0, pad))
            mask = torch.nn.functional.pad(mask.float().cpu(), (0, pad))
            return {"prompt_embeds": pe, "prompt_embeds_mask": mask}
        pe, _ = self.pipe.encode_prompt(
            prompt=prompts,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return {"prompt_embeds": pe.float().cpu()}

    def _vae_encode(self, pixels: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        return vae.encode(pixels.to(self.device, vae.dtype)).latent_dist.mode().float().cpu()

    @torch.no_grad()
    def encode_media(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised latents of pixels ``[B, 3, F, H, W]`` in [-1, 1] (Wan ``[B, C, T, h, w]``, Flux
        ``[B, C, h, w]``)."""
        if self.family == "flux":
            z = self._vae_encode(pixels[:, :, 0])
            c = self.pipe.vae.config
            return (z - c.shift_factor) * c.scaling_factor
        if self.family == "flux2":  # Flux2Pipeline._encode_vae_image: patchify 2 x 2, then the VAE's batch-norm stats
            vae = self.pipe.vae
            z = self.pipe._patchify_latents(self._vae_encode(pixels[:, :, 0]))
            mean = vae.bn.running_mean.detach().float().cpu().view(1, -1, 1, 1)
            std = torch.sqrt(vae.bn.running_var.detach().float().cpu().view(1, -1, 1, 1) + vae.config.batch_norm_eps)
            return (z - mean) / std
        if self.family == "qwen":  # [B, C, 1, h, w] -> [B, C, h, w]
            return ((self._vae_encode(pixels[:, :, :1]) - self.mean) / self.std)[:, :, 0]
        if self.family == "hunyuan15":  # HunyuanVideo15Pipeline decodes latents / scaling_factor (no shift)
            return self._vae_encode(pixels) * self.pipe.vae.config.scaling_factor
        return (self._vae_encode(pixels) - self.mean) / self.std

    @torch.no_grad()
    def encode_condition(self, first_frames: torch.Tensor) -> dict[str, torch.Tensor]:
        """Wan I2V conditions of first frames ``[B, 3, H, W]``: ``condition`` = 4-channel first-frame mask +
        normalised latents of ``[image, zeros...]`` (``[B, 4 + C, T, h, w]``), and CLIP ``image_embeds`` when the
        pipeline has an image encoder (penultimate hidden states, as ``WanImageToVideoPipeline.encode_image``)."""
        B, F = first_frames.shape[0], self.num_frames
        video = torch.cat(
            [first_frames[:, :, None], first_frames.new_zeros(B, 3, F - 1, self.height, self.width)], dim=2
        )
        lat = (self._vae_encode(video) - self.mean) / self.std
        T, h, w = lat.shape[2:]
        mask = torch.zeros(B, self.tf, T, h, w)
        mask[:, :, 0] = 1.0  # frame 0 is repeated tf times in the pipeline's mask, then folded into channels
        out = {"condition": torch.cat([mask, lat], dim=1)}
        if getattr(self.pipe, "image_encoder", None) is not None:
            from PIL import Image

            imgs = [
                Image.fromarray(((f.permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255).byte().numpy())
                for f in first_frames
            ]
            out["image_embeds"] = self.pipe.encode_image(imgs, device=self.device).float().cpu()
        return out


def _negative(enc: PipelineEncoder, negative_prompt: str | None) -> dict[str, torch.Tensor]:
    if negative_prompt is None:
        return {}
    t = enc.encode_text([negative_prompt])
    return {"negative_" + k: v for k, v in t.items()}


class ShardWriter:
    """Streams per-sample rows into the docs/math.md §8 format (``rcm_diffusers.distill.data``): a shard file every
    ``shard_size`` samples, then tables and ``meta.json`` last, so an interrupted run leaves no dataset."""

    def __init__(self, out_dir: str, shard_size: int = 256, dtype: torch.dtype = torch.float32):
        self.out_dir, self.shard_size, self.dtype = out_dir, shard_size, dtype
        os.makedirs(out_dir, exist_ok=True)
        if os.path.exists(os.path.join(out_dir, "meta.json")):
            os.remove(os.path.join(out_dir, "meta.json"))  # the old dataset is gone from here on
        self.buf: dict[str, list] = {}
        self.shards: list[dict] = []
        self.num_samples = 0

    def add(self, rows: dict[str, torch.Tensor]) -> None:
        """Append rows (leading dim = samples; floats stored in ``dtype``)."""
        for k, v in rows.items():
            self.buf.setdefault(k, []).append(v.to(self.dtype) if v.is_floating_point() else v)
        while self._buffered() >= self.shard_size:
            self._flush(self.shard_size)

    def _buffered(self) -> int:
        return sum(v.shape[0] for v in self.buf["latents"]) if self.buf else 0

    def _flush(self, n: int) -> None:
        cat = {k: torch.cat(v) for k, v in self.buf.items()}
        name = f"shard-{len(self.shards):05d}.safetensors"
        _atomic_save({k: v[:n] for k, v in cat.items()}, os.path.join(self.out_dir, name))
        self.shards.append({"file": name, "num_samples": n})
        self.num_samples += n
        self.buf = {k: [v[n:]] for k, v in cat.items()} if cat["latents"].shape[0] > n else {}

    def close(self, family: str, tables: dict, table_index: dict, extra_meta: dict) -> str:
        """Flush the last shard, write ``tables.safetensors`` and ``meta.json`` (atomic); returns ``out_dir``."""
        if self._buffered():
            self._flush(self._buffered())
        if not self.num_samples:
            raise ValueError("no samples were written")
        meta = {
            "format": FORMAT,
            "version": 1,
            "family": family,
            "num_samples": self.num_samples,
            "shards": self.shards,
            "tables": table_index,
            **extra_meta,
        }
        if tables:
            _atomic_save(
                {k: v.to(self.dtype) for k, v in tables.items()}, os.path.join(self.out_dir, "tables.safetensors")
            )
            meta["tables_file"] = "tables.safetensors"
        tmp = os.path.join(self.out_dir, "meta.json.tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, os.path.join(self.out_dir, "meta.json"))
        return self.out_dir


class _Text:
    """Caption embeddings: a ``prompt_embeds`` table + ``prompt_index`` when captions repeat (each unique
    caption at most half of the samples), else per-sample rows encoded batch by batch (bounded memory)."""

    def __init__(self, enc: PipelineEncoder, captions: list[str], batch_size: int, progress: bool):
        from tqdm.auto import tqdm

        self.enc, self.unique = enc, list(dict.fromkeys(captions))
        self.as_table = 2 * len(self.unique) <= len(captions)
        self.tables: dict[str, torch.Tensor] = {}
        if self.as_table:
            rows: dict[str, list] = {}
            for s in tqdm(range(0, len(self.unique), batch_size), desc="text", disable=not progress):
                for k, v in enc.encode_text(self.unique[s : s + batch_size]).items():
                    rows.setdefault(k, []).append(v)
            self.tables = {k: torch.cat(v) for k, v in rows.items()}
            self.pos = {c: i for i, c in enumerate(self.unique)}

    def rows(self, captions: list[str]) -> tuple[dict, dict]:
        """``(stored per-sample fields, embeddings for the model)`` of a batch of captions."""
        if self.as_table:
            idx = torch.tensor([self.pos[c] for c in captions], dtype=torch.long)
            return {"prompt_index": idx}, {k: v[idx] for k, v in self.tables.items()}
        emb = self.enc.encode_text(captions)
        return emb, emb

    def table_index(self) -> dict:
        return {k: "prompt_index" for k in self.tables}


def _close(writer: ShardWriter, enc: PipelineEncoder, text: _Text, neg: dict, negative_prompt, extra_meta: dict) -> str:
    meta = {
        "prompts": text.unique if text.as_table else None,
        "negative_prompt": negative_prompt,
        "height": enc.height,
        "width": enc.width,
        "num_frames": enc.num_frames,
        **extra_meta,
    }
    return writer.close(enc.family, {**text.tables, **neg}, {**text.table_index(), **{k: None for k in neg}}, meta)


def prepare_real(
    enc: PipelineEncoder,
    items: list[Item],
    out_dir: str,
    *,
    negative_prompt: str | None = "",
    resize: str = "error",
    batch_size: int = 4,
    shard_size: int = 256,
    save_dtype=torch.float32,
    progress: bool = True,
) -> str:
    """Encode media + captions with the pipeline into a docs/math.md §8 dataset at ``out_dir``, streamed shard by
    shard."""
    from tqdm.auto import tqdm

    if not items:
        raise ValueError("no data items")
    for it in items:
        if not it.caption:
            raise ValueError(f"{it.media}: empty caption")
    text = _Text(enc, [it.caption for it in items], batch_size, progress)
    neg = _negative(enc, negative_prompt)
    writer = ShardWriter(out_dir, shard_size, save_dtype)
    for s in tqdm(range(0, len(items), batch_size), desc="encode", disable=not progress):
        chunk = items[s : s + batch_size]
        px = torch.stack([load_media(it.media, enc.height, enc.width, enc.num_frames, resize) for it in chunk])
        rows = {"latents": enc.encode_media(px), **text.rows([it.caption for it in chunk])[0]}
        if enc.family == "wan_i2v":
            rows.update(enc.encode_condition(px[:, :, 0]))
        writer.add(rows)
    return _close(
        writer,
        enc,
        text,
        neg,
        negative_prompt,
        {"source": "real", "files": [os.path.basename(it.media) for it in items]},
    )


# ----------------------------------------------------------------------------- synthetic teacher samples


def _scheduler(solver: str, steps: int, shift: float, sigma_max: float):
    from ..schedulers import TrigFlowEulerScheduler, TrigFlowUniPCScheduler

    cls = {"euler": TrigFlowEulerScheduler, "unipc": TrigFlowUniPCScheduler}.get(solver)
    if cls is None:
        raise ValueError(f"unknown solver {solver!r}; use 'euler' or 'unipc'")
    sch = cls(shift=shift, sigma_max=sigma_max)
    sch.set_timesteps(steps)
    return sch


def check_guider(config: dict | None, where: str) -> None:
    """A pipeline guider (HunyuanVideo15Pipeline's ``guider``, its ``config``) must be one the teacher's plain CFG
    ``v_u + s (v_c - v_u)`` reproduces: ``ClassifierFreeGuidance`` over the whole trajectory, without
    ``guidance_rescale`` or the original formulation; ValueError naming the setting otherwise. ``None``: no guider."""
    if not config:
        return
    cls = config.get("_class_name", "ClassifierFreeGuidance")
    if cls != "ClassifierFreeGuidance":
        raise ValueError(
            f"{where}: the pipeline's guider is {cls}; the teacher applies plain classifier-free guidance "
            "(ClassifierFreeGuidance) only"
        )
    odd = {
        k: config[k]
        for k, default in (("guidance_rescale", 0.0), ("use_original_formulation", False), ("start", 0.0))
        if k in config and config[k] != default
    }
    if "stop" in config and config["stop"] != 1.0:
        odd["stop"] = config["stop"]
    if odd:
        got = ", ".join(f"{k}={v}" for k, v in odd.items())
        raise ValueError(
            f"{where}: the pipeline's ClassifierFreeGuidance has {got}; the teacher applies plain CFG "
            "v_u + s (v_c - v_u) at every time, so its samples would differ from the pipeline's. Save the pipeline "
            "with ClassifierFreeGuidance(guidance_scale=s) (guidance_rescale 0, start 0, stop 1)"
        )


def synthetic_defaults(enc: "PipelineEncoder", steps: int) -> dict[str, float]:
    """The teacher's sampling settings its own pipeline uses at ``enc``'s size, for ``--synthetic`` runs that set
    none: ``shift`` (the scheduler's ``shift`` / ``flow_shift``; with ``use_dynamic_shifting`` the pipeline's ``mu``
    at this token count: FLUX.1 / Qwen-Image ``calculate_shift``, FLUX.2 ``compute_empirical_mu(tokens, steps)``;
    ``shift = exp(mu)``, or ``mu`` for ``time_shift_type='linear'``) and ``guidance_scale`` (Wan: ``__call__``'s
    ``guidance_scale`` default 5; Qwen-Image: ``true_cfg_scale`` 4; HunyuanVideo-1.5: its guider's scale; FLUX.1 /
    FLUX.2: 1, guidance-distilled). A scheduler's ``shift_terminal`` (Qwen-Image's stretch of the last sigma) has no
    counterpart in the TrigFlow schedulers and is not reproduced."""
    import inspect
    import math

    pipe, fam = enc.pipe, enc.family
    c = pipe.scheduler.config
    if c.get("use_dynamic_shifting", False):
        tokens = pack_latents(fam, torch.zeros(1, *enc.latent_shape)).shape[1]
        module = inspect.getmodule(type(pipe))
        if fam == "flux2":
            mu = module.compute_empirical_mu(image_seq_len=tokens, num_steps=steps)
        else:
            mu = module.calculate_shift(
                tokens,
                c.get("base_image_seq_len", 256),
                c.get("max_image_seq_len", 4096),
                c.get("base_shift", 0.5),
                c.get("max_shift", 1.15),
            )
        shift = float(mu) if c.get("time_shift_type", "exponential") == "linear" else math.exp(mu)
    else:
        shift = float(c.get("flow_shift", None) or c.get("shift", 1.0))
    params = inspect.signature(type(pipe).__call__).parameters
    if fam in ("flux", "flux2"):
        guidance = 1.0
    elif fam == "qwen":
        guidance = float(params["true_cfg_scale"].default)
    elif fam == "hunyuan15":
        guider = getattr(pipe, "guider", None)
        check_guider(dict(guider.config) if guider is not None else None, "--synthetic")
        guidance = float(guider.guidance_scale) if guider is not None and guider._enabled else 1.0
    else:
        guidance = float(params["guidance_scale"].default)
    return {"shift": shift, "guidance_scale": guidance}


def seed_noise(latent_shape, seeds: list[int]) -> torch.Tensor:
    """The starting noise of synthetic samples ``[len(seeds), *latent_shape]`` (dataset layout, float32): sample ``j``
    is ``randn(latent_shape, generator=manual_seed(seeds[j]))``, as a diffusers pipeline draws it for one seeded
    sample."""
    return torch.stack(
        [torch.randn(tuple(latent_shape), generator=torch.Generator().manual_seed(int(s))) for s in seeds]
    )


@torch.no_grad()
def teacher_samples(
    transformer,
    family: str,
    batch: dict,
    noise: torch.Tensor,
    *,
    steps: int = 100,
    shift: float = 3.0,
    guidance_scale: float = 5.0,
    solver: str = "euler",
    sigma_max: float = 5000.0,
    flux_guidance: float | None = None,
    device="cpu",
) -> torch.Tensor:
    """Teacher ODE samples ``x0`` in the dataset layout from conditions ``batch`` (docs/math.md §2.2, §8).

    Starting from ``noise`` ``[B, *latent_shape]`` (float32, dataset layout, e.g. ``seed_noise``; Flux packs it as
    FluxPipeline does; Qwen-Image likewise). Velocity ``v_u + s (v_c - v_u)`` (standard CFG scale ``s``; no CFG
    without ``negative_prompt_embeds`` or at ``s = 1``; Qwen-Image: QwenImagePipeline's per-token norm rescale of it,
    ``losses.guided_norm_rescaled``), stepped by ``TrigFlowEulerScheduler`` /
    ``TrigFlowUniPCScheduler`` (shift ``shift``, ``steps`` steps).
    """
    from ..models import compute_dtype, velocity_fn
    from .data import model_inputs
    from .losses import guided_norm_rescaled

    dtype = compute_dtype(transformer)
    _, cond, uncond = model_inputs(family, {**batch, "latents": noise}, device, dtype, flux_guidance)
    x = pack_latents(family, noise).to(device)
    use_cfg = uncond is not None and guidance_scale != 1.0
    v_fn = velocity_fn(transformer)
    sch = _scheduler(solver, steps, shift, sigma_max)
    for ts in sch.timesteps:
        r = ts.double() / sch.config.num_train_timesteps
        v = v_fn(x.to(dtype), r, **cond)
        if use_cfg:
            v_u = v_fn(x.to(dtype), r, **uncond)
            if family == "qwen":
                v = guided_norm_rescaled(v, v_u, guidance_scale)
            else:
                v = v_u + guidance_scale * (v - v_u)
        x = sch.step(v, ts, x, return_dict=False)[0]
    x = x.float().cpu()
    return unpack_latents(family, x, *noise.shape[-2:])


def prepare_synthetic(
    enc: PipelineEncoder,
    prompts: list[str],
    out_dir: str,
    *,
    num_samples: int,
    seed: int = 0,
    steps: int = 100,
    shift: float = 3.0,
    guidance_scale: float = 5.0,
    solver: str = "euler",
    sigma_max: float = 5000.0,
    flux_guidance: float | None = 3.5,
    negative_prompt: str | None = "",
    images: list[str] | None = None,
    resize: str = "error",
    batch_size: int = 4,
    shard_size: int = 256,
    save_dtype=torch.float32,
    progress: bool = True,
) -> str:
    """Synthetic dataset: sample ``i`` = teacher sample of ``prompts[i % P]`` with seed ``seed + i`` (docs/math.md §8).
    Wan I2V needs ``images`` (first frames, one per prompt)."""
    from tqdm.auto import tqdm

    if num_samples < 1:
        raise ValueError(f"--num_samples must be >= 1, got {num_samples}")
    if not prompts:
        raise ValueError("synthetic data needs at least one prompt")
    if enc.family == "wan_i2v" and (images is None or len(images) != len(prompts)):
        raise ValueError(
            "Wan I2V synthetic data needs one first-frame image per prompt (a folder or manifest of image + caption)"
        )
    captions = [prompts[i % len(prompts)] for i in range(num_samples)]
    text = _Text(enc, captions, batch_size, progress)
    neg = _negative(enc, negative_prompt)
    first = None
    if enc.family == "wan_i2v":
        px = torch.stack([load_media(p, enc.height, enc.width, 1, resize)[:, 0] for p in images])
        first = enc.encode_condition(px)  # one row per prompt
    guide = flux_guidance if getattr(enc.pipe.transformer.config, "guidance_embeds", False) else None
    writer = ShardWriter(out_dir, shard_size, save_dtype)
    for s in tqdm(range(0, num_samples, batch_size), desc="teacher", disable=not progress):
        ids = list(range(s, min(num_samples, s + batch_size)))
        stored, emb = text.rows([captions[i] for i in ids])
        batch = {**emb, **{k: v.expand(len(ids), *v.shape[1:]) for k, v in neg.items()}}
        if first is not None:
            per = {k: v[[i % len(prompts) for i in ids]] for k, v in first.items()}
            batch.update(per)
            stored = {**stored, **per}
        noise = seed_noise(enc.latent_shape, [seed + i for i in ids])
        x0 = teacher_samples(
            enc.pipe.transformer,
            enc.family,
            batch,
            noise,
            steps=steps,
            shift=shift,
            guidance_scale=guidance_scale,
            solver=solver,
            sigma_max=sigma_max,
            flux_guidance=guide,
            device=enc.device,
        )
        if not torch.isfinite(x0).all():
            raise FloatingPointError(
                f"teacher samples {ids} contain NaN/inf; check the model dtype and the guidance scale"
            )
        writer.add({"latents": x0, "noise": noise, **stored})
    meta = {
        "source": "synthetic",
        "seed": seed,
        "solver": solver,
        "steps": steps,
        "shift": shift,
        "guidance_scale": guidance_scale,
        "sigma_max": sigma_max,
        "flux_guidance": guide,
    }
    return _close(writer, enc, text, neg, negative_prompt, meta)
