"""Training quality of each ``state_precision``: the demo's character GPT from scratch, in fp32, bf16 and int8.

Three runs in one process, from the same seed and data order: the character GPT of ``smartinf demo`` (real English:
the documentation that ships with CPython, 90% to train on, the last 10% held out), ``bf16-mixed``, AdamW with
one-cycle LR, on two emulated devices; only ``state_precision`` differs. Validation loss is taken every
``--val-every`` steps; the script prints each format's final validation loss and its ratio to fp32's, and writes
a JSON record (and a plot with ``--out``).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_state_quality.py --steps 400 --out docs/state-quality
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_compression import SEQ, Record, ValidatedCharGPT, split  # noqa: E402
from bench_state_formats import cpu_model  # noqa: E402

from lightning_smartinf import SmartInfinityStrategy  # noqa: E402
from lightning_smartinf.commands.demo import english_text  # noqa: E402

FORMATS = ("fp32", "bf16", "int8")


def train(precision: str, *, steps: int, val_every: int, root: Path, vocab: list[str], data: tuple) -> Record:
    L.seed_everything(0, verbose=False)
    model = ValidatedCharGPT(len(vocab), seq=SEQ)
    storage = [root / precision / f"csd{i}" for i in range(2)]
    for path in storage:
        path.mkdir(parents=True)
    record = Record()
    record.params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=SmartInfinityStrategy(
            storage_paths=storage, sub_group_size=100_000, chunk_size=1 << 16, state_precision=precision
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
        callbacks=[record],
    )
    train_set, val_set = data
    generator = torch.Generator().manual_seed(0)
    trainer.fit(
        model,
        DataLoader(train_set, batch_size=16, shuffle=True, generator=generator),
        DataLoader(val_set, batch_size=32),
    )
    return record


def plot(records: dict[str, Record], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, record in records.items():
        ax.plot(*zip(*record.val), label=name, marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title("character GPT, AdamW: optimizer state precision")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS), help="fp32 always runs, first")
    parser.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.png")
    args = parser.parse_args(argv)
    text = english_text()
    vocab = sorted(set(text))
    data = split(text, vocab)
    formats = sorted(set(args.formats) | {"fp32"}, key=FORMATS.index)
    print(f"CPU: {cpu_model()}; {args.steps} steps", flush=True)
    records: dict[str, Record] = {}
    with tempfile.TemporaryDirectory(prefix="smartinf-quality-") as tmp:
        for name in formats:  # each result printed as it comes: a run stopped early keeps what it had
            records[name] = train(
                name, steps=args.steps, val_every=args.val_every, root=Path(tmp), vocab=vocab, data=data
            )
            loss, reference = records[name].val[-1][1], records["fp32"].val[-1][1]
            print(f"{name}: final validation loss {loss:.4f} ({loss / reference:.4f}x fp32's)", flush=True)
    final = {name: record.val[-1][1] for name, record in records.items()}
    result = {
        "cpu": cpu_model(),
        "params": records["fp32"].params,
        "steps": args.steps,
        "final_val_loss": final,
        "ratio_to_fp32": {name: final[name] / final["fp32"] for name in records},
        "val": {name: record.val for name, record in records.items()},
        "storage_bytes_per_step": {
            name: sum(r.storage_per_step) / len(r.storage_per_step) for name, r in records.items()
        },
    }
    if args.out is not None:
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        plot(records, args.out)


if __name__ == "__main__":
    main()
