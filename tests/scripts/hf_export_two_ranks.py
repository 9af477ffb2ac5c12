"""Run as a plain script (``python hf_export_two_ranks.py ROOT KINDS MODEL_DIRS``) by tests/test_hf_export.py:
Lightning itself launches the second rank (``Trainer(devices=2)`` on CPU re-runs this script).

For each kind (``sequence``, ``token``, ``causal``, comma-separated, with its model directory in ``MODEL_DIRS``),
trains the test's own LightningModule with ``smart_infinity`` on 2 ranks, each rank taking half of every batch of
the 1-process reference, and checkpoints its last step with a stock ``ModelCheckpoint`` into ``ROOT/<kind>/ckpts``.
"""

import os
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.hf_models import BATCH, KINDS, STEPS, samples  # noqa: E402

from lightning_smartinf import SmartInfinityStrategy  # noqa: E402


def main(root: Path, kind: str, model_dir: str) -> None:
    storage = [root / kind / f"ssd{i}" for i in range(2)]
    for path in storage:
        path.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0)  # the new head's initialization, as in the reference
    module = KINDS[kind][0](model_dir)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SmartInfinityStrategy(storage_paths=[str(p) for p in storage]),
        precision="32-true",
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        callbacks=[ModelCheckpoint(dirpath=root / kind / "ckpts", every_n_train_steps=STEPS)],
        use_distributed_sampler=False,
    )
    dataset = samples(kind, model_dir)
    # Rank r takes samples r, r + 2, ...: each step the two ranks hold exactly the reference's batch between them.
    sampler = DistributedSampler(dataset, num_replicas=2, rank=int(os.environ.get("LOCAL_RANK", 0)), shuffle=False)
    trainer.fit(module, DataLoader(dataset, batch_size=BATCH // 2, sampler=sampler))


if __name__ == "__main__":
    for kind, model_dir in zip(sys.argv[2].split(","), sys.argv[3].split(","), strict=True):
        main(Path(sys.argv[1]), kind, model_dir)
