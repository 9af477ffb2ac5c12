"""Measure this machine and write a planner profile: direct-I/O bandwidth of a path and update throughput.

Imports torch (the model does not). Everything measured here uses the project's own I/O path
(:class:`~lightning_smartinf.core.io.direct.StateFile` + :class:`~lightning_smartinf.core.io.direct.ThreadedIO` on
``aligned_empty`` buffers) and the ``cpu`` backend (:class:`~lightning_smartinf.core.CpuBackend`).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from lightning_smartinf.plan.model import PlanError

MiB = 1 << 20


def _bandwidth(path: Path, nbytes: int, block: int = 4 * MiB) -> dict[str, Any]:
    import torch

    from lightning_smartinf.core.io.direct import StateFile, ThreadedIO, aligned_empty

    io = ThreadedIO(block_size=1 * MiB, queue_depth=8)
    buf = aligned_empty(block)
    buf.view(torch.uint8).random_(0, 255)
    a = StateFile(path / "bw-a.bin", nbytes, create=True)
    b = StateFile(path / "bw-b.bin", nbytes, create=True)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, block):
            io.write(a, buf, off)
        a.sync()
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for off in range(0, nbytes, block):
            io.read(a, buf, off)
        read_s = time.perf_counter() - t0
        # Concurrent read of a + write of b: what a device streaming its state in and out gets.
        rbuf = aligned_empty(block)

        def reader() -> None:
            for off in range(0, nbytes, block):
                io.read(a, rbuf, off)

        t0 = time.perf_counter()
        thread = threading.Thread(target=reader)
        thread.start()
        for off in range(0, nbytes, block):
            io.write(b, buf, off)
        thread.join()
        b.sync()
        both_s = time.perf_counter() - t0
        direct = a.direct
    finally:
        a.close()
        b.close()
        io.close()
    return {
        "direct_io": direct,
        "read_gbps": nbytes / read_s / 1e9,
        "write_gbps": nbytes / write_s / 1e9,
        "concurrent_read_write_gbps": 2 * nbytes / both_s / 1e9,
        "bytes": nbytes,
    }


def _update_rate(numel: int, chunk: int = 1 << 20, repeats: int = 3) -> float:
    """Elements per second of the ``cpu`` backend's Adam(W) update, in its 1M-element chunks, without I/O."""
    import torch

    from lightning_smartinf.core import Adam, StepParams

    rule = Adam(decoupled_weight_decay=True)
    master, m, v, g = (torch.randn(numel) for _ in range(4))
    scratch = torch.empty(chunk)
    best = float("inf")
    for step in range(1, repeats + 1):
        hp = StepParams(step=step, lr=1e-3, weight_decay=0.01)
        t0 = time.perf_counter()
        for start in range(0, numel, chunk):
            sl = slice(start, start + chunk)
            grad = scratch[: master[sl].numel()].copy_(g[sl])
            rule.apply(master[sl], grad, [m[sl], v[sl]], hp)
        best = min(best, time.perf_counter() - t0)
    return numel / best


def _update_rate_best(numel: int) -> float:
    """Best of the update rate with torch's intra-op threads and with one thread (a device worker is one
    thread, and intra-op threads collapse when the cores are oversubscribed)."""
    import torch

    threads = torch.get_num_threads()
    rates = [_update_rate(numel)]
    try:
        torch.set_num_threads(1)
        rates.append(_update_rate(numel))
    finally:
        torch.set_num_threads(threads)
    return max(rates)


def _host_adam_rate(numel: int) -> float:
    """Elements per second of torch's fused CPU AdamW (stand-in for DeepSpeed's CPU-Adam)."""
    import torch

    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    try:
        opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    except (RuntimeError, TypeError):  # older torch without fused CPU Adam
        opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
    opt.step()
    t0 = time.perf_counter()
    opt.step()
    return numel / (time.perf_counter() - t0)


def _backend_step(path: Path, numel: int, devices: int = 1) -> float:
    """Seconds per 1e9 parameters of one ``CpuBackend`` optimizer step (state on ``path``, O_DIRECT)."""
    import torch

    from lightning_smartinf.core import Adam, ShardSpec, StepParams
    from lightning_smartinf.devices.cpu import CpuBackend

    dirs = [path / f"dev{i}" for i in range(devices)]
    shards_n = 4
    per = numel // shards_n // 1024 * 1024
    backend = CpuBackend(dirs, owned_dirs=dirs)
    try:
        rule = Adam(decoupled_weight_decay=True)
        backend.open([ShardSpec(i, per, rule) for i in range(shards_n)])
        for i in range(shards_n):
            backend.initialize(i, torch.randn(per))
        backend.wait()
        grads = [torch.randn(per).to(torch.bfloat16) for _ in range(shards_n)]
        outs = [torch.empty(per, dtype=torch.bfloat16) for _ in range(shards_n)]
        times = []
        for step in (1, 2):
            t0 = time.perf_counter()
            for i in range(shards_n):
                backend.submit(i, grads[i], StepParams(step=step, lr=1e-3), outs[i])
            backend.wait()
            for device in backend.devices:
                device.drain()
            times.append(time.perf_counter() - t0)
    finally:
        backend.close()
    return min(times) / (per * shards_n) * 1e9


def calibrate(path: str | Path, *, megabytes: int = 384, name: str | None = None) -> dict[str, Any]:
    """Measure ``path`` and this CPU; return a profile dict for :class:`~lightning_smartinf.plan.model.Profile`."""
    root = Path(path)
    if not root.is_dir():
        raise PlanError(f"`--calibrate {path}`: not a directory. Pass a directory on the storage to measure.")
    free = shutil.disk_usage(root).free
    need = 3 * megabytes * MiB
    if free < need:
        raise PlanError(f"`--calibrate {path}`: needs {need / 1e9:.1f} GB free, has {free / 1e9:.1f} GB.")
    work = Path(tempfile.mkdtemp(prefix="smartinf-calibrate-", dir=root))
    try:
        bw = _bandwidth(work, megabytes * MiB)
        update = _update_rate_best(8 << 20)
        host = _host_adam_rate(8 << 20)
        step_s_per_gparam = _backend_step(work, megabytes * MiB // 12)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    disk = max(bw["read_gbps"], bw["write_gbps"])
    when = _dt.date.today().isoformat()
    return {
        "name": name or f"calibrated-{platform.node() or 'host'}",
        "description": f"measured by `python -m lightning_smartinf.plan --calibrate {root}` on {when}: "
        f"{os.cpu_count()} CPUs, cpu backend devices sharing one storage path",
        "gpu": "none (optimizer step only)",
        "gpu_peak_tflops": None,
        "cpu_step_s_per_gparam": 0.0,
        "host_update_gparams_per_s": round(host / 1e9, 4),
        "ssd_read_gbps": round(bw["read_gbps"], 3),
        "ssd_write_gbps": round(bw["write_gbps"], 3),
        "raid_read_ceiling_gbps": round(bw["read_gbps"], 3),
        "raid_write_ceiling_gbps": round(bw["write_gbps"], 3),
        "shared_link_gbps": None,
        "device_storage_ceiling_gbps": round(disk, 3),
        "gradient_staged_on_ssd": False,
        "device_update_gparams_per_s": round(update / 1e9, 4),
        "max_devices": max(1, min(8, os.cpu_count() or 1)),
        "device_memory_gb": 1.0,
        "baseline_pipelined": False,
        "sources": {
            "ssd_read_gbps": f"measured: O_DIRECT={bw['direct_io']} StateFile+ThreadedIO, {megabytes} MiB, 4 MiB "
            "requests",
            "ssd_write_gbps": "measured: same file, written then fsync'd",
            "device_storage_ceiling_gbps": "emulated devices share this one path: its bandwidth is their aggregate",
            "device_update_gparams_per_s": "measured: cpu backend Adam(W), 1M-element chunks of 8M in-memory fp32 "
            "elements (best of all threads / 1 thread)",
            "host_update_gparams_per_s": "measured: torch fused CPU AdamW (stand-in for DeepSpeed CPU-Adam)",
            "shared_link_gbps": "null: the cpu backend's link is host memory",
        },
        "measured": {
            **bw,
            "cpu_backend_step_s_per_gparam": round(step_s_per_gparam, 3),
            "date": when,
        },
    }
