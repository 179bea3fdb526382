"""Official rCM checkpoints (NVlabs/rcm): training dumps, ``dcp_to_pth`` files, the Linear patch embedding.

Layouts, as the producing code writes them:

- ``scripts/dcp_to_pth.py`` (``__main__``): ``torch.save`` of a flat dict ``net.<key>`` in bfloat16,
  taken from the ``net_ema.`` entries of a distributed checkpoint.
- a training dump (the distributed checkpoint loaded flat) holds ``net.`` (the student),
  ``net_ema.`` (its EMA) and ``net_fake_score.`` (the fake-score network) side by side.
- ``rcm/networks/wan2pt1.py`` ``WanModel.__init__``: original Wan key names, except that
  ``patch_embedding`` is an ``nn.Linear(in_dim * kt * kh * kw, dim)`` over patches flattened as
  ``"b c (t kt) (h kh) (w kw) -> b (t h w) (c kt kh kw)"`` (``WanModel.forward``). So its 2-D weight
  ``[dim, C*kt*kh*kw]`` is the ``nn.Conv3d`` weight ``[dim, C, kt, kh, kw]`` of diffusers/ComfyUI
  flattened row-major: the two forms reshape into each other exactly. TurboDiffusion's
  ``scripts/safetensors_to_pth.py`` writes the same 2-D form (``tensor.reshape(shape[0], -1)``).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "NETWORKS",
    "WAN_PATCH_SIZE",
    "select_network",
    "patch_embedding_to_conv",
    "patch_embedding_to_linear",
    "is_patch_embedding",
]

#: networks of a training dump: name given by the user -> key prefix
NETWORKS = {"ema": "net_ema.", "net": "net.", "fake_score": "net_fake_score."}
#: every released Wan 2.1 / 2.2 transformer patchifies with (kt, kh, kw) = (1, 2, 2)
WAN_PATCH_SIZE = (1, 2, 2)


def select_network(keys, prefer: str | None = None) -> tuple[str | None, list[str]]:
    """``(prefix to strip, networks present)`` for flat keys of a training dump.

    ``prefer`` is "ema" (default), "net" or "fake_score". Only when two or more of
    ``net.``/``net_ema.``/``net_fake_score.`` are present is a choice made (``None`` otherwise:
    a plain ``net.`` file such as dcp_to_pth's output is handled by the prefix stripper).
    Raises ValueError when the asked-for network is absent.
    """
    present = [name for name, p in NETWORKS.items() if any(k.startswith(p) for k in keys)]
    if len(present) < 2:
        if prefer not in (None, "ema") and present and prefer not in present:
            raise ValueError(f"the checkpoint holds only the {present[0]!r} network; --network {prefer} is not in it")
        if present and present[0] != "net" and all(k.startswith(NETWORKS[present[0]]) for k in keys):
            return NETWORKS[present[0]], present  # e.g. only net_ema.*: strip it too
        return None, present
    want = prefer or "ema"
    if want not in NETWORKS:
        raise ValueError(f"network must be one of {sorted(NETWORKS)}, got {want!r}")
    if want not in present:
        raise ValueError(f"the training dump holds the networks {present}, not {want!r}; choose one of them")
    return NETWORKS[want], present


def is_patch_embedding(name: str) -> bool:
    """True for the patch embedding's weight/bias/deltas in any naming (no prefix)."""
    return name.split(".", 1)[0] == "patch_embedding"


def patch_embedding_to_conv(w: torch.Tensor, patch_size=WAN_PATCH_SIZE) -> torch.Tensor:
    """Linear form ``[dim, C*kt*kh*kw]`` -> Conv3d form ``[dim, C, kt, kh, kw]`` (a view; exact)."""
    if w.dim() == 5:
        return w
    n = math.prod(patch_size)
    if w.dim() != 2 or w.shape[1] % n:
        raise ValueError(f"patch embedding of shape {tuple(w.shape)} is not [dim, C*{n}] for patch size {patch_size}")
    return w.reshape(w.shape[0], w.shape[1] // n, *patch_size)


def patch_embedding_to_linear(w: torch.Tensor) -> torch.Tensor:
    """Conv3d form ``[dim, C, kt, kh, kw]`` -> Linear form ``[dim, C*kt*kh*kw]`` (exact)."""
    return w.reshape(w.shape[0], -1) if w.dim() > 2 else w
