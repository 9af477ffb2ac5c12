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

With ``--task gpt2``, the second, larger task: the GPT-2 pre-training recipe's model (``HFCausalLM``, the recipe's
byte-level BPE tokenizer trained on ``recipes/data/python_docs.txt``) widened to ``--gpt2-dim`` and ``--gpt2-layers``
(12.3M parameters by default), pre-trained from scratch on Python source (the first ``--gpt2-text-mb`` MB of the
standard library's modules, 95% / 5% held out: enough text that 2,000 steps do not repeat it much), batch 8 x 128
tokens, AdamW (peak LR 1e-3, 10 warm-up steps, cosine to 10%), gradient clipping at 1.0, ``bf16-mixed``.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_compression.py --task gpt2 --steps 2000 --val-every 250 \
        --out docs/compression-gpt2
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
from torch.utils.data import DataLoader, DistributedSampler, Subset

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.commands.demo import CharDataset, CharGPT, english_text
from lightning_smartinf.core.compression import RULE_CHOICES
from lightning_smartinf.lightning.callbacks import CompressionWarmup

SEQ = 64


class ValidatedCharGPT(CharGPT):
    def __init__(
        self,
        *args: Any,
        optimizer: str = "adamw",
        max_lr: float = 3e-3,
        adamw_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.optimizer_name = optimizer
        self.max_lr = max_lr
        self.adamw_class = adamw_class

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            decay = [p for p in self.parameters() if p.ndim >= 2]
            no_decay = [p for p in self.parameters() if p.ndim < 2]
            groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
            optimizer = self.adamw_class(groups, lr=self.max_lr)
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
        self.storage_per_step: list[float] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.val.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        m = trainer.callback_metrics
        self.train.append((trainer.global_step, float(m["loss"] if "loss" in m else m["train_loss"])))
        if "smartinf/link_write_bytes" not in m:  # a baseline without this project's strategy
            return
        self.link_per_step.append(float(m["smartinf/link_write_bytes"]) + float(m["smartinf/link_read_bytes"]))
        self.storage_per_step.append(float(m["smartinf/storage_read_bytes"]) + float(m["smartinf/storage_write_bytes"]))


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


def task_inputs(
    *, finetune: bool, gpt2: tuple[int, int, float] | None, pretrain_steps: int
) -> tuple[list[str], dict[str, torch.Tensor] | None, tuple[Subset, Subset] | None]:
    """The character vocabulary, the pre-trained weights (``finetune``) and the train/held-out split of a task (the
    GPT-2 task brings its own data module: no split)."""
    english = english_text() if gpt2 is None else ""
    code = python_source() if finetune else ""
    vocab = sorted(set(english) | set(code))
    init = pretrain(vocab, pretrain_steps) if finetune else None
    data = split(code if finetune else english, vocab) if gpt2 is None else None
    return vocab, init, data


def gpt2_task(root: Path, dim: int, layers: int, text_mb: float) -> tuple[Any, Any]:
    """The GPT-2 recipe's module and data module, on Python source (see the module docstring)."""
    from lightning_smartinf.hf import HFCausalLM, TextDataModule

    text = root / "python_source.txt"
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True))
    chunks, size = [], 0
    for f in files:
        if size >= text_mb * 1e6:
            break
        part = Path(f).read_text(encoding="utf-8", errors="replace")
        chunks.append(part)
        size += len(part)
    text.write_text("".join(chunks))
    repo = Path(__file__).resolve().parents[1]
    tokenizer = root / "tokenizer"
    module = HFCausalLM(
        config={
            "model_type": "gpt2",
            "n_positions": 256,
            "n_embd": dim,
            "n_layer": layers,
            "n_head": max(1, dim // 64),
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
        tokenizer_path=str(tokenizer),
        tokenizer_train_files=[str(repo / "recipes" / "data" / "python_docs.txt")],
        tokenizer_vocab_size=4096,
        optimizer="adamw",
        lr=1e-3,
        weight_decay=0.1,
        betas=(0.9, 0.95),
        warmup_steps=10,
        scheduler="cosine",
        min_lr_ratio=0.1,
    )
    data = TextDataModule(
        train_file=str(text), block_size=128, batch_size=8, val_fraction=0.05, tokenizer_path=str(tokenizer)
    )
    return module, data


def train(
    name: str,
    *,
    steps: int,
    ratio: float | None,
    warmup: CompressionWarmup | None,
    val_every: int,
    root: Path,
    data: tuple[Subset, Subset] | None,
    vocab: list[str],
    optimizer: str = "adamw",
    error_feedback: bool = True,
    rule: str = "auto",
    max_lr: float = 3e-3,
    init: dict[str, torch.Tensor] | None = None,
    gpt2: tuple[int, int, float] | None = None,
    precision: str = "bf16-mixed",
    state_precision: str = "fp32",
    baseline_adamw: type[torch.optim.Optimizer] | None = None,
) -> tuple[Record, int]:
    """Train one run and record it. With ``baseline_adamw`` (char and fine-tuning tasks), the run is a baseline:
    Lightning's own single-device strategy and that AdamW class instead of this project's strategy."""
    L.seed_everything(0, verbose=False)
    if gpt2 is not None and baseline_adamw is not None:
        raise ValueError("`baseline_adamw` runs the character tasks only, not the GPT-2 task")
    if gpt2 is not None:
        model, datamodule = gpt2_task(root, *gpt2)
        model.configure_model()
    else:
        adamw_class = baseline_adamw or torch.optim.AdamW
        model = ValidatedCharGPT(len(vocab), seq=SEQ, optimizer=optimizer, max_lr=max_lr, adamw_class=adamw_class)
    if init is not None:
        model.load_state_dict(init)
    params = sum(p.numel() for p in model.parameters())
    record = Record()
    strategy = "auto"  # a baseline: Lightning's own single-device strategy
    if baseline_adamw is None:
        storage = [root / name / f"csd{i}" for i in range(2)]
        for path in storage:
            path.mkdir(parents=True)
        strategy = SmartInfinityStrategy(
            storage_paths=storage,
            sub_group_size=100_000,
            chunk_size=1 << 16,
            compression=None if ratio is None else {"ratio": ratio, "error_feedback": error_feedback, "rule": rule},
            state_precision=state_precision,
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        val_check_interval=val_every,
        check_val_every_n_epoch=None,
        limit_val_batches=16 if gpt2 is None else 32,
        gradient_clip_val=None if gpt2 is None else 1.0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record, *([warmup] if warmup else [])],
    )
    if gpt2 is not None:
        trainer.fit(model, datamodule=datamodule)
        return record, params
    train_set, val_set = data
    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(train_set, batch_size=16, shuffle=True, generator=generator)
    if baseline_adamw is not None:
        # This project's strategy is distributed: Lightning swaps the shuffle for a DistributedSampler (seed 0) even
        # on one device. A baseline takes the same sampler, so that every run sees the same batches in the same order.
        loader = DataLoader(train_set, batch_size=16, sampler=DistributedSampler(train_set, num_replicas=1, rank=0))
    trainer.fit(model, loader, DataLoader(val_set, batch_size=32))
    return record, params


def reference_record(path: Path) -> tuple[Record, int]:
    """The dense run of an earlier record (``--dense-from``): validation losses, link and storage bytes per step."""
    saved = json.loads(path.read_text())
    record = Record()
    record.val = [tuple(v) for v in saved["val_dense"]]
    record.train = [tuple(v) for v in saved.get("train_dense", [])]
    steps = saved["steps"]
    record.link_per_step = [saved["link_bytes_per_param_per_step_dense"] * saved["params"]] * steps
    storage = saved.get("storage_bytes_per_param_per_step_dense")  # records older than storage counting lack it
    record.storage_per_step = [] if storage is None else [storage * saved["params"]] * steps
    return record, saved["params"]


def check_reference(
    path: Path, args: argparse.Namespace, *, max_lr: float, params: int | None = None, val_steps: list | None = None
) -> None:
    """Refuse a ``--dense-from`` record of another run: its dense run must be the one this run would have made.
    Before training, the recipe is compared; after it, the model's size and the validation steps too."""
    saved = json.loads(path.read_text())
    expected = {
        "steps": args.steps,
        "optimizer": args.optimizer,
        "precision": args.precision,
        "pretrain_steps": args.pretrain_steps if args.finetune else 0,
        "max_lr": max_lr if args.optimizer == "adamw" else 0.3,
        **({} if params is None else {"params": params}),
        **({} if val_steps is None else {"validation steps": val_steps}),
    }
    found = {**{key: saved.get(key) for key in expected}, "validation steps": [v[0] for v in saved["val_dense"]]}
    if differ := {key: (found[key], value) for key, value in expected.items() if found[key] != value}:
        shown = ", ".join(f"{key}: {there!r} there, {here!r} here" for key, (there, here) in differ.items())
        raise SystemExit(f"--dense-from {path}: that record's dense run is not this run's ({shown}).")


def plot(dense: Record, comp: Record, ratio: float, warmup_steps: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_link) = plt.subplots(1, 2, figsize=(11, 4))
    for record, label, colour in ((dense, "dense", "tab:blue"), (comp, f"top-{ratio:.0%} + error feedback", "tab:red")):
        if record.train:  # a dense run taken from an older record may lack its training losses
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
    parser.add_argument("--rule", choices=list(RULE_CHOICES), default="auto", help="the compressed run's device rule")
    parser.add_argument("--finetune", action="store_true", help="pre-train on English, fine-tune on Python source")
    parser.add_argument("--pretrain-steps", type=int, default=400, help="dense pre-training steps (--finetune)")
    parser.add_argument("--finetune-lr", type=float, default=1e-3, help="AdamW peak LR of fine-tuning (--finetune)")
    parser.add_argument(
        "--task", choices=["char", "gpt2"], default="char", help="char GPT, or the GPT-2 recipe's model"
    )
    parser.add_argument("--gpt2-dim", type=int, default=384)
    parser.add_argument("--gpt2-layers", type=int, default=6)
    parser.add_argument("--gpt2-text-mb", type=float, default=4.0, help="MB of Python source to train on (--task gpt2)")
    parser.add_argument(
        "--dense-from",
        type=Path,
        default=None,
        help="take the dense run from an earlier record (its .json) of the same task and steps instead of running it",
    )
    parser.add_argument(
        "--precision",
        choices=["bf16-mixed", "32-true"],
        default="bf16-mixed",
        help="Lightning precision of both runs (32-true: where the CPU lacks bf16 matmuls, about 20x faster there)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write <out>.png and <out>.json")
    args = parser.parse_args(argv)
    max_lr = args.finetune_lr if args.finetune else 1e-3 if args.task == "gpt2" else 3e-3
    if args.dense_from:
        check_reference(args.dense_from, args, max_lr=max_lr)  # before anything loads or trains

    warmup = CompressionWarmup(dense_steps=args.dense_steps, schedule="dgc", steps_per_stage=args.steps_per_stage)
    gpt2 = (args.gpt2_dim, args.gpt2_layers, args.gpt2_text_mb) if args.task == "gpt2" else None
    vocab, init, data = task_inputs(finetune=args.finetune, gpt2=gpt2, pretrain_steps=args.pretrain_steps)
    dense_run = {"ratio": None, "warmup": None}
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
            gpt2=gpt2,
            precision=args.precision,
        )
        dense, params = reference_record(args.dense_from) if args.dense_from else train("dense", **dense_run, **common)
        comp, comp_params = train(
            "comp", ratio=args.ratio, warmup=warmup, error_feedback=not args.no_error_feedback, rule=args.rule, **common
        )
    if args.dense_from:
        check_reference(args.dense_from, args, max_lr=max_lr, params=comp_params, val_steps=[s for s, _ in comp.val])
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
        "rule": args.rule,
        "task": (
            "fine-tune on Python source after dense pre-training on English"
            if args.finetune
            else "GPT-2 recipe model, pre-train on Python source"
            if gpt2
            else "pre-train"
        ),
        "pretrain_steps": args.pretrain_steps if args.finetune else 0,
        "max_lr": max_lr if args.optimizer == "adamw" else 0.3,
        "warmup_steps": warm,
        "final_val_loss_dense": final_dense,
        "final_val_loss_compressed": final_comp,
        "relative_difference": (final_comp - final_dense) / final_dense,
        "link_bytes_per_param_per_step_dense": dense.link_per_step[-1] / params,
        "link_bytes_per_param_per_step_compressed": max(after) / params,
        "link_bytes_per_param_per_step_compressed_whole_run": sum(comp.link_per_step)
        / len(comp.link_per_step)
        / params,
        "storage_bytes_per_param_per_step_dense": (
            dense.storage_per_step[-1] / params if dense.storage_per_step else None
        ),
        "storage_bytes_per_param_per_step_compressed": comp.storage_per_step[-1] / params,
        "dense_from": str(args.dense_from) if args.dense_from else None,
        "precision": args.precision,
        "val_dense": dense.val,
        "train_dense": dense.train,
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
