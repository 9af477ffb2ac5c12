"""Launched by ``torch.distributed.run`` from tests/test_checkpoint.py: on 2 CPU ranks, train TOTAL steps with
checkpoints every EVERY steps, then resume from the step-EVERY checkpoint onto other storage paths and train to
TOTAL again. Rank 0 saves both results (``full.pt``, ``resumed.pt``) for the test to compare bit for bit."""

import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.models import CaptureParams  # noqa: E402
from scripts.ckpt_common import EVERY, fit_sharded  # noqa: E402


def run(root: Path, storage: list[Path], ckpt_path: Path | None) -> dict[str, torch.Tensor]:
    for path in storage:
        path.mkdir(parents=True, exist_ok=True)
    capture = CaptureParams()
    callbacks: list[L.Callback] = [capture]
    if ckpt_path is None:
        callbacks.append(
            ModelCheckpoint(dirpath=root / "ckpts", filename="{step}", every_n_train_steps=EVERY, save_top_k=-1)
        )
    rank = int(os.environ["RANK"])
    fit_sharded(storage, rank=rank, world_size=2, callbacks=callbacks, ckpt_path=ckpt_path, devices=2)
    return capture.params


def main(root: Path) -> None:
    full = run(root, [root / "ssd_a0", root / "ssd_a1"], None)
    # Resume onto other paths, two per rank (a different number of devices per rank, too).
    resumed = run(root, [root / f"ssd_b{i}" for i in range(4)], root / "ckpts" / f"step={EVERY}.ckpt")
    if int(os.environ["RANK"]) == 0:
        torch.save(full, root / "full.pt")
        torch.save(resumed, root / "resumed.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
