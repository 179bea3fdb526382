"""Precomputed-latent datasets (docs/math.md §8) and the model inputs built from them.

On-disk format (a directory; training never runs a VAE or text encoder)::

    meta.json            {"format": "rcm-latents", "version": 1,
                          "family": "wan" | "wan_i2v" | "flux" | "qwen" | "flux2",
                          "num_samples": N, "shards": [{"file": "shard-00000.safetensors", "num_samples": n}, ...],
                          "tables": {"prompt_embeds": "prompt_index", "negative_prompt_embeds": null, ...}}
    shard-XXXXX.safetensors   per-sample tensors, leading dim = samples in the shard
    tables.safetensors        (optional) shared tensors looked up by an index field

Per-sample keys (float tensors are stored in the dtype written, cast to float32 on load):

- ``latents``: clean latents ``x0``: Wan ``[C, T, H, W]`` (VAE-normalised as the pipeline does),
  Flux ``[C, H, W]`` (unpacked, after the VAE shift/scale; packed into tokens at load), Qwen-Image ``[C, H, W]``
  (its VAE's one latent frame dropped, VAE-normalised as the pipeline does; packed 2 x 2 into tokens at load),
  FLUX.2 ``[4C, H/2, W/2]`` (patchified 2 x 2 and batch-norm-normalised as Flux2Pipeline does, the layout its
  ``prepare_latents`` draws noise in; one token per pixel at load).
- ``prompt_embeds`` ``[L, D]`` (Wan: T5 hidden states padded to the pipeline's length;
  Flux: T5 hidden states), or ``prompt_index`` (int64) into a ``prompt_embeds`` table.
- ``negative_prompt_embeds`` ``[L, D]`` for CFG (usually one table row shared by all samples).
- Flux: ``pooled_prompt_embeds`` ``[768]`` (+ ``negative_pooled_prompt_embeds`` for CFG).
- FLUX.2: ``prompt_embeds`` ``[L, D]`` (Flux2Pipeline.encode_prompt: the text encoder's stacked hidden states,
  padded to ``max_sequence_length``; no mask, no pooled text).
- Qwen-Image: ``prompt_embeds`` padded with zeros to a fixed length and ``prompt_embeds_mask`` ``[L]`` (float, 1 for
  a token of the prompt, 0 for padding; + ``negative_prompt_embeds_mask``); a batch is cut to its longest prompt and
  the mask dropped when no token is padding, as QwenImagePipeline.encode_prompt hands them to the transformer.
- Wan I2V: ``condition`` ``[4 + C, T, H, W]`` (first-frame mask + image latents, as
  WanImageToVideoPipeline builds them) and optionally ``image_embeds`` ``[257, 1280]`` (CLIP).
- ``noise`` (optional, same shape as ``latents``): the noise a teacher ODE sample started from (synthetic data);
  such a dataset is the ODE pairs of the regression term (``regression_data_dir``, docs/math.md §4.7).
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

__all__ = [
    "write_latent_dataset",
    "check_dataset",
    "scan_values",
    "DataError",
    "LatentDataset",
    "batch_indices",
    "pair_indices",
    "step_seed",
    "step_generator",
    "sample_generators",
    "step_noise",
    "model_inputs",
    "pair_inputs",
    "pack_flux_latents",
    "unpack_flux_latents",
    "qwen_text",
    "hunyuan15_text",
    "PACKED",
    "pack_latents",
    "unpack_latents",
]

FORMAT = "rcm-latents"


def _atomic_save(tensors: dict, path: str) -> None:
    tmp = path + ".tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
    os.replace(tmp, path)


def write_latent_dataset(
    out_dir: str,
    samples: dict[str, torch.Tensor],
    *,
    family: str,
    tables: dict[str, torch.Tensor] | None = None,
    table_index: dict[str, str | None] | None = None,
    shard_size: int = 4096,
    extra_meta: dict | None = None,
) -> str:
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
        _atomic_save({k: v[start : start + shard_size] for k, v in samples.items()}, os.path.join(out_dir, name))
        shards.append({"file": name, "num_samples": min(shard_size, N - start)})
    meta = {
        "format": FORMAT,
        "version": 1,
        "family": family,
        "num_samples": N,
        "shards": shards,
        "tables": table_index,
        **(extra_meta or {}),
    }
    if tables:
        _atomic_save(tables, os.path.join(out_dir, "tables.safetensors"))
        meta["tables_file"] = "tables.safetensors"
    tmp = os.path.join(out_dir, "meta.json.tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "meta.json"))
    return out_dir


# ----------------------------------------------------------------------------- validation before any model loads

FAMILIES = ("wan", "wan_i2v", "flux", "qwen", "flux2", "hunyuan15")
_FLOATS = {"F16", "BF16", "F32", "F64"}
_INTS = {"I8", "U8", "I16", "I32", "I64", "U16", "U32", "U64"}


class DataError(ValueError):
    """A latent dataset that cannot be trained on; the message names the file and what is wrong."""


def _inside(root: str, rel, what: str) -> str:
    """``root/rel`` for a plain relative file name that stays inside ``root`` (no absolute path, no ``..``,
    no link out), and is a regular file."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/"):
        raise DataError(f"{root}/meta.json: {what} {rel!r} is not a file name inside the dataset folder")
    path = os.path.join(root, rel)
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
        raise DataError(f"{root}/meta.json: {what} {rel!r} points outside the dataset folder")
    if not os.path.exists(path):
        raise DataError(f"{root}: {what} {rel} is missing")
    if not os.path.isfile(path):
        raise DataError(f"{root}: {what} {rel} is not a regular file")
    return path


def _header(path: str) -> dict:
    """``{name: (dtype, shape)}`` of a safetensors file from its header alone, after checking that the header
    parses and that the data it describes fits the file exactly (a truncated or padded file fails)."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if n <= 0 or 8 + n > size or n > 100 * 2**20:
                raise ValueError("bad header length")
            head = json.loads(f.read(n))
    except (OSError, ValueError, RecursionError) as e:
        raise DataError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    if not isinstance(head, dict):
        raise DataError(f"{path} is not a readable safetensors file (header is not a JSON object)")
    out, end = {}, 0
    for k, v in head.items():
        if k == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = v["dtype"], [int(d) for d in v["shape"]], v["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise DataError(f"{path} is not a readable safetensors file (bad entry {k!r})") from None
        if not 0 <= int(a) <= int(b) or min(shape, default=0) < 0:
            raise DataError(f"{path} is not a readable safetensors file (bad offsets or shape of {k!r})")
        out[k] = (dtype, tuple(shape))
        end = max(end, int(b))
    if end != size - 8 - n:
        raise DataError(
            f"{path}: the header describes {end} bytes of data, the file holds {size - 8 - n} "
            "(truncated or damaged; write the dataset again)"
        )
    return out


def _dims(model_config: dict | None, family: str) -> dict:
    """What the teacher's ``config.json`` fixes about the data: latent channels, text width, ..."""
    c = model_config or {}
    cls = c.get("_class_name", "")
    out = {}
    if cls.startswith("Wan"):
        if family not in ("wan", "wan_i2v"):
            raise DataError(f"the data is family {family!r} but the teacher is a {cls}")
        out["channels"] = c.get("out_channels") or c.get("in_channels")
        out["in_channels"] = c.get("in_channels")
        out["text_dim"] = c.get("text_dim")
        out["image_dim"] = c.get("image_dim")
        p = c.get("patch_size") or (1, 2, 2)
        out["patch"] = tuple(p)[-2:]
    elif cls == "Flux2Transformer2DModel":
        if family != "flux2":
            raise DataError(f"the data is family {family!r} but the teacher is a {cls}")
        out["channels"] = c.get("in_channels")  # the patchified latent: 4 x the VAE's channels, one token a pixel
        out["text_dim"] = c.get("joint_attention_dim")
    elif cls.startswith("Flux"):
        if family != "flux":
            raise DataError(f"the data is family {family!r} but the teacher is a {cls}")
        ic = c.get("in_channels")
        out["channels"] = ic // 4 if ic else None
        out["text_dim"] = c.get("joint_attention_dim")
        out["pooled_dim"] = c.get("pooled_projection_dim")
    elif cls == "HunyuanVideo15Transformer3DModel":
        if family != "hunyuan15":
            raise DataError(f"the data is family {family!r} but the teacher is a {cls}")
        out["channels"] = c.get("out_channels")
        out["in_channels"] = c.get("in_channels")
        out["text_dim"] = c.get("text_embed_dim")
        out["text_2_dim"] = c.get("text_embed_2_dim")
        p = c.get("patch_size") or 1
        out["patch"] = (p, p)
    elif cls == "QwenImageTransformer2DModel":
        if family != "qwen":
            raise DataError(f"the data is family {family!r} but the teacher is a {cls}")
        ic = c.get("in_channels")
        out["channels"] = ic // 4 if ic else None
        out["text_dim"] = c.get("joint_attention_dim")
    return out


def check_dataset(root: str, model_config: dict | None = None, option: str = "--data_dir") -> dict:
    """Check a latent dataset completely and cheaply before any model loads: ``meta.json``, every shard and table
    file (headers only: names, dtypes, shapes, sizes), the per-family layout, the sample counts and the range of
    every index field; with the teacher's ``config.json`` (``model_config``) also the latent channels and the text
    and pooled widths. Raises ``DataError`` naming the first problem (and ``option``, the setting that named the
    folder); returns ``{"family", "num_samples", "fields"}``."""
    if not root or not os.path.isdir(root):
        raise DataError(f"{option} {root}: no such folder (make a latent dataset with training/prepare_data.py)")
    mpath = os.path.join(root, "meta.json")
    if not os.path.isfile(mpath):
        raise DataError(
            f"{option} {root}: no meta.json, not an rcm latent dataset (make one with training/prepare_data.py)"
        )
    try:
        with open(mpath) as f:
            meta = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise DataError(f"{mpath} is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(
            f"{mpath}: format {meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT!r}"
        )
    family = meta.get("family")
    if family not in FAMILIES:
        raise DataError(f"{mpath}: unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    n = meta.get("num_samples")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise DataError(f"{mpath}: num_samples {n!r} must be a whole number >= 1")
    shards = meta.get("shards")
    if not isinstance(shards, list) or not shards:
        raise DataError(f"{mpath}: no shards listed")
    fields, total = None, 0
    index_files = []
    for s in shards:
        if not isinstance(s, dict):
            raise DataError(f"{mpath}: bad shard entry {s!r}")
        path = _inside(root, s.get("file"), "shard")
        head = _header(path)
        rows = {k: shape[0] if shape else None for k, (_, shape) in head.items()}
        if "latents" not in head:
            raise DataError(f"{path}: no 'latents' tensor")
        r = rows["latents"]
        bad = [k for k, v in rows.items() if v != r]
        if bad:
            raise DataError(f"{path}: field {bad[0]!r} has {rows[bad[0]]} rows, latents has {r}")
        if s.get("num_samples") != r:
            raise DataError(
                f"{mpath}: shard {s.get('file')} says num_samples {s.get('num_samples')!r}, the file holds {r}"
            )
        sig = {k: (d, shape[1:]) for k, (d, shape) in head.items()}
        if fields is None:
            fields = sig
        elif sig != fields:
            raise DataError(
                f"{path}: fields, dtypes or shapes differ from the first shard's ({sorted(sig)} vs {sorted(fields)})"
            )
        total += r
        index_files.append(path)
    if total != n:
        raise DataError(f"{mpath}: num_samples is {n} but the shards hold {total} samples")
    tables = {}
    if meta.get("tables_file") is not None:
        tpath = _inside(root, meta["tables_file"], "tables file")
        tables = {k: (d, shape) for k, (d, shape) in _header(tpath).items()}
    index = meta.get("tables") or {}
    if not isinstance(index, dict):
        raise DataError(f"{mpath}: 'tables' must map a table name to its index field (or null)")
    # every field as the model sees it: (dtype, per-sample shape)
    per = {k: v for k, v in fields.items()}
    ranges = {}
    for name, idx in index.items():
        if name not in tables:
            raise DataError(
                f"{mpath}: table {name!r} is listed but "
                + (
                    f"{meta.get('tables_file')} has no such tensor"
                    if meta.get("tables_file")
                    else "there is no tables_file"
                )
            )
        d, shape = tables[name]
        if not shape or shape[0] < 1:
            raise DataError(f"{root}: table {name!r} has no rows")
        if idx is not None:
            if idx not in fields:
                raise DataError(f"{mpath}: table {name!r} is indexed by {idx!r}, which is not a per-sample field")
            if fields[idx][0] not in _INTS or fields[idx][1] != ():
                raise DataError(
                    f"{root}: index field {idx!r} must hold one whole number per sample, got "
                    f"{fields[idx][0]} {list(fields[idx][1])}"
                )
            ranges.setdefault(idx, []).append((name, shape[0]))
        per[name] = (d, shape[1:])
    for idx, limits in ranges.items():  # the only values read: one small integer per sample
        hi = min(m for _, m in limits)
        for path in index_files:
            with safe_open(path, framework="pt") as f:
                v = f.get_tensor(idx)
            if v.numel() and (int(v.min()) < 0 or int(v.max()) >= hi):
                bad = int(v.min()) if int(v.min()) < 0 else int(v.max())
                raise DataError(
                    f"{path}: {idx} holds {bad}, outside the table rows 0..{hi - 1} "
                    f"({', '.join(f'{t}: {m} rows' for t, m in limits)})"
                )
    _check_layout(root, family, per, _dims(model_config, family))
    return {
        "family": family,
        "num_samples": n,
        "fields": sorted(per),
        "shapes": {k: (d, tuple(shape)) for k, (d, shape) in per.items()},
    }


#: bytes of one field read at a time by ``scan_values`` (the memory the scan needs, whatever the dataset's size)
SCAN_CHUNK_BYTES = 64 * 2**20


def scan_values(
    root: str, option: str = "--data_dir", part: int = 0, parts: int = 1, chunk_bytes: int = SCAN_CHUNK_BYTES
) -> int:
    """Read every float value of a dataset that ``check_dataset`` passed (latents, noise, conditions, per-sample
    embeddings, every table) in chunks of rows and raise ``DataError`` at the first NaN or inf, naming the file, the
    field and the sample (or table row). Streams: memory stays near ``chunk_bytes`` for any dataset size; the cost
    is one read of the whole dataset (docs/training.md). ``part`` of ``parts``: this process reads that share of
    every field's rows (processes scan side by side). Returns the number of bytes read."""
    with open(os.path.join(root, "meta.json")) as f:
        meta = json.load(f)
    nbytes = 0
    files = [(s["file"], "sample", s["num_samples"]) for s in meta["shards"]]
    if meta.get("tables_file"):
        files.append((meta["tables_file"], "table row", 0))
    first = 0  # the first sample of the shard
    for name, unit, count in files:
        path = os.path.join(root, name)
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                if sl.get_dtype() not in _FLOATS:
                    continue
                shape = sl.get_shape()
                rows = shape[0] if shape else 1
                row_bytes = max(1, math.prod(shape[1:]) * {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}[sl.get_dtype()])
                step = max(1, chunk_bytes // row_bytes)
                start, stop = rows * part // parts, rows * (part + 1) // parts
                for a in range(start, stop, step):
                    t = sl[a : min(a + step, stop)] if shape else f.get_tensor(k).reshape(1)
                    nbytes += t.numel() * t.element_size()
                    if not t.numel():
                        continue
                    lo, hi = torch.aminmax(t)  # NaN and inf propagate into the extremes: ~20x faster than isfinite
                    if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
                        bad = ~torch.isfinite(t)
                        j = a + int(bad.reshape(len(t), -1).any(1).nonzero()[0, 0])
                        where = f"{k} of sample {first + j}" if unit == "sample" else f"table {k!r}, row {j}"
                        raise DataError(
                            f"{option} {root}: {where} holds NaN or inf ({name}); training on it gives "
                            "non-finite gradients. Remove or re-encode that "
                            + ("sample" if unit == "sample" else "row")
                            + "."
                        )
        first += count
    return nbytes


def _check_layout(root: str, family: str, per: dict, dims: dict) -> None:
    def need(k):
        if k not in per:
            raise DataError(f"{root}: family {family!r} needs a {k!r} field (per sample or a table)")
        d, shape = per[k]
        if d not in _FLOATS:
            raise DataError(f"{root}: {k} has dtype {d}; it must be a float tensor (F32, F16, BF16 or F64)")
        return shape

    lat = need("latents")
    video = family.startswith("wan") or family == "hunyuan15"
    want = 4 if video else 3
    layout = "[C, T, H, W]" if video else "[C, H, W]"
    if len(lat) != want:
        raise DataError(
            f"{root}: latents are {len(lat) + 1}-D [N, {', '.join(map(str, lat))}]; family {family!r} "
            f"needs [N, {layout[1:]}"
        )
    C = lat[0]
    if dims.get("channels") and C != dims["channels"]:
        raise DataError(f"{root}: latents have {C} channels, the teacher's transformer takes {dims['channels']}")
    hw = lat[-2:]
    # Flux and Qwen-Image pack 2 x 2 latent pixels per token
    p = (2, 2) if family in ("flux", "qwen") else dims.get("patch", (1, 1))
    if any(h % q for h, q in zip(hw, p)):
        raise DataError(
            f"{root}: latent height x width {hw[0]} x {hw[1]} is not divisible by the patch size {p[0]} x {p[1]}"
        )
    if "noise" in per and tuple(need("noise")) != tuple(lat):
        raise DataError(f"{root}: noise {list(per['noise'][1])} must have the latents' shape {list(lat)}")
    text = need("prompt_embeds")
    for k in ("prompt_embeds", "negative_prompt_embeds"):
        if k in per:
            shape = need(k)
            if len(shape) != 2:
                raise DataError(f"{root}: {k} must be [L, D] per sample, got {list(shape)}")
            if dims.get("text_dim") and shape[1] != dims["text_dim"]:
                raise DataError(
                    f"{root}: {k} are {shape[1]} wide, the teacher's transformer takes {dims['text_dim']} "
                    "(text encoder of another model?)"
                )
    if family == "wan_i2v":
        cond = need("condition")
        if len(cond) != 4 or tuple(cond[1:]) != tuple(lat[1:]):
            raise DataError(
                f"{root}: condition {list(cond)} must be [4 + C, T, H, W] with the latents' T, H, W {list(lat[1:])}"
            )
        if dims.get("in_channels") and C + cond[0] != dims["in_channels"]:
            raise DataError(
                f"{root}: latents ({C}) + condition ({cond[0]}) channels = {C + cond[0]}, the teacher's "
                f"transformer takes {dims['in_channels']}"
            )
        if "image_embeds" in per:
            img = need("image_embeds")
            if len(img) != 2 or (dims.get("image_dim") and img[1] != dims["image_dim"]):
                raise DataError(f"{root}: image_embeds {list(img)} must be [tokens, {dims.get('image_dim') or 'D'}]")
            if text[0] != 512:
                raise DataError(
                    f"{root}: Wan I2V with image embeddings needs prompt_embeds of exactly 512 tokens, got "
                    f"{text[0]}: re-run training/prepare_data.py with --max_sequence_length 512"
                )
    elif family == "wan" and dims.get("in_channels") and C != dims["in_channels"]:
        raise DataError(
            f"{root}: latents have {C} channels, the teacher's transformer takes {dims['in_channels']} "
            "(an image-to-video teacher needs family 'wan_i2v' data with a condition)"
        )
    if family == "hunyuan15":
        _check_hunyuan15(root, per, dims, C, need)
    if family == "qwen":
        for k in ("prompt_embeds_mask", "negative_prompt_embeds_mask"):
            emb = k[: -len("_mask")]
            if k in per:
                shape = need(k)
                if emb not in per or tuple(shape) != tuple(per[emb][1][:1]):
                    raise DataError(f"{root}: {k} {list(shape)} must be [L] with the L of {emb} per sample")
    if family == "flux":
        for k in ("pooled_prompt_embeds", "negative_pooled_prompt_embeds"):
            if k in per or k == "pooled_prompt_embeds":
                shape = need(k)
                if len(shape) != 1 or (dims.get("pooled_dim") and shape[0] != dims["pooled_dim"]):
                    raise DataError(f"{root}: {k} {list(shape)} must be [{dims.get('pooled_dim') or 'D'}] per sample")


def _check_hunyuan15(root: str, per: dict, dims: dict, C: int, need) -> None:
    """HunyuanVideo-1.5: both text encoders' embeddings with their masks (the negative ones too, when there), and the
    transformer's input channels ``2 C + 1`` (latents, zero condition latents, zero mask)."""
    if dims.get("in_channels") and 2 * C + 1 != dims["in_channels"]:
        raise DataError(
            f"{root}: latents have {C} channels, the teacher's transformer takes {dims['in_channels']} inputs "
            f"(HunyuanVideo15Pipeline feeds 2 C + 1: latents, condition latents and mask)"
        )
    for neg in ("", "negative_"):
        if neg and f"{neg}prompt_embeds" not in per:
            continue
        for emb in (f"{neg}prompt_embeds", f"{neg}prompt_embeds_2"):
            shape = need(emb)
            width = dims.get("text_2_dim" if emb.endswith("_2") else "text_dim")
            if len(shape) != 2 or (width and shape[1] != width):
                raise DataError(f"{root}: {emb} {list(shape)} must be [L, {width or 'D'}] per sample")
            mask = emb.replace("prompt_embeds", "prompt_embeds_mask")
            if tuple(need(mask)) != tuple(shape[:1]):
                raise DataError(f"{root}: {mask} {list(per[mask][1])} must be [L] with the L of {emb} per sample")


class LatentDataset:
    """Reader of the docs/math.md §8 format; ``get(indices)`` returns a batch dict of float32 tensors."""

    def __init__(self, root: str):
        path = os.path.join(root, "meta.json")
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{root} is not an rcm latent dataset (no meta.json); create one with training/prepare_data.py"
            )
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
                rows.setdefault(k, []).append(f.get_slice(k)[j : j + 1])
        batch = {k: torch.cat(v) for k, v in rows.items()}
        for name, idx in self.table_index.items():
            tab = self.tables[name]
            batch[name] = tab[batch[idx].long()] if idx is not None else tab[:1].expand(len(indices), *tab.shape[1:])
        batch = {k: (v.float() if v.is_floating_point() else v) for k, v in batch.items()}
        batch["index"] = torch.tensor(indices, dtype=torch.long)
        return batch


def step_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed mixed from ``(seed, *keys)`` (e.g. step, rank) by numpy's SeedSequence."""
    return int(
        np.random.SeedSequence([int(seed) & 0xFFFFFFFF, *[int(k) for k in keys]]).generate_state(2, np.uint64)[0] >> 1
    )


def step_generator(seed: int, step: int, rank: int, stream: int = 0, device="cpu") -> torch.Generator:
    """Per-(step, rank, stream) generator: noise depends on nothing but these numbers."""
    return torch.Generator(device=device).manual_seed(step_seed(seed, step, rank, stream))


SAMPLE_STREAM = 0x5A3D  # keeps the per-sample seeds apart from the per-(step, rank, stream) ones


def sample_generators(seed: int, step: int, first: int, count: int, device="cpu"):
    """``rng.SampleGenerators`` of the ``count`` samples at global positions ``first, first + 1, ...`` of ``step``'s
    global batch (the rows ``batch_indices`` reads): each sample's noise depends on ``(seed, step, position)`` only,
    not on how the global batch is split over processes and micro-batches."""
    from ..rng import SampleGenerators

    return SampleGenerators(
        torch.Generator(device=device).manual_seed(step_seed(seed, step, SAMPLE_STREAM, first + j))
        for j in range(count)
    )


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


PAIR_STREAM = 0x0DE  # keeps the ODE pairs' order apart from the training data's


def pair_indices(num_pairs: int, batch_size: int, step: int, rank: int, world: int, seed: int) -> list[int]:
    """Rows of the ODE-pair dataset for ``rank`` at ``step``: ``batch_indices`` with its own epoch permutations, seeded
    by ``step_seed(seed, PAIR_STREAM)``, so the pairs and the training data are drawn independently."""
    return batch_indices(num_pairs, batch_size, step, rank, world, step_seed(seed, PAIR_STREAM))


# ----------------------------------------------------------------------------- model inputs


#: data families whose latents the transformer takes as 2 x 2-packed tokens
PACKED = ("flux", "qwen")


def pack_flux_latents(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W] -> [B, (H/2)(W/2), 4C]`` as FluxPipeline (and QwenImagePipeline) packs them."""
    B, C, H, W = latents.shape
    x = latents.view(B, C, H // 2, 2, W // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // 2) * (W // 2), C * 4)


def unpack_flux_latents(tokens: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """Inverse of ``pack_flux_latents`` for latent size ``H x W``."""
    B, L, D = tokens.shape
    x = tokens.view(B, H // 2, W // 2, D // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(B, D // 4, H, W)


def pack_latents(family: str, latents: torch.Tensor) -> torch.Tensor:
    """Dataset-layout latents ``[B, C, H, W]`` as the transformer's tokens: 2 x 2-packed (``PACKED`` families), one
    token per latent pixel for FLUX.2 (``[B, H W, C]``, Flux2Pipeline._pack_latents of its patchified latents), the
    latents themselves otherwise."""
    if family in PACKED:
        return pack_flux_latents(latents)
    if family == "flux2":
        return latents.flatten(2).transpose(1, 2)
    return latents


def unpack_latents(family: str, tokens: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """Inverse of ``pack_latents`` for dataset latents of height x width ``H x W``."""
    if family in PACKED:
        return unpack_flux_latents(tokens, H, W)
    if family == "flux2":
        return tokens.transpose(1, 2).reshape(tokens.shape[0], -1, H, W)
    return tokens


def flux2_ids(B: int, H: int, W: int, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FLUX.2 position ids ``(img_ids [B, H W, 4], txt_ids [B, L, 4])`` (int64, (t, h, w, l)) as Flux2Pipeline builds
    them: image tokens ``(0, h, w, 0)`` row-major, text tokens ``(0, 0, 0, l)``."""
    a = torch.arange
    img = torch.cartesian_prod(a(1), a(H), a(W), a(1)).unsqueeze(0).expand(B, -1, -1)
    txt = torch.cartesian_prod(a(1), a(1), a(1), a(L)).unsqueeze(0).expand(B, -1, -1)
    return img, txt


def _flux_img_ids(H: int, W: int) -> torch.Tensor:
    ids = torch.zeros(H // 2, W // 2, 3)
    ids[..., 1] = torch.arange(H // 2)[:, None]
    ids[..., 2] = torch.arange(W // 2)[None, :]
    return ids.reshape(-1, 3)


def qwen_text(embeds: torch.Tensor, mask: torch.Tensor | None) -> dict:
    """Qwen-Image text conditions of a batch as QwenImagePipeline hands them to the transformer: ``embeds`` ``[B, L,
    D]`` cut to the batch's longest prompt (the pipeline pads a batch of prompts to its longest) with
    ``encoder_hidden_states_mask`` (long, 1 = prompt token), or no mask when no token is padding
    (``encode_prompt`` drops an all-ones mask)."""
    if mask is None:
        return {"encoder_hidden_states": embeds}
    m = mask > 0.5
    pos = torch.arange(1, m.shape[1] + 1, device=m.device)
    n = max(int((m * pos).max()), 1)
    m = m[:, :n]
    out = {"encoder_hidden_states": embeds[:, :n]}
    if not bool(m.all()):
        out["encoder_hidden_states_mask"] = m.long()
    return out


def hunyuan15_text(batch: dict, prefix: str, md) -> dict:
    """HunyuanVideo-1.5 text conditions as HunyuanVideo15Pipeline hands them to the transformer: the Qwen2.5-VL
    ``{prefix}prompt_embeds`` and ByT5 ``{prefix}prompt_embeds_2`` at their full padded lengths with their masks, all
    in the transformer's dtype (``encode_prompt`` casts the masks too; ``md``)."""
    return {
        "encoder_hidden_states": md(batch[f"{prefix}prompt_embeds"]),
        "encoder_attention_mask": md(batch[f"{prefix}prompt_embeds_mask"]),
        "encoder_hidden_states_2": md(batch[f"{prefix}prompt_embeds_2"]),
        "encoder_attention_mask_2": md(batch[f"{prefix}prompt_embeds_mask_2"]),
    }


def model_inputs(family: str, batch: dict, device, model_dtype, flux_guidance: float | None = None):
    """``(x0, cond, uncond)``: float64 clean latents in the model's layout (Flux, Qwen-Image: packed tokens) and
    the condition kwargs of ``rcm_diffusers.models.velocity_fn`` (``uncond`` is ``None`` without negatives)."""

    def md(x):
        return x.to(device=device, dtype=model_dtype)

    def text(embeds, mask):
        out = qwen_text(embeds, mask)
        out["encoder_hidden_states"] = md(out["encoder_hidden_states"])
        if "encoder_hidden_states_mask" in out:
            out["encoder_hidden_states_mask"] = out["encoder_hidden_states_mask"].to(device)
        return out

    x0 = batch["latents"].to(device=device, dtype=torch.float64)
    neg = batch.get("negative_prompt_embeds")
    if family in ("wan", "wan_i2v"):
        cond = {"encoder_hidden_states": md(batch["prompt_embeds"])}
        if family == "wan_i2v":
            cond["condition"] = md(batch["condition"])
            if "image_embeds" in batch:
                n_txt = batch["prompt_embeds"].shape[1]
                if n_txt != 512:  # diffusers' Wan I2V attention takes the last 512 context tokens as text
                    raise ValueError(
                        f"Wan I2V with image embeddings needs prompt_embeds of exactly 512 tokens (the WanPipeline "
                        f"padding), got {n_txt}: re-run training/prepare_data.py with --max_sequence_length 512"
                    )
                cond["encoder_hidden_states_image"] = md(batch["image_embeds"])
        uncond = None if neg is None else {**cond, "encoder_hidden_states": md(neg)}
        return x0, cond, uncond
    if family == "flux":
        H, W = x0.shape[-2:]
        x0 = pack_flux_latents(x0)
        L = batch["prompt_embeds"].shape[1]
        cond = {
            "encoder_hidden_states": md(batch["prompt_embeds"]),
            "pooled_projections": md(batch["pooled_prompt_embeds"]),
            "txt_ids": md(torch.zeros(L, 3)),
            "img_ids": md(_flux_img_ids(H, W)),
        }
        if flux_guidance is not None:
            cond["guidance"] = torch.full((x0.shape[0],), float(flux_guidance), device=device, dtype=torch.float32)
        uncond = None
        if neg is not None:
            uncond = {
                **cond,
                "encoder_hidden_states": md(neg),
                "pooled_projections": md(batch.get("negative_pooled_prompt_embeds", batch["pooled_prompt_embeds"])),
            }
        return x0, cond, uncond
    if family == "flux2":
        # Flux2Pipeline: patchified, batch-norm-normalised latents [B, 4C, h, w] flattened to tokens; int64 (t, h, w,
        # l) ids; the guidance embedding's value in float32 (FLUX.2 [dev] is guidance-distilled); no pooled text
        H, W = x0.shape[-2:]
        x0 = pack_latents(family, x0)
        img_ids, txt_ids = flux2_ids(x0.shape[0], H, W, batch["prompt_embeds"].shape[1])
        cond = {
            "encoder_hidden_states": md(batch["prompt_embeds"]),
            "txt_ids": txt_ids.to(device),
            "img_ids": img_ids.to(device),
        }
        if flux_guidance is not None:
            cond["guidance"] = torch.full((x0.shape[0],), float(flux_guidance), device=device, dtype=torch.float32)
        uncond = None
        if neg is not None:
            _, neg_ids = flux2_ids(x0.shape[0], H, W, neg.shape[1])
            uncond = {**cond, "encoder_hidden_states": md(neg), "txt_ids": neg_ids.to(device)}
        return x0, cond, uncond
    if family == "qwen":
        H, W = x0.shape[-2:]
        x0 = pack_flux_latents(x0)  # QwenImagePipeline._pack_latents: the same 2 x 2 packing as Flux
        shapes = [[(1, H // 2, W // 2)]] * x0.shape[0]  # the pipeline's img_shapes
        cond = {**text(batch["prompt_embeds"], batch.get("prompt_embeds_mask")), "img_shapes": shapes}
        uncond = None
        if neg is not None:
            uncond = {**text(neg, batch.get("negative_prompt_embeds_mask")), "img_shapes": shapes}
        return x0, cond, uncond
    if family == "hunyuan15":
        cond = hunyuan15_text(batch, "", md)
        return x0, cond, (None if neg is None else hunyuan15_text(batch, "negative_", md))
    raise ValueError(f"unknown data family {family!r}; expected one of {', '.join(FAMILIES)}")


def pair_inputs(family: str, batch: dict, device, model_dtype, flux_guidance: float | None = None):
    """``(noise, target, cond)`` of an ODE-pair batch (docs/math.md §4.7): the float64 starting ``noise`` and the
    teacher's ODE sample ``latents`` in the model's layout (Flux, Qwen-Image: both packed) and the condition kwargs of
    ``model_inputs``."""
    target, cond, _ = model_inputs(family, batch, device, model_dtype, flux_guidance)
    noise = batch["noise"].to(device=device, dtype=torch.float64)
    return pack_latents(family, noise), target, cond


def video_noise_multiplier(x0: torch.Tensor, family: str) -> float:
    """``sqrt(latent frames)`` for Wan video latents ``[B, C, T, H, W]``, 1 otherwise (docs/math.md §3)."""
    video = family.startswith("wan") or family == "hunyuan15"
    return math.sqrt(x0.shape[2]) if video and x0.dim() == 5 else 1.0


def batch_rows(obj, start: int, stop: int, batch: int):
    """Rows ``start:stop`` of every tensor in ``obj`` (a tensor, a dict of them, or ``None``) whose leading dimension
    is ``batch``; other values (shared conditions, scalars) are passed through."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return {k: batch_rows(v, start, stop, batch) for k, v in obj.items()}
    if torch.is_tensor(obj) and obj.dim() and obj.shape[0] == batch:
        return obj[start:stop]
    return obj
