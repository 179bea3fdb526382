"""One training run's session, shared by the rCM and QAD trainers: the run folder's lock, the choice between a fresh
start and a resume (with the options' resume policy), ``env.json``, ``metrics.jsonl``, the periodic and final
checkpoints and ``final.json`` (written last: its presence means the run and its exports are complete).

docs/training.md describes the run folder; ``run_folder`` holds its rules, ``checkpoints`` the checkpoint files.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import torch

from . import run_folder as RF
from .checkpoints import read_state
from .errors import user_error
from .guards import check_learned, param_checksum

__all__ = [
    "TrainState",
    "MetricsWriter",
    "RunSession",
    "env_snapshot",
    "merge_logs",
    "peak_memory_mb",
    "EXIT_AFTER_STEP_ENV",
    "DTYPES",
    "make_accelerator",
]

#: test aid: hard-exit (``os._exit(17)``) right after this iteration, as if killed (docs/training.md, testing aids)
EXIT_AFTER_STEP_ENV = "RCM_TEST_EXIT_AFTER_STEP"


class TrainState:
    """Counters saved with every checkpoint (JSON, ``checkpoints.Checkpointer``): the next iteration, the
    skipped optimizer steps, the spike guard's history and the student's initial weight fingerprint."""

    def __init__(self):
        self.step = 0  # next iteration to run
        self.skipped = 0
        self.skipped_steps = []
        self.guard = {}
        self.init_checksum = []  # runs.param_checksum of the student's trainable weights at step 0

    def state_dict(self):
        return {
            "step": self.step,
            "skipped": self.skipped,
            "skipped_steps": self.skipped_steps,
            "guard": self.guard,
            "init_checksum": self.init_checksum,
        }

    def load_state_dict(self, s):
        self.step, self.skipped, self.guard = int(s["step"]), int(s["skipped"]), dict(s["guard"])
        self.skipped_steps = [int(i) for i in s["skipped_steps"]]
        self.init_checksum = [float(v) for v in s["init_checksum"]]


class MetricsWriter:
    """Append-only ``metrics.jsonl``; on resume, lines at or after the resumed step are dropped, and so is a
    line that does not parse (the torn last line of a killed run), with a warning."""

    def __init__(self, path: str, resume_step: int, enabled: bool):
        self.path, self.enabled = path, enabled
        if enabled and os.path.exists(path):
            keep, torn = [], 0
            with open(path) as f:
                for ln in f:
                    if not ln.strip():
                        continue
                    try:
                        rec = json.loads(ln)
                    except ValueError:
                        torn += 1
                        continue
                    if rec.get("step", -1) < resume_step:
                        keep.append(ln if ln.endswith("\n") else ln + "\n")
            if torn:
                print(
                    f"warning: {path}: dropped {torn} unreadable line(s) (a write cut off by a kill)", file=sys.stderr
                )
            with open(path + ".tmp", "w") as f:
                f.writelines(keep)
            os.replace(path + ".tmp", path)

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def env_snapshot(path: str, cfg, extra: dict | None = None) -> dict:
    """Write ``env.json``: package versions, python, platform, git revision, config, seeds."""
    import importlib.metadata as md
    import platform

    vers = {}
    for pkg in (
        "torch",
        "diffusers",
        "transformers",
        "accelerate",
        "peft",
        "safetensors",
        "numpy",
        "triton",
        "rcm-diffusers",
    ):
        try:
            vers[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        rev = subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "-C", here, "status", "--porcelain"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
        )
    except Exception:  # noqa: BLE001 - no git is fine
        rev, dirty = "", None
    snap = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": sys.version,
        "platform": platform.platform(),
        "argv": sys.argv,
        "packages": vers,
        "git_revision": rev,
        "git_dirty": dirty,
        "cuda": torch.version.cuda,
        "config": cfg.model_dump(),
        **(extra or {}),
    }
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(snap, f, indent=1, default=str)
    os.replace(tmp, path)
    return snap


def merge_logs(parts: list[dict]) -> dict:
    """One iteration's logs from its micro-batches' (equal sizes): counts (``nan*``, ``scm_high``) are summed, other
    numbers averaged (so a per-sample mean such as ``loss_scm`` is the mean over the whole batch)."""
    if len(parts) == 1:
        return parts[0]
    out = {}
    for k in parts[0]:
        vals = [p[k] for p in parts if k in p]
        if k.startswith("nan") or k == "scm_high":
            out[k] = sum(vals)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[k] = vals[0] if all(v == vals[0] for v in vals) else sum(vals) / len(vals)
        else:
            out[k] = vals[-1]
    return out


def peak_memory_mb(device) -> float:
    """Peak memory of this process: CUDA's allocator peak on a GPU, else the resident-set high-water mark (Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB -> MiB


def write_json(path: str, obj) -> None:
    """``obj`` as JSON at ``path``, atomically (a temporary file renamed over it)."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def _missing_dirs(path: str) -> list[str]:
    """The folders ``os.makedirs(path)`` would create, deepest first."""
    out, p = [], os.path.abspath(path)
    while not os.path.exists(p):
        out.append(p)
        p = os.path.dirname(p)
    return out


def _remove_new(lock, dirs: list[str]) -> None:
    """Undo the run folder a refused start created: its lock file and the folders (only while they are empty)."""
    if lock is not None:
        try:
            os.remove(lock.path)
        except OSError:
            pass
        lock.release()
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:
            break


class RunSession:
    """The run folder of one trainer process. ``open`` takes the lock (main process), chooses fresh / resume /
    overwrite and reads the checkpoint's config for the resume policy; ``start`` loads the checkpoint into the
    ``Checkpointer``, writes ``env.json`` and opens ``metrics.jsonl``; ``end_of_step`` logs and saves periodic
    checkpoints; ``finish`` checks the replicas and the learned weights, saves the last checkpoint and, after the
    caller's exports, ``write_final`` writes ``final.json``."""

    def __init__(self, cfg, accelerator, name: str):
        from . import watchdog
        from .inputs import scan_data_values

        self.cfg, self.acc, self.name = cfg, accelerator, name
        self.main = accelerator.is_main_process
        watchdog.guard_launcher()  # (done by check_inputs already when the trainer was built the usual way)
        scan_data_values(cfg, accelerator)  # NaN / inf in the data: refused before the run folder is touched
        new_dirs = _missing_dirs(cfg.output_dir)
        self.lock = None
        try:
            self.lock = RF.RunLock(cfg.output_dir) if self.main else None  # held until the process exits
            self.ckpt = RF.broadcast_start(accelerator, RF.choose_start(cfg, accelerator.print) if self.main else None)
            self._resumed_from(self.ckpt)
        except SystemExit:  # refused: leave no folder (nor lock file) that this process created
            if self.main and new_dirs:
                _remove_new(self.lock, new_dirs)
            raise
        watchdog.watch_peers(accelerator)  # a peer rank on this machine gone: stop (docs/training.md)
        self.state = TrainState()
        self.metrics = None
        self.checkpointer = None
        self.exit_after = int(os.environ.get(EXIT_AFTER_STEP_ENV, "-1"))

    def _resumed_from(self, ckpt: str | None) -> None:
        """``saved`` and ``changed`` (the resume policy) of the checkpoint ``ckpt`` (``None``: a fresh start)."""
        cfg, world = self.cfg, self.acc.num_processes
        self.ckpt = ckpt
        self.saved = read_state(ckpt) if ckpt else None
        self.changed = RF.resume_changes(self.saved["config"], cfg, self.saved["train_state"]["step"]) if ckpt else {}
        if ckpt and self.saved.get("world_size") != world:
            self.changed["world_size"] = [self.saved.get("world_size"), world]  # the data shards change from here on

    def _matching_checkpoint(self, checkpointer) -> str | None:
        """The checkpoint chosen at ``__init__``, or the newest older one, that also fits the model built since
        (``Checkpointer.mismatch``: keys and shapes of the trainable weights, optimizer states and EMA). A misfit is
        damage: with ``--resume latest`` it is named, renamed ``*.damaged`` and the previous intact checkpoint is
        taken (none: refused, or a fresh start with ``--overwrite true``, as ``run_folder.choose_start``); with
        ``--resume PATH`` the run stops with one line. Decided by the main process."""
        from .checkpoints import find_resumable

        cfg, out, path = self.cfg, self.cfg.output_dir, self.ckpt
        if self.main:
            problem = checkpointer.mismatch(path)
            while problem:
                if cfg.resume != "latest":
                    user_error(f"--resume {cfg.resume}: {problem}")
                self.acc.print(f"warning: checkpoint {path} is damaged, skipped: {problem}")
                os.replace(path, path + ".damaged")
                path, damaged = find_resumable(out, checkpointer.mismatch)
                for p, why in damaged:
                    self.acc.print(f"warning: checkpoint {p} is damaged, skipped: {why}")
                    os.replace(p, p + ".damaged")
                if path is None:
                    if not cfg.overwrite:
                        user_error(
                            f"no intact checkpoint in {out} (each failed verification, see above); "
                            "--overwrite true starts again from scratch"
                        )
                    gone = RF.remove_run_files(out)
                    self.acc.print(
                        f"--overwrite: no intact checkpoint, starting fresh (removed {', '.join(gone) or 'nothing'})"
                    )
                    break
                self.acc.print(f"resuming from the newest intact checkpoint {path} (damaged ones renamed *.damaged)")
                problem = None
        path = RF.broadcast_start(self.acc, path if self.main else None)
        if path != self.ckpt:
            self._resumed_from(path)
        return path

    @property
    def fresh(self) -> bool:
        return self.ckpt is None

    def path(self, name: str) -> str:
        return os.path.join(self.cfg.output_dir, name)

    def start(
        self, checkpointer, student_params, env_extra: dict | None = None, keep_metrics_before: int | None = None
    ):
        """Load the checkpoint (if resuming), fingerprint the student's initial weights, write ``env.json``, open
        ``metrics.jsonl`` (lines from the resumed step on are dropped; ``keep_metrics_before`` for a fresh run keeps
        nothing by default) and start the tracker."""
        cfg, acc, state = self.cfg, self.acc, self.state
        self.checkpointer = checkpointer
        state.init_checksum = param_checksum(student_params)
        if self.ckpt:
            self._matching_checkpoint(checkpointer)
        if self.ckpt:
            checkpointer.load(self.ckpt, verify=False)  # verified by choose_start, matched just above
            acc.print(f"resumed from {self.ckpt} at iteration {state.step}")
            if self.changed:
                acc.print(
                    "settings changed on resume, applied from iteration {}: {}".format(
                        state.step, ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in self.changed.items())
                    )
                )
            if state.step < cfg.max_steps and self.main and os.path.exists(self.path("final.json")):
                os.remove(self.path("final.json"))  # unfinished again until its exports are rewritten
        if self.main:
            env_path = self.path("env.json")
            session = {
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "argv": sys.argv,
                "resumed_from": self.ckpt,
                "start_step": state.step,
                "changed_on_resume": self.changed,
                "world_size": acc.num_processes,
            }
            env_snapshot(
                env_path,
                cfg,
                {
                    "world_size": acc.num_processes,
                    "resumed_from": self.ckpt,
                    "seed": cfg.seed,
                    "device": str(acc.device),
                    "changed_on_resume": self.changed,
                    **(env_extra or {}),
                    "sessions": RF.env_sessions(env_path, session, self.ckpt is None),
                },
            )
        if self.metrics is None:
            self.open_metrics(
                state.step if self.ckpt else (keep_metrics_before if keep_metrics_before is not None else 0)
            )
        if cfg.report_to != "none":
            acc.init_trackers(self.name, config={k: str(v) for k, v in cfg.model_dump().items()})

    def open_metrics(self, resume_step: int):
        """``metrics.jsonl`` (and ``spikes.jsonl``, trimmed alike) keeping the lines before ``resume_step``."""
        self.metrics = MetricsWriter(self.path("metrics.jsonl"), resume_step, self.main)
        MetricsWriter(self.path("spikes.jsonl"), resume_step, self.main)
        return self.metrics

    def progress(self, desc: str):
        from tqdm.auto import tqdm

        cfg = self.cfg
        return tqdm(
            range(self.state.step, cfg.max_steps),
            initial=self.state.step,
            total=cfg.max_steps,
            disable=not (cfg.progress and self.acc.is_local_main_process),
            desc=desc,
        )

    def end_of_step(self, i: int, record: dict) -> None:
        """After iteration ``i``: ``metrics.jsonl`` (every ``log_every`` and the last), the tracker, the periodic
        checkpoint at ``step = i + 1``."""
        cfg = self.cfg
        self.state.step = i + 1
        if i % cfg.log_every == 0 or i == cfg.max_steps - 1:
            self.metrics.write(record)
            if cfg.report_to != "none":
                self.acc.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=i)
        step = i + 1
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.max_steps:
            self.checkpointer.save(cfg.output_dir, step, cfg.model_dump(), cfg.checkpoints_total_limit)

    def exit_if_asked(self, i: int) -> None:
        """Test aid (``RCM_TEST_EXIT_AFTER_STEP``): hard-exit right after iteration ``i``, as if killed."""
        if self.exit_after == i:
            self.acc.print(f"exit_after_step {i}: hard exit")
            sys.stdout.flush()
            os._exit(17)

    def spike(self, record: dict) -> None:
        if self.main:
            with open(self.path("spikes.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")

    def finish(self, student_params) -> list[float]:
        """Replicas must agree (a drift is a bug worth stopping for), the student must have learned something; then
        the last checkpoint. Returns the per-rank checksums for ``final.json``."""
        params = list(student_params.values()) if isinstance(student_params, dict) else list(student_params)
        with torch.no_grad():
            checksum = torch.stack([p.double().sum() for p in params]).sum()
        sums = self.acc.gather(checksum.reshape(1).to(self.acc.device)).tolist()
        if len(set(sums)) != 1:
            raise RuntimeError(f"student weights differ across ranks: {sums}")
        check_learned(student_params, self.state.init_checksum, self.state, self.cfg)
        self.checkpointer.save(
            self.cfg.output_dir, self.state.step, self.cfg.model_dump(), self.cfg.checkpoints_total_limit
        )
        return sums

    def write_final(self, sums: list[float], extra: dict | None = None) -> None:
        """``final.json`` (main process): steps, skipped steps, per-rank checksums, ``extra``, and every exported file
        with its size and SHA-256 (``--verify`` checks them); then wait for every process and end the trackers."""
        from . import watchdog

        watchdog.stop_watching_peers()  # the last checkpoint is written; peers may exit once past the barrier below
        if self.main:
            s = self.state
            final = {
                "step": s.step,
                "skipped": s.skipped,
                "skipped_steps": s.skipped_steps,
                "skipped_fraction": s.skipped / max(1, s.step),
                "student_checksum_per_rank": sums,
                **(extra or {}),
            }
            final["files"] = RF.export_files(self.cfg.output_dir)
            final["run_entries"] = RF.run_entries(self.cfg.output_dir)  # logs, checkpoints: --verify accepts them
            write_json(self.path("final.json"), final)
        self.acc.wait_for_everyone()
        self.acc.end_training()


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_accelerator(cfg, **extra):
    """The ``Accelerator`` of a trainer: gloo on CPU processes when there is no GPU, accumulation and trackers from
    the config, and the LR schedule stepped once per iteration (accelerate would step a prepared scheduler once per
    process per call, so P processes would run the warm-up P times faster)."""
    from accelerate import Accelerator

    return Accelerator(
        cpu=not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1,
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        log_with=None if cfg.report_to == "none" else cfg.report_to,
        project_dir=cfg.output_dir,
        step_scheduler_with_optimizer=False,
        **extra,
    )
