"""How the trainers end on bad input and on faults: one ``error:`` line, no traceback (docs/training.md, "Errors").

Exit status 2: bad input, refused before the run folder is touched or anything is trained (options, teacher
folder, datasets, context-parallel settings, the run folder's state, a checkpoint to resume that cannot be used);
on several processes the line is printed once, by rank 0 (every rank reaches the same verdict). Exit status 1: a
fault during a run (disk full, run folder made read-only, a run that diverges or learns nothing, the launcher or a
peer process gone).
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["fail", "user_error", "UserError", "load_config_or_exit", "run_main", "EXIT_BAD_INPUT", "EXIT_FAULT"]

EXIT_BAD_INPUT = 2
EXIT_FAULT = 1
#: seconds a rank other than 0 waits, on bad input, for the launcher to stop it after rank 0 reported the problem
PEER_WAIT_S = 10.0


class UserError(SystemExit):
    """Bad input: exit status 2; ``str()`` is the ``error:`` line (printed once by ``user_error``)."""

    def __init__(self, msg: str):
        super().__init__(EXIT_BAD_INPUT)
        self.msg = msg

    def __str__(self):
        return f"error: {self.msg}"


def fail(msg: str):
    """Stop the run on a fault during it: ``msg`` on stderr, no traceback, exit status 1."""
    raise SystemExit(f"error: {msg}")


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def user_error(msg: str):
    """Stop on bad input: ``msg`` on stderr as one line, no traceback, exit status 2 (``UserError``).

    Under a launcher every process checks the same inputs and reaches the same verdict; rank 0 prints it and exits,
    and the launcher then stops the others. A rank other than 0 waits up to ``PEER_WAIT_S`` for that before it prints
    the line itself (so the line is never lost when only that rank saw the problem)."""
    if _rank() != 0 and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        time.sleep(PEER_WAIT_S)
    print(f"error: {msg}", file=sys.stderr, flush=True)
    raise UserError(msg)


def load_config_or_exit(argv=None, **kw):
    """``config.load_config``, with a bad option or config file reported once, plainly (no traceback, exit status 2)."""
    import yaml

    from .config import load_config

    try:
        return load_config(argv, **kw)
    except (ValueError, OSError, yaml.YAMLError) as e:
        user_error(f"{e}")


def run_main(main) -> None:
    """Run a trainer's ``main``: a full disk, a run folder that became read-only and an unusable checkpoint end
    with one plain message."""
    from .checkpoints import CheckpointError, disk_full_message, is_disk_full, is_unwritable, unwritable_message

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
