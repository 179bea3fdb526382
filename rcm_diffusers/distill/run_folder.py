"""The run folder of the trainers: one writer (a lock), no silent mixing of two runs (fresh, resume or overwrite),
the resume policy of the options, and the integrity check of a finished run's exports (``--verify``).

See docs/training.md for what a run folder holds and what resume restores.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import stat
import sys
import time

from .checkpoints import CheckpointError, _sha256, checkpoint_step, find_resumable, list_checkpoints, verify_checkpoint
from .errors import user_error

__all__ = [
    "RunLock",
    "choose_start",
    "broadcast_start",
    "resume_changes",
    "remove_run_files",
    "env_sessions",
    "export_files",
    "run_entries",
    "verify_run",
    "verify_main",
    "LOCK",
    "EXPORT_FILES",
    "RUN_FILES",
    "TOOL_FILES",
]

LOCK = ".rcm-run.lock"
# what the trainers export at the end (each listed with its size and SHA-256 in final.json, ``export_files``)
EXPORT_FILES = (
    "pytorch_lora_weights.safetensors",
    "lora_comfyui.safetensors",
    "delta_comfyui.safetensors",
    "quantized_transformer.safetensors",
    "transformer_2",
    "student_transformer",
    "student_transformer_2",
    "scheduler",
    "ema",
)
# files and folders the trainers write into output_dir (removed by --overwrite true; anything else is left alone)
RUN_FILES = (
    "checkpoints",
    "metrics.jsonl",
    "spikes.jsonl",
    "env.json",
    "final.json",
    "samples",
    "warm_start.json",
    *EXPORT_FILES,
    "final.json.tmp",
    "env.json.tmp",
    "metrics.jsonl.tmp",
    "warm_start.json.tmp",
)
# written by tools around a run before it starts (training/demo_digits.py logs here): not a sign of a run
NEUTRAL_FILES = (LOCK, "train.log")
EXPORTS = ("final.json", *(n for n in EXPORT_FILES if n != "ema"))


class RunLock:
    """Exclusive ``flock`` on ``<output_dir>/.rcm-run.lock`` for the life of the process (the kernel drops it when
    the process dies, even by SIGKILL, so it never goes stale). A second writer is refused, naming the holder."""

    def __init__(self, output_dir: str):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, LOCK)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self.fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            self.fd = None
            user_error(
                f"{output_dir} is in use by {holder}: two trainers must not write one run folder. Wait for it "
                "to finish or stop it, or choose another --output_dir."
            )
        os.ftruncate(self.fd, 0)
        os.pwrite(
            self.fd,
            f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(),
            0,
        )

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def remove_run_files(output_dir: str, keep_checkpoints_upto: int | None = None) -> list[str]:
    """Delete what the trainers write into ``output_dir`` (``RUN_FILES``); with ``keep_checkpoints_upto = k``
    only the checkpoints after step ``k`` and the exports go. Returns the removed paths."""
    gone = []
    for n in RUN_FILES:
        p = os.path.join(output_dir, n)
        if n == "checkpoints" and keep_checkpoints_upto is not None:
            for s, c in list_checkpoints(output_dir):
                if s > keep_checkpoints_upto:
                    shutil.rmtree(c)
                    gone.append(c)
            continue
        if keep_checkpoints_upto is not None and n not in EXPORTS and n != "ema":
            continue
        if os.path.isdir(p):
            shutil.rmtree(p)
            gone.append(p)
        elif os.path.exists(p):
            os.remove(p)
            gone.append(p)
    return gone


def _contents(output_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(output_dir) if n not in NEUTRAL_FILES) if os.path.isdir(output_dir) else []


def choose_start(cfg, log=print) -> str | None:
    """The checkpoint to resume from (``None`` = fresh), after the checks of the run folder (main process only).

    - no ``--resume``: ``output_dir`` must be empty, else refused unless ``--overwrite true`` (then the previous
      run's files are deleted);
    - ``--resume latest``: the newest checkpoint that passes ``verify_checkpoint``; damaged newer ones are
      named, renamed ``*.damaged`` and skipped; no checkpoint = fresh start (refused if the folder holds
      finished exports or only damaged checkpoints);
    - ``--resume PATH``: that checkpoint, verified; inside ``output_dir`` the checkpoints after it (another
      history) must go first (``--overwrite true``); outside it, ``output_dir`` must be empty or overwritten.
    """
    out = cfg.output_dir
    found = _contents(out)
    what = f"{out} already holds a training run ({', '.join(found[:6])}{', ...' if len(found) > 6 else ''})"
    if not cfg.resume:
        if found and not cfg.overwrite:
            user_error(
                f"{what}. Pass --resume latest to continue it, --overwrite true to delete it and start again, "
                "or choose another --output_dir."
            )
        if found:
            log(f"--overwrite: removed {', '.join(remove_run_files(out)) or 'nothing'}")
        return None
    if cfg.resume == "latest":
        path, damaged = find_resumable(out)
        for p, why in damaged:
            log(f"warning: checkpoint {p} is damaged, skipped: {why}")
        if path is None:
            if damaged and not cfg.overwrite:
                user_error(
                    f"no intact checkpoint in {out} (all {len(damaged)} failed verification, see above); "
                    "--overwrite true starts again from scratch"
                )
            if any(os.path.exists(os.path.join(out, n)) for n in EXPORTS) and not cfg.overwrite:
                user_error(f"{what} with exports but no checkpoint to continue from; --overwrite true starts again")
            if found:  # an attempt that stopped before its first checkpoint: its logs would mix with the new ones
                gone = remove_run_files(out)
                log(
                    f"--resume latest: no checkpoint in {out}, starting fresh"
                    + (f" (removed {', '.join(gone)})" if gone else "")
                )
            return None
        for p, _ in damaged:
            os.replace(p, p + ".damaged")
        if damaged:
            log(f"resuming from the newest intact checkpoint {path} (damaged ones renamed *.damaged)")
        return path
    path = os.path.abspath(os.path.expanduser(cfg.resume))
    ckpt_dir = os.path.abspath(os.path.join(out, "checkpoints"))
    try:  # a checkpoint of this run must lie inside it; another run's, inside its own folder
        verify_checkpoint(path, out if os.path.dirname(path) == ckpt_dir else os.path.dirname(os.path.dirname(path)))
    except CheckpointError as e:
        user_error(f"--resume {cfg.resume}: {e}")
    if os.path.dirname(path) == ckpt_dir:
        k = checkpoint_step(path)
        newer = [p for s, p in list_checkpoints(out) if s > k]
        if newer and not cfg.overwrite:
            later = ", ".join(os.path.basename(p) for p in newer)
            user_error(
                f"{out} has checkpoints after {os.path.basename(path)} ({later}); "
                "continuing from an older one would mix two histories. Resume the newest (--resume latest), or "
                "pass --overwrite true to delete the later checkpoints and the exports."
            )
        if newer or cfg.overwrite:
            log(f"--overwrite: removed {', '.join(remove_run_files(out, keep_checkpoints_upto=k)) or 'nothing'}")
        return path
    if found and not cfg.overwrite:
        user_error(
            f"{what}; resuming the checkpoint {path} of another run needs an empty --output_dir (or --overwrite true)"
        )
    if found:
        log(f"--overwrite: removed {', '.join(remove_run_files(out)) or 'nothing'}")
    return path


def broadcast_start(accelerator, ckpt: str | None) -> str | None:
    """The main process's choice, on every process."""
    if accelerator.num_processes == 1:
        return ckpt
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([ckpt])[0]


def resume_changes(saved: dict, cfg, step: int) -> dict:
    """Compare the checkpoint's config with this run's by the options' resume policy (``config.resume_policy``):
    refuse a change of a ``fixed`` option, a switch of the EMA on/off, or ``max_steps`` below the checkpoint's step;
    return ``{key: [old, new]}`` of the changed ``applied`` options (they apply from ``step`` on)."""
    from .config import resume_policy

    new = cfg.model_dump()
    policy = resume_policy(type(cfg))
    bad = [
        f"{k} {saved[k]!r} -> {new[k]!r} ({why})"
        for k, (kind, why) in policy.items()
        if kind == "fixed" and k in saved and saved[k] != new[k]
    ]
    if "ema_rate" in saved and (saved["ema_rate"] > 0) != (new.get("ema_rate", 0) > 0):
        bad.append(
            f"ema_rate {saved['ema_rate']!r} -> {new['ema_rate']!r} (the EMA cannot be switched on or off mid-run)"
        )
    if bad:
        user_error(
            "cannot change on resume: " + "; ".join(bad) + ". Resume with the old values, or start a new run "
            "(another --output_dir, or --overwrite true)."
        )
    if cfg.max_steps < step:
        user_error(
            f"--max_steps {cfg.max_steps} is below the checkpoint's step {step}; a run cannot be shortened "
            f"on resume (resume an earlier checkpoint with --resume PATH, or use max_steps >= {step})"
        )
    # an option newer than the checkpoint counts as its default there (the behaviour before the option existed)
    old = {n: f.get_default(call_default_factory=True) for n, f in type(cfg).model_fields.items()} | saved
    return {k: [old.get(k), v] for k, v in new.items() if policy[k][0] == "applied" and old.get(k) != v}


def env_sessions(env_path: str, record: dict, fresh: bool) -> list[dict]:
    """``env.json``'s ``sessions``: the previous ones (kept on resume) plus ``record``."""
    old = []
    if not fresh and os.path.exists(env_path):
        try:
            with open(env_path) as f:
                old = json.load(f).get("sessions", [])
        except (OSError, ValueError):
            old = []
    return [*old, record]


def _export_paths(output_dir: str) -> list[str]:
    """Relative paths of the files under ``EXPORT_FILES`` in ``output_dir`` (sorted)."""
    out = []
    for n in EXPORT_FILES:
        p = os.path.join(output_dir, n)
        if os.path.isfile(p):
            out.append(n)
        elif os.path.isdir(p):
            for dirpath, _, files in os.walk(p):
                out += [os.path.relpath(os.path.join(dirpath, f), output_dir) for f in files]
    return sorted(out)


def export_files(output_dir: str) -> dict:
    """``{relative path: {"bytes", "sha256"}}`` of every exported file of a run (for ``final.json``)."""
    return {
        r: {"bytes": os.path.getsize(os.path.join(output_dir, r)), "sha256": _sha256(os.path.join(output_dir, r))}
        for r in _export_paths(output_dir)
    }


# written next to a run by this repository's tools (training/demo_digits.py, training/eval_digits.py): not exports
TOOL_FILES = ("train.log", "report.md", "results.json", "samples.png", "demo_timing.json")


def run_entries(output_dir: str) -> list[str]:
    """The top-level names of ``output_dir`` that are not exports (logs, checkpoints, samples, a tracker's folder):
    ``final.json`` records them, and ``--verify`` accepts them unlisted."""
    return sorted(n for n in os.listdir(output_dir) if n not in EXPORT_FILES and n != "final.json")


def _scan(run_dir: str):
    """Everything under ``run_dir`` without following a link: ``(regular files, links {rel: target}, other
    entries, unreadable folders {rel: why})``, relative paths."""
    files, links, other, unreadable = [], {}, [], {}
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        try:
            with os.scandir(os.path.join(run_dir, rel_dir)) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            unreadable[rel_dir or "."] = e.strerror or str(e)
            continue
        for e in entries:
            rel = os.path.join(rel_dir, e.name) if rel_dir else e.name
            if e.is_symlink():
                try:
                    links[rel] = os.readlink(e.path)
                except OSError:
                    links[rel] = "?"
            elif e.is_dir(follow_symlinks=False):
                stack.append(rel)
            elif e.is_file(follow_symlinks=False):
                files.append(rel)
            else:
                other.append(rel)
    return files, links, other, unreadable


def _read_regular(path: str):
    """Open ``path`` for reading only if it is a regular file reached without a link (``O_NOFOLLOW``)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IsADirectoryError(f"{path} is not a regular file")
    return os.fdopen(fd, "rb")


def _digest(path: str) -> tuple[int, str]:
    h, n = hashlib.sha256(), 0
    with _read_regular(path) as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
            n += len(block)
    return n, h.hexdigest()


def verify_run(run_dir: str) -> tuple[int, list[str]]:
    """Check a finished run's exports against the sizes and SHA-256 in its ``final.json``: ``(files checked,
    problems)``. Only regular files inside ``run_dir`` are read: a symbolic link anywhere in the run folder (file
    or folder) is reported and never followed, as is anything that is not a regular file; a file that cannot be
    read gets a read message; every file besides the run's own logs and checkpoints (``run_entries``, recorded in
    ``final.json``) must be listed, and one that is not is named. A missing ``final.json`` or one without the list
    is one problem."""
    path = os.path.join(run_dir, "final.json")
    if os.path.islink(path):
        return 0, [f"final.json: a symbolic link (to {os.readlink(path)}); not followed (a run writes no links)"]
    if not os.path.lexists(path):
        return 0, [f"{run_dir}: no final.json (not a finished run)"]
    try:
        with _read_regular(path) as f:
            final = json.loads(f.read(64 * 2**20))
        listed = final.get("files")
    except OSError as e:
        return 0, [f"{path}: cannot read it ({e.strerror or e})"]
    except (ValueError, RecursionError, AttributeError) as e:
        return 0, [f"{path}: unreadable ({type(e).__name__}: {e})"]
    if not isinstance(listed, dict):
        return 0, [f"{path}: lists no exported files (written by an older version: nothing to verify against)"]
    files, links, other, unreadable = _scan(run_dir)
    files_set, other_set = set(files), set(other)
    problems = [f"{rel}/: cannot read the folder ({why})" for rel, why in sorted(unreadable.items())]
    problems += [
        f"{rel}: a symbolic link (to {t}); not followed (a run writes no links)" for rel, t in sorted(links.items())
    ]

    def under_link(rel):
        parts = rel.split("/")
        return any("/".join(parts[:i]) in links for i in range(1, len(parts) + 1))

    for rel, meta in sorted(listed.items()):
        if not isinstance(rel, str) or os.path.isabs(rel) or ".." in rel.split("/") or not isinstance(meta, dict):
            problems.append(f"{path}: bad entry {rel!r}")
        elif under_link(rel):
            continue  # reported above
        elif rel in other_set:
            problems.append(f"{rel}: not a regular file")
        elif rel not in files_set:
            problems.append(f"{rel}: missing")
        else:
            try:
                size, digest = _digest(os.path.join(run_dir, rel))
            except OSError as e:
                problems.append(f"{rel}: cannot read it ({e.strerror or e})")
                continue
            if size != meta.get("bytes"):
                problems.append(f"{rel}: {size} bytes, final.json says {meta.get('bytes')}")
            elif digest != meta.get("sha256"):
                problems.append(f"{rel}: SHA-256 differs from final.json (the file was changed or damaged)")
    recorded = final.get("run_entries")
    own = set(recorded if isinstance(recorded, list) else RUN_FILES) | {*NEUTRAL_FILES, *TOOL_FILES, "final.json"}
    own -= set(EXPORT_FILES)
    for rel in sorted([*files, *other]):
        if rel not in listed and rel.split("/")[0] not in own:
            problems.append(f"{rel}: not listed in final.json (not written by this run)")
    return len(listed), problems


def verify_main(args: list[str]) -> int:
    """``--verify RUN_DIR``: print what ``verify_run`` found; exit status 0 all intact, 1 damaged, 2 bad usage."""
    if len(args) != 1 or not os.path.isdir(args[0]):
        print(
            f"error: --verify needs one run folder{f', {args[0]} is not a folder' if len(args) == 1 else ''}",
            file=sys.stderr,
        )
        return 2
    n, problems = verify_run(args[0])
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"ok: {n} exported files match final.json")
    return 0
