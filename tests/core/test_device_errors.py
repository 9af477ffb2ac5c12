"""Device errors are loud, early and final: a storage failure names its path, operation and errno, stops the
backend (no further update, no save of torn state), never hands a buffer back with I/O in flight, and a device
that stops answering raises after ``device_timeout_s`` instead of hanging the run.

Real files and real threads. The I/O engines are the real ``ThreadedIO`` with faults injected around it: an
``OSError`` on the Nth transfer, a transfer that blocks until the test releases it, a piece that fails while its
sibling is still in flight; and the device directory itself removed or renamed away.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import wait as futures_wait
from pathlib import Path

import pytest
import torch
from helpers.hang_guard import GUARD_S, run_with_timeout
from helpers.machine import aio_op

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.io.direct import IO_ALIGN, StateFile, ThreadedIO, aligned_empty
from lightning_smartinf.core.io.storage import StorageError
from lightning_smartinf.core.rules import Adam, StepParams
from lightning_smartinf.core.streaming.backend import check_device_timeout
from lightning_smartinf.devices.cpu import CpuBackend

CHUNK = 1024
RULE = Adam(decoupled_weight_decay=True)
HP = StepParams(step=1, lr=1e-2, weight_decay=0.1)
#: A short device timeout, so the timeout tests take about this long.
SHORT_TIMEOUT_S = 0.5


class FaultyIO(ThreadedIO):
    """The real ``ThreadedIO``, except that the ``nth`` ``operation`` after :meth:`arm` raises ``OSError(code)``."""

    def __init__(self, operation: str, code: int, nth: int = 1) -> None:
        super().__init__(block_size=IO_ALIGN, queue_depth=2)
        self.operation, self.code, self.nth = operation, code, nth
        self._lock = threading.Lock()
        self._count: int | None = None  # None until armed

    def arm(self) -> None:
        with self._lock:
            self._count = 0

    def _inject(self, operation: str) -> None:
        with self._lock:
            if self._count is None or operation != self.operation:
                return
            self._count += 1
            hit = self._count == self.nth
        if hit:
            raise OSError(self.code, os.strerror(self.code))

    def read(self, file: StateFile, buf: torch.Tensor, offset: int) -> None:
        self._inject("read")
        super().read(file, buf, offset)

    def write(self, file: StateFile, buf: torch.Tensor, offset: int) -> None:
        self._inject("write")
        super().write(file, buf, offset)


class HungIO(ThreadedIO):
    """The real ``ThreadedIO`` whose ``operation``, once armed, blocks until :attr:`release` is set."""

    def __init__(self, operation: str) -> None:
        super().__init__(block_size=IO_ALIGN, queue_depth=2)
        self.operation = operation
        self.armed = False
        self.blocked = threading.Event()
        self.release = threading.Event()

    def _hang(self, operation: str) -> None:
        if self.armed and operation == self.operation:
            self.blocked.set()
            assert self.release.wait(GUARD_S), "the test never released the hung transfer"

    def read(self, file: StateFile, buf: torch.Tensor, offset: int) -> None:
        self._hang("read")
        super().read(file, buf, offset)

    def write(self, file: StateFile, buf: torch.Tensor, offset: int) -> None:
        self._hang("write")
        super().write(file, buf, offset)


class _SplitPieces:
    """Stands for a :class:`StateFile` inside ``ThreadedIO``: the piece at ``offset`` fails with ``EIO`` at once;
    the next one is held until ``release`` is set, then records whether ``check()`` held while it was in flight."""

    def __init__(self, file: StateFile, offset: int, block: int, check: Callable[[], bool]) -> None:
        self.file = file
        self.failing, self.slow = offset, offset + block
        self.check = check
        self.slow_started = threading.Event()
        self.release = threading.Event()
        self.held_while_in_flight: bool | None = None

    def read_into(self, buf: torch.Tensor, offset: int) -> None:
        if offset == self.failing:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        if offset == self.slow:
            self.slow_started.set()
            assert self.release.wait(GUARD_S), "the test never released the slow piece"
            self.held_while_in_flight = self.check()
        self.file.read_into(buf, offset)


class SplitFailIO(ThreadedIO):
    """The real ``ThreadedIO``; the first read after :meth:`arm` goes through :class:`_SplitPieces`."""

    def __init__(self) -> None:
        super().__init__(block_size=IO_ALIGN, queue_depth=4)
        self.gate: _SplitPieces | None = None
        self._check: Callable[[], bool] | None = None
        self._lock = threading.Lock()
        self.gate_made = threading.Event()

    def arm(self, check: Callable[[], bool]) -> None:
        self._check = check

    def read(self, file: StateFile, buf: torch.Tensor, offset: int) -> None:
        with self._lock:
            gated = self._check is not None and self.gate is None
            if gated:
                self.gate = _SplitPieces(file, offset, self.block_size, self._check)
                self.gate_made.set()
        super().read(self.gate if gated else file, buf, offset)  # type: ignore[arg-type]


def _backend(
    tmp_path: Path, engines: list[ThreadedIO], sizes: tuple[int, ...] = (3 * CHUNK,), **kwargs
) -> tuple[CpuBackend, list[torch.Tensor]]:
    """An opened backend with one device per engine, every shard initialised (before any fault is armed)."""
    supply = iter(engines)
    kwargs.setdefault("buffer_count", 4)
    kwargs.setdefault("io_threads", 1)
    backend = CpuBackend(
        [tmp_path / f"csd{i}" for i in range(len(engines))],
        chunk_elems=CHUNK,
        io_factory=lambda: next(supply),
        **kwargs,
    )
    backend.open([ShardSpec(i, n, RULE) for i, n in enumerate(sizes)])
    masters = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(sizes)]
    for i, master in enumerate(masters):
        backend.initialize(i, master)
    backend.wait()
    return backend, masters


def _step(backend: CpuBackend, shard: int, numel: int) -> object:
    return backend.submit(shard, torch.ones(numel), HP, torch.empty(numel))


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _assert_names(exc: BaseException, path: Path, operation: str, code: int) -> None:
    assert isinstance(exc, StorageError), repr(exc)
    assert isinstance(exc, OSError)  # code written for I/O errors still catches it
    assert (exc.path, exc.operation, exc.errno) == (path, operation, code)
    message = str(exc)
    assert str(path) in message
    assert operation in message
    assert f"{errno.errorcode[code]} ({code})" in message
    assert "resume from the last" in message


# ---------------------------------------------------------------------------------------------- loud: the message


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC], ids=["EIO", "ENOSPC"])
@pytest.mark.parametrize("operation", ["read", "write"])
def test_first_io_error_names_path_operation_and_errno(tmp_path, operation, code) -> None:
    engine = FaultyIO(operation, code, nth=2)
    backend, _ = _backend(tmp_path, [engine])
    try:
        engine.arm()
        handle = _step(backend, 0, 3 * CHUNK)
        if operation == "read":  # the request itself fails
            exc = run_with_timeout(lambda: backend.result(handle))
        else:  # write-back trails the request; `wait` reports it
            assert run_with_timeout(lambda: backend.result(handle)) is None
            exc = run_with_timeout(backend.wait)
        _assert_names(exc, backend.shards[0].file.path, operation, code)
        assert backend.failure is exc
    finally:
        assert run_with_timeout(backend.close) is None


def test_storage_error_keeps_its_fields_across_processes() -> None:
    exc = StorageError.from_os_error(OSError(errno.EIO, "Input/output error"), path="/d/s.state", operation="read")
    copy = pickle.loads(pickle.dumps(exc))
    assert (copy.path, copy.operation, copy.errno, str(copy)) == (exc.path, exc.operation, exc.errno, str(exc))
    assert str(StorageError("plain message")) == "plain message"


# ---------------------------------------------------------------------------------------------- final: the latch


def test_after_an_error_the_backend_refuses_work_and_saves_nothing(tmp_path) -> None:
    engine = FaultyIO("read", errno.EIO)
    backend, masters = _backend(tmp_path, [engine], sizes=(2 * CHUNK, CHUNK), tentative_slots=True)
    saved = tmp_path / "ckpt"
    try:
        backend.save(saved)
        before = _files(saved)
        tentative = backend.submit(1, torch.ones(CHUNK), HP, torch.empty(CHUNK), tentative=True)
        assert run_with_timeout(lambda: backend.result(tentative)) is None
        engine.arm()
        original = run_with_timeout(lambda: backend.result(_step(backend, 0, 2 * CHUNK)))
        assert isinstance(original, StorageError) and backend.failure is original

        refusals: dict[str, Callable[[], object]] = {
            "submit": lambda: _step(backend, 0, 2 * CHUNK),
            "initialize": lambda: backend.initialize(0, masters[0]),
            "read_master": lambda: backend.read_master(0, torch.empty(2 * CHUNK)),
            "commit": lambda: backend.commit([1]),
            "save": lambda: backend.save(saved),
            "load": lambda: backend.load(saved),
            "check_storage": backend.check_storage,
        }
        for method, call in refusals.items():
            exc = run_with_timeout(call)
            assert isinstance(exc, StorageError), (method, exc)
            assert f"`CpuBackend.{method}` refused" in str(exc)
            assert "torn" in str(exc) and "last good checkpoint" in str(exc)
            assert str(original) in str(exc)  # path, operation and errno of the first error
            assert (exc.path, exc.operation, exc.errno) == (original.path, "read", errno.EIO)
            assert exc.__cause__ is original
        # A checkpoint of torn state is worse than none: the saved one is untouched, and no temporary copy appeared.
        assert _files(saved) == before
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt")) == []
        assert run_with_timeout(lambda: backend.prefetch([0, 1])) is None  # advice is ignored
        assert run_with_timeout(backend.wait) is None  # the error was reported once
    finally:
        assert run_with_timeout(backend.close) is None
    device = backend.devices[0]
    assert not device.running
    assert device.pool.in_use == 0 and device.allocated_bytes == 0


def test_requests_queued_before_the_error_was_reported_still_run(tmp_path) -> None:
    """The latch is on the host: what was submitted before the host saw the error finishes (or fails) normally."""
    engine = FaultyIO("read", errno.EIO)
    backend, _ = _backend(tmp_path, [engine], sizes=(CHUNK, CHUNK))
    try:
        engine.arm()
        failed, healthy = _step(backend, 0, CHUNK), _step(backend, 1, CHUNK)
        assert isinstance(run_with_timeout(lambda: backend.result(failed)), StorageError)
        assert run_with_timeout(lambda: backend.result(healthy)) is None
        assert isinstance(run_with_timeout(lambda: _step(backend, 1, CHUNK)), StorageError)
    finally:
        assert run_with_timeout(backend.close) is None


# ---------------------------------------------------------------------------------------------- no I/O in flight


def test_threaded_io_raises_only_after_every_piece_settled(tmp_path) -> None:
    engine = ThreadedIO(block_size=IO_ALIGN, queue_depth=4)
    file = StateFile(tmp_path / "f", 4 * IO_ALIGN, create=True)
    returned = threading.Event()
    gate = _SplitPieces(file, 0, IO_ALIGN, check=lambda: not returned.is_set())
    box: list[BaseException | None] = [None]

    def read() -> None:
        try:
            engine.read(gate, aligned_empty(4 * IO_ALIGN), 0)  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box[0] = exc
        returned.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    try:
        assert gate.slow_started.wait(GUARD_S)
        returned.wait(0.3)  # the failed first piece must not make `read` return while the second is in flight
    finally:
        gate.release.set()
    thread.join(GUARD_S)
    assert not thread.is_alive()
    assert gate.held_while_in_flight is True, "`read` returned while one of its pieces was still in flight"
    assert isinstance(box[0], OSError) and box[0].errno == errno.EIO
    file.close()
    engine.close()


def test_no_buffer_goes_back_to_the_pool_while_a_piece_is_in_flight(tmp_path) -> None:
    engine = SplitFailIO()
    backend, _ = _backend(tmp_path, [engine], sizes=(CHUNK,), buffer_count=2)
    device = backend.devices[0]
    handles: list = []
    # Checked from inside the slow piece: its request still pending, its chunk buffer still out of the pool.
    engine.arm(lambda: not handles[0].done() and device.pool.in_use >= 1)
    try:
        handles.append(_step(backend, 0, CHUNK))
        assert engine.gate_made.wait(GUARD_S) and engine.gate.slow_started.wait(GUARD_S)
        futures_wait(handles, timeout=0.3)  # time for a premature failure (and release) to show
        engine.gate.release.set()
        exc = run_with_timeout(lambda: backend.result(handles[0]))
        assert engine.gate.held_while_in_flight is True, "the chunk buffer left the read while a piece was in flight"
        _assert_names(exc, backend.shards[0].file.path, "read", errno.EIO)
        assert device.pool.wait_idle(GUARD_S)
    finally:
        if engine.gate is not None:
            engine.gate.release.set()
        assert run_with_timeout(backend.close) is None


# ---------------------------------------------------------------------------------------------- early: timeouts


@pytest.mark.parametrize("operation", ["read", "write"])
def test_a_device_that_stops_answering_raises_after_the_timeout(tmp_path, operation) -> None:
    engine = HungIO(operation)
    backend, _ = _backend(tmp_path, [engine], device_timeout_s=SHORT_TIMEOUT_S)
    device = backend.devices[0]
    try:
        engine.armed = True
        handle = _step(backend, 0, 3 * CHUNK)
        # Reads hang: the request itself never finishes. Writes hang: the request finishes, its write-back does not.
        exc = run_with_timeout(lambda: backend.result(handle) if operation == "read" else backend.wait())
        assert engine.blocked.is_set()
        assert isinstance(exc, StorageError), repr(exc)
        assert exc.errno == errno.ETIMEDOUT and exc.operation == operation
        assert exc.path == backend.shards[0].file.path
        message = str(exc)
        assert str(device.directory) in message and str(exc.path) in message
        assert f"{operation} of" in message and f"`device_timeout_s={SHORT_TIMEOUT_S}`" in message
        assert backend.failure is exc
        assert "refused" in str(run_with_timeout(lambda: _step(backend, 0, 3 * CHUNK)))
        # `close` releases what it can and gives the hung threads up after the timeout instead of hanging.
        assert run_with_timeout(backend.close) is None
    finally:
        engine.release.set()
    device._worker.join(GUARD_S)
    assert not device.running, "the worker did not finish once the storage answered again"
    engine.close()


def test_a_slow_device_that_keeps_moving_does_not_time_out(tmp_path) -> None:
    """The timeout is on silence, not on the total wait: a long queue of work that progresses never trips it."""

    class SlowIO(ThreadedIO):
        def read(self, file: StateFile, buf: torch.Tensor, offset: int) -> None:
            threading.Event().wait(0.05)
            super().read(file, buf, offset)

    numel = 24 * CHUNK  # 24 chunk reads of at least 0.05 s each: the request takes twice the timeout, or more
    backend, _ = _backend(tmp_path, [SlowIO(IO_ALIGN, 2)], sizes=(numel,), device_timeout_s=0.6)
    try:
        handle = _step(backend, 0, numel)
        assert run_with_timeout(lambda: backend.result(handle)) is None
        assert run_with_timeout(backend.wait) is None
        assert backend.failure is None
    finally:
        assert run_with_timeout(backend.close) is None


def test_traffic_is_the_same_with_and_without_a_timeout(tmp_path) -> None:
    traffic = []
    for timeout in (None, 60.0):
        sizes = (3 * CHUNK, CHUNK)
        backend, _ = _backend(tmp_path / str(timeout), [ThreadedIO()], sizes=sizes, device_timeout_s=timeout)
        try:
            for shard, numel in ((0, 3 * CHUNK), (1, CHUNK)):
                backend.result(_step(backend, shard, numel))
            backend.wait()
            traffic.append(backend.traffic_snapshot())
        finally:
            backend.close()
    assert traffic[0] == traffic[1]


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "30"])
def test_device_timeout_is_validated(tmp_path, value) -> None:
    with pytest.raises(ValueError, match=re.escape(f"`device_timeout_s={value!r}`") + ".*positive.*None"):
        CpuBackend([tmp_path / "csd0"], chunk_elems=CHUNK, device_timeout_s=value)


@pytest.mark.parametrize(("value", "seconds"), [(None, None), (1, 1.0), (0.25, 0.25)])
def test_device_timeout_accepts_seconds_or_none(value, seconds) -> None:
    assert check_device_timeout(value) == seconds


# ---------------------------------------------------------------------------------------------- vanished storage


@pytest.mark.parametrize("how", ["rmtree", "rename"])
def test_a_vanished_device_directory_stops_the_backend(tmp_path, how) -> None:
    backend, _ = _backend(tmp_path, [ThreadedIO(), ThreadedIO()], sizes=(CHUNK, CHUNK))
    saved = tmp_path / "ckpt"
    try:
        backend.save(saved)
        before = _files(saved)
        for shard in (0, 1):
            backend.result(_step(backend, shard, CHUNK))
        victim = backend.devices[1].directory
        if how == "rmtree":
            shutil.rmtree(victim)
        else:
            victim.rename(victim.with_name("moved-away"))
        exc = run_with_timeout(backend.check_storage)
        _assert_names(exc, victim, "stat", errno.ENOENT)
        assert "disappeared" in str(exc) and backend.failure is exc
        assert "refused" in str(run_with_timeout(lambda: _step(backend, 0, CHUNK)))
        assert "refused" in str(run_with_timeout(lambda: backend.save(saved)))
        assert _files(saved) == before
    finally:
        assert run_with_timeout(backend.close) is None


def test_deepspeed_aio_reports_a_vanished_path_with_its_errno(tmp_path) -> None:
    aio, op = aio_op()
    backend, _ = _backend(tmp_path, [aio.DeepSpeedAIO(1 << 16, 4, op=op)], sizes=(CHUNK,))
    try:
        directory = backend.devices[0].directory
        directory.rename(directory.with_name("moved-away"))  # async_io opens the file by name for every transfer
        exc = run_with_timeout(lambda: backend.result(_step(backend, 0, CHUNK)))
        _assert_names(exc, backend.shards[0].file.path, "read", errno.ENOENT)
    finally:
        assert run_with_timeout(backend.close) is None
