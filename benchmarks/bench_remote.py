"""Remote device servers: the protocol's overhead over loopback against the in-process ``cpu`` backend.

One script, both backends side by side, no DeepSpeed engine (the backend alone, as the controller drives it):

- **local**: ``CpuBackend`` with one device on ``--path/local``;
- **remote**: a ``smartinf serve`` process on loopback with one device on ``--path/server``, reached by
  ``RemoteBackend`` (gRPC, bearer token, chunked frames).

Both update AdamW over ``--params`` parameters in shards of ``--sub-group`` elements: bf16 gradients in (dense, or
top-k pairs with ``--ratio``), bf16 parameters out. A step is timed from the first submit until every shard's
parameters are back and the state is written (``wait()``). Rounds alternate local and remote so drift on a noisy
machine hits both alike; the median over rounds is reported with each round. Network bytes per parameter per step
are the link counters (what the frames carry), to compare with the link figures (4.0 dense in bf16, 2.06 at 1%).

On this 2-core machine the server shares the cores with the trainer, so the overhead measured includes that
contention; on two machines it does not.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_remote.py --path /var/tmp/remote-bench --params 100e6
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.remote_servers import ServerProcess, write_token  # noqa: E402

from lightning_smartinf.core.backend import Backend, ShardSpec  # noqa: E402
from lightning_smartinf.core.compression import compress_topk  # noqa: E402
from lightning_smartinf.core.rules import Adam, StepParams  # noqa: E402
from lightning_smartinf.devices.cpu import CpuBackend  # noqa: E402
from lightning_smartinf.devices.remote.client import RemoteBackend  # noqa: E402
from lightning_smartinf.devices.remote.tokens import read_token  # noqa: E402


def shards(params: int, sub_group: int) -> list[ShardSpec]:
    sizes = [sub_group] * (params // sub_group) + ([params % sub_group] if params % sub_group else [])
    return [ShardSpec(index=i, numel=n, rule=Adam(decoupled_weight_decay=True)) for i, n in enumerate(sizes)]


def prepare(backend: Backend, specs: list[ShardSpec]) -> None:
    backend.open(specs)
    for spec in specs:
        backend.initialize(spec.index, torch.randn(spec.numel) * 0.02)
    backend.wait()


def step(backend: Backend, specs, grads, outs, number: int, ratio: float | None) -> float:
    started = time.perf_counter()
    handles = []
    for spec, grad, out in zip(specs, grads, outs):
        sent = grad if ratio is None else compress_topk(grad, ratio, value_dtype=torch.bfloat16)
        hp = StepParams(step=number, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
        handles.append(backend.submit(spec.index, sent, hp, out, link_dtype=torch.bfloat16))
    for handle in handles:
        backend.result(handle)
    backend.wait()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", type=Path, required=True, help="scratch directory on the disk to measure")
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--sub-group", type=int, default=10_000_000)
    parser.add_argument("--ratio", type=float, default=None, help="top-k kept ratio (default: dense)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round (after one warm-up step)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    params = int(args.params)
    shutil.rmtree(args.path, ignore_errors=True)
    args.path.mkdir(parents=True)
    token_file = write_token(args.path / "token")
    server = ServerProcess([args.path / "server"], token_file).start()
    specs = shards(params, args.sub_group)
    generator = torch.Generator().manual_seed(0)
    grads = [(torch.randn(s.numel, generator=generator) * 1e-3).to(torch.bfloat16) for s in specs]
    if args.ratio is not None:
        grads = [g.float() for g in grads]  # compressed from fp32, as the controller's residual is
    outs = [torch.empty(s.numel, dtype=torch.bfloat16) for s in specs]
    backends: dict[str, Backend] = {
        "local": CpuBackend([args.path / "local"]),
        "remote": RemoteBackend([server.address], read_token(token_file)),
    }
    try:
        for backend in backends.values():
            prepare(backend, specs)
        times: dict[str, list[float]] = {name: [] for name in backends}
        link: dict[str, float] = {}
        number = 0
        for round_ in range(args.rounds):
            for name, backend in backends.items():
                number_here = number
                step(backend, specs, grads, outs, number_here + 1, args.ratio)  # warm-up: page cache, sockets
                before = backend.traffic_snapshot()
                round_times = [
                    step(backend, specs, grads, outs, number_here + 2 + i, args.ratio) for i in range(args.steps)
                ]
                moved = backend.traffic_snapshot() - before
                link[name] = (moved.link_write_bytes + moved.link_read_bytes) / params / args.steps
                times[name].append(statistics.median(round_times))
                print(f"round {round_ + 1} {name:>6}: {times[name][-1]:.3f} s/step", flush=True)
            number += args.steps + 1
        local, remote = statistics.median(times["local"]), statistics.median(times["remote"])
        report = {
            "params": params,
            "sub_group": args.sub_group,
            "ratio": args.ratio,
            "local_s": local,
            "remote_s": remote,
            "overhead": remote / local - 1,
            "rounds": times,
            "network_bytes_per_param_step": link["remote"],
            "local_link_bytes_per_param_step": link["local"],
        }
        print(json.dumps(report, indent=1))
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=1))
    finally:
        for backend in backends.values():
            backend.close()
        server.stop()
        shutil.rmtree(args.path, ignore_errors=True)


if __name__ == "__main__":
    main()
