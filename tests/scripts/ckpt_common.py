"""Training set-up shared by tests/test_checkpoint.py and the processes it launches (crash_worker.py).

Epochs are ``EVERY`` batches long and checkpoints are saved every ``EVERY`` steps, so every checkpoint sits on
an epoch boundary (Lightning restarts an interrupted map-style epoch from its first batch). Device I/O uses the
thread-pool engine: checkpoints do not depend on it, and it spares each process DeepSpeed's JIT op load.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.models import CaptureParams, LMModule, adamw_factory, token_loader  # noqa: E402

from lightning_smartinf import SmartInfinityStrategy  # noqa: E402
from lightning_smartinf.commands.export import is_complete  # noqa: E402

TOTAL = 12
EVERY = 4
SUB_GROUP = 3000


adamw_cosine = adamw_factory(cosine_steps=TOTAL)


def train(
    root: Path,
    *,
    storage: Sequence[Path] | None = None,
    ckpt_path: Path | None = None,
    steps: int = TOTAL,
    every: int | None = EVERY,
    checkpointing: str = "all",
    precision: str = "32-true",
    callbacks: Sequence[L.Callback] = (),
    checkpoint_callback: ModelCheckpoint | None = None,
    trainers: list[L.Trainer] | None = None,
    strategy_kwargs: dict[str, Any] | None = None,
    num_workers: int = 0,
    **trainer_kwargs: Any,
) -> dict[str, torch.Tensor]:
    """Train (or resume) to ``steps``, checkpointing into ``<root>/ckpts``; return the gathered params.

    ``num_workers``: the DataLoader's worker processes, forked at each epoch's start (the same batches either way).

    ``checkpointing="all"``: ``step=N.ckpt`` every ``every`` steps, all kept. ``"last"``: what users write,
    ``ModelCheckpoint(save_last=True, every_n_train_steps=every)`` with its defaults (the newest
    ``epoch=E-step=N.ckpt`` kept, the one before deleted, ``last.ckpt`` overwritten at every save). Not
    ``every_n_epochs``: Lightning 2.6 replays one batch when it resumes from a checkpoint saved in
    ``on_train_epoch_end`` (plain CPU training too), so no resume from one can equal an uninterrupted run.
    """
    root = Path(root)
    if storage is None:
        storage = [root / "ssd"]
    for path in storage:
        Path(path).mkdir(parents=True, exist_ok=True)
    capture = CaptureParams()
    checkpoints = []
    if checkpoint_callback is not None:
        checkpoints.append(checkpoint_callback)
    elif every and checkpointing == "last":
        checkpoints.append(ModelCheckpoint(dirpath=root / "ckpts", save_last=True, every_n_train_steps=every))
    elif every:
        checkpoints.append(
            ModelCheckpoint(dirpath=root / "ckpts", filename="{step}", every_n_train_steps=every, save_top_k=-1)
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=SmartInfinityStrategy(
            **{
                "storage_paths": list(storage),
                "sub_group_size": SUB_GROUP,
                "io_engine": "threads",
                **(strategy_kwargs or {}),
            }
        ),
        precision=precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=bool(checkpoints),
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        use_distributed_sampler=False,
        callbacks=[capture, *callbacks, *checkpoints],
        **trainer_kwargs,
    )
    if trainers is not None:
        trainers.append(trainer)
    loader = token_loader(EVERY)
    if num_workers:
        loader = DataLoader(loader.dataset, batch_size=loader.batch_size, num_workers=num_workers)
    trainer.fit(LMModule(adamw_cosine), loader, ckpt_path=str(ckpt_path) if ckpt_path else None)
    return capture.params


def fit_sharded(
    storage: Sequence[Path],
    *,
    rank: int,
    world_size: int,
    callbacks: Sequence[L.Callback],
    ckpt_path: Path | None = None,
    strategy_kwargs: dict[str, Any] | None = None,
    model_kwargs: dict[str, Any] | None = None,
    precision: str = "32-true",
    max_steps: int = TOTAL,
    **trainer_kwargs: Any,
) -> L.Trainer:
    """Train (or resume) TOTAL steps as rank ``rank`` of a multi-rank run (launched by torchrun or by Lightning).

    Data is sharded by global rank: each rank sees EVERY batches of ``4 // world_size`` per epoch (global batch 4,
    the same samples whatever the number of ranks), so checkpoints every EVERY steps sit on epoch boundaries.
    ``trainer_kwargs`` (``devices``, ``num_nodes``) go to the Trainer.
    """
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=SmartInfinityStrategy(
            **{
                "storage_paths": [str(p) for p in storage],
                "sub_group_size": SUB_GROUP,
                "io_engine": "threads",
                **(strategy_kwargs or {}),
            }
        ),  # fmt: skip
        precision=precision,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        callbacks=list(callbacks),
        use_distributed_sampler=False,
        **trainer_kwargs,
    )
    dataset = token_loader(EVERY).dataset
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    module = LMModule(adamw_cosine, **(model_kwargs or {}))
    trainer.fit(module, DataLoader(dataset, batch_size=4 // world_size, sampler=sampler), ckpt_path=ckpt_path)
    return trainer


def checkpoint_step(path: Path) -> int:
    """The global step a checkpoint was saved at, from its seal (-1 if it has none)."""
    try:
        return int(json.loads((path / "checkpoint" / "smartinf" / "seal.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError):
        return -1


def newest_complete(ckpt_dir: Path) -> Path | None:
    """The sealed checkpoint with the highest step (``last.ckpt`` first among equals), or None."""
    if not ckpt_dir.is_dir():
        return None
    done = [p for p in sorted(ckpt_dir.iterdir()) if p.name.endswith(".ckpt") and is_complete(p)]
    return max(done, key=lambda p: (checkpoint_step(p), p.name == "last.ckpt"), default=None)
