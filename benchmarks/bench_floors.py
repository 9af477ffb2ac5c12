"""The floors of a training step on this machine, for the model ``bench_step.py`` builds with the same arguments.

- ``disk``: direct-I/O bandwidth of ``--storage`` reading and writing at once, through the devices' own I/O path and
  queue depth (``bench_step.raw_bandwidth``); the state's bytes per step over it give the disk's floor.
- ``update``: the rule's arithmetic on this CPU: fused ``torch.optim.AdamW`` over ``--update-elems`` fp32 elements,
  parameters per second (the devices run the same kernel); the model's parameters over it give the update's floor.
- ``forward_backward``: forward and backward of the same model with its parameters in memory (plain torch, bf16 like
  ``bench_step``'s ``bf16-mixed``, or fp32 with ``--precision 32-true``), no ZeRO, no offload.

Run it beside ``bench_step.py`` with the same model arguments (it prints one JSON object)::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_floors.py --dim 2048 --layers 30 --seq 16 --batch 1 \\
        --storage /var/tmp/b154
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_step  # noqa: E402
import torch  # noqa: E402


def update_rate(elems: int, repeats: int = 3) -> float:
    """Parameters per second of one fused AdamW step over ``elems`` fp32 elements (median of ``repeats``)."""
    param = torch.nn.Parameter(torch.randn(elems))
    param.grad = torch.randn(elems)
    optim = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.01, fused=True)
    optim.step()  # the moments exist from here on, as in training
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        optim.step()
        times.append(time.perf_counter() - started)
    return elems / sorted(times)[len(times) // 2]


def forward_backward_s(args: argparse.Namespace, repeats: int) -> tuple[float, int]:
    """Seconds of one forward and backward with the parameters in memory (bf16, or fp32 with ``32-true``), and the
    parameter count."""
    module = bench_step.build_module(args, "smart_infinity")
    model = module.model if args.precision == "32-true" else module.model.bfloat16()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)

    def once() -> float:
        started = time.perf_counter()
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    if repeats > 1:
        once()  # allocations and first-call costs (negligible beside a large model's pass: `--repeats 1` skips it)
    times = sorted(once() for _ in range(repeats))
    return times[len(times) // 2], module.num_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("dim", 512), ("layers", 6), ("vocab", 6144), ("seq", 128), ("batch", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--storage", required=True, help="the directory bench_step.py's devices use")
    parser.add_argument("--raw-gib", type=float, default=2.0)
    parser.add_argument("--update-elems", type=float, default=64e6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed", choices=("bf16-mixed", "32-true"))
    args = parser.parse_args()
    args.unfused = False
    torch.set_num_threads(os.cpu_count() or 1)
    disk = bench_step.raw_bandwidth(Path(args.storage), args.raw_gib)
    rate = update_rate(int(args.update_elems))
    fwd_bwd, params = forward_backward_s(args, args.repeats)
    state_bytes = 12 * params  # fp32 master, exp_avg, exp_avg_sq
    print(
        json.dumps(
            {
                "params": params,
                "disk": disk,
                "disk_floor_s": 2 * state_bytes / (disk["concurrent_gib_s"] * 2**30),
                "update_params_per_s": rate,
                "update_floor_s": params / rate,
                "forward_backward_in_memory_s": fwd_bwd,
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
