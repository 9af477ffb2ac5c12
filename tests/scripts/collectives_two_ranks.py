"""Launched by Lightning from tests/test_collectives.py: two gloo ranks whose device is not the host
(:mod:`rank_device`). Trains with top-k and error feedback (the ranks agree on the link's overflow each step), then,
at the end of training and under the checker: a checkpoint save, the overflow agreement, and the masters read and
gathered over the ranks as ``save_pretrained`` reads them. Each rank writes what the checker saw to ``rankN.json``."""

import json
import sys
from dataclasses import asdict
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.models import LMModule, adamw_factory, fit  # noqa: E402
from helpers.rank_device import rank_device  # noqa: E402

from lightning_smartinf import SmartInfinityStrategy  # noqa: E402
from lightning_smartinf.hf.pretrained import trained_weights  # noqa: E402


class UnderRankDevice(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with rank_device() as record:
            trainer.save_checkpoint(self.out / "end.ckpt")
            trainer.strategy.deepspeed_engine.optimizer._link_overflows(1.0)
            weights = trained_weights(pl_module).all()
        report = {"calls": [asdict(call) for call in record.calls], "weights": len(weights)}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def main(out: Path) -> None:
    strategy = SmartInfinityStrategy(
        storage_paths=[out / "r0", out / "r1"],
        sub_group_size=3000,
        compression={"ratio": 0.1, "error_feedback": True},
    )
    fit(LMModule(adamw_factory()), strategy, steps=2, devices=2, callbacks=[UnderRankDevice(out)])


if __name__ == "__main__":
    main(Path(sys.argv[1]))
