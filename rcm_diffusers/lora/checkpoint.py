"""Safe loading of official checkpoints (.pt/.pth/.safetensors): no pickled code, dtype kept.

Official rCM / TurboDiffusion releases are ``torch.save`` files of the transformer in the
original Wan layout, sometimes nested (``{"model": ...}``, ``{"net": ...}``, ``{"ema": ...}``,
``{"state_dict": ...}``) and sometimes prefixed (``net.``, ``model.``, ``module.``,
``_orig_mod.``, ``model.diffusion_model.``). ``load_state_dict`` returns the flat tensor dict.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch

__all__ = ["UnsafeCheckpointError", "load_state_dict", "unwrap_state_dict", "open_safetensors"]

NESTED_KEYS = ("ema", "net_ema", "model_ema", "state_dict", "model", "net", "module", "transformer")
PREFIXES = ("module.", "_orig_mod.", "net.", "model.diffusion_model.", "diffusion_model.", "model.")


class UnsafeCheckpointError(ValueError):
    """The file needs pickled code (classes/functions) to load; it was refused."""


def unwrap_state_dict(obj, prefer: str | None = None) -> dict[str, torch.Tensor]:
    """Find the tensor dict inside a loaded checkpoint and strip wrapper prefixes.

    Nested containers are searched in ``NESTED_KEYS`` order (``prefer`` first, e.g. "ema" or
    "net"); non-tensor entries (step counters, configs) are ignored. Raises ValueError when no
    tensor dict is found.
    """
    order = ((prefer,) if prefer else ()) + NESTED_KEYS
    for _ in range(4):
        if not isinstance(obj, dict) or (obj and all(isinstance(v, torch.Tensor) for v in obj.values())):
            break
        nxt = next((obj[k] for k in order if k in obj and isinstance(obj[k], dict)), None)
        if nxt is None:
            dicts = [v for v in obj.values() if isinstance(v, dict)]
            nxt = dicts[0] if len(dicts) == 1 else None
        if nxt is not None:
            obj = nxt
            continue
        obj = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}  # drop counters, configs
        break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        top = list(obj)[:10] if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"no tensor state dict found in the checkpoint (top-level entries: {top})")
    keys = list(obj)
    changed = True
    while changed:
        changed = False
        for p in PREFIXES:
            if keys and all(k.startswith(p) for k in keys):
                obj = {k[len(p):]: v for k, v in obj.items()}
                keys = list(obj)
                changed = True
    return obj


def open_safetensors(path):
    """A ``safe_open`` handle (framework pt, CPU) for streaming one tensor at a time."""
    from safetensors import safe_open

    return safe_open(str(path), framework="pt", device="cpu")


def load_state_dict(path, prefer: str | None = None, unwrap: bool = True) -> dict[str, torch.Tensor]:
    """Load ``path`` (.safetensors, or .pt/.pth/.bin with ``weights_only=True``) to a flat tensor dict.

    Dtypes are kept. A pickle that references code raises ``UnsafeCheckpointError``; a corrupt
    or truncated file raises ValueError naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            sd = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{path} is not a readable safetensors file ({e})") from e
        return unwrap_state_dict(sd, prefer) if unwrap else sd
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        msg = str(e)
        if "Weights only load failed" in msg or "Unsupported global" in msg or "GLOBAL" in msg:
            raise UnsafeCheckpointError(
                f"{path} needs pickled code to load, which is refused (torch.load weights_only=True): "
                f"{msg.splitlines()[0] if msg else e!r}. Re-save it as a plain state dict or safetensors "
                "from a trusted environment."
            ) from e
        raise ValueError(f"{path} is not a readable checkpoint ({e})") from e
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path} is not a readable checkpoint (corrupt or truncated?): {e}") from e
    return unwrap_state_dict(obj, prefer) if unwrap else obj
