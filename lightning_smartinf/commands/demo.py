"""Demo: train a small GPT-style model on real English text with optimizer state on 2 emulated CSDs.

Run with ``smartinf demo [--steps N]``. The state lives in a temporary directory
(two sub-directories standing in for two SmartSSDs) that is removed at the end. The text is the
documentation of Python's keywords and topics, which ships with every CPython (``pydoc_data``).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.core.io.leftovers import scratch_directory
from lightning_smartinf.lightning import quiet
from lightning_smartinf.lightning.monitor import ZERO_INFINITY_LINK_BYTES_PER_PARAM


def english_text() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics.values())


class CharDataset(Dataset):
    """``seq``-character windows of ``text`` and the next character of each; ``vocab`` defaults to its characters."""

    def __init__(self, text: str, seq: int, vocab: list[str] | None = None) -> None:
        self.vocab = sorted(set(text)) if vocab is None else vocab
        index = {c: i for i, c in enumerate(self.vocab)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.seq = seq

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq : (i + 1) * self.seq + 1]
        return chunk[:-1], chunk[1:]


class CharGPT(L.LightningModule):
    def __init__(self, vocab: int, seq: int, dim: int = 128, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        hidden = self.blocks(self.embed(tokens) + self.pos[: tokens.shape[1]], mask=mask, is_causal=True)
        return self.head(self.norm(hidden))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self(tokens).float().flatten(0, 1), targets.flatten())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict:
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3
        )
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=self.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LossPrinter(L.Callback):
    def __init__(self, every: int) -> None:
        self.every = every

    def on_train_batch_end(self, trainer: L.Trainer, *_: object) -> None:
        step = trainer.global_step
        if step == 1 or step % self.every == 0 or step == trainer.max_steps:
            print(f"step {step:4d}  loss {float(trainer.callback_metrics['loss']):.3f}", flush=True)


#: The most emulated CSDs the demo makes (each takes a pool of host memory; 2 show the traffic split).
MAX_DEVICES = 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="smartinf demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--devices", type=int, default=2, help="emulated CSDs (default 2)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: the demo trains at least 1 step (default 40)")
    if not 1 <= args.devices <= MAX_DEVICES:
        parser.error(f"--devices {args.devices}: the demo emulates 1 to {MAX_DEVICES} CSDs (default 2)")
    silenced = quiet.silence(entry_point=True)
    try:
        return _run(args)
    finally:
        silenced.restore()


def _run(args: argparse.Namespace) -> int:
    L.seed_everything(0, verbose=False)
    dataset = CharDataset(english_text(), seq=64)
    model = CharGPT(len(dataset.vocab), seq=64)
    params = sum(p.numel() for p in model.parameters())
    with scratch_directory("smartinf-demo") as root:
        paths = [root / f"csd{i}" for i in range(args.devices)]
        for path in paths:
            path.mkdir()
        strategy = SmartInfinityStrategy(storage_paths=paths, sub_group_size=100_000, chunk_size=1 << 16)
        print(
            f"Training a {params / 1e6:.2f}M-parameter character GPT on {len(dataset.data):,} characters of "
            f"English; optimizer state on {args.devices} emulated CSDs under {root}"
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=strategy,
            precision="bf16-mixed",
            max_steps=args.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[LossPrinter(every=10)],
        )
        trainer.fit(model, DataLoader(dataset, batch_size=16, shuffle=True))
        traffic = trainer.strategy.traffic

    steps = trainer.global_step
    per_param = {k: v / (params * steps) for k, v in traffic.as_dict().items()}
    link = per_param["link_write_bytes"] + per_param["link_read_bytes"]
    print(
        "\nTraffic per trainable parameter per optimizer step (including the initial state write, and the state the"
        "\ndevices read ahead after the last step for a next one that never came):"
    )
    print(
        f"  host link, SmartUpdate       : {per_param['link_write_bytes']:5.2f} B in (gradients) + "
        f"{per_param['link_read_bytes']:5.2f} B out (bf16 parameters) = {link:5.2f} B"
    )
    print(
        f"  inside the devices (storage) : {per_param['storage_read_bytes']:5.2f} B read + "
        f"{per_param['storage_write_bytes']:5.2f} B written (fp32 master, m, v; never crosses the link)"
    )
    print(
        f"  host link, ZeRO-Infinity     : {ZERO_INFINITY_LINK_BYTES_PER_PARAM:5.2f} B "
        f"(SmartUpdate moves {ZERO_INFINITY_LINK_BYTES_PER_PARAM / link:.1f}x less over the shared link)"
    )
    return 0


if __name__ == "__main__":
    main()
