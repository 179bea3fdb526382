"""The run folder of ``training/rcm.py`` and ``training/qad.py``: one writer (a lock), no silent mixing of
two runs, a stated policy for settings changed on resume, skipped-step accounting, plain errors.

See ``docs/training.md`` for what a run folder holds and what resume restores.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import socket
import sys
import time

import torch

from .checkpoints import CheckpointError, _sha256, checkpoint_step, find_resumable, list_checkpoints, verify_checkpoint

__all__ = ["RunLock", "choose_start", "resume_changes", "FIXED_ON_RESUME", "BOOKKEEPING", "note_skip",
           "param_checksum", "check_learned", "model_index", "load_config_or_exit", "run_main", "remove_run_files",
           "env_sessions", "cpu_launch_command", "trained_processes", "free_port", "user_error", "check_inputs",
           "export_files", "verify_run", "verify_main"]

LOCK = ".rcm-run.lock"
# what the trainers export at the end (each listed with its size and SHA-256 in final.json, ``export_files``)
EXPORT_FILES = ("pytorch_lora_weights.safetensors", "lora_comfyui.safetensors", "delta_comfyui.safetensors",
                "quantized_transformer.safetensors", "transformer_2", "student_transformer", "student_transformer_2",
                "scheduler", "ema")
# files and folders the trainers write into output_dir (removed by --overwrite true; anything else is left alone)
RUN_FILES = ("checkpoints", "metrics.jsonl", "spikes.jsonl", "env.json", "final.json", "samples", "warm_start.json",
             *EXPORT_FILES, "final.json.tmp", "env.json.tmp", "metrics.jsonl.tmp", "warm_start.json.tmp")
# written by tools around a run before it starts (training/demo_digits.py logs here): not a sign of a run
NEUTRAL_FILES = (LOCK, "train.log")
EXPORTS = ("final.json", *(n for n in EXPORT_FILES if n != "ema"))


def fail(msg: str):
    """Stop the run with ``msg`` on stderr, no traceback, exit status 1."""
    raise SystemExit(f"error: {msg}")


def user_error(msg: str):
    """Stop on bad input (data, teacher folder): ``msg`` on stderr as one line, no traceback, exit status 2."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


# ----------------------------------------------------------------------------- one writer per folder


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
            fail(f"{output_dir} is in use by {holder}: two trainers must not write one run folder. Wait for it to "
                 "finish or stop it (a killed launcher can leave its worker running), or choose another --output_dir.")
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


# ----------------------------------------------------------------------------- fresh, resume or overwrite


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
            fail(f"{what}. Pass --resume latest to continue it, --overwrite true to delete it and start again, "
                 "or choose another --output_dir.")
        if found:
            log(f"--overwrite: removed {', '.join(remove_run_files(out)) or 'nothing'}")
        return None
    if cfg.resume == "latest":
        path, damaged = find_resumable(out)
        for p, why in damaged:
            log(f"warning: checkpoint {p} is damaged, skipped: {why}")
        if path is None:
            if damaged and not cfg.overwrite:
                fail(f"no intact checkpoint in {out} (all {len(damaged)} failed verification, see above); "
                     "--overwrite true starts again from scratch")
            if any(os.path.exists(os.path.join(out, n)) for n in EXPORTS) and not cfg.overwrite:
                fail(f"{what} with exports but no checkpoint to continue from; --overwrite true starts again")
            if found:  # an attempt that stopped before its first checkpoint: its logs would mix with the new ones
                gone = remove_run_files(out)
                log(f"--resume latest: no checkpoint in {out}, starting fresh" + (f" (removed {', '.join(gone)})" if gone else ""))
            return None
        for p, _ in damaged:
            os.replace(p, p + ".damaged")
        if damaged:
            log(f"resuming from the newest intact checkpoint {path} (damaged ones renamed *.damaged)")
        return path
    path = os.path.abspath(os.path.expanduser(cfg.resume))
    try:
        verify_checkpoint(path)
    except CheckpointError as e:
        fail(f"--resume {cfg.resume}: {e}")
    ckpt_dir = os.path.abspath(os.path.join(out, "checkpoints"))
    if os.path.dirname(path) == ckpt_dir:
        k = checkpoint_step(path)
        newer = [p for s, p in list_checkpoints(out) if s > k]
        if newer and not cfg.overwrite:
            fail(f"{out} has checkpoints after {os.path.basename(path)} ({', '.join(os.path.basename(p) for p in newer)}); "
                 "continuing from an older one would mix two histories. Resume the newest (--resume latest), or "
                 "pass --overwrite true to delete the later checkpoints and the exports.")
        if newer or cfg.overwrite:
            log(f"--overwrite: removed {', '.join(remove_run_files(out, keep_checkpoints_upto=k)) or 'nothing'}")
        return path
    if found and not cfg.overwrite:
        fail(f"{what}; resuming the checkpoint {path} of another run needs an empty --output_dir (or --overwrite true)")
    if found:
        log(f"--overwrite: removed {', '.join(remove_run_files(out)) or 'nothing'}")
    return path


def broadcast_start(accelerator, ckpt: str | None) -> str | None:
    """The main process's choice, on every process."""
    if accelerator.num_processes == 1:
        return ckpt
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([ckpt])[0]


# ----------------------------------------------------------------------------- settings changed on resume

# refused on resume: they change shapes, the set of trained networks, or the random stream / schedule already
# followed (the checkpoint's state is only meaningful under the old value); key -> why
_SHAPES = "the checkpoint's weights and optimizer states have the old shapes"
_STREAM = "every batch, noise draw and alternation step is a function of it and of the step already reached"
_START = "it acts only at the start of a run (already done)"
FIXED_ON_RESUME = {
    "RCMConfig": {"transformer_subfolder": "the checkpoint belongs to the other expert",
                  "experts": "the checkpoint holds adapters of the old set of experts", "boundary_ratio": "each expert was trained on the old side of the switch",
                  "mode": _SHAPES, "lora_rank": _SHAPES,
                  "lora_alpha": "the trained adapter was scaled by the old alpha", "fake_lora_rank": _SHAPES,
                  "lora_target_modules": _SHAPES, "weight_dtype": _SHAPES, "use_dmd": "the fake score network and its optimizer",
                  "seed": _STREAM, "batch_size": _STREAM, "gradient_accumulation_steps": _STREAM, "noise_seeding": _STREAM,
                  "tangent_warmup": _STREAM, "student_update_freq": _STREAM,
                  "max_simulation_steps": _STREAM, "time_input": "the networks were trained at the old time input"},
    "QADConfig": {"transformer_subfolder": "the checkpoint belongs to the other expert", "weight_dtype": _SHAPES,
                  "format": "the student was trained through the old quantizer", "act_format": "the activation quantizer",
                  "per_channel": "the quantizer's scales", "exclude": "which layers are quantized",
                  "overrides": "which layers are quantized", "scope": _SHAPES, "lora_rank": _SHAPES,
                  "lora_alpha": "the trained adapter was scaled by the old alpha", "lora_target_modules": _SHAPES,
                  "calibration_batches": "the activation ranges are recalibrated identically on resume",
                  "r_source": "the activation ranges are calibrated at these times", "shift": "the activation ranges are calibrated at these times",
                  "rcm_steps": "the activation ranges are calibrated at these times", "sigma_max": "the activation ranges are calibrated at these times",
                  "mid_t": "the activation ranges are calibrated at these times", "seed": _STREAM, "batch_size": _STREAM,
                  "gradient_accumulation_steps": _STREAM, "noise_seeding": _STREAM, "warm_start_batches": _START, "warm_start_steps_per_batch": _START, "warm_start_lr": _START,
                  "time_input": "the student was trained at the old time input",
                  "target": "the student was trained through the old runtime arithmetic",
                  "act_scale": "the activation quantizer"},
}
# changed freely on resume, without a message (where and how often things are written, guards, testing aids)
BOOKKEEPING = {"output_dir", "resume", "overwrite", "checkpoint_every", "checkpoints_total_limit", "log_every", "report_to",
               "sample_every", "sample_steps", "spike_factor", "spike_patience", "exit_after_step", "progress",
               "max_skipped_fraction", "max_steps", "eval_batches", "export_layout"}


def resume_changes(saved: dict, cfg, step: int) -> dict:
    """Compare the checkpoint's config with this run's: refuse a change of a ``FIXED_ON_RESUME`` setting, a
    switch of the EMA on/off, or ``max_steps`` below the checkpoint's step; return ``{key: [old, new]}`` of the
    other changed settings (they apply from ``step`` on; bookkeeping ones excluded)."""
    import dataclasses

    new = dataclasses.asdict(cfg)
    fixed = FIXED_ON_RESUME.get(type(cfg).__name__, {})
    bad = [f"{k} {saved[k]!r} -> {new[k]!r} ({why})" for k, why in fixed.items() if k in saved and saved[k] != new.get(k)]
    if "ema_rate" in saved and (saved["ema_rate"] > 0) != (new.get("ema_rate", 0) > 0):
        bad.append(f"ema_rate {saved['ema_rate']!r} -> {new['ema_rate']!r} (the EMA cannot be switched on or off mid-run)")
    if bad:
        fail("cannot change on resume: " + "; ".join(bad) + ". Resume with the old values, or start a new run "
             "(another --output_dir, or --overwrite true).")
    if cfg.max_steps < step:
        fail(f"--max_steps {cfg.max_steps} is below the checkpoint's step {step}; a run cannot be shortened on resume "
             f"(resume an earlier checkpoint with --resume PATH, or use max_steps >= {step})")
    # a setting newer than the checkpoint counts as its default there (the behaviour before the setting existed)
    old = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
           for f in dataclasses.fields(cfg) if (f.default, f.default_factory) != (dataclasses.MISSING,) * 2} | saved
    return {k: [old.get(k), v] for k, v in new.items()
            if k not in BOOKKEEPING and k not in fixed and old.get(k) != v}


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


# ----------------------------------------------------------------------------- skipped steps, nothing learned


def note_skip(state, cfg, i: int, role: str, norm: float, ids, log=print) -> None:
    """Count a skipped optimizer step (non-finite gradient norm), say so, and stop the run once more than
    ``max_skipped_fraction`` of ``max_steps`` were skipped."""
    state.skipped += 1
    state.skipped_steps.append(i)
    log(f"warning: step {i}: {role} gradient norm is {norm}, optimizer step skipped "
        f"({state.skipped} skipped so far; batch sample ids {list(ids)})")
    limit = cfg.max_skipped_fraction * cfg.max_steps
    if state.skipped > limit:
        fail(f"{state.skipped} of {i + 1} steps had a non-finite gradient and were skipped (steps {state.skipped_steps[:10]}"
             f"{' ...' if state.skipped > 10 else ''}), more than max_skipped_fraction {cfg.max_skipped_fraction} of "
             f"max_steps {cfg.max_steps}. Check the data for NaN/inf (rcm_diffusers.distill.data) and the learning rate; "
             "raise --max_skipped_fraction to accept more.")


@torch.no_grad()
def param_checksum(params) -> list[float]:
    """``[sum, sum of squares]`` of the parameters in float64 (a fingerprint of the weights)."""
    ps = list(params.values()) if isinstance(params, dict) else list(params)
    s = sum(float(p.detach().double().sum()) for p in ps)
    q = sum(float(p.detach().double().square().sum()) for p in ps)
    return [s, q]


def check_learned(params, init_checksum, state, cfg) -> None:
    """Fail when the student's weights (``{name: param}`` or a list) are non-finite, still exactly their initial
    values, or form a LoRA whose ``lora_B`` matrices are all zero (``B A = 0``: the adapter changes nothing,
    whatever weight decay did to ``A``)."""
    now = param_checksum(params)
    if not all(math.isfinite(v) for v in now):
        fail("the student weights contain NaN or inf; the exports would be garbage. Lower the learning rate, keep "
             "skip_nonfinite true, and check the data for NaN/inf.")
    if state.step == 0:
        return
    named = params if isinstance(params, dict) else {}
    b = [p for n, p in named.items() if "lora_B" in n]
    if (init_checksum and now == list(init_checksum)) or (b and all(not bool(p.detach().any()) for p in b)):
        fail(f"after {state.step} steps the student {'LoRA is zero' if b else 'weights are exactly their initial values'}: "
             f"nothing was learned ({state.skipped} steps skipped). Check the data and the learning rate.")


# ----------------------------------------------------------------------------- plain errors


def model_index(pretrained: str) -> dict:
    """``model_index.json`` of ``--pretrained`` (a local pipeline folder or a hub id), with a clear error."""
    import diffusers

    p = os.path.expanduser(pretrained)
    looks_local = os.path.isabs(p) or p.startswith(".") or p.count("/") != 1 or p.endswith("/")
    if not os.path.isdir(p) and looks_local:
        fail(f"--pretrained {pretrained}: no such folder. Give a diffusers pipeline folder (with model_index.json) "
             "or a hub id such as Wan-AI/Wan2.1-T2V-1.3B-Diffusers.")
    if os.path.isdir(p) and not os.path.isfile(os.path.join(p, "model_index.json")):
        fail(f"--pretrained {pretrained}: the folder has no model_index.json (not a diffusers pipeline folder; "
             "point at the folder that holds model_index.json and transformer/)")
    try:
        return diffusers.DiffusionPipeline.load_config(p)
    except Exception as e:  # noqa: BLE001 - hub/network/format errors all mean the same to the user
        fail(f"--pretrained {pretrained}: could not read its model_index.json ({type(e).__name__}: {e})")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a launcher's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_launch_command(script: str, args: list[str], processes: int = 1) -> list[str]:
    """``accelerate launch`` of ``script`` on ``processes`` CPU processes. One: ``--cpu``. Several: accelerate's
    torchrun launcher (``--multi_gpu``) on a free local port, and the trainers ask accelerate for gloo on CPU
    (``Accelerator(cpu=...)`` in training/rcm.py). ``--cpu --num_processes 2`` would start one process, silently:
    accelerate's simple launcher needs mpirun for more; ``trained_processes`` tells afterwards."""
    if processes < 1:
        raise ValueError(f"processes = {processes}: must be >= 1")
    mode = ["--multi_gpu", "--main_process_port", str(free_port())] if processes > 1 else ["--cpu"]
    return [sys.executable, "-m", "accelerate.commands.launch", *mode, "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", script, *args]


def trained_processes(output_dir: str) -> int | None:
    """How many processes trained the finished run in ``output_dir`` (one checksum per rank in its ``final.json``);
    ``None`` without a ``final.json``."""
    path = os.path.join(output_dir, "final.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return len(json.load(f).get("student_checksum_per_rank") or [0])


PICKLE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _teacher_config(pretrained: str, sub: str) -> dict | None:
    """``<pretrained>/<sub>/config.json`` of a local teacher folder after checking that its weights are safetensors
    (``None`` for a hub id or a folder without that subfolder: the loader reports those)."""
    d = os.path.join(os.path.expanduser(pretrained), sub)
    if not os.path.isdir(d):
        return None
    names = os.listdir(d)
    if not any(n.endswith((".safetensors", ".safetensors.index.json")) for n in names):
        pickles = sorted(n for n in names if n.endswith(PICKLE_WEIGHTS))
        if pickles:
            user_error(f"--pretrained {pretrained}: {sub}/ holds only pickle weights ({', '.join(pickles[:3])}); they are "
                       "not loaded (a pickle can run code). Save the transformer as safetensors (diffusers' "
                       "save_pretrained does by default) and point --pretrained at that folder.")
        user_error(f"--pretrained {pretrained}: {sub}/ holds no weights (no .safetensors file)")
    try:
        with open(os.path.join(d, "config.json")) as f:
            c = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        user_error(f"--pretrained {pretrained}: cannot read {sub}/config.json ({type(e).__name__}: {e})")
    return c if isinstance(c, dict) else None


def check_inputs(cfg) -> dict:
    """Everything cheap about a run's inputs, before the run folder is touched or a model loads: the teacher's
    weights are safetensors, and the whole dataset (``data.check_dataset``) fits the teacher's config, as do the ODE
    pairs of the regression term (with their ``noise``) when it is on. A problem
    ends the process with one line and exit status 2; returns ``check_dataset``'s summary."""
    from .data import DataError, check_dataset

    subs = [cfg.transformer_subfolder]
    if getattr(cfg, "experts", "one") != "one" and os.path.isdir(os.path.join(os.path.expanduser(cfg.pretrained), "transformer_2")):
        subs = list(dict.fromkeys(["transformer", "transformer_2", *subs]))
    configs = [_teacher_config(cfg.pretrained, s) for s in subs]
    try:
        info = check_dataset(cfg.data_dir, configs[0])
        if getattr(cfg, "regression_weight", 0) > 0:
            pairs = check_dataset(cfg.regression_data_dir, configs[0], "--regression_data_dir")
            if "noise" not in pairs["fields"]:
                raise DataError(f"--regression_data_dir {cfg.regression_data_dir}: no 'noise' field, so these are not ODE "
                                "pairs; make them with training/prepare_data.py --synthetic")
        return info
    except DataError as e:
        user_error(str(e))


# ----------------------------------------------------------------------------- integrity of the exports


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
    return {r: {"bytes": os.path.getsize(os.path.join(output_dir, r)), "sha256": _sha256(os.path.join(output_dir, r))}
            for r in _export_paths(output_dir)}


def verify_run(run_dir: str) -> tuple[int, list[str]]:
    """Check a finished run's exports against the sizes and SHA-256 in its ``final.json``: ``(files checked,
    problems)``; a missing ``final.json`` or one without the list is one problem."""
    path = os.path.join(run_dir, "final.json")
    if not os.path.isfile(path):
        return 0, [f"{run_dir}: no final.json (not a finished run)"]
    try:
        with open(path) as f:
            listed = json.load(f).get("files")
    except (OSError, ValueError, RecursionError, AttributeError) as e:
        return 0, [f"{path}: unreadable ({type(e).__name__}: {e})"]
    if not isinstance(listed, dict):
        return 0, [f"{path}: lists no exported files (written by an older version: nothing to verify against)"]
    problems = []
    for rel, meta in sorted(listed.items()):
        p = os.path.join(run_dir, rel)
        if not isinstance(rel, str) or os.path.isabs(rel) or ".." in rel.split("/") or not isinstance(meta, dict):
            problems.append(f"{path}: bad entry {rel!r}")
        elif not os.path.exists(p):
            problems.append(f"{rel}: missing")
        elif not os.path.isfile(p):
            problems.append(f"{rel}: not a regular file")
        elif os.path.getsize(p) != meta.get("bytes"):
            problems.append(f"{rel}: {os.path.getsize(p)} bytes, final.json says {meta.get('bytes')}")
        elif _sha256(p) != meta.get("sha256"):
            problems.append(f"{rel}: SHA-256 differs from final.json (the file was changed or damaged)")
    problems += [f"{rel}: not listed in final.json (not written by this run)" for rel in _export_paths(run_dir) if rel not in listed]
    return len(listed), problems


def verify_main(args: list[str]) -> int:
    """``--verify RUN_DIR``: print what ``verify_run`` found; exit status 0 all intact, 1 damaged, 2 bad usage."""
    if len(args) != 1 or not os.path.isdir(args[0]):
        print(f"error: --verify needs one run folder{f', {args[0]} is not a folder' if len(args) == 1 else ''}", file=sys.stderr)
        return 2
    n, problems = verify_run(args[0])
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"ok: {n} exported files match final.json")
    return 0


def load_config_or_exit(argv=None, **kw):
    """``config.load_config``, with a bad option or config file reported once, plainly (no traceback)."""
    import yaml

    from .config import load_config

    try:
        return load_config(argv, **kw)
    except (ValueError, OSError, yaml.YAMLError) as e:
        fail(f"{e}")


def run_main(main) -> None:
    """Run a trainer's ``main``: a full disk, a run folder that became read-only and an unusable checkpoint end
    with one plain message."""
    from .checkpoints import disk_full_message, is_disk_full, is_unwritable, unwritable_message

    try:
        main()
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except Exception as e:
        if is_disk_full(e):
            print(f"error: {disk_full_message(getattr(e, 'filename', None) or 'the run folder', e)}", file=sys.stderr)
            raise SystemExit(1) from None
        if is_unwritable(e):
            print(f"error: {unwritable_message(getattr(e, 'filename', None) or 'the run folder', e)}", file=sys.stderr)
            raise SystemExit(1) from None
        raise
