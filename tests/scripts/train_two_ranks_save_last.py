"""Run as a plain script (``python train_two_ranks_save_last.py ROOT MODE``): Lightning itself launches the second
rank (``Trainer(devices=2)`` on CPU re-runs this script), and checkpoints go where users put them,
``ModelCheckpoint(save_last=True, every_n_train_steps=EVERY)`` into one folder.

Modes: ``full`` trains TOTAL steps and rank 0 saves the parameters to ``full.pt``; ``crash`` trains into
``ROOT/ckpts`` and raises as step ``2 * EVERY + 1`` starts (after ``last.ckpt`` was saved over once); ``resume``
resumes from ``ROOT/ckpts/last.ckpt`` to TOTAL and rank 0 saves ``resumed.pt``. A third argument, JSON, holds more
``SmartInfinityStrategy`` arguments (``'{"state_memory_budget": 100000}'``), and under ``"model"`` the model's
(``'{"model": {"dim": 512}}'``), and under ``"precision"`` the Trainer's.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.models import CaptureParams, streaming_backend  # noqa: E402
from scripts.ckpt_common import EVERY, fit_sharded  # noqa: E402


class CrashAt(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 2 * EVERY:
            raise SystemExit(3)  # every rank at the same step, as a crash of the job would


def main(root: Path, mode: str, strategy_kwargs: dict) -> None:
    model_kwargs = strategy_kwargs.pop("model", {})
    precision = strategy_kwargs.pop("precision", "32-true")
    storage = [root / f"ssd_{mode}{i}" for i in range(2)]
    for path in storage:
        path.mkdir(parents=True, exist_ok=True)
    capture = CaptureParams()
    callbacks: list[L.Callback] = [capture]
    if mode != "full":
        callbacks.append(ModelCheckpoint(dirpath=root / "ckpts", save_last=True, every_n_train_steps=EVERY))
    if mode == "crash":
        callbacks.append(CrashAt())
    ckpt_path = root / "ckpts" / "last.ckpt" if mode == "resume" else None
    rank = int(os.environ.get("LOCAL_RANK", 0))  # Lightning sets it in the rank it launches
    trainer = fit_sharded(
        storage,
        rank=rank,
        world_size=2,
        callbacks=callbacks,
        ckpt_path=ckpt_path,
        strategy_kwargs=strategy_kwargs,
        model_kwargs=model_kwargs,
        precision=precision,
        devices=2,
    )
    if strategy_kwargs.get("state_memory_budget"):
        shards = streaming_backend(trainer).shards
        assert any(s.file.in_memory for s in shards), f"rank {trainer.global_rank} kept no state in memory"
    if trainer.global_rank == 0 and mode != "crash":
        torch.save(capture.params, root / f"{mode if mode == 'full' else 'resumed'}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
