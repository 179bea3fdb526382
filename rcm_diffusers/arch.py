"""The real transformer architectures (Wan 2.1 / 2.2, FLUX.1) as shipped configs, for random-weight
runs at real width and depth (no hub access needed).

``arch_configs/<name>.json`` holds the diffusers ``config.json`` of each model's transformer, written
out from the published diffusers configs; keys starting with ``_`` are our metadata (hub id,
pipeline class, number of experts). ``build_transformer`` instantiates one with random weights
(optionally cut to fewer blocks), ``save_random_pipeline`` writes a directory that
``training/rcm.py --pretrained`` loads like a hub snapshot (``model_index.json`` + ``transformer/``).
"""

from __future__ import annotations

import json
import os

import torch

__all__ = [
    "ARCH_DIR",
    "arch_names",
    "arch_config",
    "arch_meta",
    "build_transformer",
    "save_random_pipeline",
    "count_parameters",
]

ARCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arch_configs")


def arch_names() -> list[str]:
    """Names of the shipped architectures (``arch_configs/*.json`` without the suffix)."""
    return sorted(n[:-5] for n in os.listdir(ARCH_DIR) if n.endswith(".json"))


def _read(name: str) -> dict:
    path = os.path.join(ARCH_DIR, name + ".json")
    if not os.path.exists(path):
        raise ValueError(f"unknown architecture {name!r}; shipped: {arch_names()}")
    with open(path) as f:
        return json.load(f)


def arch_config(name: str, **overrides) -> dict:
    """The transformer's diffusers config (class-name key and metadata dropped), with ``overrides``
    (e.g. ``num_layers=2``) applied; unknown override keys are refused."""
    cfg = {k: v for k, v in _read(name).items() if not k.startswith("_")}
    bad = sorted(set(overrides) - set(cfg))
    if bad:
        raise ValueError(f"{name} has no config keys {bad}; keys: {sorted(cfg)}")
    cfg.update(overrides)
    return cfg


def arch_meta(name: str) -> dict:
    """The metadata of an architecture: ``class_name``, ``pipeline``, ``hub_id``, ``experts`` (1 or 2)."""
    raw = _read(name)
    return {
        "class_name": raw["_class_name"],
        "pipeline": raw["_pipeline"],
        "hub_id": raw.get("_hub_id"),
        "experts": int(raw.get("_experts", 1)),
    }


def build_transformer(
    name: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    keep_fp32: bool = False,
    **overrides,
):
    """A random-init diffusers transformer of architecture ``name`` in ``dtype`` (``device="meta"``:
    no memory, for counting). Initialised in float32 then cast, so bf16 weights match the fp32 ones. ``keep_fp32``:
    the class's ``_keep_in_fp32_modules`` stay float32, as ``from_pretrained(torch_dtype=dtype)`` loads them."""
    import diffusers

    cls = getattr(diffusers, arch_meta(name)["class_name"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(**arch_config(name, **overrides))
    model = model.to(dtype).eval()
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ()) if keep_fp32 else set()
    for pname, t in list(model.named_parameters()) + list(model.named_buffers()):
        if keep & set(pname.split(".")):
            t.data = t.data.float()
    return model


def count_parameters(name: str, **overrides) -> int:
    """Number of parameters of architecture ``name`` (built on the meta device, no memory)."""
    return sum(p.numel() for p in build_transformer(name, device="meta", **overrides).parameters())


def save_random_pipeline(name: str, root: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0, **overrides) -> str:
    """Write ``root/model_index.json`` and ``root/transformer/`` (random weights in ``dtype``) so that
    ``training/rcm.py --pretrained root`` loads the architecture; VAE and text encoder are left out
    (the trainer reads precomputed latents). Returns ``root``; an existing complete copy is reused."""
    meta = arch_meta(name)
    index = os.path.join(root, "model_index.json")
    want = {"arch": name, "dtype": str(dtype), "seed": seed, "overrides": overrides}
    if os.path.exists(index):
        with open(index) as f:
            if json.load(f).get("_rcm_random_arch") == want:
                return root
        raise ValueError(f"{root} holds a different pipeline; remove it or pick another directory")
    model = build_transformer(name, dtype=dtype, seed=seed, **overrides)
    model.save_pretrained(os.path.join(root, "transformer"))
    del model
    tmp = index + ".tmp"
    with open(tmp, "w") as f:
        json.dump(
            {
                "_class_name": meta["pipeline"],
                "_diffusers_version": "0.35.0",
                "transformer": ["diffusers", meta["class_name"]],
                "_rcm_random_arch": want,
            },
            f,
            indent=1,
        )
    os.replace(tmp, index)  # written last: its presence marks a complete copy
    return root
