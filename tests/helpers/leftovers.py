"""Names of temporaries as a process that is gone (or one on another host) left them."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from lightning_smartinf.core.io.leftovers import temporary_path


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def left_over(target: Path, purpose: str = "tmp", *, pid: int | None = None, host: str | None = None) -> Path:
    """The name :func:`temporary_path` gives a temporary of ``target`` made by process ``pid`` (default: one that is
    gone) on ``host`` (default: this one). Nothing is created."""
    mine = temporary_path(target, purpose)
    name = mine.name.replace(
        f"-{socket.gethostname()}-{os.getpid()}-", f"-{host or socket.gethostname()}-{pid or dead_pid()}-"
    )
    return mine.with_name(name)
