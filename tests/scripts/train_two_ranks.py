"""Launched by ``torch.distributed.run`` from tests/test_multirank.py: trains on 2 CPU ranks and saves results."""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.models import CaptureParams, LMModule, adamw_factory, token_loader  # noqa: E402

from lightning_smartinf import SmartInfinityStrategy  # noqa: E402

adamw = adamw_factory(cosine_steps=8)


def backend_numels(trainer: L.Trainer) -> list[int]:
    return trainer.strategy.deepspeed_engine.optimizer.fp16_partitioned_groups_flat_numel


def main(out: Path, storage: list[str], steps: int, compression: float | None = None, extra: str = "{}") -> None:
    capture = CaptureParams()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SmartInfinityStrategy(
            storage_paths=storage, sub_group_size=3000, **{"compression": compression, **json.loads(extra)}
        ),
        precision="32-true",
        max_steps=steps,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[capture],
        use_distributed_sampler=False,
    )
    # Rank r takes samples r, r+2, ...: each global batch of 4 is the one-rank batch, split even/odd.
    dataset = token_loader(steps * 2, batch_size=2).dataset
    sampler = DistributedSampler(dataset, num_replicas=2, rank=int(os.environ["RANK"]), shuffle=False)
    trainer.fit(LMModule(adamw), DataLoader(dataset, batch_size=2, sampler=sampler))
    backend = trainer.strategy.smart_update.backend
    rank = trainer.global_rank
    report = {
        "files": [str(s.file.path) for s in getattr(backend, "shards", ())],  # remote: on the servers
        "traffic": trainer.strategy.traffic.as_dict(),
        "sub_group_numels": [int(n) for n in backend_numels(trainer)],
        "segments": [n for group in trainer.strategy.smart_update.segments for n in group],
        "moment_updates": getattr(trainer.strategy.smart_update.moments, "updates", None),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    if rank == 0:
        torch.save(capture.params, out / "params.pt")


if __name__ == "__main__":
    # argv: out, storage paths (comma-separated), steps, [kept ratio or "none", [strategy kwargs as JSON]]
    ratio = sys.argv[4] if len(sys.argv) > 4 else "none"
    main(
        Path(sys.argv[1]),
        sys.argv[2].split(","),
        int(sys.argv[3]),
        None if ratio == "none" else float(ratio),
        sys.argv[5] if len(sys.argv) > 5 else "{}",
    )
