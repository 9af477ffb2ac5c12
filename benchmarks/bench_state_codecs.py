"""Why a state format trains as it does: AdamW's moments passed through candidate 8-bit codecs, simulated in torch.

The GPT-2 task of ``bench_state_quality.py`` (the recipe's model, 6 layers of 384, from scratch on Python source;
AdamW 1e-3, betas (0.9, 0.95), weight decay 0.1, warm-up and cosine, clipping 1.0) trained by plain Lightning on one
CPU device, with torch's ``AdamW``. After every optimizer step a callback replaces each moment by what a codec would
store and load back, exactly as a device that holds the moments in that codec hands them to the next step. So one
codec's effect on quality is measured apart from everything else, a variant at a time:

- ``e4m3-ue4m4``: this project's ``state_precision="int8"`` as it is (blocks of 256; the first moment in FP8 E4M3
  codes of the element over its block's largest magnitude, the second by its square root in UE4M4, an unsigned 8-bit
  float: the sign bit given to the mantissa); ``e4m3-ue3m5``: the second moment's square root in UE3M5 instead (3
  exponent bits, 5 mantissa bits);
- ``e4m3``: ``int8`` as it was before, both moments in E4M3 (the second by its square root); ``e4m3-m`` and
  ``e4m3-v`` quantize one moment only; ``e4m3-b64`` uses blocks of 64; ``e4m3-direct`` stores the second moment
  itself;
- ``dynamic``: bitsandbytes' dynamic map (signed for the first moment, unsigned for the second, stored directly, as
  its 8-bit AdamW does), blocks of 256; ``dynamic-sqrt`` stores the second moment by its square root.

``e4m3-ue4m4`` runs the ``int8`` format's own conversions (its C kernels): the values a device keeps; ``e4m3-ue3m5``
and the first moment of ``e4m3`` and ``e4m3-m`` its plain-torch reference, of the same bytes; the second moment of
``e4m3`` and ``e4m3-v`` :class:`EarlierRootCodec`, the bytes the format stored before. Every other codec rounds to
the nearest code of a table (ties to the lower). The records made before ``e4m3`` took the format's own code
(``docs/state-codecs-gpt2.json``, ``docs/state-codecs-gpt2-2000.json``) took E4M3's table for it, whose values are
the format's but at exact ties and within 5e-7 (see :class:`FormatCodec`).

Each codec runs once per ``--seeds`` (the seed draws the initial weights; the batch order is the data module's own);
each run prints its validation losses as they come and its final one against ``fp32``'s (no codec) of the same seed,
and the summary gives each codec's mean over the seeds against ``fp32``'s mean, beside the spread of ``fp32`` between
seeds: the run-to-run noise any codec's difference must be read against. ``--fp32-from`` takes the ``fp32`` runs of an
earlier record instead of running them again.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_state_codecs.py --steps 400 --codecs fp32 e4m3 --seeds 0 1 2 \\
        --out docs/state-codecs-gpt2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compression import Record, gpt2_task  # noqa: E402
from bench_state_formats import cpu_model  # noqa: E402

from lightning_smartinf.core.state_formats import (  # noqa: E402
    BLOCK,
    E4M3_MAX,
    ROOT_CODE,
    Int8,
    UnsignedFloat8,
    state_format,
)

_CODES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
#: The finite E4M3 codes' values, sorted (largest 448), and the non-negative ones (a square root's codes).
E4M3_SIGNED = torch.unique(_CODES[torch.isfinite(_CODES)])
E4M3_UNSIGNED = E4M3_SIGNED[E4M3_SIGNED >= 0]


def dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' dynamic quantization map (its 8-bit optimizers' code), sorted; written out here so that the
    benchmark runs without bitsandbytes: sign, a run of zero bits giving the exponent, then a linear fraction."""
    values, max_exp = [], 7
    bits = 7 if signed else 8  # the bits after the sign
    for i in range(max_exp):
        fractions = 2 ** (i + bits - max_exp) + 1  # the fraction's steps double with each decade
        boundaries = torch.linspace(0.1, 1, fractions)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        values += (10 ** (-(max_exp - 1) + i) * means).tolist()
        if signed:
            values += (-(10 ** (-(max_exp - 1) + i)) * means).tolist()
    values += [0.0, 1.0]
    return torch.unique(torch.tensor(values, dtype=torch.float32))


@dataclass(frozen=True)
class Codec:
    """Blockwise absmax quantization to the nearest value of ``table``: a block's scale is its largest magnitude over
    the table's largest value (as the ``int8`` format's reference computes it)."""

    table: torch.Tensor
    block: int = 256
    sqrt: bool = False  # store the square root (a never-negative state)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().flatten().float()
        n = flat.numel()
        pad = -n % self.block
        work = torch.nn.functional.pad(flat.sqrt() if self.sqrt else flat, (0, pad)).view(-1, self.block)
        scale = work.abs().amax(dim=1, keepdim=True).div_(self.table.max())
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        midpoints = (self.table[1:] + self.table[:-1]) / 2
        codes = torch.bucketize(work / safe, midpoints)
        out = (self.table[codes] * scale).flatten()[:n]
        return (out.square() if self.sqrt else out).view_as(x)


@dataclass(frozen=True)
class FormatCodec:
    """A moment through the ``int8`` state format itself, as a device stores and loads it (its C kernels where they
    build): ``state`` names the moment, so that ``exp_avg_sq`` is stored by its square root. Its values are the
    table codec's ``Codec(E4M3_*)``'s but at exact ties, which it rounds to even as the format does, and within a
    few units in the last place for the second moment (the table codec takes torch's square root, which is not always
    correctly rounded: 0.4% of elements, at most 5e-7 apart, on random data); six times faster."""

    state: str
    #: The code of the second moment's square root (another than the format's: its plain-torch reference runs).
    root_code: UnsignedFloat8 = ROOT_CODE

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        native = self.root_code.exponent_bits == ROOT_CODE.exponent_bits
        fmt = state_format("int8") if native else Int8(native=False, root_code=self.root_code)
        flat = x.detach().flatten().float().contiguous()
        raw = torch.empty(fmt.stored_bytes(flat.numel()), dtype=torch.uint8)
        fmt.store(flat, raw, self.state)
        out = torch.empty_like(flat)
        fmt.load(raw, out, self.state)
        return out.view_as(x)


@dataclass(frozen=True)
class EarlierRootCodec:
    """A second moment as ``int8`` stored it before it took :data:`ROOT_CODE`: its IEEE square root over the block's
    largest / 448, in FP8 E4M3 (torch's conversion: round to nearest, ties to even), blocks of 256, the bytes the
    format's reference gave then."""

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().flatten().float().contiguous()
        n = flat.numel()
        root = torch.from_numpy(numpy.sqrt(torch.nn.functional.pad(flat, (0, -n % BLOCK)).numpy()))
        rows = root.view(-1, BLOCK)
        scale = rows.amax(dim=1, keepdim=True) / E4M3_MAX
        codes = (rows / scale.masked_fill(scale == 0, 1.0)).to(torch.float8_e4m3fn)
        return (codes.float() * scale).square().flatten()[:n].view_as(x)


#: A codec of one moment: what a device stores and loads back.
MomentCodec = Codec | FormatCodec | EarlierRootCodec
#: Each variant: the codec of the first moment and of the second (``None``: kept in fp32).
CODECS: dict[str, tuple[MomentCodec | None, MomentCodec | None]] = {
    "fp32": (None, None),
    "e4m3-ue4m4": (FormatCodec("exp_avg"), FormatCodec("exp_avg_sq")),
    "e4m3-ue3m5": (FormatCodec("exp_avg"), FormatCodec("exp_avg_sq", UnsignedFloat8(3))),
    "e4m3": (FormatCodec("exp_avg"), EarlierRootCodec()),
    "e4m3-m": (FormatCodec("exp_avg"), None),
    "e4m3-v": (None, EarlierRootCodec()),
    "e4m3-b64": (Codec(E4M3_SIGNED, 64), Codec(E4M3_UNSIGNED, 64, sqrt=True)),
    "e4m3-direct": (Codec(E4M3_SIGNED), Codec(E4M3_UNSIGNED)),
    "dynamic": (Codec(dynamic_map(True)), Codec(dynamic_map(False))),
    "dynamic-sqrt": (Codec(dynamic_map(True)), Codec(dynamic_map(False), sqrt=True)),
}


class QuantizedMoments(L.Callback):
    """After each optimizer step, each AdamW moment becomes what ``codecs`` store and load back."""

    def __init__(self, codecs: tuple[MomentCodec | None, MomentCodec | None]) -> None:
        self.codecs = codecs

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        for state in trainer.optimizers[0].state.values():
            for key, codec in zip(("exp_avg", "exp_avg_sq"), self.codecs):
                if codec is not None and key in state:
                    state[key].copy_(codec.round_trip(state[key]))


class PrintedRecord(Record):
    """:class:`Record`, printing each validation loss as it comes: a run of an hour shows where it stands, and one cut
    short leaves its evaluations in the log."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not trainer.sanity_checking:
            step, loss = self.val[-1]
            print(f"{self.label}: step {step}, validation loss {loss:.4f}", flush=True)


def plain_trainer(steps: int, callbacks: list[L.Callback], val_every: int | None = None) -> L.Trainer:
    """How this script's runs train: plain Lightning on one CPU device, fp32, clipping at 1.0, quiet; ``val_every``:
    32 validation batches every that many steps (``None``: no validation)."""
    validation: dict[str, Any] = (
        {"val_check_interval": val_every, "check_val_every_n_epoch": None, "limit_val_batches": 32}
        if val_every
        else {"limit_val_batches": 0}
    )
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=steps,
        gradient_clip_val=1.0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **validation,
    )


def run(name: str, seed: int, steps: int, val_every: int, root: Path) -> Record:
    L.seed_everything(seed, verbose=False)
    model, datamodule = gpt2_task(root, 384, 6, 4.0)
    model.configure_model()
    record = PrintedRecord(f"seed {seed}, {name}")
    trainer = plain_trainer(steps, [record, QuantizedMoments(CODECS[name])], val_every)
    trainer.fit(model, datamodule=datamodule)
    return record


def plot(records: list[dict[str, Any]], out: Path) -> None:
    """``out``: each codec's validation loss by step for every seed of ``records`` (this script's records), and each
    one's ratio to ``fp32``'s of the same seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (losses, ratios) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    drawn: set[tuple[str, str]] = set()  # a run two records hold (fp32 taken with --fp32-from) is drawn once
    for record in records:
        fp32 = record["val"]["fp32"]
        for name, by_seed in record["val"].items():
            for seed, points in by_seed.items():
                if (name, seed) in drawn:
                    continue
                drawn.add((name, seed))
                label = f"{name}, seed {seed}"
                losses.plot(*zip(*points), label=label, marker="o", markersize=3)
                if name != "fp32" and seed in fp32:
                    base = dict(map(tuple, fp32[seed]))
                    steps = [step for step, _ in points if step in base]
                    ratios.plot(steps, [loss / base[step] for step, loss in points if step in base], label=label)
    ratios.axhline(1.01, color="grey", linestyle="--", linewidth=0.8, label="the bound, 1.01")
    losses.set_ylabel("validation loss")
    ratios.set_ylabel("against fp32, same seed")
    ratios.set_xlabel("step")
    losses.set_title("GPT-2 task, AdamW with its moments through each codec", fontsize=9)
    losses.legend(fontsize=7)
    ratios.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--codecs", nargs="+", choices=list(CODECS), default=["fp32", "e4m3", "dynamic"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.png")
    parser.add_argument(
        "--plot",
        nargs="+",
        type=Path,
        default=None,
        metavar="RECORD",
        help="run nothing: plot these records of this script together into <out>.png",
    )
    parser.add_argument(
        "--fp32-from",
        type=Path,
        default=None,
        help="a record of this script with the same --steps (checked) and --val-every, made on this kind of CPU: take "
        "its fp32 runs of the seeds it has instead of running them again",
    )
    args = parser.parse_args(argv)
    if args.plot:
        if args.out is None:
            parser.error("--plot needs --out: the plot goes to <out>.png")
        plot([json.loads(path.read_text()) for path in args.plot], args.out.with_suffix(".png"))
        return
    names = ["fp32"] + [c for c in args.codecs if c != "fp32"]
    print(f"CPU: {cpu_model()}; {args.steps} steps; seeds {args.seeds}", flush=True)
    final: dict[str, dict[int, float]] = {name: {} for name in names}
    val: dict[str, dict[int, list]] = {name: {} for name in names}
    seconds: dict[str, float] = {name: 0.0 for name in names}
    reused: list[int] = []
    if args.fp32_from is not None:
        earlier = json.loads(args.fp32_from.read_text())
        if earlier["steps"] != args.steps:
            parser.error(f"--fp32-from {args.fp32_from}: its runs took {earlier['steps']} steps, not {args.steps}")
        for seed in args.seeds:
            if str(seed) in earlier["final_val_loss"]["fp32"]:
                final["fp32"][seed] = earlier["final_val_loss"]["fp32"][str(seed)]
                val["fp32"][seed] = earlier["val"]["fp32"][str(seed)]
                reused.append(seed)
                print(f"seed {seed}, fp32: final validation loss {final['fp32'][seed]:.4f} (from {args.fp32_from})")
    with tempfile.TemporaryDirectory(prefix="smartinf-codecs-") as tmp:
        for seed in args.seeds:  # a seed's codecs one after another: a run stopped early keeps whole seeds
            for name in names:
                if name == "fp32" and seed in reused:
                    continue
                start = time.perf_counter()
                record = run(name, seed, args.steps, args.val_every, Path(tmp))
                seconds[name] += time.perf_counter() - start
                val[name][seed], final[name][seed] = record.val, record.val[-1][1]
                ratio = final[name][seed] / final["fp32"][seed]
                print(f"seed {seed}, {name}: final validation loss {final[name][seed]:.4f} ({ratio:.4f}x fp32's)")
    means = {name: statistics.fmean(losses.values()) for name, losses in final.items()}
    spread = max(final["fp32"].values()) / min(final["fp32"].values())
    for name in names:
        print(f"{name}: mean final validation loss {means[name]:.4f} ({means[name] / means['fp32']:.4f}x fp32's)")
    print(f"fp32 between seeds: the largest final loss is {spread:.4f}x the smallest", flush=True)
    if args.out is not None:
        result = {
            "cpu": cpu_model(),
            "steps": args.steps,
            "seeds": args.seeds,
            "final_val_loss": final,
            "mean_final_val_loss": means,
            "mean_ratio_to_fp32": {name: mean / means["fp32"] for name, mean in means.items()},
            "fp32_spread_between_seeds": spread,
            "fp32_from": {"record": str(args.fp32_from), "seeds": reused} if reused else None,
            "val": val,
            "seconds": seconds,
        }
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        plot([json.loads(json.dumps(result))], args.out.with_suffix(".png"))  # (the seeds as the record's keys)


if __name__ == "__main__":
    main()
