"""Device streaming: how close an emulated CSD's state streaming comes to the raw direct-I/O bandwidth.

One script, one storage path, no DeepSpeed engine (the backend alone, as the adapter drives it):

1. **raw**: direct I/O of the same path through the same I/O engine and request size as a device uses, with
   no update in between: sequential read, write, and read + write at once (the ceiling);
2. **1 device**: ``CpuBackend`` with one device streams AdamW over ``--gib`` GiB of fp32 master + moments
   (shards of ``--sub-group`` elements, bf16 gradients in, bf16 parameters out), ``--steps`` timed steps;
3. **2 devices**: the same state over two directories on the same disk (``dir/csd0``, ``dir/csd1``), one
   worker each: per-device seconds of read, write and compute show whether anything serialises across
   devices beyond the disk itself;
4. **4x state**: host memory of the update path (buffer pools, gradient chunks) and the process's RSS growth
   while streaming, at ``--gib`` and at 4x ``--gib``.

A step is timed from the first submit until every device has written its last chunk back (``wait()``), so
the state bandwidth counts all 12 B/param read and 12 B/param written. State files are opened with
``O_DIRECT`` (the script refuses a path that does not support it), so the page cache serves none of it.

    PYTHONPATH=. TORCH_EXTENSIONS_DIR=.venv/torch_extensions .venv/bin/python benchmarks/bench_streaming.py \
        --path /var/tmp --gib 4
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.io.direct import IOEngine, StateFile, ThreadedIO, aligned_empty, supports_direct_io
from lightning_smartinf.core.rules import Adam, StepParams
from lightning_smartinf.devices.cpu import CpuBackend

GIB = 2**30


def engine_factory(name: str, block: int, depth: int) -> Callable[[], IOEngine]:
    if name == "threads":
        return lambda: ThreadedIO(block, depth)
    from lightning_smartinf.zero.aio import DeepSpeedAIO, load_aio_op

    op = load_aio_op()
    return lambda: DeepSpeedAIO(block, depth, op=op)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakRss:
    """Samples the process RSS every 5 ms in a thread; ``peak`` is the highest seen."""

    def __init__(self) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def start(self) -> None:
        self.peak = rss_bytes()
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()


class RawProbe:
    """Direct I/O of the storage path in a device's own pattern, without the update in between.

    Two files of ``nbytes`` each; :meth:`both` reads one while overwriting the other, in ``record_bytes``
    requests, ``threads`` requests in flight per direction, one engine per direction: what a device's reader
    and writer threads do in a step over ``nbytes`` of state. Both files are fully written once first (a
    device's steps overwrite written blocks, never fresh fallocated extents).
    """

    def __init__(
        self, directory: Path, nbytes: int, record_bytes: int, factory: Callable[[], IOEngine], threads: int
    ) -> None:
        self.size = nbytes // record_bytes * record_bytes
        self.record_bytes = record_bytes
        self.work = Path(tempfile.mkdtemp(prefix="raw-", dir=directory))
        self.reader, self.writer = factory(), factory()
        self.a = StateFile(self.work / "a", self.size, create=True)
        self.b = StateFile(self.work / "b", self.size, create=True)
        self.threads = threads
        self.bufs = [aligned_empty(record_bytes) for _ in range(2 * threads)]
        self.offsets = range(0, self.size, record_bytes)
        for f in (self.a, self.b):
            self._timed([self._writes(f, i) for i in range(threads)])

    def _reads(self, i: int) -> Callable[[], None]:
        # Thread i of T takes records i, i + T, ...: T sequential streams interleaved, as T reader threads.
        return lambda: [self.reader.read(self.a, self.bufs[i], o) for o in self.offsets[i :: self.threads]]

    def _writes(self, f: StateFile, i: int) -> Callable[[], None]:
        buf = self.bufs[self.threads + i]
        return lambda: [self.writer.write(f, buf, o) for o in self.offsets[i :: self.threads]]

    @staticmethod
    def _timed(jobs: list[Callable[[], None]]) -> float:
        threads = [threading.Thread(target=job) for job in jobs]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    def read(self) -> float:
        return self.size / GIB / self._timed([self._reads(i) for i in range(self.threads)])

    def write(self) -> float:
        return self.size / GIB / self._timed([self._writes(self.b, i) for i in range(self.threads)])

    def both(self) -> float:
        """GiB/s of read + write together."""
        jobs = [self._reads(i) for i in range(self.threads)] + [self._writes(self.b, i) for i in range(self.threads)]
        return 2 * self.size / GIB / self._timed(jobs)

    def close(self) -> None:
        self.a.close()
        self.b.close()
        self.reader.close()
        self.writer.close()
        shutil.rmtree(self.work, ignore_errors=True)


def stream(
    dirs: list[Path],
    gib: float,
    args: argparse.Namespace,
    factory: Callable[[], IOEngine],
    probe: RawProbe | None = None,
) -> dict[str, Any]:
    """Time AdamW steps of ``gib`` GiB of state on one device per directory.

    With ``probe``, every timed step is preceded by a raw read + write pass of the same bytes, so each step
    has its own ceiling measured seconds before it (this virtual disk drifts by tens of percent per minute).
    """
    rule = Adam(decoupled_weight_decay=True)
    sub_group = args.sub_group
    numel_total = int(gib * GIB) // rule.bytes_per_element
    sizes = [sub_group] * (numel_total // sub_group) + ([numel_total % sub_group] if numel_total % sub_group else [])
    backend = CpuBackend(
        dirs, chunk_elems=args.chunk, buffer_count=args.buffer_count, io_factory=factory, io_threads=args.io_threads
    )
    try:
        backend.open([ShardSpec(i, n, rule) for i, n in enumerate(sizes)])
        grad = torch.randn(sub_group).mul_(1e-3).to(torch.bfloat16)  # one gradient, read by every shard
        outs = [torch.empty(sub_group, dtype=torch.bfloat16) for _ in dirs]
        master = torch.randn(sub_group)
        for i, n in enumerate(sizes):
            backend.initialize(i, master[:n])
        backend.wait()
        buffers = backend.buffer_bytes
        steps: list[dict[str, float]] = []
        # RSS is sampled over the timed steps only: the warm-up step creates the I/O threads, their aio handles
        # and the link scratch chunk, once per device, whatever the state size.
        peak, rss0 = PeakRss(), 0
        try:
            for step in range(1, args.steps + 2):  # step 1 is a warm-up
                if step == 2:
                    rss0 = rss_bytes()
                    peak.start()
                ceiling = probe.both() if probe is not None and step > 1 else None
                hp = StepParams(step=step, lr=1e-4, weight_decay=0.1)
                before = [(d.stats.read_s, d.stats.write_s, d.stats.compute_s) for d in backend.devices]
                t0 = backend.traffic.snapshot()
                start = time.perf_counter()
                handles = [backend.submit(i, grad[:n], hp, outs[i % len(dirs)][:n]) for i, n in enumerate(sizes)]
                for h in handles:
                    h.result()
                params_ready = time.perf_counter() - start
                backend.wait()
                wall = time.perf_counter() - start
                delta = (backend.traffic.snapshot() - t0).as_dict()
                state = delta["storage_read_bytes"] + delta["storage_write_bytes"]
                per_device = [
                    {
                        "read_s": d.stats.read_s - b[0],
                        "write_s": d.stats.write_s - b[1],
                        "compute_s": d.stats.compute_s - b[2],
                    }
                    for d, b in zip(backend.devices, before)
                ]
                if step > 1:
                    steps.append(
                        {
                            "wall_s": wall,
                            "params_ready_s": params_ready,
                            "state_gib": state / GIB,
                            "devices": per_device,
                            "raw_gib_s": ceiling,
                        }
                    )
        finally:
            peak.stop()
        best = min(steps, key=lambda s: s["wall_s"])
        median = sorted(s["wall_s"] for s in steps)[len(steps) // 2]
        efficiency = sorted(s["state_gib"] / s["wall_s"] / s["raw_gib_s"] for s in steps if s["raw_gib_s"])
        return {
            "efficiency_per_step": efficiency,
            "efficiency_median": statistics.median(efficiency) if efficiency else None,
            "raw_gib_s_per_step": [s["raw_gib_s"] for s in steps],
            "devices": len(dirs),
            "state_gib": gib,
            "shards": len(sizes),
            "step_wall_s": [s["wall_s"] for s in steps],
            "step_median_s": median,
            "params_ready_median_s": sorted(s["params_ready_s"] for s in steps)[len(steps) // 2],
            "state_gib_s_median": best["state_gib"] / median,
            "per_device_median_step": steps[[s["wall_s"] for s in steps].index(median)]["devices"],
            "update_path_buffer_mib": buffers / 2**20,
            "rss_growth_mib": (peak.peak - rss0) / 2**20,
        }
    finally:
        backend.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, default=Path(tempfile.gettempdir()), help="storage path (one disk)")
    parser.add_argument("--gib", type=float, default=4.0, help="GiB of fp32 master + Adam moments")
    parser.add_argument("--sub-group", type=int, default=8 << 20, help="elements per shard (ZeRO sub-group)")
    parser.add_argument("--chunk", type=int, default=1 << 20, help="elements per streamed chunk")
    parser.add_argument("--buffer-count", type=int, default=16, help="chunk buffers per device")
    parser.add_argument("--block", type=int, default=1 << 20, help="I/O block bytes")
    parser.add_argument("--depth", type=int, default=8, help="I/O queue depth")
    parser.add_argument("--io-threads", type=int, default=3, help="chunk transfers in flight per direction")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--engine", choices=["threads", "aio"], default="aio")
    parser.add_argument("--skip", nargs="*", default=[], choices=["two", "scale"], help="parts to leave out")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/bench_streaming.json"))
    args = parser.parse_args(argv)

    if not supports_direct_io(args.path):
        parser.error(f"--path {str(args.path)!r} does not support O_DIRECT; the page cache would serve the reads.")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    factory = engine_factory(args.engine, args.block, args.depth)
    root = Path(tempfile.mkdtemp(prefix="bench-streaming-", dir=args.path))
    record_bytes = args.chunk * 4 * 3  # one Adam chunk record: master, exp_avg, exp_avg_sq
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    try:
        readers = max(1, min(args.io_threads, args.buffer_count - 1))  # what the device can keep in flight
        probe = RawProbe(root, int(args.gib * GIB), record_bytes, factory, readers)
        try:
            result["raw"] = {"read_gib_s": probe.read(), "write_gib_s": probe.write()}
            print(f"raw {args.engine}: {result['raw']}", file=sys.stderr, flush=True)
            one = stream([root / "one" / "csd0"], args.gib, args, factory, probe)
        finally:
            probe.close()
        result["one_device"] = one
        print(f"1 device: {json.dumps(one)}", file=sys.stderr, flush=True)
        if "two" not in args.skip:
            result["two_devices"] = stream([root / "two" / "csd0", root / "two" / "csd1"], args.gib, args, factory)
            print(f"2 devices: {json.dumps(result['two_devices'])}", file=sys.stderr, flush=True)
        if "scale" not in args.skip:
            small = stream([root / "small" / "csd0"], args.gib / 4, args, factory)
            result["quarter_state"] = small
            print(f"1/4 state: {json.dumps(small)}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    ceilings = result["one_device"]["raw_gib_s_per_step"]
    concurrent = sorted(ceilings)[len(ceilings) // 2]
    rows = [("1 device", result["one_device"])]
    if "two_devices" in result:
        rows.append(("2 devices, same disk", result["two_devices"]))
    print(
        f"\nraw direct I/O ({args.engine}): read {result['raw']['read_gib_s']:.2f}, write "
        f"{result['raw']['write_gib_s']:.2f}, read+write at once {concurrent:.2f} GiB/s (median of the passes "
        f"before each timed step: {', '.join(f'{c:.2f}' for c in ceilings)})"
    )
    one = result["one_device"]
    print(
        f"1 device: streaming / raw read+write measured just before each step: "
        f"{', '.join(f'{e:.0%}' for e in one['efficiency_per_step'])} (median {one['efficiency_median']:.0%})"
    )
    print(
        "| configuration | step, median (s) | params ready (s) | state GiB/s | of raw read+write | per device: "
        "read / write / compute (s) |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for name, r in rows:
        split = "; ".join(
            f"{d['read_s']:.2f} / {d['write_s']:.2f} / {d['compute_s']:.2f}" for d in r["per_device_median_step"]
        )
        print(
            f"| {name} | {r['step_median_s']:.2f} | {r['params_ready_median_s']:.2f} | "
            f"{r['state_gib_s_median']:.2f} | {r['state_gib_s_median'] / concurrent:.0%} | {split} |"
        )
    if "quarter_state" in result:
        q, o = result["quarter_state"], result["one_device"]
        print(
            f"\nhost memory of the update path: {q['update_path_buffer_mib']:.1f} MiB at {args.gib / 4:g} GiB of "
            f"state, {o['update_path_buffer_mib']:.1f} MiB at {args.gib:g} GiB; RSS growth while streaming "
            f"{q['rss_growth_mib']:.1f} vs {o['rss_growth_mib']:.1f} MiB"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
