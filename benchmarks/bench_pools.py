"""Heterogeneous device pools: sub-groups shared out by measured speed against round-robin, beside the optimum.

Two storage paths on this machine's disk, each behind an I/O engine rate-limited to a different bandwidth (a
token bucket over the device's reads and writes together: a slower disk). The backend alone (as the ZeRO adapter
drives it) streams AdamW over ``--mib`` MiB of fp32 state in equal shards; a step is timed from the first submit to
the last write-back (``wait()``), so it counts all 12 B/param read and 12 B/param written.

- **round-robin**: shard ``s`` on device ``s mod 2`` (the default before weighted placement);
- **measured**: the speeds :func:`~lightning_smartinf.core.placement.measure_write_read` measures through the same
  engines (what the strategy does for paths on different filesystems), as ``device_weights``;
- **optimum**: every byte moved at the two devices' summed rate, the bound no placement beats.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_pools.py --path /var/tmp/pools --rates 800 200
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.io.direct import RateLimitedIO, ThreadedIO
from lightning_smartinf.core.placement import RoundRobin, measure_write_read
from lightning_smartinf.core.rules import Adam, StepParams
from lightning_smartinf.devices.cpu import CpuBackend

OUT = Path(__file__).resolve().parent / "out" / "bench_pools.json"


def throttled(bytes_per_s: float) -> RateLimitedIO:
    """The devices' engine at most ``bytes_per_s``, reads and writes together: a slower disk."""
    return RateLimitedIO(ThreadedIO(), bytes_per_s)


def run(root: Path, rates: list[float], shards: int, numel: int, steps: int, weights: Any) -> dict[str, Any]:
    engines = iter([throttled(r) for r in rates])
    backend = CpuBackend(
        [root / f"dev{i}" for i in range(len(rates))],
        chunk_elems=1 << 20,
        buffer_count=8,
        io_factory=lambda: next(engines),
        placement=RoundRobin() if weights is None else None,
        device_weights=weights,
    )
    try:
        specs = [ShardSpec(i, numel, Adam(decoupled_weight_decay=True)) for i in range(shards)]
        backend.open(specs)
        for i in range(shards):
            backend.initialize(i, torch.zeros(numel))
        backend.wait()
        grad = torch.full((numel,), 1e-3, dtype=torch.bfloat16)
        outs = [torch.empty(numel, dtype=torch.bfloat16) for _ in range(shards)]
        times = []
        for t in range(1, steps + 1):
            started = time.perf_counter()
            for i in range(shards):
                backend.submit(i, grad, StepParams(step=t, lr=1e-4), outs[i])
            backend.wait()
            times.append(time.perf_counter() - started)
        counts = [backend.assignment.count(d) for d in range(len(rates))]
        return {"step_s": statistics.median(times), "times_s": times, "shards_per_device": counts}
    finally:
        backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", required=True, help="a directory on a disk faster than the summed --rates")
    parser.add_argument("--rates", type=float, nargs="+", default=[800.0, 200.0], help="MB/s of each device")
    parser.add_argument("--mib", type=float, default=768.0, help="MiB of fp32 state (master + 2 Adam states)")
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="alternate round-robin and measured this many times")
    args = parser.parse_args()

    rates = [r * 1e6 for r in args.rates]
    numel = int(args.mib * 2**20 / 12 / args.shards) // 1024 * 1024
    root = Path(args.path)
    root.mkdir(parents=True, exist_ok=True)
    measured_dirs = [root / f"probe{i}" for i in range(len(rates))]
    for d in measured_dirs:
        d.mkdir(exist_ok=True)
    weights = [measure_write_read(d, throttled(r)) for d, r in zip(measured_dirs, rates)]
    for d in measured_dirs:
        shutil.rmtree(d)
    state = 12 * numel * args.shards
    optimum = 2 * state / sum(rates)  # every state byte read and written once, at the summed rate
    results: dict[str, list[dict[str, Any]]] = {"round-robin": [], "measured": []}
    for r in range(args.rounds):
        order = ("round-robin", "measured") if r % 2 == 0 else ("measured", "round-robin")
        for name in order:
            work = root / f"{name}-{r}"
            results[name].append(
                run(work, rates, args.shards, numel, args.steps, None if name == "round-robin" else weights)
            )
            shutil.rmtree(work, ignore_errors=True)
            print(f"# round {r + 1} {name}: {results[name][-1]}", flush=True)
    rr = statistics.median(x["step_s"] for x in results["round-robin"])
    ms = statistics.median(x["step_s"] for x in results["measured"])
    table = "\n".join(
        [
            f"{state / 2**20:.0f} MiB of state in {args.shards} shards; devices throttled to "
            + ", ".join(f"{r:g}" for r in args.rates)
            + " MB/s; measured "
            + ", ".join(f"{w / 1e6:.0f}" for w in weights)
            + " MB/s",
            "",
            "| placement | shards per device | step, median (s) | / optimum |",
            "|---|---|---:|---:|",
            f"| round-robin | {results['round-robin'][-1]['shards_per_device']} | {rr:.2f} | {rr / optimum:.2f} |",
            f"| measured speeds | {results['measured'][-1]['shards_per_device']} | {ms:.2f} | {ms / optimum:.2f} |",
            f"| optimum (all bytes at the summed rate) | — | {optimum:.2f} | 1.00 |",
        ]
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"args": vars(args), "weights": weights, "results": results, "table": table}, indent=2))
    print(table)


if __name__ == "__main__":
    main()
