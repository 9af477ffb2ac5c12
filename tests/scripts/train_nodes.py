"""Launched by ``torch.distributed.run`` from tests/test_multinode.py, once per node:
``train_nodes.py SHARED STORAGE NODES DEVICES TAG MODE``.

``SHARED`` is the folder every node sees (checkpoints, results), as on a shared filesystem; ``STORAGE`` is this
node's own storage root, under which its ``storage_paths`` are made up (not created here: the strategy creates
them). Trains ``Trainer(num_nodes=NODES, devices=DEVICES)`` for TOTAL steps with a checkpoint every EVERY steps in
``SHARED/ckpts_TAG``; MODE ``resume`` then resumes from the step-EVERY checkpoint onto other storage paths (two per
rank) and trains to TOTAL again. Global rank 0 saves the parameters (``TAG_full.pt``, ``TAG_resumed.pt``); every
rank reports where its device state went (``TAG_rank<global rank>.json``).
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.models import CaptureParams  # noqa: E402
from scripts.ckpt_common import EVERY, fit_sharded  # noqa: E402


def run(
    shared: Path, tag: str, storage: list[Path], nodes: int, devices: int, ckpt_path: Path | None
) -> tuple[dict[str, torch.Tensor], dict]:
    capture = CaptureParams()
    callbacks: list[L.Callback] = [capture]
    if ckpt_path is None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=shared / f"ckpts_{tag}", filename="{step}", every_n_train_steps=EVERY, save_top_k=-1
            )
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainer = fit_sharded(
        storage,
        rank=rank,
        world_size=world_size,
        callbacks=callbacks,
        ckpt_path=ckpt_path,
        num_nodes=nodes,
        devices=devices,
    )
    strategy = trainer.strategy
    backend = trainer.strategy.smart_update.backend
    report = {
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "node_rank": trainer.node_rank,
        "world_size": trainer.world_size,
        "storage_paths": [str(p) for p in strategy.settings.storage_paths],
        "rank_storage_paths": [str(p) for p in strategy.rank_storage_paths()],
        "device_dirs": sorted({str(s.file.path.parent) for s in backend.shards}),
        "files": [str(s.file.path) for s in backend.shards],
    }
    return capture.params, report


def main(shared: Path, storage_root: Path, nodes: int, devices: int, tag: str, mode: str) -> None:
    full, report = run(shared, tag, [storage_root / f"ssd_a{i}" for i in range(devices)], nodes, devices, None)
    reports = {"full": report}
    if mode == "resume":
        storage = [storage_root / f"ssd_b{i}" for i in range(2 * devices)]
        resumed, reports["resumed"] = run(
            shared, tag, storage, nodes, devices, shared / f"ckpts_{tag}" / f"step={EVERY}.ckpt"
        )
    rank = int(os.environ["RANK"])
    (shared / f"{tag}_rank{rank}.json").write_text(json.dumps(reports))
    if rank == 0:
        torch.save(full, shared / f"{tag}_full.pt")
        if mode == "resume":
            torch.save(resumed, shared / f"{tag}_resumed.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
