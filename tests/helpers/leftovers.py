"""Names of temporaries as a process that is gone (or one on another host) left them."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from lightning_smartinf.core.io.leftovers import _start_ticks, temporary_path


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def left_over(
    target: Path, purpose: str = "tmp", *, pid: int | None = None, host: str | None = None, start: int | None = None
) -> Path:
    """The name :func:`temporary_path` gives a temporary of ``target`` made by process ``pid`` (default: one that is
    gone) started at tick ``start`` (default: that process's own; 0 for one that is gone) on ``host`` (default: this
    one). Nothing is created."""
    pid = pid or dead_pid()
    start = start if start is not None else (_start_ticks(pid) or 0)
    mine = temporary_path(target, purpose)
    return mine.with_name(
        mine.name.replace(
            f"-{socket.gethostname()}-{os.getpid()}.{_start_ticks(os.getpid())}-",
            f"-{host or socket.gethostname()}-{pid}.{start}-",
        )
    )
