"""Print the path of one dense gradient through the package: every file and function of ``lightning_smartinf`` that
runs from ``training_step`` to the device and back, on every thread, during one training step on the ``cpu`` backend.

    PYTHONPATH=. .venv/bin/python scripts/gradient_path.py

The step traced is the third (the first two build the pools and warm the prefetch); ``docs/architecture.md`` shows
the files this prints.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_smartinf import SmartInfinityStrategy

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_smartinf"
TRACED_STEP = 2


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return nn.functional.mse_loss(self.net(x), x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Trace(L.Callback):
    """Records the package's calls, on every thread, from the start of one batch to its end.

    The profiler is installed for the whole run (threads started later, the devices' included, inherit it) and
    records only while :attr:`active`.
    """

    def __init__(self) -> None:
        self.calls: dict[str, set[str]] = defaultdict(set)
        self.active = False

    def profile(self, frame, event, arg):  # noqa: ANN001, ANN201 - the profiler's signature
        if self.active and event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(PACKAGE):
                self.calls[str(path.relative_to(PACKAGE))].add(frame.f_code.co_qualname)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.active = batch_idx == TRACED_STEP

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if batch_idx == TRACED_STEP:
            trainer.strategy.smart_update.backend.wait()  # the write-back that trails the step
            self.active = False


def main() -> int:
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 64)), batch_size=8)
    trace = Trace()
    threading.setprofile(trace.profile)
    sys.setprofile(trace.profile)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            strategy=SmartInfinityStrategy(storage_paths=[os.path.join(root, "nvme0")]),
            accelerator="cpu",
            devices=1,
            max_steps=TRACED_STEP + 1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[trace],
        )
        trainer.fit(Tiny(), data)
    sys.setprofile(None)
    threading.setprofile(None)
    functions = sum(len(names) for names in trace.calls.values())
    print(f"{len(trace.calls)} files, {functions} functions of lightning_smartinf in one training step:")
    for path in sorted(trace.calls):
        print(f"  {path} ({len(trace.calls[path])}): {', '.join(sorted(trace.calls[path]))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
