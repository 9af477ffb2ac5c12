"""Launched by ``torch.distributed.run`` from tests/test_checkpoint.py: on 2 CPU ranks, train TOTAL steps with
checkpoints every EVERY steps, then resume from the step-EVERY checkpoint onto other storage paths and train to
TOTAL again. Rank 0 saves both results (``full.pt``, ``resumed.pt``) for the test to compare bit for bit."""

import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import CaptureParams, LMModule, token_loader  # noqa: E402
from scripts.ckpt_common import EVERY, SUB_GROUP, TOTAL, adamw_cosine  # noqa: E402

from lightning_smartinf import SmartInfinityStrategy  # noqa: E402


def run(root: Path, storage: list[Path], ckpt_path: Path | None) -> dict[str, torch.Tensor]:
    for path in storage:
        path.mkdir(parents=True, exist_ok=True)
    capture = CaptureParams()
    callbacks = [capture]
    if ckpt_path is None:
        callbacks.append(
            ModelCheckpoint(dirpath=root / "ckpts", filename="{step}", every_n_train_steps=EVERY, save_top_k=-1)
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SmartInfinityStrategy(
            storage_paths=[str(p) for p in storage], sub_group_size=SUB_GROUP, io_engine="threads"
        ),
        precision="32-true",
        max_steps=TOTAL,
        logger=False,
        enable_checkpointing=ckpt_path is None,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        callbacks=callbacks,
        use_distributed_sampler=False,
    )
    # Each rank sees EVERY batches of 2 per epoch, so checkpoints sit on epoch boundaries.
    dataset = token_loader(EVERY).dataset
    sampler = DistributedSampler(dataset, num_replicas=2, rank=int(os.environ["RANK"]), shuffle=False)
    trainer.fit(LMModule(adamw_cosine), DataLoader(dataset, batch_size=2, sampler=sampler), ckpt_path=ckpt_path)
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
