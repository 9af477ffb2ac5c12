"""Where a training step's time goes, on the training thread: cumulative wall-clock seconds per named phase.

A training loop times its phases with :meth:`PhaseClocks.phase` (the strategy: ``forward``, ``backward`` and what
its optimizer step does after them, ``after_backward``) and a monitor logs each step's difference. Host time: on an
accelerator, work the host only queued is counted where the host waits for it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PhaseClocks"]


class PhaseClocks:
    """Cumulative seconds per phase name; phases may nest (each counts its own wall time)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        """Count ``seconds`` more in phase ``name``."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def total(self, *names: str) -> float:
        """Seconds counted so far in ``names`` together."""
        return sum(self.seconds.get(name, 0.0) for name in names)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the time inside this block in phase ``name`` (also when it raises)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)
