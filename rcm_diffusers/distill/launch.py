"""Starting trainers on CPU processes (gloo) and reading back how many processes trained a run."""

from __future__ import annotations

import json
import os
import socket
import sys

__all__ = ["free_port", "cpu_launch_command", "trained_processes"]


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
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *mode,
        "--num_processes",
        str(processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        script,
        *args,
    ]


def trained_processes(output_dir: str) -> int | None:
    """How many processes trained the finished run in ``output_dir`` (one checksum per rank in its ``final.json``);
    ``None`` without a ``final.json``."""
    path = os.path.join(output_dir, "final.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return len(json.load(f).get("student_checksum_per_rank") or [0])
