"""Training checkpoints that load no code: safetensors + JSON only, verified by a manifest (docs/math.md §4.4-§4.5, §6).

A checkpoint ``<output_dir>/checkpoints/step-XXXXXXXX/`` holds

- ``trainable.safetensors``: the trainable weights (adapters or full copies), ``save_trainable``;
- ``optimizer-<role>.safetensors``: the optimizer state tensors keyed ``<param name>::<key>``;
- ``ema.safetensors``: the power-EMA shadow weights (rCM with ``ema_rate > 0``);
- ``rng-rank<r>.safetensors``: torch CPU/CUDA generator states of process ``r``, Python and NumPy states
  in its JSON metadata;
- ``state.json``: counters, optimizer hyper-parameters, learning-rate schedulers, the EMA rate, the fp16
  loss-scaler state and the run's config;
- ``manifest.json``, written last: format, step, and the size and SHA-256 of every other file.

Why not ``accelerator.save_state``: accelerate stores objects registered with
``register_for_checkpointing`` as ``custom_checkpoint_*.pkl`` and reads them back with
``torch.load(weights_only=False)`` (accelerate ``checkpointing.load_custom_state``), which runs any code
a crafted file carries; its optimizer, scheduler and RNG files are pickles too. Nothing here reads a
pickle: a file of another format in a slot fails to parse and the resume stops with a
``CheckpointError``. The directory is written as ``step-XXXXXXXX.tmp`` and renamed when complete;
``verify_checkpoint`` re-checks sizes and checksums, so a truncated file or a flipped bit is caught.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import random
import re
import shutil
import stat
import sys

import numpy as np
import torch

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "checkpoint_step",
    "list_checkpoints",
    "verify_checkpoint",
    "find_resumable",
    "prune_checkpoints",
    "read_state",
    "check_state",
    "check_rng",
    "check_inside",
    "FORMAT",
]

FORMAT = "rcm-diffusers-checkpoint/1"
MANIFEST = "manifest.json"
STATE = "state.json"
_STEP_RE = re.compile(r"^step-(\d+)$")
# testing aid: kill the process in the middle of writing the checkpoint of this step (files written, no manifest)
KILL_ENV = "RCM_TEST_KILL_IN_CHECKPOINT"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: damaged, incomplete, of another format, or not matching the run."""


# ----------------------------------------------------------------------------- listing, verification, pruning


def checkpoint_step(name: str) -> int | None:
    """Step number of a directory named ``step-<digits>`` (``None`` for anything else, e.g. ``*.tmp``)."""
    m = _STEP_RE.match(os.path.basename(os.path.normpath(name)))
    return int(m.group(1)) if m else None


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """``[(step, path)]`` of the checkpoint directories of a run, ordered by step number (not by name)."""
    d = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(d):
        return []
    out = [(checkpoint_step(n), os.path.join(d, n)) for n in os.listdir(d)]
    return sorted((s, p) for s, p in out if s is not None and os.path.isdir(p))


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _regular(path: str, what: str) -> None:
    """Refuse anything but a regular file (a FIFO would block the reader forever, a device or link is not ours)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise CheckpointError(f"{what}: {path} is missing ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{what}: {path} is not a regular file")


def _read_json(path: str, what: str):
    _regular(path, what)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{what}: cannot read {path}: {str(e)[:200]}") from None


def _is_int(v, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_state(st, where: str) -> None:
    """Types and ranges of every value of ``state.json`` that resume uses (a wrong one is a damaged checkpoint)."""

    def bad(what):
        raise CheckpointError(f"{where}/{STATE}: {what}")

    if (
        not isinstance(st, dict)
        or st.get("format") != FORMAT
        or not isinstance(st.get("config"), dict)
        or not isinstance(st.get("train_state"), dict)
    ):
        bad(f"not a {FORMAT} state file")
    ts = st["train_state"]
    if not _is_int(ts.get("step")):
        bad(f"step {ts.get('step')!r} is not a whole number >= 0")
    if not _is_int(ts.get("skipped")) or ts["skipped"] > ts["step"]:
        bad(f"skipped {ts.get('skipped')!r} is not a whole number between 0 and the step {ts['step']}")
    if not isinstance(ts.get("skipped_steps"), list) or not all(_is_int(i) for i in ts["skipped_steps"]):
        bad("skipped_steps is not a list of steps")
    if (
        not isinstance(ts.get("guard"), dict)
        or not isinstance(ts.get("init_checksum"), list)
        or not all(_is_num(v) for v in ts["init_checksum"])
    ):
        bad("bad spike-guard history or initial checksum")
    if "world_size" in st and not _is_int(st["world_size"], 1):
        bad(f"world_size {st['world_size']!r} is not a whole number >= 1")
    for r, sch in (st.get("schedulers") or {}).items():
        if (
            not isinstance(sch, dict)
            or not _is_int(sch.get("last_epoch"), -1)
            or ("_step_count" in sch and not _is_int(sch["_step_count"]))
            or not all(_is_num(v) for k in ("base_lrs", "_last_lr") for v in (sch.get(k) or []))
        ):
            bad(
                f"learning-rate scheduler {r!r}: last_epoch "
                f"{sch.get('last_epoch') if isinstance(sch, dict) else sch!r} "
                "or its rates are not numbers of the right kind"
            )
    for r, o in (st.get("optimizers") or {}).items():
        groups = o.get("param_groups") if isinstance(o, dict) else None
        if (
            not isinstance(groups, list)
            or not isinstance(o.get("params"), list)
            or len(groups) != len(o["params"])
            or not all(isinstance(n, list) and all(isinstance(x, str) for x in n) for n in o["params"])
            or not isinstance(o.get("scalars", {}), dict)
            or not all(_is_num(v) for v in o.get("scalars", {}).values())
        ):
            bad(f"optimizer {r!r}: bad parameter groups or scalars")
        for g in groups:
            if (
                not isinstance(g, dict)
                or not all(_is_num(g[k]) and g[k] >= 0 for k in ("lr", "eps", "weight_decay") if k in g)
                or (
                    "betas" in g
                    and not (
                        isinstance(g["betas"], list)
                        and len(g["betas"]) == 2
                        and all(_is_num(b) and 0 <= b < 1 for b in g["betas"])
                    )
                )
            ):
                bad(f"optimizer {r!r}: bad hyper-parameters {g!r}"[:300])
    ema = st.get("ema")
    if ema is not None and not (isinstance(ema, dict) and _is_num(ema.get("s")) and ema["s"] > 0):
        bad(f"bad EMA rate {ema!r}"[:200])
    if st.get("grad_scaler") is not None and not isinstance(st["grad_scaler"], dict):
        bad("bad loss-scaler state")


_RNG_BYTES = None


def check_rng(tensors: dict, meta, where: str) -> None:
    """Sizes, dtypes and ranges of a process's saved generator states (what ``set_rng_state`` restores)."""
    global _RNG_BYTES
    if _RNG_BYTES is None:
        _RNG_BYTES = torch.get_rng_state().numel()
    t = tensors.get("torch_cpu")
    if t is None or t.dtype != torch.uint8 or tuple(t.shape) != (_RNG_BYTES,):
        raise CheckpointError(
            f"{where}: the torch CPU generator state is {None if t is None else (t.dtype, tuple(t.shape))}, "
            f"not {_RNG_BYTES} bytes"
        )
    if any(v.dtype != torch.uint8 or v.dim() != 1 for k, v in tensors.items() if k.startswith("torch_cuda_")):
        raise CheckpointError(f"{where}: bad CUDA generator state")
    try:
        v, internal, gauss = meta["python"]
        kind, keys, pos, has_gauss, cached = meta["numpy"]
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{where}: bad Python or NumPy random state") from None
    word = all(_is_int(x) and x < 2**32 for x in internal) if isinstance(internal, list) else False
    if not (_is_int(v) and word and len(internal) == 625 and (gauss is None or isinstance(gauss, float))):
        raise CheckpointError(f"{where}: bad Python random state")
    if not (
        kind == "MT19937"
        and isinstance(keys, list)
        and len(keys) == 624
        and all(_is_int(x) and x < 2**32 for x in keys)
        and _is_int(pos)
        and pos <= 624
        and has_gauss in (0, 1)
        and _is_num(cached)
    ):
        raise CheckpointError(f"{where}: bad NumPy random state")


def check_inside(path: str, run_dir: str | None = None) -> None:
    """A checkpoint folder is read where it lies: not through a symbolic link, and (``run_dir`` given) not resolving
    outside that run folder (a ``checkpoints/`` that links elsewhere included). Raises ``CheckpointError``."""
    p = os.path.abspath(path).rstrip(os.sep) or os.sep
    real = os.path.realpath(p)
    if os.path.islink(p):
        raise CheckpointError(
            f"{path} is a symbolic link (to {real}); a checkpoint is read only where it lies, inside its run folder"
        )
    if run_dir is not None:
        root = os.path.realpath(run_dir)
        if os.path.commonpath([root, real]) != root:
            raise CheckpointError(f"{path} resolves to {real}, outside the run folder {run_dir}")


def verify_checkpoint(path: str, run_dir: str | None = None) -> dict:
    """Check ``path`` against its manifest (format, step, every file a regular file with its size and SHA-256, the
    files a resume reads all listed) and the values of ``state.json`` and the random states (types, sizes,
    ranges); the folder must not be a link nor resolve outside ``run_dir`` (``check_inside``). Returns the manifest
    or raises ``CheckpointError`` naming the first problem."""
    man_path = os.path.join(path, MANIFEST)
    check_inside(path, run_dir)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a checkpoint directory")
    if not os.path.lexists(man_path):
        legacy = [n for n in os.listdir(path) if n.endswith((".pkl", ".bin"))]
        hint = (
            " (an accelerate save_state checkpoint of an older version: its pickle files can run code and are "
            "not loaded; start a new run)"
            if legacy
            else " (incomplete: the write was interrupted)"
        )
        raise CheckpointError(f"{path} has no {MANIFEST}{hint}")
    man = _read_json(man_path, "manifest")
    if not isinstance(man, dict) or man.get("format") != FORMAT or not isinstance(man.get("files"), dict):
        raise CheckpointError(f"{man_path}: not a {FORMAT} manifest")
    for name, meta in sorted(man["files"].items()):
        f = os.path.join(path, name)
        if os.path.basename(name) != name or name == MANIFEST or not isinstance(meta, dict):
            raise CheckpointError(f"{man_path}: bad file name {name!r}")
        if not os.path.lexists(f):
            raise CheckpointError(f"{path}: {name} is missing")
        _regular(f, "checkpoint")
        size = os.path.getsize(f)
        if size != meta.get("bytes"):
            raise CheckpointError(
                f"{path}: {name} has {size} bytes, the manifest says {meta.get('bytes')} (truncated or replaced)"
            )
        try:
            digest = _sha256(f)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read {name} ({e.strerror or e})") from None
        if digest != meta.get("sha256"):
            raise CheckpointError(f"{path}: {name} does not match its SHA-256 in the manifest (the file is damaged)")
    if not _is_int(man.get("step")) or (checkpoint_step(path) is not None and man["step"] != checkpoint_step(path)):
        raise CheckpointError(
            f"{man_path}: step {man.get('step')!r} does not match the folder {os.path.basename(path)}"
        )
    st = read_state(path, man)
    need = [
        "trainable.safetensors",
        *(f"optimizer-{r}.safetensors" for r in st.get("optimizers") or {}),
        *(["ema.safetensors"] if st.get("ema") else []),
        *(f"rng-rank{r}.safetensors" for r in range(st.get("world_size") or 1)),
    ]
    missing = [n for n in need if n not in man["files"]]
    if missing:
        raise CheckpointError(f"{path}: {', '.join(missing)} not listed in {MANIFEST} (the checkpoint was altered)")
    for n in man["files"]:
        if n.startswith("rng-rank"):
            t, meta = _load_tensors(os.path.join(path, n), "random state")
            check_rng(t, _rng_meta(meta, os.path.join(path, n)), os.path.join(path, n))
    return man


def _rng_meta(meta: dict, where: str):
    try:
        return json.loads(meta.get("json", "{}"))
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}: bad random state ({str(e)[:200]})") from None


def _manifest_files(path: str) -> dict:
    """The ``files`` of ``path``'s manifest (read, not re-verified)."""
    man = _read_json(os.path.join(path, MANIFEST), "manifest")
    if not isinstance(man, dict) or not isinstance(man.get("files"), dict):
        raise CheckpointError(f"{path}/{MANIFEST}: not a {FORMAT} manifest")
    return man["files"]


def _listed(path: str, name: str, files: dict) -> str:
    """``path/name`` if the manifest lists it and it is a regular file: nothing else in a checkpoint is read."""
    if name not in files:
        raise CheckpointError(f"{path}: {name} is not listed in {MANIFEST}; it is not read")
    p = os.path.join(path, name)
    _regular(p, "checkpoint")
    return p


def find_resumable(output_dir: str, check=None) -> tuple[str | None, list[tuple[str, str]]]:
    """Newest intact checkpoint of a run and the newer ones that failed verification, ``(path, [(path, why)])``;
    ``check(path)``, if given, is a further test (``Checkpointer.mismatch``: a problem string or ``None``)."""
    damaged = []
    for _, p in reversed(list_checkpoints(output_dir)):
        try:
            verify_checkpoint(p, output_dir)
            problem = check(p) if check is not None else None
            if problem:
                raise CheckpointError(problem)
            return p, damaged
        except CheckpointError as e:
            damaged.append((p, str(e)))
    return None, damaged


def prune_checkpoints(output_dir: str, keep: int, protect: str | None = None) -> list[str]:
    """Delete all but the ``keep`` highest-step checkpoints (0 = keep all); ``protect`` is never deleted."""
    if keep <= 0:
        return []
    gone = []
    for _, p in list_checkpoints(output_dir)[:-keep]:
        if protect is None or os.path.abspath(p) != os.path.abspath(protect):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def read_state(path: str, manifest: dict | None = None) -> dict:
    """The checkpoint's ``state.json`` (counters, config, optimizer settings), listed in the manifest and checked
    for the format and the types and ranges of its values (``check_state``)."""
    files = manifest["files"] if manifest is not None else _manifest_files(path)
    st = _read_json(_listed(path, STATE, files), "checkpoint state")
    check_state(st, path)
    return st


# ----------------------------------------------------------------------------- state <-> safetensors / JSON


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU tensor of ``t`` (a sharded DTensor is gathered first: a collective, every rank calls)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu().contiguous()


def _like(param: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` placed like ``param`` (sharded again when ``param`` is a DTensor)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(t.to(param.device), param.device_mesh, param.placements)
    return t


def _jsonable(v):
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    raise TypeError(f"cannot store {type(v).__name__} in JSON")


def optimizer_state(opt, named_params: dict) -> tuple[dict, dict]:
    """``(tensors, meta)`` of an optimizer: state tensors keyed ``<name>::<key>``, and JSON
    ``{"param_groups": [...], "params": [[names of group 0], ...], "scalars": {...}}``."""
    opt = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps the torch one
    name_of = {id(p): n for n, p in named_params.items()}
    tensors, scalars, groups, names = {}, {}, [], []
    for g in opt.param_groups:
        gnames = []
        for p in g["params"]:
            if id(p) not in name_of:
                raise CheckpointError("an optimizer parameter has no name among the trainable parameters")
            n = name_of[id(p)]
            gnames.append(n)
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    tensors[f"{n}::{k}"] = _full(v)
                else:
                    scalars[f"{n}::{k}"] = _jsonable(v)
        names.append(gnames)
        groups.append({k: _jsonable(v) for k, v in g.items() if k != "params"})
    return tensors, {"param_groups": groups, "params": names, "scalars": scalars}


def load_optimizer_state(opt, named_params: dict, tensors: dict, meta: dict, where: str) -> None:
    """Inverse of ``optimizer_state``: the parameter names and shapes must match the model's."""
    opt = getattr(opt, "optimizer", opt)
    name_of = {id(p): n for n, p in named_params.items()}
    now = [[name_of.get(id(p)) for p in g["params"]] for g in opt.param_groups]
    if now != meta.get("params"):
        a = {n for g in now for n in g}
        b = {n for g in meta.get("params", []) for n in g}
        raise CheckpointError(
            f"{where}: the optimizer parameters differ from the model's (missing {sorted(a - b)[:3]}, "
            f"unexpected {sorted(b - a)[:3]})"
        )
    per_param = {}
    for key, v in [*tensors.items(), *meta.get("scalars", {}).items()]:
        pn, _, k = key.rpartition("::")
        per_param.setdefault(pn, {})[k] = v
    state, idx = {}, 0
    for g in opt.param_groups:
        for p in g["params"]:
            s = {}
            for k, t in per_param.get(name_of[id(p)], {}).items():
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    if t.shape != _full_shape(p):
                        raise CheckpointError(
                            f"{where}: optimizer state {name_of[id(p)]}::{k} has shape {tuple(t.shape)}, "
                            f"the parameter {tuple(_full_shape(p))}"
                        )
                    t = _like(p, t)
                s[k] = t
            if s:
                state[idx] = s
            idx += 1
    groups = []
    start = 0
    for g, saved in zip(opt.param_groups, meta["param_groups"]):
        saved = {k: v for k, v in dict(saved).items() if k in g}
        if "betas" in saved:
            saved["betas"] = tuple(saved["betas"])
        saved["params"] = list(range(start, start + len(g["params"])))
        start += len(g["params"])
        groups.append(saved)
    opt.load_state_dict({"state": state, "param_groups": groups})


def _full_shape(p: torch.Tensor) -> torch.Size:
    return p.shape  # a DTensor reports its global shape


def rng_state() -> tuple[dict, dict]:
    """This process's generator states: torch tensors and JSON (Python ``random``, NumPy)."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    v, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    meta = {
        "python": [v, list(internal), gauss],
        "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
    }
    return tensors, meta


def set_rng_state(tensors: dict, meta: dict) -> None:
    """Restore what ``rng_state`` returned (values are checked to be plain numbers)."""
    torch.set_rng_state(tensors["torch_cpu"].to(torch.uint8))
    cuda = [
        tensors[k]
        for k in sorted((k for k in tensors if k.startswith("torch_cuda_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    ]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([c.to(torch.uint8) for c in cuda[: torch.cuda.device_count()]])
    v, internal, gauss = meta["python"]
    if not (
        isinstance(v, int) and all(isinstance(x, int) for x in internal) and (gauss is None or isinstance(gauss, float))
    ):
        raise CheckpointError("bad Python random state")
    random.setstate((v, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((str(kind), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))


# ----------------------------------------------------------------------------- atomic writing


def _fsync(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass


def _save_tensors(tensors: dict, path: str, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=metadata)


def _write_json(obj, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, allow_nan=True)


def _shapes(path: str, what: str) -> dict:
    """``{key: shape}`` of a safetensors file from its header (no tensor is read)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types; any failure = unusable
        raise CheckpointError(f"{what}: {path} is not a readable safetensors file ({e})") from None


def _key_problem(where: str, got, want) -> str | None:
    extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    if not extra and not missing:
        return None
    parts = ([f"names {len(extra)} key(s) the model does not have ({', '.join(extra[:3])})"] if extra else []) + (
        [f"lacks {len(missing)} key(s) the model has ({', '.join(missing[:3])})"] if missing else []
    )
    return f"{where} {' and '.join(parts)}"


def _load_tensors(path: str, what: str) -> tuple[dict, dict]:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, (f.metadata() or {})
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types; any failure = unusable
        raise CheckpointError(f"{what}: {path} is not a readable safetensors file ({e})") from None


def disk_full_message(path: str, e: BaseException) -> str:
    """The user-facing text for a write that failed for lack of space."""
    try:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path)) or ".").free / 2**20
        free_s = f"{free:.1f} MiB free"
    except OSError:
        free_s = "free space unknown"
    return (
        f"disk full while writing {path} ({free_s}; {e}). Nothing older was overwritten: free some space "
        "(or choose another --output_dir) and run again with --resume latest."
    )


def is_unwritable(e: BaseException) -> bool:
    """``True`` for a write refused by permissions or a read-only file system."""
    return isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS)


def unwritable_message(path: str, e: BaseException) -> str:
    """The user-facing text for a write refused by permissions (a run folder made read-only mid-run)."""
    return (
        f"cannot write {path} ({getattr(e, 'strerror', None) or e}). Nothing older was overwritten: make the run "
        "folder writable and run again with --resume latest."
    )


def is_disk_full(e: BaseException) -> bool:
    """``True`` for ENOSPC / EDQUOT, including the text forms safetensors and torch raise."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    s = str(e).lower()
    return "no space left" in s or "disk quota exceeded" in s or "iostream error" in s or "os error 28" in s


class Checkpointer:
    """Saves and restores every piece of a run's state (see the module docstring).

    ``trainable``: ``(modules, names)`` given to ``save_trainable``/``load_trainable``;
    ``optimizers``: ``{role: (optimizer, {param name: param})}``; ``schedulers``: ``{role: LambdaLR}``;
    ``state``: an object with ``state_dict``/``load_state_dict`` of JSON values; ``ema``: a ``PowerEMA`` or None.
    """

    def __init__(self, accelerator, trainable, optimizers: dict, schedulers: dict, state, ema=None):
        self.acc, self.trainable, self.optimizers, self.schedulers, self.state, self.ema = (
            accelerator,
            trainable,
            optimizers,
            schedulers,
            state,
            ema,
        )

    # -- save
    def save(self, output_dir: str, step: int, config: dict, total_limit: int = 0, protect: str | None = None) -> str:
        """Write ``checkpoints/step-XXXXXXXX`` atomically (all ranks call), then prune to ``total_limit``."""

        from . import watchdog

        acc = self.acc
        d = os.path.join(output_dir, "checkpoints")
        final = os.path.join(d, f"step-{step:08d}")
        tmp = final + ".tmp"
        watchdog.check()  # the launcher or a peer gone: no checkpoint from here on
        try:
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp, exist_ok=True)
            acc.wait_for_everyone()
            opt_files = {
                r: optimizer_state(o, named) for r, (o, named) in self.optimizers.items()
            }  # collective under FSDP
            ema_tensors = {k: _full(v) for k, v in self.ema.shadow.items()} if self.ema is not None else None
            scaler = getattr(acc, "scaler", None)  # fp16 mixed precision: loss-scale state
            rng_t, rng_m = rng_state()
            _save_tensors(
                rng_t, os.path.join(tmp, f"rng-rank{acc.process_index}.safetensors"), {"json": json.dumps(rng_m)}
            )
            if acc.is_main_process:
                save_trainable(self.trainable[0], self.trainable[1], os.path.join(tmp, "trainable.safetensors"))
                for r, (tensors, _) in opt_files.items():
                    _save_tensors(tensors, os.path.join(tmp, f"optimizer-{r}.safetensors"))
                if os.environ.get(KILL_ENV) == str(step):
                    print(f"{KILL_ENV}={step}: hard exit while writing the checkpoint", flush=True)
                    os._exit(17)
                if ema_tensors is not None:
                    _save_tensors(ema_tensors, os.path.join(tmp, "ema.safetensors"))
                _write_json(
                    {
                        "format": FORMAT,
                        "step": step,
                        "world_size": acc.num_processes,
                        "train_state": self.state.state_dict(),
                        "optimizers": {r: meta for r, (_, meta) in opt_files.items()},
                        "schedulers": {r: _jsonable(s.state_dict()) for r, s in self.schedulers.items()},
                        "ema": {"s": self.ema.s} if self.ema is not None else None,
                        "grad_scaler": _jsonable(scaler.state_dict()) if scaler is not None else None,
                        "config": config,
                    },
                    os.path.join(tmp, STATE),
                )
            acc.wait_for_everyone()
            if acc.is_main_process:
                files = {}
                for n in sorted(os.listdir(tmp)):
                    p = os.path.join(tmp, n)
                    _fsync(p)
                    files[n] = {"bytes": os.path.getsize(p), "sha256": _sha256(p)}
                _write_json({"format": FORMAT, "step": step, "files": files}, os.path.join(tmp, MANIFEST))
                _fsync(os.path.join(tmp, MANIFEST))
                watchdog.check()
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
                _fsync(d)
                prune_checkpoints(output_dir, total_limit, protect=final)
        except Exception as e:
            if is_disk_full(e):
                shutil.rmtree(tmp, ignore_errors=True)
                raise SystemExit("error: " + disk_full_message(tmp, e)) from None
            if is_unwritable(e):
                shutil.rmtree(tmp, ignore_errors=True)
                raise SystemExit("error: " + unwritable_message(getattr(e, "filename", None) or tmp, e)) from None
            raise
        acc.wait_for_everyone()
        return final

    # -- what a checkpoint must hold for this model, checked before anything is loaded
    def mismatch(self, path: str) -> str | None:
        """What in ``path`` does not fit the model being resumed, from the file headers and ``state.json`` (nothing
        is loaded): the trainable weights, each optimizer's parameters and state keys, the EMA, each key set exactly
        the model's and each shape the parameter's. ``None`` when it fits; a problem counts as damage."""
        try:
            files = _manifest_files(path)
            st = read_state(path, {"files": files})
            models, names = self.trainable
            want = {
                f"{name}::{k}": tuple(_full_shape(p))
                for name, m in zip(names, models)
                for k, p in m.named_parameters()
                if p.requires_grad
            }
            got = _shapes(_listed(path, "trainable.safetensors", files), "trainable weights")
            problem = _key_problem(f"{path}: trainable.safetensors", got, want)
            if problem:
                return problem
            bad = [k for k in want if got[k] != want[k]]
            if bad:
                return (
                    f"{path}: trainable.safetensors: {bad[0]} has shape {list(got[bad[0]])}, the model's is "
                    f"{list(want[bad[0]])}"
                )
            for r, (o, named) in self.optimizers.items():
                meta = (st.get("optimizers") or {}).get(r)
                if not isinstance(meta, dict):
                    return f"{path}: no optimizer state for {r!r}"
                o = getattr(o, "optimizer", o)
                name_of = {id(p): n for n, p in named.items()}
                now = [[name_of.get(id(p)) for p in g["params"]] for g in o.param_groups]
                saved = [n for g in meta.get("params", []) for n in g]
                problem = _key_problem(f"{path}: {STATE}, optimizer {r!r}", saved, [n for g in now for n in g])
                if problem or meta.get("params") != now:
                    return problem or f"{path}: {STATE}, optimizer {r!r}: the parameter groups differ from the model's"
                shapes = _shapes(_listed(path, f"optimizer-{r}.safetensors", files), "optimizer")
                per = {}
                for key in [*shapes, *meta.get("scalars", {})]:
                    pn, sep, k = key.rpartition("::")
                    per.setdefault(pn if sep else key, set()).add(k)
                problem = _key_problem(f"{path}: optimizer-{r}.safetensors", per, named)
                if problem and set(per) - set(named):  # state of no parameter of the model
                    return problem
                kinds = {frozenset(ks) for ks in per.values()}
                if len(kinds) > 1:  # every parameter with state holds the same entries (step, moments, ...)
                    return (
                        f"{path}: optimizer-{r}.safetensors: parameters hold different state entries "
                        f"({sorted(map(sorted, kinds))[:2]})"
                    )
                for key, shape in shapes.items():
                    pn = key.rpartition("::")[0]
                    if len(shape) and shape != tuple(_full_shape(named[pn])):
                        return (
                            f"{path}: optimizer-{r}.safetensors: {key} has shape {list(shape)}, the parameter "
                            f"{list(_full_shape(named[pn]))}"
                        )
            if self.ema is not None:
                if not st.get("ema"):
                    return f"{path}: holds no EMA (the run had ema_rate 0)"
                got = _shapes(_listed(path, "ema.safetensors", files), "EMA")
                want = {k: tuple(v.shape) for k, v in self.ema.shadow.items()}
                problem = _key_problem(f"{path}: ema.safetensors", got, want)
                if problem:
                    return problem
                bad = [k for k in want if got[k] != want[k]]
                if bad:
                    return (
                        f"{path}: ema.safetensors: {bad[0]} has shape {list(got[bad[0]])}, the model's is "
                        f"{list(want[bad[0]])}"
                    )
        except CheckpointError as e:
            return str(e)
        return None

    # -- load
    def load(self, path: str, verify: bool = True) -> dict:
        """Restore everything from ``path`` (verified first, and ``mismatch`` before anything is changed); returns
        the saved ``state.json``."""

        if verify:
            verify_checkpoint(path)
        problem = self.mismatch(path)
        if problem:
            raise CheckpointError(problem)
        fresh = self._hyper()
        files = _manifest_files(path)
        st = read_state(path, {"files": files})
        try:
            load_trainable(self.trainable[0], self.trainable[1], _listed(path, "trainable.safetensors", files))
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path}: trainable weights do not load ({e})") from None
        for r, (o, named) in self.optimizers.items():
            if r not in st.get("optimizers", {}):
                raise CheckpointError(f"{path}: no optimizer state for {r!r}")
            tensors, _ = _load_tensors(_listed(path, f"optimizer-{r}.safetensors", files), "optimizer")
            load_optimizer_state(o, named, tensors, st["optimizers"][r], path)
        for r, s in self.schedulers.items():
            if r not in st.get("schedulers", {}):
                raise CheckpointError(f"{path}: no learning-rate scheduler state for {r!r}")
            s = getattr(s, "scheduler", s)
            keep = set(s.state_dict())
            saved = {k: v for k, v in dict(st["schedulers"][r]).items() if k in keep}
            saved["lr_lambdas"] = [None] * len(s.lr_lambdas)  # the lambdas are rebuilt from the config
            s.load_state_dict(saved)
        if self.ema is not None:
            if not st.get("ema"):
                raise CheckpointError(f"{path}: holds no EMA (the run had ema_rate 0)")
            shadow, _ = _load_tensors(_listed(path, "ema.safetensors", files), "EMA")
            if set(shadow) != set(self.ema.shadow) or any(shadow[k].shape != self.ema.shadow[k].shape for k in shadow):
                raise CheckpointError(f"{path}: the EMA weights do not match the student's parameters")
            self.ema.load_state_dict({"s": float(st["ema"]["s"]), "shadow": shadow})
        scaler = getattr(self.acc, "scaler", None)
        if scaler is not None and st.get("grad_scaler"):
            scaler.load_state_dict({k: v for k, v in st["grad_scaler"].items() if k in scaler.state_dict()})
        try:
            self.state.load_state_dict(st["train_state"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: bad counters in {STATE} ({e})") from None
        rank = self.acc.process_index
        if rank < (st.get("world_size") or 1) or f"rng-rank{rank}.safetensors" in files:
            rng = _listed(path, f"rng-rank{rank}.safetensors", files)
            t, meta = _load_tensors(rng, "random state")
            meta = _rng_meta(meta, rng)
            check_rng(t, meta, rng)
            try:
                set_rng_state(t, meta)
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"{rng}: bad random state ({e})") from None
        else:
            print(
                f"warning: {path} has no random state for process {self.acc.process_index} (more processes than "
                "the run that wrote it); this process keeps its seeded state",
                file=sys.stderr,
            )
        self._apply(fresh)
        return st

    # -- the current config's optimizer settings win over the saved ones (the resume policy,
    # rcm_diffusers.distill.run_folder)
    _HYPER = ("initial_lr", "betas", "eps", "weight_decay")

    def _hyper(self) -> dict:
        out = {}
        for r, (o, _) in self.optimizers.items():
            groups = getattr(o, "optimizer", o).param_groups
            out[r] = [{k: g[k] for k in self._HYPER if k in g} for g in groups]
        for r, s in self.schedulers.items():
            out["sched:" + r] = list(getattr(s, "scheduler", s).base_lrs)
        out["ema"] = self.ema.s if self.ema is not None else None
        return out

    def _apply(self, fresh: dict) -> None:
        """Put the settings the optimizers/schedulers/EMA were built with (this run's config) back over the
        loaded ones where they differ: learning rate from the next step on (``base_lr * warm-up(k)``), AdamW
        betas/eps/weight decay, EMA rate. Unchanged settings are left bit-identical."""
        for r, (o, _) in self.optimizers.items():
            for g, want in zip(getattr(o, "optimizer", o).param_groups, fresh[r]):
                for k, v in want.items():
                    if g.get(k) != v:
                        g[k] = v
        for r, s in self.schedulers.items():
            s = getattr(s, "scheduler", s)
            base = fresh["sched:" + r]
            if list(s.base_lrs) != base:
                s.base_lrs = list(base)
                groups = s.optimizer.param_groups
                for g, b, lam in zip(groups, base, s.lr_lambdas):
                    g["lr"] = b * lam(s.last_epoch)
                s._last_lr = [g["lr"] for g in groups]
        if self.ema is not None and fresh["ema"] is not None and self.ema.s != fresh["ema"]:
            from .ema import power_ema_exponent

            self.ema.s, self.ema.alpha = fresh["ema"], power_ema_exponent(fresh["ema"])


def save_trainable(models: list, names: list[str], path: str) -> None:
    """Save only the trainable parameters (adapters or full copies) of ``models`` (safetensors)."""
    from safetensors.torch import save_file

    sd = {}
    for name, m in zip(names, models):
        for k, p in m.named_parameters():
            if p.requires_grad:
                sd[f"{name}::{k}"] = p.detach().cpu().contiguous()
    save_file(sd, path)


def load_trainable(models: list, names: list[str], path: str) -> None:
    """Load what ``save_trainable`` wrote (strict on the trainable names)."""
    from safetensors.torch import load_file

    sd = load_file(path)
    for name, m in zip(names, models):
        params = dict(m.named_parameters())
        want = {k for k, p in params.items() if p.requires_grad}
        got = {k.split("::", 1)[1] for k in sd if k.startswith(name + "::")}
        if want != got:
            raise ValueError(
                f"checkpoint {path} does not match model {name}: missing {sorted(want - got)[:5]}, "
                f"unexpected {sorted(got - want)[:5]}"
            )
        with torch.no_grad():
            for k in want:
                params[k].copy_(sd[f"{name}::{k}"])
