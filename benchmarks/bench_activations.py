"""Activation offload on a GPT-style model (CPU): memory held by saved activations, step time, and where the time goes.

Modes, measured side by side in alternating rounds (the order rotates each round, so machine load hits all alike):
  plain     no hooks at all (step-time reference)
  resident  the hooks installed with offload disabled: every saved activation stays in memory (memory reference)
  offload   activations above the threshold outside the last ``keep_last`` layers go to files on --path

"Saved-activation bytes" are the bytes of distinct saved tensors (deduplicated by storage) that the hooks hold in
memory; parameters are not counted. Files are opened with O_DIRECT where the filesystem allows, so reads are not
served by the page cache.

Per step and mode the profile records the process's CPU seconds (all threads) and minor page faults, the storage
device's busy time and bytes (``/proc/diskstats``), and the offloader's own clocks: how long forward and backward
waited, and the I/O threads' copy, write and read seconds.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_activations.py --path /var/tmp/act
    PYTHONPATH=. .venv/bin/python benchmarks/bench_activations.py --path /var/tmp/act --preset long
    PYTHONPATH=. .venv/bin/python benchmarks/bench_activations.py --path /var/tmp/act --device cuda   # on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_smartinf.activations import SavedTensorOffloader
from lightning_smartinf.activations.costs import offload_overhead
from lightning_smartinf.activations.tuning import MEASURE_AT, MEASURE_COUNT, RECHECK_COUNT, tune
from lightning_smartinf.core.io.direct import supports_direct_io
from lightning_smartinf.plan.cost_model import load_profile

#: Model and batch of each configuration; ``long`` is the one where activations dominate (4x the tokens).
PRESETS = {
    "default": dict(dim=384, layers=8, heads=6, seq=256, batch=4, vocab=2048),
    "long": dict(dim=384, layers=8, heads=6, seq=1024, batch=4, vocab=2048),
}
MODES = ("plain", "resident", "offload")


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class DiskCounters:
    """The storage device's cumulative busy milliseconds and sectors read/written (``/proc/diskstats``).

    A path on a partition is counted on its partition's row; a path whose device has no row (tmpfs) counts zero.
    """

    def __init__(self, path: Path) -> None:
        dev = os.stat(path).st_dev
        self._key = (os.major(dev), os.minor(dev))

    def read(self) -> tuple[float, int, int]:
        with open("/proc/diskstats") as f:
            for line in f:
                parts = line.split()
                if (int(parts[0]), int(parts[1])) == self._key:
                    return int(parts[12]) / 1e3, int(parts[5]) * 512, int(parts[9]) * 512
        return 0.0, 0, 0


def _sample(disk: DiskCounters) -> dict[str, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    busy, read, written = disk.read()
    return {
        "t": time.perf_counter(),
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "sys_s": usage.ru_stime,
        "minor_faults": usage.ru_minflt,
        "context_switches": usage.ru_nvcsw + usage.ru_nivcsw,
        "disk_busy_s": busy,
        "disk_read_bytes": read,
        "disk_write_bytes": written,
    }


_CLOCKS = (
    "forward_wait_s",
    "backward_wait_s",
    "copy_s",
    "write_s",
    "read_s",
    "write_busy_s",
    "read_busy_s",
    "io_cpu_s",
)


def run_step(model: nn.Module, off: SavedTensorOffloader | None, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    if off is None:
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        return
    off.reset_peak()
    with off:
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)


def profile_step(
    model: nn.Module, off: SavedTensorOffloader | None, x: torch.Tensor, y: torch.Tensor, disk: DiskCounters
) -> dict[str, float]:
    """One timed step: wall seconds, and what the process, the disk and the offloader did during it."""
    clocks = {k: getattr(off.stats, k) for k in _CLOCKS} if off is not None else {}
    before = _sample(disk)
    run_step(model, off, x, y)
    after = _sample(disk)
    out = {k: after[k] - before[k] for k in before}
    out["step_s"] = out.pop("t")
    out.update({k: getattr(off.stats, k) - v for k, v in clocks.items()})
    return out


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def summarize(rows: list[dict[str, float]], cores: int) -> dict[str, float]:
    """Medians over steps; CPU busy as a fraction of the machine's cores, disk busy as a fraction of wall time."""
    keys = sorted(set().union(*rows))
    out = {k: round(_median(rows, k), 4) for k in keys}
    out["cpu_busy"] = round(statistics.median(r["cpu_s"] / (r["step_s"] * cores) for r in rows), 3)
    out["disk_busy"] = round(statistics.median(min(1.0, r["disk_busy_s"] / r["step_s"]) for r in rows), 3)
    return out


def gpu_prediction(shape: dict[str, int], off: SavedTensorOffloader, profile_name: str) -> dict[str, Any]:
    """What the cost model predicts for this model on a GPU: layer times from its FLOPs at the profile's sustained
    rate, the layers' saved bytes and the disk rates measured here, and no CPU cost (compute is not on the host)."""
    profile = load_profile(profile_name)
    tuned = off.tuning
    if tuned is None or off._meter is None:
        return {"error": "the offloader chose no settings (all were given)"}
    d, tokens = shape["dim"], shape["batch"] * shape["seq"]
    layer_params = 12 * d * d + 13 * d
    # Forward FLOPs of a block: its matrix products, and causal attention's two (half of each computed).
    flops = 2 * tokens * layer_params + 2 * shape["batch"] * shape["seq"] ** 2 * d
    layer_s = flops / (profile.gpu_peak_tflops * 1e12 * profile.gpu_efficiency)
    head_s = 2 * tokens * d * shape["vocab"] / (profile.gpu_peak_tflops * 1e12 * profile.gpu_efficiency)
    io = dataclasses.replace(tuned.io, compute_on_host=False)
    sizes = off._meter.sizes
    chosen = tune([layer_s] * shape["layers"], head_s, sizes, io, None, None, None)
    everything = offload_overhead(
        [layer_s] * shape["layers"], [sum(x) for x in sizes], 0, io, chosen.max_inflight_bytes
    )
    return {
        "profile": profile.name,
        "gpu": profile.gpu,
        "sustained_tflops": profile.gpu_peak_tflops * profile.gpu_efficiency,
        "layer_forward_ms": round(layer_s * 1e3, 3),
        "step_s": round(chosen.predicted.step_s, 5),
        "chosen": chosen.describe(shape["layers"]),
        "overhead_chosen": round(chosen.predicted.share, 3),
        "overhead_offloading_every_layer": round(everything.share, 3),
        # What the disk would have to do for every layer's bytes to leave during forward and return during backward.
        "write_gbps_to_hide_every_layer": round(sum(map(sum, sizes)) / (layer_s * shape["layers"]) / 1e9, 1),
        "read_gbps_to_hide_every_layer": round(sum(map(sum, sizes)) / (2 * layer_s * shape["layers"]) / 1e9, 1),
    }


def main() -> None:  # noqa: PLR0915 - one linear script
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", type=Path, default=None, help="storage directory (default: a temp dir)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    for name in ("dim", "layers", "heads", "seq", "batch", "vocab"):
        parser.add_argument(f"--{name}", type=int, default=None, help="overrides the preset")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode per round (after 1 warm-up)")
    parser.add_argument("--keep-last", type=int, default=None, help="default: the offloader's default")
    parser.add_argument("--threshold", type=int, default=None, help="bytes; default: the offloader's default")
    parser.add_argument("--budget-mib", type=int, default=None, help="default: the offloader's default")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    parser.add_argument("--gpu-profile", default="paper-a100", help="planner profile of the GPU prediction")
    args = parser.parse_args()
    shape = PRESETS[args.preset] | {k: getattr(args, k) for k in PRESETS["default"] if getattr(args, k) is not None}

    path = args.path or Path(tempfile.mkdtemp(prefix="act-bench-"))
    path.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    tokens = torch.randint(
        0, shape["vocab"], (shape["batch"], shape["seq"] + 1), generator=torch.Generator().manual_seed(0)
    )
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return GPT(shape["vocab"], shape["seq"], shape["dim"], shape["layers"], shape["heads"]).to(device)

    options: dict[str, Any] = {}
    if args.keep_last is not None:
        options["keep_last"] = args.keep_last
    if args.threshold is not None:
        options["threshold_bytes"] = args.threshold
    if args.budget_mib is not None:
        options["max_inflight_bytes"] = args.budget_mib << 20
    runs: dict[str, tuple[nn.Module, SavedTensorOffloader | None]] = {"plain": (make(), None)}
    runs["resident"] = (m := make(), SavedTensorOffloader([path], enabled=False).attach(m))
    runs["offload"] = (m := make(), SavedTensorOffloader([path], **options).attach(m))
    # Settings left to the offloader are chosen after its first micro-batches and re-checked once over the next
    # ones (which pause offload every other micro-batch): time only what it settles on.
    model, off = runs["offload"]
    for _ in range(MEASURE_AT + MEASURE_COUNT - 1 + 2 * RECHECK_COUNT + 1):
        run_step(model, off, x, y)
    settled = dataclasses.replace(runs["offload"][1].stats)
    disk = DiskCounters(path)
    cores = len(os.sched_getaffinity(0))
    rows: dict[str, list[list[dict[str, float]]]] = {k: [] for k in MODES}
    for r in range(args.rounds):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
        for name in order:
            model, off = runs[name]
            run_step(model, off, x, y)  # warm-up
            rows[name].append([profile_step(model, off, x, y, disk) for _ in range(args.steps)])
    grads_equal = all(
        torch.equal(a.grad, b.grad) for a, b in zip(runs["plain"][0].parameters(), runs["offload"][0].parameters())
    )
    res_stats, off_stats = runs["resident"][1].stats, runs["offload"][1].stats
    offloader = runs["offload"][1]
    steps = args.rounds * (args.steps + 1)
    every = {k: [row for rnd in v for row in rnd] for k, v in rows.items()}
    med = {k: _median(v, "step_s") for k, v in every.items()}
    per_round = [
        round(statistics.median(r["step_s"] for r in off) / statistics.median(r["step_s"] for r in plain) - 1, 3)
        for off, plain in zip(rows["offload"], rows["plain"])
    ]
    result = {
        "config": shape
        | {
            "preset": args.preset,
            "device": str(device),
            "path": str(path),
            "direct_io": supports_direct_io(path),
            "threads": torch.get_num_threads(),
            "cores": cores,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "offloader": {k: getattr(offloader, k) for k in ("threshold_bytes", "keep_last", "max_inflight_bytes")}
            | {"chosen": offloader.tuning.describe(shape["layers"]) if offloader.tuning else "given"}
            | {"measured_overhead_at_recheck": offloader.measured_overhead},
        },
        "params_M": round(sum(p.numel() for p in runs["plain"][0].parameters()) / 1e6, 2),
        "peak_saved_bytes_resident": res_stats.peak_resident_bytes,
        "peak_saved_bytes_offload": off_stats.peak_resident_bytes,
        "activation_memory_reduction": round(1 - off_stats.peak_resident_bytes / res_stats.peak_resident_bytes, 3),
        "peak_staging_bytes_offload": off_stats.peak_staging_bytes,
        "reduction_counting_staging": round(
            1 - (off_stats.peak_resident_bytes + off_stats.peak_staging_bytes) / res_stats.peak_resident_bytes, 3
        ),
        "step_s_median": {k: round(v, 4) for k, v in med.items()},
        "overhead_vs_plain": round(med["offload"] / med["plain"] - 1, 3),
        "overhead_vs_plain_per_round": per_round,
        "overhead_vs_resident_hooks": round(med["offload"] / med["resident"] - 1, 3),
        "profile_median_per_step": {k: summarize(v, cores) for k, v in every.items()},
        "per_step_bytes_written": (off_stats.bytes_written - settled.bytes_written) // steps,
        "per_step_bytes_read": (off_stats.bytes_read - settled.bytes_read) // steps,
        "per_step": {
            k: (getattr(off_stats, k) - getattr(settled, k)) / steps
            for k in ("tensors_offloaded", "tensors_kept", "dedup_hits", "forwarded", "sync_reads", "waited_reads")
        },
        "offload_stats": dataclasses.asdict(off_stats),
        "grads_bitwise_equal_last_step": grads_equal,
    }
    if device.type == "cpu":
        result["gpu_prediction"] = gpu_prediction(shape, offloader, args.gpu_profile)
    for _, o in runs.values():
        if o is not None:
            o.close()
    result["files_left"] = [str(f) for f in path.rglob("*") if f.is_file()]
    if args.path is None:  # the benchmark's own temporary directory
        shutil.rmtree(path, ignore_errors=True)
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
