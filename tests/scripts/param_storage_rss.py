"""Run as ``python param_storage_rss.py ROOT WIDTH LAYERS OFFLOAD [compressed]``: train a stack of ``LAYERS``
bias-free ``WIDTH``-wide linear layers, built in ``configure_model``, for 2 bf16 steps with
``offload_parameters=OFFLOAD`` (``storage`` or ``memory``), and print one JSON line: the parameter count and this
process's peak RSS in bytes. ``compressed``: top-1% with error feedback, and a checkpoint saved at the last step
(which writes the residual) by a stock ``ModelCheckpoint``."""

import json
import sys
from pathlib import Path

import lightning as L
import torch

from lightning_smartinf import SmartInfinityStrategy


class Stack(L.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.width, self.layers = width, layers
        self.net: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = torch.nn.Sequential(
                *(torch.nn.Linear(self.width, self.width, bias=False) for _ in range(self.layers))
            )

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main(root: Path, width: int, layers: int, offload: str, compressed: bool) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(8, width, generator=torch.Generator().manual_seed(1)))
    strategy = SmartInfinityStrategy(
        storage_paths=[root],
        offload_parameters="storage" if offload == "storage" else True,
        io_engine="threads",
        sub_group_size=8_000_000,  # the working set: a few sub-groups and one reduce bucket, whatever the depth
        reduce_bucket_size=8_000_000,
        compression={"ratio": 0.01} if compressed else None,
    )
    saving = [L.pytorch.callbacks.ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2)]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        precision="bf16-true",
        max_steps=2,
        logger=False,
        enable_checkpointing=compressed,
        callbacks=saving if compressed else None,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Stack(width, layers), torch.utils.data.DataLoader(data, batch_size=4))
    # VmHWM, this process's own: `ru_maxrss` starts from the launching process's peak (it survives fork and exec).
    status = Path("/proc/self/status").read_text().splitlines()
    peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    print(
        json.dumps(
            {
                "params": width * width * layers,
                "peak_rss": peak,
                "param_write_bytes": strategy.traffic.param_write_bytes,
                "checkpoints": sorted(p.name for p in (root / "checkpoints").glob("*")) if compressed else [],
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:] == ["compressed"])
