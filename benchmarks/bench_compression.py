"""SmartComp convergence: dense vs top-k compressed gradients on a real language-modelling task.

Trains the demo's character GPT (real English: the documentation that ships with CPython) twice in one
process, from the same seed and data order, with ``bf16-mixed`` and AdamW + one-cycle LR on emulated CSDs:
once dense, once with ``compression`` (default 1%), error feedback and a ``CompressionWarmup`` (dense steps,
then the DGC schedule). Validation loss on held-out text is recorded along the way; the script prints the
final ratio, the link bytes per parameter per step after warm-up, and writes a plot and a JSON record.

With ``--finetune``, the model is first pre-trained densely on that English text (``--pretrain-steps``, plain
Lightning), then fine-tuned from those weights on Python source (the standard library's first 60 modules,
90% train / 10% held out) twice, dense and compressed, as Smart-Infinity evaluates SmartComp on fine-tuning.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_compression.py --steps 400 --out docs/compression
    PYTHONPATH=. .venv/bin/python benchmarks/bench_compression.py --finetune --steps 200 --out docs/compression-ft
"""

from __future__ import annotations

import argparse
import glob
import json
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.callbacks import CompressionWarmup
from lightning_smartinf.demo import CharDataset, CharGPT, english_text

SEQ = 64


class ValidatedCharGPT(CharGPT):
    def __init__(self, *args: Any, optimizer: str = "adamw", max_lr: float = 3e-3, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.optimizer_name = optimizer
        self.max_lr = max_lr

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            decay = [p for p in self.parameters() if p.ndim >= 2]
            no_decay = [p for p in self.parameters() if p.ndim < 2]
            groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
            optimizer = torch.optim.AdamW(groups, lr=self.max_lr)
            total = self.trainer.max_steps
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.max_lr, total_steps=total)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        optimizer = torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9, nesterov=True)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.3, total_steps=self.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self(tokens).float().flatten(0, 1), targets.flatten())
        self.log("val_loss", loss, prog_bar=True)


class Record(L.Callback):
    """Validation loss at every check, and link bytes of every optimizer step."""

    def __init__(self) -> None:
        self.val: list[tuple[int, float]] = []
        self.train: list[tuple[int, float]] = []
        self.link_per_step: list[float] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.val.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        m = trainer.callback_metrics
        self.train.append((trainer.global_step, float(m["loss"])))
        self.link_per_step.append(float(m["smartinf/link_write_bytes"]) + float(m["smartinf/link_read_bytes"]))


def python_source() -> str:
    """The first 60 modules of the standard library, in name order: real code, shipped with Python."""
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:60]
    return "".join(Path(f).read_text(encoding="utf-8") for f in files)[:800_000]


def split(text: str, vocab: list[str]) -> tuple[Subset, Subset]:
    """90% of ``text``'s windows to train on, the last 10% held out."""
    dataset = CharDataset(text, seq=SEQ, vocab=vocab)
    cut = int(len(dataset) * 0.9)
    return Subset(dataset, range(cut)), Subset(dataset, range(cut, len(dataset)))


def pretrain(vocab: list[str], steps: int) -> dict[str, torch.Tensor]:
    """Weights after ``steps`` dense AdamW steps on the English text (plain Lightning, fp32 on CPU)."""
    L.seed_everything(0, verbose=False)
    train_set, _ = split(english_text(), vocab)
    model = ValidatedCharGPT(len(vocab), seq=SEQ)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    generator = torch.Generator().manual_seed(0)
    trainer.fit(model, DataLoader(train_set, batch_size=16, shuffle=True, generator=generator))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(
    name: str,
    *,
    steps: int,
    ratio: float | None,
    warmup: CompressionWarmup | None,
    val_every: int,
    root: Path,
    data: tuple[Subset, Subset],
    vocab: list[str],
    optimizer: str = "adamw",
    error_feedback: bool = True,
    max_lr: float = 3e-3,
    init: dict[str, torch.Tensor] | None = None,
) -> tuple[Record, int]:
    L.seed_everything(0, verbose=False)
    train_set, val_set = data
    model = ValidatedCharGPT(len(vocab), seq=SEQ, optimizer=optimizer, max_lr=max_lr)
    if init is not None:
        model.load_state_dict(init)
    params = sum(p.numel() for p in model.parameters())
    storage = [root / name / f"csd{i}" for i in range(2)]
    for path in storage:
        path.mkdir(parents=True)
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=SmartInfinityStrategy(
            storage_paths=storage,
            sub_group_size=100_000,
            chunk_size=1 << 16,
            compression=None if ratio is None else {"ratio": ratio, "error_feedback": error_feedback},
        ),
        precision="bf16-mixed",
        max_steps=steps,
        val_check_interval=val_every,
        check_val_every_n_epoch=None,
        limit_val_batches=16,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record, *([warmup] if warmup else [])],
    )
    generator = torch.Generator().manual_seed(0)
    trainer.fit(
        model,
        DataLoader(train_set, batch_size=16, shuffle=True, generator=generator),
        DataLoader(val_set, batch_size=32),
    )
    return record, params


def plot(dense: Record, comp: Record, ratio: float, warmup_steps: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_link) = plt.subplots(1, 2, figsize=(11, 4))
    for record, label, colour in ((dense, "dense", "tab:blue"), (comp, f"top-{ratio:.0%} + error feedback", "tab:red")):
        steps, losses = zip(*record.train)
        ax_loss.plot(steps, losses, color=colour, alpha=0.25, linewidth=0.8)
        steps, losses = zip(*record.val)
        ax_loss.plot(steps, losses, color=colour, marker="o", markersize=3, label=f"{label} (validation)")
    ax_loss.axvline(warmup_steps, color="grey", linestyle=":", label="end of compression warm-up")
    ax_loss.set(xlabel="optimizer step", ylabel="cross-entropy (nats/char)", title="Loss (faint: training)")
    ax_loss.legend()
    params = comp.params
    for record, label, colour in ((dense, "dense", "tab:blue"), (comp, "compressed", "tab:red")):
        ax_link.plot(
            range(1, len(record.link_per_step) + 1),
            [b / params for b in record.link_per_step],
            color=colour,
            label=label,
        )
    ax_link.set(xlabel="optimizer step", ylabel="bytes / parameter", title="Host-link bytes per step (in + out)")
    ax_link.set_ylim(bottom=0)
    ax_link.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--dense-steps", type=int, default=20)
    parser.add_argument("--steps-per-stage", type=int, default=10)
    parser.add_argument("--val-every", type=int, default=25)
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--no-error-feedback", action="store_true")
    parser.add_argument("--finetune", action="store_true", help="pre-train on English, fine-tune on Python source")
    parser.add_argument("--pretrain-steps", type=int, default=400, help="dense pre-training steps (--finetune)")
    parser.add_argument("--finetune-lr", type=float, default=1e-3, help="AdamW peak LR of fine-tuning (--finetune)")
    parser.add_argument("--out", type=Path, default=None, help="write <out>.png and <out>.json")
    args = parser.parse_args(argv)

    warmup = CompressionWarmup(dense_steps=args.dense_steps, schedule="dgc", steps_per_stage=args.steps_per_stage)
    english = english_text()
    code = python_source() if args.finetune else ""
    vocab = sorted(set(english) | set(code))
    init = pretrain(vocab, args.pretrain_steps) if args.finetune else None
    data = split(code if args.finetune else english, vocab)
    max_lr = args.finetune_lr if args.finetune else 3e-3
    with tempfile.TemporaryDirectory(prefix="smartinf-comp-") as root:
        common = dict(
            steps=args.steps,
            val_every=args.val_every,
            root=Path(root),
            optimizer=args.optimizer,
            data=data,
            vocab=vocab,
            max_lr=max_lr,
            init=init,
        )
        dense, params = train("dense", ratio=None, warmup=None, **common)
        comp, _ = train("comp", ratio=args.ratio, warmup=warmup, error_feedback=not args.no_error_feedback, **common)
    dense.params = comp.params = params
    warm = warmup.warmup_steps()
    final_dense, final_comp = dense.val[-1][1], comp.val[-1][1]
    after = comp.link_per_step[warm:]
    result = {
        "params": params,
        "steps": args.steps,
        "ratio": args.ratio,
        "optimizer": args.optimizer,
        "error_feedback": not args.no_error_feedback,
        "task": "fine-tune on Python source after dense pre-training on English" if args.finetune else "pre-train",
        "pretrain_steps": args.pretrain_steps if args.finetune else 0,
        "max_lr": max_lr if args.optimizer == "adamw" else 0.3,
        "warmup_steps": warm,
        "final_val_loss_dense": final_dense,
        "final_val_loss_compressed": final_comp,
        "relative_difference": (final_comp - final_dense) / final_dense,
        "link_bytes_per_param_per_step_dense": dense.link_per_step[-1] / params,
        "link_bytes_per_param_per_step_compressed": max(after) / params,
        "val_dense": dense.val,
        "val_compressed": comp.val,
    }
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("val_")}, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
        plot(dense, comp, args.ratio, warm, args.out.with_suffix(".png"))
        print(f"wrote {args.out.with_suffix('.png')} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
