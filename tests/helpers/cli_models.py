"""A LightningModule and a LightningDataModule that `smartinf fit` configs can name by ``class_path``."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from helpers.models import SEQ, VOCAB, TinyGPT, param_groups


class TokenDicts(Dataset):
    """Random token sequences as ``{"input_ids", "labels"}`` dicts, like a Hugging Face dataset."""

    def __init__(self, samples: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


class RandomTokens(L.LightningDataModule):
    """Train and validation loaders of random tokens.

    Args:
        batches: training batches per epoch.
        batch_size: sequences per batch (each ``SEQ`` tokens).
    """

    def __init__(self, batches: int = 4, batch_size: int = 4) -> None:
        super().__init__()
        self.batches = batches
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenDicts(self.batches * self.batch_size, seed=1), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TokenDicts(2 * self.batch_size, seed=2), batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        """The validation batches: the same model scores the same on both loops."""
        return self.val_dataloader()


class TinyLM(L.LightningModule):
    """:class:`models.TinyGPT` trained with AdamW; logs ``train_loss``, ``val_loss`` and ``test_loss``.

    Args:
        dim: model width.
        layers: transformer blocks.
        lr: AdamW learning rate.
    """

    def __init__(self, dim: int = 64, layers: int = 2, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.model = TinyGPT(dim=dim, layers=layers)

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.model(batch["input_ids"])
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(param_groups(self.model, 0.1), lr=self.hparams.lr)
