"""Training quality of each ``state_precision``: fp32, bf16 and int8 on the project's convergence tasks.

Each format trains once, in one process, from the same seed and data order; only ``state_precision`` differs.
The tasks are ``bench_compression.py``'s, dense (no top-k), on two emulated devices, ``bf16-mixed`` (``--precision``):

- ``char`` (default): the demo's character GPT from scratch on real English (the documentation that ships with
  CPython, 10% held out), AdamW with one-cycle LR;
- ``finetune``: that model pre-trained densely on the English text (``--pretrain-steps``, plain Lightning), then
  fine-tuned on Python source (the standard library's first 60 modules, 10% held out), peak LR ``--finetune-lr``;
- ``gpt2``: the GPT-2 pre-training recipe's model (``HFCausalLM``, its byte-level BPE tokenizer) widened to 6 layers
  of 384 (12.3M parameters), from scratch on Python source, AdamW with warm-up and cosine decay, clipping at 1.0.

Validation loss is taken every ``--val-every`` steps; the script prints each format's final validation loss and its
ratio to fp32's, and writes a JSON record (and a plot with ``--out``).

``--baselines`` adds runs without this project's strategy (plain Lightning, one CPU device), on the character tasks:
``torch`` (``torch.optim.AdamW``: the equivalence suite says fp32 matches it; here on the whole task) and
``bitsandbytes`` (``bitsandbytes.optim.AdamW8bit`` with its defaults: blockwise dynamic 8-bit moments, tensors under
4,096 elements kept in 32 bits; ``.venv/bin/pip install bitsandbytes``, whose 8-bit optimizers run on CPU since 0.46).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_state_quality.py --steps 400 --baselines torch bitsandbytes \
        --out docs/state-quality
    PYTHONPATH=. .venv/bin/python benchmarks/bench_state_quality.py --task finetune --steps 200 --val-every 25 \
        --out docs/state-quality-finetune
    PYTHONPATH=. .venv/bin/python benchmarks/bench_state_quality.py --task gpt2 --steps 2000 --val-every 250 \
        --out docs/state-quality-gpt2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_compression import Record, task_inputs, train  # noqa: E402
from bench_state_formats import cpu_model  # noqa: E402

FORMATS = ("fp32", "bf16", "int8")
BASELINES = ("torch", "bitsandbytes")
TASKS = {
    "char": "character GPT from scratch on English",
    "finetune": "character GPT pre-trained on English, fine-tuned on Python source",
    "gpt2": "GPT-2 recipe model (12.3M) from scratch on Python source",
}


def baseline_adamw(name: str) -> type[torch.optim.Optimizer]:
    """The AdamW class of a baseline run."""
    if name == "torch":
        return torch.optim.AdamW
    try:
        import bitsandbytes
    except ImportError:
        sys.exit("--baselines bitsandbytes: bitsandbytes is not installed; `.venv/bin/pip install bitsandbytes`")
    return bitsandbytes.optim.AdamW8bit


def plot(records: dict[str, Record], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, record in records.items():
        ax.plot(*zip(*record.val), label=name, marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{title}\nAdamW: optimizer state precision", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=list(TASKS), default="char")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--pretrain-steps", type=int, default=400, help="dense pre-training steps (--task finetune)")
    parser.add_argument("--finetune-lr", type=float, default=1e-3, help="AdamW peak LR (--task finetune)")
    parser.add_argument(
        "--precision",
        default="bf16-mixed",
        choices=("bf16-mixed", "32-true"),
        help="Lightning precision of every run; 32-true where the CPU multiplies bf16 matrices slowly",
    )
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS), help="fp32 always runs, first")
    parser.add_argument(
        "--baselines",
        nargs="*",
        choices=BASELINES,
        default=[],
        help="plain-Lightning runs beside the formats (character tasks): torch's AdamW, bitsandbytes' AdamW8bit",
    )
    parser.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.png")
    args = parser.parse_args(argv)
    if args.baselines and args.task == "gpt2":
        parser.error("--baselines runs on the character tasks (--task char or finetune), not --task gpt2")
    baselines = {f"{name} (plain Lightning)": baseline_adamw(name) for name in args.baselines}
    gpt2 = (384, 6, 4.0) if args.task == "gpt2" else None
    finetune = args.task == "finetune"
    vocab, init, data = task_inputs(finetune=finetune, gpt2=gpt2, pretrain_steps=args.pretrain_steps)
    max_lr = args.finetune_lr if finetune else 3e-3
    formats = sorted(set(args.formats) | {"fp32"}, key=FORMATS.index)
    print(f"CPU: {cpu_model()}; {TASKS[args.task]}; {args.steps} steps", flush=True)
    records: dict[str, Record] = {}
    params = 0
    with tempfile.TemporaryDirectory(prefix="smartinf-quality-") as tmp:
        runs = [(name, None) for name in formats] + list(baselines.items())
        for name, adamw in runs:  # each result printed as it comes: a run stopped early keeps what it had
            records[name], params = train(
                name,
                steps=args.steps,
                ratio=None,
                warmup=None,
                val_every=args.val_every,
                root=Path(tmp),
                data=data,
                vocab=vocab,
                max_lr=max_lr,
                init=init,
                gpt2=gpt2,
                precision=args.precision,
                state_precision=name if adamw is None else "fp32",
                baseline_adamw=adamw,
            )
            loss, reference = records[name].val[-1][1], records["fp32"].val[-1][1]
            print(f"{name}: final validation loss {loss:.4f} ({loss / reference:.4f}x fp32's)", flush=True)
    final = {name: record.val[-1][1] for name, record in records.items()}
    result = {
        "cpu": cpu_model(),
        "task": TASKS[args.task],
        "params": params,
        "steps": args.steps,
        "precision": args.precision,
        "pretrain_steps": args.pretrain_steps if finetune else 0,
        "final_val_loss": final,
        "ratio_to_fp32": {name: final[name] / final["fp32"] for name in records},
        "val": {name: record.val for name, record in records.items()},
        "storage_bytes_per_step": {
            name: sum(r.storage_per_step) / len(r.storage_per_step) for name, r in records.items() if r.storage_per_step
        },
    }
    if args.out is not None:
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        plot(records, args.out, TASKS[args.task])


if __name__ == "__main__":
    main()
