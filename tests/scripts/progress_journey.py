"""Run by tests/test_progress.py: the long operations of a run, small, as a user runs them, with what they print.

``progress_journey.py OUT [--bar on|off] [--devices N] [--hf]``: a fit on ``N`` CPU ranks (launched by Lightning)
that writes its initial optimizer state and saves a checkpoint (``ModelCheckpoint(save_last=True)``), then two
resumes of it: with the same ``sub_group_size`` (loaded) and with another (re-sharded); with ``--hf``, also a tiny
Llama loaded with ``from_pretrained``, trained, saved and exported (``smartinf export``'s function), and a text file
tokenised into a token cache. ``--bar`` is the Trainer's ``enable_progress_bar``. Operations are shown however short
they are (``min_seconds=0``) and announced however small.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.models import LMModule, adamw_factory, token_loader  # noqa: E402

from lightning_smartinf import SmartInfinityStrategy  # noqa: E402
from lightning_smartinf.core import progress  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def trainer(root: Path, *, steps: int, sub_group_size: int, devices: int, bar: bool, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=SmartInfinityStrategy(
            storage_paths=[root / f"state{rank}" for rank in range(devices)], sub_group_size=sub_group_size
        ),
        max_steps=steps,
        logger=False,
        enable_progress_bar=bar,
        enable_model_summary=False,
        use_distributed_sampler=False,
        **kwargs,
    )


def fit_and_resume(root: Path, devices: int, bar: bool) -> None:
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", save_last=True)
    trainer(root, steps=2, sub_group_size=3000, devices=devices, bar=bar, callbacks=[checkpoint]).fit(
        LMModule(adamw_factory()), token_loader(2)
    )
    for steps, sub_group_size in ((3, 3000), (3, 5000)):  # the same layout (loaded), then another (re-sharded)
        again = trainer(
            root, steps=steps, sub_group_size=sub_group_size, devices=devices, bar=bar, enable_checkpointing=False
        )
        again.fit(LMModule(adamw_factory()), token_loader(3), ckpt_path=str(root / "ckpt" / "last.ckpt"))


class OwnLM(L.LightningModule):
    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path, self.model = path, None

    def configure_model(self) -> None:
        from lightning_smartinf.hf import from_pretrained

        if self.model is None:
            self.model = from_pretrained(self, self.path)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def hugging_face(root: Path, bar: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_smartinf.commands.export import export_pretrained
    from lightning_smartinf.hf import TextDataModule, train_bpe_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(root / "llama", max_shard_size="40KB")
    module = OwnLM(root / "llama")
    (root / "hf").mkdir()
    saved = ModelCheckpoint(dirpath=root / "hf-ckpt", save_last=True)
    run = trainer(root / "hf", steps=1, sub_group_size=20_000, devices=1, bar=bar, callbacks=[saved])
    run.fit(module, torch.utils.data.DataLoader([torch.randint(0, 256, (12,))], batch_size=1))
    export_pretrained(root / "hf-ckpt" / "last.ckpt", root / "exported", model_dir=root / "llama")
    tokenizer = train_bpe_tokenizer([REPO / "recipes" / "data" / "python_docs.txt"], root / "tok", vocab_size=300)
    data = TextDataModule(
        str(REPO / "recipes" / "data" / "python_docs.txt"), tokenizer_path=str(root / "tok"), block_size=32,
        cache_dir=str(root / "cache"),
    )  # fmt: skip
    data.prepare_data()
    assert len(tokenizer) == 300


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--bar", choices=("on", "off"), default="on")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--hf", action="store_true")
    args = parser.parse_args()
    progress.configure(min_seconds=0.0, announce_bytes=0)
    fit_and_resume(args.out, args.devices, args.bar == "on")
    if args.hf:
        hugging_face(args.out, args.bar == "on")


if __name__ == "__main__":
    main()
