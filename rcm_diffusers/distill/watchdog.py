"""Trainer processes that stop with their launcher and with their peers (docs/training.md, "Stopping a run").

torchrun's elastic agent (what ``accelerate launch`` runs for several processes) starts every worker in a session of
its own (``start_new_session=True`` in ``torch.distributed.elastic``'s ``SubprocessHandler``) so that it can signal
each worker's process group. The other side of that: a SIGKILL of the launcher, or of the launcher's process group,
reaches no worker, and the workers train on, write checkpoints and hold the run folder's lock with nobody watching
them. torch has no launcher option that ties a worker's life to the agent's (``--monitor-interval`` watches the
workers from the agent's side only), so the worker ties itself:

- Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, called on the worker itself through ``ctypes`` (the launcher's
  ``Popen`` is not ours to change): the kernel kills the worker the moment its launcher exits, however it exits;
- everywhere, and for the moment before that call: a daemon thread that polls the parent pid (a process whose
  parent exits is re-parented, so ``os.getppid()`` changes) and, once the process group exists, the pids of the
  peer ranks on the same machine (``watch_peers``). A rank whose launcher or peer is gone exits at once with status 1;
- ``check()``, called before a checkpoint is written and again before it is renamed into place, so no checkpoint
  appears after the launcher or a peer is gone, whatever the poll interval.

Only a process started by torchrun's agent (``TORCHELASTIC_RUN_ID`` in its environment) is tied: a trainer started
directly (``python training/rcm.py`` under ``nohup``, or from Python) keeps running when its shell goes away.
Peers on other machines are not watched (their pids mean nothing here); the collectives' own timeouts cover them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

__all__ = ["guard_launcher", "watch_peers", "stop_watching_peers", "check", "armed", "POLL_S"]

POLL_S = 0.2  #: seconds between two looks of the watchdog thread
_PR_SET_PDEATHSIG = 1

_state = {"parent": None, "peers": {}, "thread": None, "rank": None}
_lock = threading.Lock()


def armed() -> bool:
    """``True`` once ``guard_launcher`` tied this process to its launcher."""
    return _state["parent"] is not None


def _launched_by_agent() -> bool:
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def _start_time(pid: int) -> str | None:
    """The start time of ``pid`` from ``/proc/<pid>/stat`` (Linux), to tell a reused pid from the peer; ``None``
    where there is no ``/proc`` or the process is a zombie (exited, not yet reaped) or gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw.rsplit(")", 1)[-1].split()  # after "(comm)": state is field 3, starttime field 22 of the whole line
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19] if len(fields) > 19 else ""


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if os.path.isdir("/proc"):
        now = _start_time(pid)
        return now is not None and (started is None or now == started)
    return True


def _gone() -> str | None:
    """Why this process must stop (its launcher or a peer is gone), or ``None``."""
    parent = _state["parent"]
    if parent is not None and os.getppid() != parent:
        return f"its launcher (pid {parent}) is gone"
    for rank, (pid, started) in list(_state["peers"].items()):
        if not _alive(pid, started):
            return f"process rank {rank} (pid {pid}) is gone"
    return None


def _stop(why: str) -> None:
    rank = _state["rank"]
    try:
        os.write(
            2,
            f"error: {why}; stopping {'rank ' + str(rank) if rank is not None else 'this process'} "
            f"(pid {os.getpid()}) without writing anything further\n".encode(),
        )
    except OSError:  # the launcher held the other end of stderr
        pass
    os._exit(1)


def check() -> None:
    """Stop now (exit status 1) if the launcher or a watched peer is gone; a no-op in a process that is not tied."""
    if armed():
        why = _gone()
        if why:
            _stop(why)


def _loop() -> None:
    while True:
        time.sleep(POLL_S)
        why = _gone()
        if why:
            _stop(why)


def _set_parent_death_signal() -> bool:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux (libc through ctypes); ``False`` where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def guard_launcher() -> bool:
    """Tie this process to its launcher (only under torchrun's agent; idempotent): the parent-death signal and the
    watchdog thread. Returns whether the process is tied. Called first thing by the trainers (``inputs.check_inputs``):
    a launcher that dies before this call (while Python starts) is not noticed."""
    if not _launched_by_agent():
        return False
    with _lock:
        if armed():
            return True
        parent = os.getppid()
        _state["rank"] = os.environ.get("RANK")
        _state["parent"] = parent  # (a launcher that is pid 1 itself, in a container, is a parent like any other)
        _set_parent_death_signal()
        if os.getppid() != parent:  # it died between the look above and the prctl call
            _stop(f"its launcher (pid {parent}) is gone")
        _state["thread"] = threading.Thread(target=_loop, name="rcm-launcher-watchdog", daemon=True)
        _state["thread"].start()
    return True


def watch_peers(accelerator) -> None:
    """Also stop when a peer rank on this machine is gone (every process calls this: it gathers the pids). The peers
    on this machine are the workers of the same agent (the same ``GROUP_RANK``): their pids are in this pid
    namespace, whatever the host names say."""
    if not armed() or accelerator.num_processes == 1:
        return
    from accelerate.utils import gather_object

    me = (os.environ.get("GROUP_RANK", ""), os.getpid(), _start_time(os.getpid()))
    everyone = gather_object([me])
    _state["rank"] = accelerator.process_index
    _state["peers"] = {
        r: (pid, started) for r, (group, pid, started) in enumerate(everyone) if group == me[0] and pid != me[1]
    }


def stop_watching_peers() -> None:
    """The run's last collective is next: peers that finish first may exit from here on (the launcher stays watched)."""
    _state["peers"] = {}
