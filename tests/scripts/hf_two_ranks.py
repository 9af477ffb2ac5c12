"""Launched by ``torch.distributed.run`` from tests/test_hf.py: fine-tunes a local GPT-2 on 2 CPU ranks and writes
its ``save_pretrained`` directory (masters gathered from both ranks' devices) and a checkpoint of the same step."""

import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.hf import HFCausalLM, SavePretrained, TextDataModule


def main(model_dir: str, text: str, out: Path, storage: list[str]) -> None:
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SmartInfinityStrategy(storage_paths=storage, sub_group_size=20_000, chunk_size=4096),
        precision="bf16-mixed",
        max_steps=2,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, save_top_k=-1),
            SavePretrained(str(out / "hf")),
        ],
    )
    trainer.fit(HFCausalLM(model_dir, lr=3e-3), TextDataModule(text, block_size=32, batch_size=2, val_fraction=0.0))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4].split(","))
