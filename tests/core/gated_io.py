"""A real I/O engine whose reads and writes tests hold back, to look at a device at a chosen moment."""

from __future__ import annotations

import threading

import torch

from lightning_smartinf.core.io.direct import StateFile, ThreadedIO
from lightning_smartinf.core.rules import Adam, StepParams

CHUNK = 1024
RULE = Adam(decoupled_weight_decay=True)
HP = StepParams(step=1, lr=1e-2, weight_decay=0.1)
TIMEOUT_S = 30.0


class GatedIO(ThreadedIO):
    """Real ``pread``/``pwrite``; reads wait for ``reads_open`` and writes for ``writes_open``."""

    def __init__(self) -> None:
        super().__init__(block_size=4096, queue_depth=2)
        self.reads_open = threading.Event()
        self.writes_open = threading.Event()
        self.reads_open.set()
        self.writes_open.set()

    def read(self, file: StateFile, buf: torch.Tensor, offset: int) -> None:
        assert self.reads_open.wait(TIMEOUT_S), "test gate never opened"
        super().read(file, buf, offset)

    def write(self, file: StateFile, buf: torch.Tensor, offset: int) -> None:
        assert self.writes_open.wait(TIMEOUT_S), "test gate never opened"
        super().write(file, buf, offset)
