"""Measure this machine and write a profile of the ``local-nvme`` kind (:class:`~.machine.Machine`).

``smartinf plan --calibrate PATH [PATH ...]`` measures, in a temporary directory under each path:

- each path alone: direct-I/O write, read, and reads and writes at once (what a device streaming its state does);
- all paths at once, each reading and writing: training streams the state through every path together, so a shared
  disk, controller or PCIe switch shows here even where each path alone looks fast;
- which disk each path is on (``/sys/dev/block``), its free space, host RAM and cores;
- the ``cpu`` backend's Adam(W) update rates (a device's, and the memory tier's over state in RAM), and one
  end-to-end ``CpuBackend`` step over all paths (recorded under ``measured``);
- for CPU training, the host's rate of forward and backward through a stack of Llama blocks, and ZeRO-3's host passes
  over each gradient replayed (this project's and stock ZeRO-3's); each format's device step again beside that
  training, and the memory tier's step in CPU seconds;
- the GPU when CUDA is available: its memory, pinned host <-> device copies and a bf16 matmul rate.

Measures with torch (the model only counts). The I/O is the project's own path
(:class:`~lightning_smartinf.core.io.direct.StateFile` + :class:`~lightning_smartinf.core.io.direct.ThreadedIO` on
``aligned_empty`` buffers).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import os
import platform
import shutil
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from lightning_smartinf.core.io.leftovers import remove_leftovers, scratch_directory
from lightning_smartinf.core.io.storage import disk_of
from lightning_smartinf.core.progress import Progress
from lightning_smartinf.plan.cost_model import PlanError
from lightning_smartinf.plan.machine import MACHINE_KIND

MiB = 1 << 20
#: Elements of the real device and memory-tier steps timed per state format (fp32 state: 12 bytes each, on the first
#: path).
STEP_ELEMENTS = 32 << 20
#: Bytes of each request of the measurements (the strategy's chunk records are 12 MiB, streamed in 1 MiB requests).
BLOCK = 4 * MiB


class _Probe:
    """Two state files on one path, ``a`` and ``b``, moved through the project's I/O path in 4 MiB requests: from
    its own buffers (huge pages where the OS gives them), or from buffers of ordinary pages, as ZeRO-Infinity's swap
    buffers are (``ordinary``)."""

    def __init__(self, directory: Path, nbytes: int) -> None:
        import torch

        from lightning_smartinf.core.io.direct import StateFile, ThreadedIO, aligned_empty

        self.nbytes = nbytes
        self.io = ThreadedIO(block_size=1 * MiB, queue_depth=8)
        # (out, into): the project's buffers, and (ordinary=True) buffers of ordinary pages
        self.buffers = {
            ordinary: (aligned_empty(BLOCK, huge_pages=not ordinary), aligned_empty(BLOCK, huge_pages=not ordinary))
            for ordinary in (False, True)
        }
        for out, _ in self.buffers.values():
            out.view(torch.uint8).random_(0, 255)
        self.a = StateFile(directory / "bw-a.bin", nbytes, create=True)
        self.b = StateFile(directory / "bw-b.bin", nbytes, create=True)

    def write(self, file: Any, ordinary: bool = False) -> None:
        for offset in range(0, self.nbytes, BLOCK):
            self.io.write(file, self.buffers[ordinary][0], offset)
        file.sync()

    def read(self, file: Any, ordinary: bool = False) -> None:
        for offset in range(0, self.nbytes, BLOCK):
            self.io.read(file, self.buffers[ordinary][1], offset)

    def streams(self, ordinary: bool = False) -> list[Callable[[], None]]:
        """Read ``a`` and write ``b``: the two halves of a device streaming its state, to run at once."""
        return [lambda: self.read(self.a, ordinary), lambda: self.write(self.b, ordinary)]

    def close(self) -> None:
        self.a.close()
        self.b.close()
        self.io.close()


def _best_seconds(
    run: Callable[[int], object], repeats: int = 3, *, after: Callable[[], object] = lambda: None
) -> float:
    """The fastest of ``repeats`` timed calls ``run(1)``, ``run(2)``, ... (``after`` ends each timed call: a device's
    synchronisation)."""
    best = math.inf
    for number in range(1, repeats + 1):
        started = time.perf_counter()
        run(number)
        after()
        best = min(best, time.perf_counter() - started)
    return best


def _at_once(work: Sequence[Callable[[], None]]) -> float:
    """Seconds to run every callable of ``work``, each on its own thread, all started together."""
    threads = [threading.Thread(target=fn) for fn in work]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def _together(probes: Sequence[_Probe], ordinary: bool = False) -> float:
    """GB/s of reads plus writes with every path reading one file and writing another, all at once (``ordinary``:
    from buffers of ordinary pages)."""
    seconds = _at_once([stream for probe in probes for stream in probe.streams(ordinary)])
    return 2 * sum(probe.nbytes for probe in probes) / seconds / 1e9


def _alone(probe: _Probe) -> dict[str, Any]:
    """One path by itself: write, read, then reads and writes at once (GB/s; the last counts both)."""
    write_s = _best_seconds(lambda _: probe.write(probe.a), repeats=1)
    read_s = _best_seconds(lambda _: probe.read(probe.a), repeats=1)
    return {
        "direct_io": probe.a.direct,
        "read_gbps": probe.nbytes / read_s / 1e9,
        "write_gbps": probe.nbytes / write_s / 1e9,
        "read_write_gbps": _together([probe]),
        "bytes": probe.nbytes,
    }


def _disk(path: Path) -> str:
    """The physical disk holding ``path`` (``nvme0n1``, :func:`disk_of`); its device numbers where that names none
    (overlay and network filesystems)."""
    if (disk := disk_of(path)) is not None:
        return disk.name
    dev = os.stat(path).st_dev
    return f"device {os.major(dev)}:{os.minor(dev)}"


def _gpu() -> dict[str, Any] | None:
    """The current CUDA device: memory, pinned copies each way and a bf16 matmul rate; ``None`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    nbytes = 256 * MiB
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def best(fn: Callable[[], object]) -> float:
        fn()  # the first call chooses the kernels
        return _best_seconds(lambda _: fn(), 5, after=lambda: torch.cuda.synchronize(device))

    to_gpu = nbytes / best(lambda: on_gpu.copy_(host, non_blocking=True)) / 1e9
    to_host = nbytes / best(lambda: host.copy_(on_gpu, non_blocking=True)) / 1e9
    n, products = 8192, 10
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    tflops = products * 2 * n**3 / best(lambda: [a @ b for _ in range(products)]) / 1e12
    return {
        "name": torch.cuda.get_device_name(device),
        "memory_gb": torch.cuda.get_device_properties(device).total_memory / 1e9,
        "host_to_device_gbps": to_gpu,
        "device_to_host_gbps": to_host,
        "matmul_bf16_tflops": tflops,
    }


#: Tokens of the two micro-batches CPU training is timed over: a long one gives the rate of its FLOPs, a short one the
#: time forward and backward take per parameter whatever the tokens (reading the weights, starting each kernel),
#: which is most of a short micro-batch's.
TRAINING_TOKENS = (16, 512)


#: Bytes of the host's largest CPU cache where ``/sys`` does not say.
DEFAULT_CACHE_BYTES = 32 * MiB
#: Most Llama blocks a training replay stacks, whatever the cache.
MAX_TRAINING_BLOCKS = 16


def _cache_bytes() -> int:
    """Bytes of the host's largest CPU cache, from ``/sys/devices/system/cpu/cpu0/cache`` (``DEFAULT_CACHE_BYTES``
    where it does not say)."""
    largest = 0
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = size.read_text().strip()
            largest = max(largest, int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return largest or DEFAULT_CACHE_BYTES


class _TrainingReplay:
    """Forward and backward through a stack of Llama blocks (a 1B Llama's: ``hidden`` 2048, MLP ``inner`` 5632,
    causal attention, RMS norms) in ``dtype`` on torch's threads, each pass with fresh gradients as training makes
    them.

    Invariant: the stack's weights and gradients take at least twice the host's largest cache (``cache_bytes``), as a
    large model's are far beyond it; a stack that fits the cache would time its weights read from there.
    """

    def __init__(self, dtype: Any, cache_bytes: int, hidden: int = 2048, inner: int = 5632, heads: int = 32) -> None:
        import torch
        from torch.nn import Linear, RMSNorm

        torch.manual_seed(0)
        block_params = 4 * hidden * hidden + 3 * hidden * inner + 2 * hidden
        weights_and_gradients = 2 * block_params * torch.empty(0, dtype=dtype).element_size()
        count = min(MAX_TRAINING_BLOCKS, max(1, math.ceil(2 * cache_bytes / weights_and_gradients)))
        self.blocks = [
            tuple(
                module.to(dtype)
                for module in (
                    Linear(hidden, 3 * hidden, bias=False),
                    Linear(hidden, hidden, bias=False),
                    Linear(hidden, 2 * inner, bias=False),
                    Linear(inner, hidden, bias=False),
                    RMSNorm(hidden),
                    RMSNorm(hidden),
                )
            )
            for _ in range(count)
        ]
        self.parameters = [p for block in self.blocks for module in block for p in module.parameters()]
        self.params = sum(p.numel() for p in self.parameters)
        self.dtype, self.hidden, self.heads = dtype, hidden, heads

    def run(self, tokens: int) -> None:
        """One forward and backward over a micro-batch of ``tokens``."""
        import torch
        from torch.nn.functional import scaled_dot_product_attention, silu

        for p in self.parameters:
            p.grad = None
        hidden, heads = self.hidden, self.heads
        y = torch.randn(1, tokens, hidden, dtype=self.dtype, requires_grad=True)
        for qkv, out, gate_up, down, attention_norm, mlp_norm in self.blocks:
            q, k, v = qkv(attention_norm(y)).view(1, tokens, 3, heads, hidden // heads).transpose(1, 3).unbind(2)
            attended = scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, tokens, hidden)
            y = y + out(attended)
            gate, up = gate_up(mlp_norm(y)).chunk(2, dim=-1)
            y = y + down(silu(gate) * up)
        y.float().square().mean().backward()

    def seconds(self, repeats: int = 3) -> list[float]:
        """Seconds of a pass over a micro-batch of each of :data:`TRAINING_TOKENS`: the median of ``repeats`` after
        one that chooses the kernels (a typical pass, as a run's steps are, not the luckiest)."""
        timed = []
        for tokens in TRAINING_TOKENS:
            self.run(tokens)
            passes = []
            for _ in range(repeats):
                started = time.perf_counter()
                self.run(tokens)
                passes.append(time.perf_counter() - started)
            timed.append(statistics.median(passes))
        return timed

    def until(self, stop: threading.Event) -> None:
        """Passes over the short micro-batch until ``stop`` is set: the cores busy as a short micro-batch's
        training keeps them."""
        while not stop.is_set():
            self.run(TRAINING_TOKENS[0])


def training_fit(params: int, seconds: Sequence[float]) -> tuple[float, float]:
    """A micro-batch's forward and backward as ``6·params·tokens / rate + fixed·params``, through the two timings of
    :meth:`_TrainingReplay.seconds`: the rate in TFLOPS (6 FLOPs per parameter and token) and ``fixed`` in seconds
    per 1e9 parameters (0 where the timings' noise would make it negative)."""
    (short, long), (short_s, long_s) = TRAINING_TOKENS, seconds
    per_token = max(long_s - short_s, 1e-3 * long_s) / (long - short)
    return 6 * params / per_token / 1e12, max(0.0, short_s - short * per_token) / params * 1e9


def _reduce_passes(numel: int = 32 << 20) -> dict[str, float]:
    """Seconds per 1e9 parameters of ZeRO-3's host passes over each gradient element in one micro-batch of CPU
    training (bf16 gradients, one rank), replayed on ``numel`` elements, best of three; the step's last micro-batch
    (which takes the norm) and one before it (which adds to the fp32 sum), this project's and stock ZeRO-3's.

    Both: autograd writes the gradient into a fresh tensor, which goes into the accumulation buffer (the first
    micro-batch) or is added there in fp32 (later ones, through a fresh fp32 copy). Stock ZeRO-3 first copies it into
    its reduce bucket and averages over the ranks, one or more (a flat copy into fresh memory, a division, and
    ``torch.distributed.reduce_scatter_tensor`` over a group of one gloo rank, as DeepSpeed calls it:
    :func:`_one_rank_collective`), and at the step's end takes each partition's norm through a fresh float64 copy of
    it, then makes a fresh fp32 copy of it, which its swapper copies into a swap buffer; this project, with one rank,
    leaves the gradient where autograd put it and reads it once for the norm
    (:class:`~lightning_smartinf.core.float64_norm.PartitionNorm`). Allocations this large are fresh mappings on a
    host, whose pages fault in as they are first written: that is most of the cost, and why it is replayed, not
    counted in bytes. In this project's step of one micro-batch, a linear weight's gradient is
    computed in the buffer itself (:mod:`lightning_smartinf.zero.linear`): the norm's read is all that is left
    (``cpu_reduce_in_place_s_per_gparam``).
    """
    import torch

    from lightning_smartinf.core.float64_norm import PartitionNorm

    norm = PartitionNorm()
    gradient = torch.randn(numel).to(torch.bfloat16)
    bucket = torch.empty(numel, dtype=torch.bfloat16)
    partition = torch.empty_like(bucket)
    summed = torch.empty(numel)
    swap_out = torch.empty(numel)

    def micro_batch(collective: Callable[[Any], Any], *, stock: bool, last: bool) -> None:
        reduced = torch.empty_like(gradient).copy_(gradient)
        if stock:
            bucket.copy_(reduced)
            flat = torch.empty_like(bucket).copy_(bucket)
            flat.div_(1)
            reduced = collective(flat)
        if last and stock:
            partition.copy_(reduced)
            partition.to(torch.float64).norm(2)
            swap_out.copy_(partition.to(torch.float32))
        elif last:
            summed.copy_(reduced)
            norm(summed)
        else:
            summed.add_(reduced.to(torch.float32))

    def seconds_per_gparam(passes: Callable[[], object]) -> float:
        return round(_best_seconds(lambda _: passes()) / numel * 1e9, 3)

    with _one_rank_collective() as collective:

        def micro_batch_passes(**kind: bool) -> float:
            return seconds_per_gparam(lambda: micro_batch(collective, **kind))

        return {
            "cpu_reduce_s_per_gparam": micro_batch_passes(stock=False, last=True),
            # The buffer, in the training dtype, holds the gradient already: the norm reads it.
            "cpu_reduce_in_place_s_per_gparam": seconds_per_gparam(lambda: norm(gradient)),
            "cpu_reduce_accumulating_s_per_gparam": micro_batch_passes(stock=False, last=False),
            "baseline_cpu_reduce_s_per_gparam": micro_batch_passes(stock=True, last=True),
            "baseline_cpu_reduce_accumulating_s_per_gparam": micro_batch_passes(stock=True, last=False),
        }


@contextlib.contextmanager
def _one_rank_collective() -> Iterator[Callable[[Any], Any]]:
    """What stock ZeRO-3's reduce-scatter does to a flat bucket on one rank: ``torch.distributed
    .reduce_scatter_tensor`` in place over a gloo group of this process alone (made here and destroyed after), as
    DeepSpeed calls it. Where torch.distributed is unavailable, has no gloo, or is initialised already (a caller's own
    group, which this must not touch), a copy into a second buffer stands in."""
    import torch
    import torch.distributed as dist

    def copy(flat: Any) -> Any:
        return torch.empty_like(flat).copy_(flat)

    if not dist.is_available() or dist.is_initialized():
        yield copy
        return
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    except (RuntimeError, ValueError):  # a torch built without gloo
        yield copy
        return
    try:

        def reduce_scatter(flat: Any) -> Any:
            with warnings.catch_warnings():  # deprecated for reduce_scatter_single; DeepSpeed 0.19 calls this one
                warnings.simplefilter("ignore", FutureWarning)
                dist.reduce_scatter_tensor(flat, flat)
            return flat

        yield reduce_scatter
    finally:
        dist.destroy_process_group()


def _chunk_update_seconds(precision: str, numel: int, chunk: int = 1 << 20, *, fused: bool = False) -> float:
    """Best of three passes of the ``cpu`` backend's Adam(W) update over ``numel`` in-memory elements (a whole number
    of chunks) with ``state_precision=precision``, chunk by chunk as a device runs it, without I/O: fp32 in place,
    another format loaded, updated and stored (``fused``: the rule of an optimizer built with ``fused=True``)."""
    import torch

    from lightning_smartinf.core import Adam, StepParams
    from lightning_smartinf.core.state_formats import state_format, update_chunk

    rule, fmt = Adam(decoupled_weight_decay=True, fused=fused), state_format(precision)
    master, g = torch.randn(numel), torch.randn(numel)
    stored = [torch.zeros(numel // chunk, fmt.stored_bytes(chunk), dtype=torch.uint8) for _ in range(2)]
    grad = torch.empty(chunk)

    def run(step: int) -> None:
        hp = StepParams(step=step, lr=1e-3, weight_decay=0.01)
        for i, start in enumerate(range(0, numel, chunk)):
            sl, states = slice(start, start + chunk), [s[i] for s in stored]
            if precision == "fp32":  # no format to load or store
                rule.apply(master[sl], grad.copy_(g[sl]), [s.view(torch.float32) for s in states], hp)
            else:
                update_chunk(rule, fmt, master[sl], grad.copy_(g[sl]), states, hp)

    seconds = _best_seconds(run)
    # Timed on real values: a NaN (a negative second moment's square root) runs several times slower.
    if not bool(torch.isfinite(master).all()):
        raise RuntimeError(
            f"The timed {precision} update made non-finite weights; its timing would not be the update's."
        )
    return seconds


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one intra-op thread inside, as a device worker runs; its threads as they were after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _update_rate_best(numel: int, *, fused: bool = False) -> float:
    """Best of the update rate with torch's intra-op threads and with one thread (a device worker is one
    thread, and intra-op threads collapse when the cores are oversubscribed)."""
    rate = numel / _chunk_update_seconds("fp32", numel, fused=fused)
    with _one_thread():
        return max(rate, numel / _chunk_update_seconds("fp32", numel, fused=fused))


def _update_costs(numel: int = 4 << 20, *, fused: bool = False) -> dict[str, float]:
    """Each ``state_precision``'s Adam(W) update time per element over fp32's: the ``cpu`` backend's chunk update in
    that format (load, update, store), one thread, best of three passes over ``numel`` in-memory elements
    (``fused``: the rule of an optimizer built with ``fused=True``, against its own fp32 time)."""
    from lightning_smartinf.core.state_formats import FORMATS

    with _one_thread():
        seconds = {name: _chunk_update_seconds(name, numel, fused=fused) for name in FORMATS}
    return {name: round(t / seconds["fp32"], 3) for name, t in seconds.items()}


def _host_adam_rate(numel: int) -> float:
    """Elements per second of torch's fused CPU AdamW (stand-in for DeepSpeed's CPU-Adam)."""
    import torch

    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)  # on the CPU since torch 2.4, the least this project takes
    opt.step()
    return numel / _best_seconds(lambda _: opt.step())


def _timed_steps(
    backend: Any, shards: int, numel: int, steps: int, precision: str = "fp32"
) -> list[tuple[float, float]]:
    """Open ``shards`` shards of ``numel`` elements in all (each a whole number of 1024) on ``backend`` (Adam(W) as
    recipes build it, the state in ``precision``) and run ``steps`` optimizer steps, bf16 gradients in and parameters
    out; each step's wall and CPU seconds (every thread of this process) per 1e9 elements. Closes ``backend``."""
    import torch

    from lightning_smartinf.core import Adam, ShardSpec, StepParams

    per = numel // shards // 1024 * 1024
    try:
        rule = Adam(decoupled_weight_decay=True)
        backend.open([ShardSpec(i, per, rule, state_format=precision) for i in range(shards)])
        for i in range(shards):
            backend.initialize(i, torch.randn(per))
        backend.wait()
        grads = [torch.randn(per).to(torch.bfloat16) for _ in range(shards)]
        params = [torch.empty(per, dtype=torch.bfloat16) for _ in range(shards)]
        timed = []
        for step in range(1, steps + 1):
            wall, cpu = time.perf_counter(), time.process_time()
            for i in range(shards):
                backend.submit(i, grads[i], StepParams(step=step, lr=1e-3), params[i])
            backend.wait()  # every update and write-back done
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            timed.append((wall / (per * shards) * 1e9, cpu / (per * shards) * 1e9))
        return timed
    finally:
        backend.close()


def _backend_step(paths: Sequence[Path], numel: int) -> float:
    """Seconds per 1e9 parameters of one ``CpuBackend`` optimizer step, one device per path (O_DIRECT)."""
    from lightning_smartinf.devices.cpu import CpuBackend

    dirs = [path / "device" for path in paths]
    wall_s, _ = min(_timed_steps(CpuBackend(dirs, owned_dirs=dirs), 4 * len(dirs), numel, steps=2))
    return wall_s


def _step_seconds(
    directory: Path,
    precision: str,
    numel: int = STEP_ELEMENTS,
    *,
    in_memory: bool,
    beside: _TrainingReplay | None = None,
) -> tuple[float, float]:
    """Wall and CPU seconds (every thread of this process) per 1e9 elements of one real optimizer step: a ``cpu``
    device's with its state in ``directory``, or the memory tier's (``in_memory``); the state in ``precision``. The
    best of two steps after the first; ``beside``: while that training replay keeps the cores busy."""
    from lightning_smartinf.core.build import tiers_over
    from lightning_smartinf.devices.cpu import CpuBackend

    dirs = [directory / f"step-{precision}"]
    backend: Any = CpuBackend(dirs, owned_dirs=dirs)
    if in_memory:  # every shard fits the budget: the tier holds them all
        backend = tiers_over(
            backend, memory_bytes=1 << 50, devices_compute=True, measure_memory_share=False, chunk_elems=1 << 20
        )
    stop = threading.Event()
    training = threading.Thread(target=beside.until, args=(stop,), daemon=True) if beside is not None else None
    if training is not None:
        training.start()
    try:
        return min(_timed_steps(backend, 4, numel, steps=3, precision=precision)[1:])
    finally:
        stop.set()
        if training is not None:
            training.join()


def _step_costs(directory: Path, training: _TrainingReplay) -> dict[str, dict[str, float]]:
    """Each state format's real steps (:func:`_step_seconds`), per 1e9 elements, as the profile's ``*_by_precision``
    fields: a device's CPU seconds, the share of its rate it keeps while ``training`` runs on the cores (at most 1),
    and the memory tier's seconds and CPU seconds."""
    from lightning_smartinf.core.state_formats import FORMATS

    device = {name: _step_seconds(directory, name, in_memory=False) for name in FORMATS}
    beside = {name: _step_seconds(directory, name, in_memory=False, beside=training)[0] for name in FORMATS}
    memory = {name: _step_seconds(directory, name, in_memory=True) for name in FORMATS}
    return {
        "device_step_cpu_s_per_gparam_by_precision": {name: round(s[1], 3) for name, s in device.items()},
        "device_rate_share_training_by_precision": {
            name: round(min(1.0, device[name][0] / beside[name]), 3) for name in FORMATS
        },
        "memory_step_s_per_gparam_by_precision": {name: round(s[0], 3) for name, s in memory.items()},
        "memory_step_cpu_s_per_gparam_by_precision": {name: round(s[1], 3) for name, s in memory.items()},
    }


def calibrate(paths: Sequence[str | Path], *, megabytes: int = 384, name: str | None = None) -> dict[str, Any]:
    """Measure ``paths`` (each alone, then all at once), this host and its GPU; return a machine profile
    (``"kind": "local-nvme"``, :class:`~lightning_smartinf.plan.machine.Machine`) as a dict."""
    import psutil
    import torch

    roots = [Path(os.path.abspath(p)) for p in paths]
    if isinstance(megabytes, bool) or not isinstance(megabytes, int) or megabytes < 1:  # the space below needs it
        raise PlanError(f"`--calibrate-mb {megabytes!r}` must be an int >= 1 (MiB of test data per file), e.g. 384.")
    problems = []
    for index, root in enumerate(roots):
        need = 3 * megabytes * MiB + (12 * STEP_ELEMENTS if index == 0 else 0)  # the steps run on the first path
        if not root.is_dir():
            problems.append(f"`--calibrate {root}`: not a directory. Pass directories on the storage to measure.")
        elif (free := shutil.disk_usage(root).free) < need:
            problems.append(
                f"`--calibrate {root}`: needs {need / 1e9:.2f} GB free, has {free / 1e9:.2f} GB. Free some space, or "
                "measure less with `--calibrate-mb`."
            )
    if len({r.resolve() for r in roots}) < len(roots):
        problems.append(f"`--calibrate {' '.join(map(str, roots))}`: a directory is named twice; name each once.")
    if problems:
        raise PlanError("\n".join(problems))
    for root in roots:
        remove_leftovers(root, "smartinf-calibrate")  # the probe files of a calibration that was killed
    probes: list[_Probe] = []
    # Each path alone, all at once, the update rates (fp32, fused AdamW, each precision), real steps, CPU training,
    # and all paths at once again.
    measure = Progress("measuring this machine", len(roots) + 9, unit="measurements", announce=True)
    with contextlib.ExitStack() as scratch:
        work = [scratch.enter_context(scratch_directory("smartinf-calibrate", root)) for root in roots]
        try:
            probes = [_Probe(directory, megabytes * MiB) for directory in work]
            alone = []
            for probe in probes:
                alone.append(_alone(probe))
                measure.update(1)
            together_start, baseline_start = _together(probes), _together(probes, ordinary=True)
            measure.update(1)
            update = _update_rate_best(8 << 20)
            measure.update(1)
            fused = _host_adam_rate(8 << 20)
            measure.update(1)
            costs = _update_costs()
            fused_update, fused_costs = _update_rate_best(8 << 20, fused=True), _update_costs(fused=True)
            measure.update(1)
            step_s_per_gparam = _backend_step(work, megabytes * MiB // 12)
            measure.update(1)
            cache = _cache_bytes()
            replays = {"bf16": _TrainingReplay(torch.bfloat16, cache), "fp32": _TrainingReplay(torch.float32, cache)}
            training = {name: (replay.params, replay.seconds()) for name, replay in replays.items()}
            # Training in the faster of bf16 and fp32 per parameter over the long micro-batch (their stacks differ):
            # the precision to train in on this CPU.
            faster = min(training, key=lambda name: training[name][1][-1] / training[name][0])
            replay = replays.pop(faster)
            del replays  # the slower stack's memory, before the steps
            measure.update(1)
            step_costs = _step_costs(work[0], replay)
            del replay
            measure.update(1)
            reduce_passes = _reduce_passes()
            measure.update(1)
            # All paths at once again, half a minute later: a disk whose rate moves by the minute shows it here.
            together_end, baseline_end = _together(probes), _together(probes, ordinary=True)
            measure.update(1)
            measure.close()
        finally:
            measure.close(failed=True)  # after `close()`, nothing more
            for probe in probes:
                probe.close()
    gpu = _gpu()
    memory = psutil.virtual_memory()
    training_rate, fixed_s = training_fit(*training[faster])
    disks = [_disk(root) for root in roots]
    when = _dt.date.today().isoformat()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    sum_alone = sum(a["read_write_gbps"] for a in alone)
    together, baseline_together = (together_start + together_end) / 2, (baseline_start + baseline_end) / 2
    shared = len(set(disks)) < len(disks) or (len(roots) > 1 and together < 0.75 * sum_alone)
    described = f"{len(roots)} path(s) on {len(set(disks))} disk(s)" + (
        f", sharing bandwidth: {together:.2f} GB/s at once, {sum_alone:.2f} alone summed" if shared else ""
    )
    command = f"smartinf plan --calibrate {' '.join(map(str, roots))}"
    return {
        "kind": MACHINE_KIND,
        "name": name or f"calibrated-{platform.node() or 'host'}",
        "description": f"measured by `{command}` on {when}: {cores} CPU cores, {memory.total / 1e9:.0f} GB RAM, "
        f"{described}, {gpu['name'] if gpu else 'no GPU'}",
        "backend": "cpu",
        "storage": [
            {
                "path": str(root),
                **{rate: round(a[rate], 3) for rate in ("read_gbps", "write_gbps", "read_write_gbps")},
                "disk": disk,
                "free_gb": round(shutil.disk_usage(root).free / 1e9, 1),
            }
            for root, a, disk in zip(roots, alone, disks)
        ],
        "together_read_write_gbps": round(together, 3),
        "baseline_together_read_write_gbps": round(baseline_together, 3),
        "host_memory_gb": round(memory.total / 1e9, 1),
        "state_memory_gb": None,
        "cpu_cores": cores,
        "device_update_gparams_per_s": round(update / 1e9, 4),
        "host_update_gparams_per_s": round(update / 1e9, 4),
        "baseline_update_gparams_per_s": round(fused / 1e9, 4),
        "update_cost_by_precision": costs,
        "fused_update_gparams_per_s": round(fused_update / 1e9, 4),
        "fused_update_cost_by_precision": fused_costs,
        **step_costs,
        "gpu": None
        if gpu is None
        else {
            "name": gpu["name"],
            "memory_gb": round(gpu["memory_gb"], 1),
            "link_gbps": round(min(gpu["host_to_device_gbps"], gpu["device_to_host_gbps"]), 2),
            "peak_tflops": round(gpu["matmul_bf16_tflops"], 1),
            "efficiency": 0.4,
        },
        "cpu_training_tflops": round(training_rate, 3),
        **reduce_passes,
        "cpu_step_s_per_gparam": round(fixed_s, 3),
        "transfer_bytes": 2,
        "sources": {
            "storage": f"measured: O_DIRECT={alone[0]['direct_io']} StateFile+ThreadedIO, {megabytes} MiB per path, "
            "4 MiB requests: written then read, then one file read while another is written (read_write_gbps)",
            "together_read_write_gbps": "measured: every path reading one file and writing another, all at once, "
            "at the start and at the end of the calibration (measured.together_gbps_start, _end): their mean",
            "baseline_together_read_write_gbps": "measured: as together_read_write_gbps, from buffers of ordinary "
            "pages (ZeRO-Infinity's swap buffers; the project's are huge pages where the OS gives them), next to each "
            "of those (measured.baseline_together_gbps_start, _end): their mean",
            "disk": "/sys/dev/block of each path's filesystem; paths on one disk share its bandwidth",
            "host_memory_gb": "psutil: total RAM",
            "device_update_gparams_per_s": "measured: cpu backend Adam(W), 1M-element chunks of 8M in-memory fp32 "
            "elements (best of all threads / 1 thread)",
            "update_cost_by_precision": "measured: each state_precision's chunk update (load, Adam(W), store) "
            "over fp32's, 1M-element chunks of 4M in-memory elements, one thread",
            "fused_update_gparams_per_s": "measured: as device_update_gparams_per_s and update_cost_by_precision, with "
            "the rule of an optimizer built with fused=True (torch's fused kernel; `smartinf plan --fused`)",
            "host_update_gparams_per_s": "measured: as a device's, the same rule code on one worker thread (the "
            "memory tier has no I/O, not a faster update)",
            "device_step_cpu_s_per_gparam_by_precision": "measured: the CPU time (every thread) of a real cpu "
            "device's Adam(W) step over 32M elements on the first path, bf16 gradients in and parameters out, per "
            "state_precision, best of two steps after the first",
            "device_rate_share_training_by_precision": "measured: the same steps' wall time alone over theirs while "
            "the training replay below runs passes of its short micro-batch on torch's threads (at most 1): the "
            "share of its rate a device keeps while backward runs on the cores it shares",
            "memory_step_s_per_gparam_by_precision": "measured: the same steps with the state in the memory tier, "
            "their wall time",
            "memory_step_cpu_s_per_gparam_by_precision": "measured: the memory tier's steps, their CPU time (every "
            "thread): what the tier takes of the cores after backward, beside the devices",
            "baseline_update_gparams_per_s": "measured: torch's fused AdamW over 8M in-memory elements, on torch's "
            "threads, standing in for DeepSpeed's CPU-Adam (ZeRO-Infinity's host update; also fused and vectorised)",
            "cpu_training_tflops": "measured: forward and backward of a stack of a 1B Llama's blocks (their weights "
            "and gradients at least twice the largest CPU cache, as a large model's are beyond it) over micro-batches "
            "of 16 and 512 tokens on torch's threads, the median of three passes, in the faster of bf16 and fp32 over "
            "512 (each under measured; on a CPU without bf16 matrix units train in 32-true): the rate of what the "
            "longer one adds, 6 FLOPs per parameter and token",
            "cpu_step_s_per_gparam": "measured: the same two timings, what a micro-batch takes per 1e9 parameters "
            "whatever its tokens (reading the weights, starting each kernel)",
            "cpu_reduce_s_per_gparam": "measured: ZeRO-3's host passes over each gradient element of one micro-batch "
            "(this project's and, as baseline_*, stock ZeRO-3's: the last micro-batch of a step, and each one "
            "before it as *_accumulating_*; *_in_place_*: this project's step of one micro-batch, whose linear "
            "weights' gradients are computed in ZeRO's buffer), replayed on 32M elements, best of three",
            "gpu": "measured: pinned copies of 256 MiB each way (the slower), 8192^2 bf16 matmuls; efficiency "
            "assumed: the share of that rate a training step reaches"
            if gpu
            else "no GPU: torch.cuda.is_available() is False here (forward and backward are not modelled)",
        },
        "measured": {
            "paths": [{"path": str(root), **a} for root, a in zip(roots, alone)],
            "together_gbps": together,
            "together_gbps_start": round(together_start, 3),
            "together_gbps_end": round(together_end, 3),
            "baseline_together_gbps_start": round(baseline_start, 3),
            "baseline_together_gbps_end": round(baseline_end, 3),
            "shared_bandwidth": shared,
            "host_memory_available_gb": round(memory.available / 1e9, 1),
            "torch_threads": torch.get_num_threads(),
            "fused_adamw_gparams_per_s": round(fused / 1e9, 4),
            "training_tflops": {  # over the long micro-batch alone
                name: round(6 * n * TRAINING_TOKENS[-1] / timed[-1] / 1e12, 3) for name, (n, timed) in training.items()
            },
            "training_params": {name: n for name, (n, _) in training.items()},
            "cpu_cache_bytes": cache,
            "training_seconds": {
                name: dict(zip(map(str, TRAINING_TOKENS), (round(t, 5) for t in seconds)))
                for name, (_, seconds) in training.items()
            },
            "cpu_backend_step_s_per_gparam": round(step_s_per_gparam, 3),
            "gpu": gpu or "none: torch.cuda.is_available() is False",
            "date": when,
        },
    }
