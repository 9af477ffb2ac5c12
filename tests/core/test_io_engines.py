"""I/O engines of the emulated devices, and write-back that trails the update without ever being overtaken."""

from __future__ import annotations

import gc
import inspect
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers.machine import aio_op, lacking
from torch.testing import assert_close

from lightning_smartinf.core import Adam, ShardSpec, StepParams
from lightning_smartinf.core.io.direct import HUGE_PAGE, IO_ALIGN, IOEngine, StateFile, ThreadedIO, aligned_empty
from lightning_smartinf.devices.cpu import CpuBackend


def _round_trip(engine: IOEngine, tmp_path) -> None:
    nbytes = 3 * engine.block_size + 4096  # several pieces plus a short tail
    file = StateFile(tmp_path / "f", nbytes + 8192, create=True)
    src = aligned_empty(nbytes)
    src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    engine.write(file, src, 4096)
    dst = aligned_empty(nbytes)
    engine.read(file, dst, 4096)
    assert torch.equal(src, dst)
    file.close()
    engine.close()


def _mapping_flags(address: int) -> list[str] | None:
    """The ``VmFlags`` of the mapping of this process that holds ``address`` (``/proc/self/smaps``), or ``None``."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return None


def test_an_engines_large_buffer_is_aligned_to_huge_pages_asks_for_them_and_goes_with_its_tensor():
    """Direct transfers from huge pages are one segment each, not a 4 KiB page's: a buffer an engine gives of at least
    a huge page (a device's pool) starts on one and its mapping carries the advice (``hg``: ``MADV_HUGEPAGE``); its
    memory lives as long as any view of it and no longer. A smaller buffer, or one not asked for huge pages (short-
    lived ones), is ordinary memory, ``IO_ALIGN``-aligned."""
    nbytes = 3 * HUGE_PAGE + IO_ALIGN
    engine = ThreadedIO()
    buf = engine.empty(nbytes).view(torch.float32)
    engine.close()
    address = buf.data_ptr()
    assert address % HUGE_PAGE == 0 and buf.numel() * 4 == nbytes
    assert "hg" in _mapping_flags(address)
    buf.fill_(1.5)
    view = buf[-4:]
    del buf
    gc.collect()
    assert view.tolist() == [1.5] * 4  # the mapping stays while a view does
    del view
    gc.collect()
    assert _mapping_flags(address) is None, "the buffer's memory outlived its tensor"

    # Ordinary buffers come from malloc, whose heap numpy advises for huge pages under its own arrays of 4 MB and more
    # (and keeps advised after they are freed): only a fresh interpreter tells whether our code asked.
    code = f"{_ORDINARY_BUFFERS}\n{inspect.getsource(_mapping_flags)}\nprint(check())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ordinary", "ordinary"]


_ORDINARY_BUFFERS = """
from lightning_smartinf.core.io.direct import HUGE_PAGE, IO_ALIGN, aligned_empty

def check():
    small, ordinary = aligned_empty(HUGE_PAGE - IO_ALIGN, huge_pages=True), aligned_empty(3 * HUGE_PAGE + IO_ALIGN)
    for buf, size in ((small, HUGE_PAGE - IO_ALIGN), (ordinary, 3 * HUGE_PAGE + IO_ALIGN)):
        assert buf.data_ptr() % IO_ALIGN == 0 and buf.numel() == size
    return " ".join("huge" if "hg" in (_mapping_flags(b.data_ptr()) or []) else "ordinary" for b in (small, ordinary))
"""


@pytest.mark.parametrize(("block", "depth"), [(4096, 1), (1 << 16, 4), (1 << 20, 8)])
def test_threaded_io_round_trip(tmp_path, block, depth):
    _round_trip(ThreadedIO(block, depth), tmp_path)


def test_deepspeed_aio_round_trip(tmp_path):
    aio, op = aio_op()
    _round_trip(aio.DeepSpeedAIO(1 << 16, 4, op=op), tmp_path)


_FIRST_WRITES = """
import sys, threading
from pathlib import Path
from lightning_smartinf.core.io.direct import StateFile, aligned_empty
from lightning_smartinf.zero.aio import DeepSpeedAIO, load_aio_op

engine = DeepSpeedAIO(1 << 16, 4, op=load_aio_op())
files = [StateFile(Path(sys.argv[1]) / f"f{i}", 1 << 16, create=True) for i in range(32)]
start = threading.Barrier(32)

def first_write(i):
    buf = aligned_empty(1 << 16)
    start.wait()
    engine.write(files[i], buf, 0)

threads = [threading.Thread(target=first_write, args=(i,)) for i in range(32)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("all first writes done")
# The engine is left open on purpose: the atexit hook must close it before the interpreter finalises.
"""


def test_a_suffixed_cuda_arch_list_reaches_deepspeed_without_its_suffix(monkeypatch):
    """An H100 image set ``TORCH_CUDA_ARCH_LIST=9.0a``: DeepSpeed 0.19's builder could not parse it and the async_io op
    (no CUDA source) never built. Within the block DeepSpeed reads ``9.0``; the user's value is back after it."""
    from deepspeed.ops.op_builder.async_io import AsyncIOBuilder  # the CUDA accelerator's builder

    from lightning_smartinf.zero.aio import arch_list_deepspeed_parses

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a 10.0f;8.6+PTX")
    builder = AsyncIOBuilder()
    builder.jit_mode = True  # how `OpBuilder.jit_load` asks for the flags
    with pytest.raises(ValueError, match="'0a'"):
        builder.compute_capability_args()
    with arch_list_deepspeed_parses():
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0 10.0;8.6+PTX"
        builder.compute_capability_args()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0a 10.0f;8.6+PTX"


@pytest.mark.parametrize("runs", [1, pytest.param(12, marks=pytest.mark.slow)])
def test_deepspeed_aio_first_writes_from_many_threads_and_exit_cleanly(tmp_path, runs):
    """DeepSpeed logs a one-time warning from a C++ ``call_once`` holding the GIL: concurrent first writes hung.

    In a fresh process (the once-flag is per process), 32 threads each make their first write at the same moment,
    and the process exits with the engine still open. Handles destroyed while the interpreter finalised aborted
    7 exits in 40 here, so the slow variant repeats it.
    """
    aio_op()
    for run in range(runs):
        done = subprocess.run(
            [sys.executable, "-c", _FIRST_WRITES, str(tmp_path)], capture_output=True, text=True, timeout=90
        )
        assert done.returncode == 0, f"run {run}: {done.stderr[-3000:]}"
        assert "all first writes done" in done.stdout


def _os_threads_settle_at(count: int, timeout: float = 10.0) -> bool:
    """Whether this process's OS thread count reaches ``count`` (joined threads take a moment to leave /proc)."""
    deadline = time.monotonic() + timeout
    while len(os.listdir("/proc/self/task")) != count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_deepspeed_aio_close_joins_every_handles_io_thread(tmp_path):
    """Each calling thread's handle owns an OS thread; ``close`` must destroy all of them, not just forget them."""
    aio, op = aio_op()
    engine = aio.DeepSpeedAIO(1 << 16, 4, op=op)
    file = StateFile(tmp_path / "f", 1 << 16, create=True)
    engine.write(file, aligned_empty(1 << 16), 0)  # warm-up: whatever torch starts once is started now
    engine.close()
    before = len(os.listdir("/proc/self/task"))
    callers = [threading.Thread(target=engine.write, args=(file, aligned_empty(1 << 16), 0)) for _ in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    engine.write(file, aligned_empty(1 << 16), 0)  # the warm-up handle of this thread is gone: a new one
    assert _os_threads_settle_at(before + 5)  # one I/O thread per handle, outliving its caller
    engine.close()
    assert _os_threads_settle_at(before)
    engine.write(file, aligned_empty(1 << 16), 0)  # usable again: a new handle for this thread
    engine.close()
    file.close()


def _locked_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmLck:"))


def test_deepspeed_aio_pool_buffers_are_page_locked_and_freed_on_close(tmp_path):
    """Locked once, DeepSpeed transfers straight into them: no locked bounce buffer and copy per transfer."""
    aio, op = aio_op()
    if aio.lockable_bytes() is not None and aio.lockable_bytes() < 8 << 20:
        lacking("this process may not lock 8 MiB (`ulimit -l`; CI runs as root)")
    engine = aio.DeepSpeedAIO(1 << 20, 4, op=op)
    before = _locked_kib()
    bufs = [engine.empty(3 << 20) for _ in range(2)]
    assert _locked_kib() - before >= 2 * 3 * 1024
    assert all(engine._handle().is_pinned(b) for b in bufs)
    assert all(b.data_ptr() % 4096 == 0 and b.dtype == torch.uint8 and b.numel() == 3 << 20 for b in bufs)
    file = StateFile(tmp_path / "f", 3 << 20, create=True)
    bufs[0].copy_(torch.randint(0, 256, (3 << 20,), dtype=torch.uint8))
    engine.write(file, bufs[0], 0)
    engine.read(file, bufs[1], 0)
    assert torch.equal(bufs[0], bufs[1])
    file.close()
    engine.close()
    assert _locked_kib() == before


_NO_MEMLOCK = """
import resource, sys
from pathlib import Path
import torch
from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.core.io.direct import StateFile, ThreadedIO, aligned_empty
from lightning_smartinf.zero.aio import DeepSpeedAIO, load_aio_op, lockable_bytes
from lightning_smartinf.zero.io_choice import choose_io_engine

resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))
assert lockable_bytes() is not None and lockable_bytes() <= 1 << 20, lockable_bytes()
d = Path(sys.argv[1])
engine = DeepSpeedAIO(1 << 16, 4, op=load_aio_op())
file = StateFile(d / "f", 4 << 20, create=True)
for attempt in (lambda: engine.empty(4 << 20), lambda: engine.write(file, aligned_empty(4 << 20), 0)):
    try:
        attempt()
    except RuntimeError as exc:
        assert "ulimit -l" in str(exc) and "io_engine='threads'" in str(exc), exc
    else:
        raise AssertionError("a lock beyond the limit was not refused")
engine.write(file, aligned_empty(256 << 10), 0)  # a bounce buffer within the limit still works
engine.close()
file.close()
auto = choose_io_engine(SmartInfinityStrategy(storage_paths=[d], io_engine="auto").settings, [d]).factory()
assert isinstance(auto, ThreadedIO), auto
try:
    choose_io_engine(SmartInfinityStrategy(storage_paths=[d], io_engine="aio").settings, [d])
except ValueError as exc:  # the strategy raises it as a MisconfigurationException
    assert "io_engine='aio'" in str(exc) and "ulimit -l" in str(exc), exc
else:
    raise AssertionError("io_engine='aio' was accepted without the memory to lock its pools")
print("refused cleanly")
"""


@pytest.mark.slow
def test_deepspeed_aio_without_lockable_memory_is_refused_not_aborted(tmp_path):
    """A user without ``CAP_IPC_LOCK`` and with an 8 MiB ``ulimit -l`` (a common default) had DeepSpeed abort the
    process on the first 12 MiB transfer (a failed ``mlock`` asserted in C++). Now: a clear error, and ``auto``
    picks threads. Run in a process without the capability and with a 1 MiB limit."""
    aio_op()
    command = [sys.executable, "-c", _NO_MEMLOCK, str(tmp_path)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            lacking("root keeps CAP_IPC_LOCK without setpriv (util-linux) to drop it")
        command = ["setpriv", "--bounding-set", "-ipc_lock", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused cleanly" in done.stdout


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"block_size": 1000}, r"io_block_size=1000.*multiple of 4096"), ({"queue_depth": 0}, r"io_queue_depth=0")],
)
def test_bad_io_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ThreadedIO(**kwargs)


class SlowWrites(ThreadedIO):
    """Real file I/O whose writes take long, so the next step's reads would overtake them if unordered."""

    def write(self, file, buf, offset):
        time.sleep(0.02)
        super().write(file, buf, offset)


def test_trailing_write_back_is_never_overtaken_by_the_next_read(tmp_path):
    n, chunk = 5 * 1024, 1024
    backend = CpuBackend([tmp_path], chunk_elems=chunk, buffer_count=2, io_factory=lambda: SlowWrites(4096, 2))
    backend.open([ShardSpec(0, n, Adam())])
    start = torch.randn(n)
    backend.initialize(0, start)
    reference = torch.nn.Parameter(start.clone())
    optimizer = torch.optim.Adam([reference], lr=1e-2)
    out = torch.empty(n)
    for step in range(1, 6):
        grad = torch.randn(n)
        reference.grad = grad.clone()
        optimizer.step()
        # No wait between steps: the handle completes when parameters are ready, with writes still pending.
        backend.submit(0, grad, StepParams(step=step, lr=1e-2), out).result()
        assert_close(out, reference.detach(), rtol=0, atol=0)
    backend.wait()
    backend.close()


def test_handle_completes_before_trailing_writes(tmp_path):
    n = 8 * 1024
    backend = CpuBackend([tmp_path], chunk_elems=1024, buffer_count=3, io_factory=lambda: SlowWrites(4096, 1))
    backend.open([ShardSpec(0, n, Adam())])
    backend.initialize(0, torch.zeros(n))
    backend.wait()
    handle = backend.submit(0, torch.ones(n), StepParams(step=1, lr=1e-2), torch.empty(n))
    handle.result()
    assert backend.devices[0].trailing and not all(f.done() for f in backend.devices[0].trailing)
    backend.wait()
    assert all(f.done() for f in backend.devices[0].trailing) or not backend.devices[0].trailing
    backend.close()


def test_gradient_is_rounded_to_the_link_dtype_and_counted_at_its_size(tmp_path):
    n = 3000
    wide, narrow = CpuBackend([tmp_path / "a"], chunk_elems=1024), CpuBackend([tmp_path / "b"], chunk_elems=1024)
    start, grad = torch.randn(n), torch.randn(n)
    outs = []
    for backend, g, link in ((wide, grad, torch.bfloat16), (narrow, grad.to(torch.bfloat16), None)):
        backend.open([ShardSpec(0, n, Adam())])
        backend.initialize(0, start)
        backend.wait()
        out = torch.empty(n, dtype=torch.bfloat16)
        before = backend.traffic_snapshot()
        backend.submit(0, g, StepParams(step=1, lr=1e-2), out, link_dtype=link).result()
        assert (backend.traffic_snapshot() - before).link_write_bytes == 2 * n
        outs.append(out)
        backend.close()
    assert torch.equal(outs[0], outs[1])
