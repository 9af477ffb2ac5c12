"""What split masters cost the devices' compute: the update of each state format with whole and with split masters,
the state in host memory (the memory tier: no disk), alternating rounds.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_split_masters.py --numel 67108864 --rounds 2 --out docs/NAME.json

Each configuration updates ``--numel`` elements in shards of 8M with AdamW as users build it (single-tensor, not
``fused=True``) for four steps and keeps the fastest of the last three: nanoseconds per element, one device (its
worker thread, and helper threads for the fused format kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.build import tiers_over
from lightning_smartinf.core.rules import Adam, StepParams
from lightning_smartinf.devices.cpu import CpuBackend

SHARD = 8 << 20


def time_updates(numel: int, state_precision: str, master_format: str, root: Path) -> float:
    """Nanoseconds per element of one update of every shard (the fastest of steps 2 to 4)."""
    sizes = [SHARD] * max(1, numel // SHARD)
    backend = tiers_over(
        CpuBackend([root / "device"], chunk_elems=1 << 20, buffer_count=4), memory_bytes=1 << 40,
        measure_memory_share=False,
    )  # fmt: skip
    rule = Adam(decoupled_weight_decay=True)
    specs = [
        ShardSpec(i, n, rule, state_format=state_precision, master_format=master_format) for i, n in enumerate(sizes)
    ]
    backend.open(specs)
    try:
        params = [torch.randn(n).to(torch.bfloat16) for n in sizes]
        if master_format == "split":
            backend.bind_parameters(lambda i: params[i])
        for i, p in enumerate(params):
            backend.initialize(i, p)
        backend.wait()
        grads = [torch.randn(n).to(torch.bfloat16) for n in sizes]
        times = []
        for step in range(1, 5):
            hp = StepParams(step=step, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
            started = time.perf_counter()
            for i, grad in enumerate(grads):
                backend.submit(i, grad, hp, params[i])
            backend.wait()
            times.append(time.perf_counter() - started)
        return min(times[1:]) / sum(sizes) * 1e9
    finally:
        backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=64 << 20, help="elements updated per step (default 64M)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    parser.add_argument("--formats", nargs="+", default=["fp32", "bf16", "int8"], help="state precisions")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            for fmt in args.formats:
                order = ("fp32", "split") if r % 2 == 0 else ("split", "fp32")
                for master_format in order:
                    ns = time_updates(args.numel, fmt, master_format, Path(scratch) / f"{fmt}-{master_format}-{r}")
                    results.setdefault(f"{fmt} state, {master_format} masters", []).append(ns)
                    print(f"round {r + 1}: {fmt} state, {master_format} masters: {ns:.2f} ns/element", flush=True)
    record = {
        "what": "ns per element of one update, state in host memory, AdamW single-tensor, one device",
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
        },
        "numel": args.numel,
        "ns_per_element_by_round": results,
    }
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
