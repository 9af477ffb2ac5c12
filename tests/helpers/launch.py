"""Running the project in processes of its own, as users start it: a script, ``torchrun``, Lightning's launcher.

Each process gets the environment of this one without its rendezvous (a fit run here puts ``MASTER_PORT`` and the
ranks into ``os.environ``), with the repository and ``tests/`` on its path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
SCRIPTS = TESTS / "scripts"
#: What a fit in this process leaves in ``os.environ`` that a new process group must not inherit (torchrun's own
#: ``TORCHELASTIC_*`` variables neither).
RENDEZVOUS = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK"}


def worker_env(**extra: str) -> dict[str, str]:
    """This process's environment without its rendezvous, the repository and ``tests/`` first on the path."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS and not k.startswith("TORCHELASTIC_")}
    path = os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")])
    return {**env, "PYTHONPATH": path, **extra}


def run(
    command: Sequence[str], *, timeout: float = 600, env: dict[str, str] | None = None, check: bool = True, **kwargs
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` (its output captured as text); with ``check``, fail the test with the end of its output."""
    done = subprocess.run(
        list(command), env=env or worker_env(), capture_output=True, text=True, timeout=timeout, **kwargs
    )
    if check:
        assert done.returncode == 0, f"{' '.join(map(str, command))}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def python(*args: str | Path, **kwargs) -> subprocess.CompletedProcess[str]:
    """``python ARGS...`` in a process of its own (see :func:`run`)."""
    return run([sys.executable, *map(str, args)], **kwargs)


def torchrun(
    script: str | Path, *args: str | Path, port: int, ranks: int = 2, **kwargs
) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc_per_node=RANKS SCRIPT ARGS...`` on ``port`` (see :func:`run`)."""
    launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={port}"]
    return python(*launcher, script, *args, **kwargs)
