"""How the trainers end on bad input and on faults of the disk: one ``error:`` line, no traceback.

Exit status 2 for bad input (config, data, teacher folder), 1 for faults during a run (docs/training.md).
"""

from __future__ import annotations

import sys

__all__ = ['fail', 'user_error', 'load_config_or_exit', 'run_main']


def fail(msg: str):
    """Stop the run with ``msg`` on stderr, no traceback, exit status 1."""
    raise SystemExit(f"error: {msg}")


def user_error(msg: str):
    """Stop on bad input (data, teacher folder): ``msg`` on stderr as one line, no traceback, exit status 2."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


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
