"""A device's reads run ahead across request boundaries, but never past an update of the same shard.

Real files and real threads; the I/O engine is the real ``ThreadedIO`` with gates that hold reads or writes
back, so the tests can look at the device at a chosen moment instead of racing it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.devices.cpu import CpuBackend
from tests.core.gated_io import CHUNK, HP, RULE, TIMEOUT_S, GatedIO


def _backend(tmp_path: Path, engine: GatedIO, sizes: tuple[int, ...]) -> tuple[CpuBackend, list[torch.Tensor]]:
    backend = CpuBackend([tmp_path / "csd0"], chunk_elems=CHUNK, buffer_count=4, io_factory=lambda: engine)
    backend.open([ShardSpec(i, n, RULE) for i, n in enumerate(sizes)])
    masters = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(sizes)]
    for i, master in enumerate(masters):
        backend.initialize(i, master)
    backend.wait()
    return backend, masters


def _expected(master: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    master = master.clone()
    RULE.apply(master, grad.clone(), [torch.zeros_like(master), torch.zeros_like(master)], HP)
    return master


def test_next_request_is_read_while_the_current_one_updates(tmp_path: Path) -> None:
    engine = GatedIO()
    backend, masters = _backend(tmp_path, engine, (2 * CHUNK, 2 * CHUNK))
    device = backend.devices[0]
    try:
        grads = [torch.randn(2 * CHUNK) for _ in masters]
        outs = [torch.empty(2 * CHUNK) for _ in masters]
        in_use_when_done: list[int] = []
        # Writes held back: their buffers stay in use, so at shard 0's completion the pool counts exactly its
        # two pending write-backs plus whatever reads were already issued for shard 1.
        engine.writes_open.clear()
        engine.reads_open.clear()  # hold shard 0 back until both requests are queued
        first = backend.submit(0, grads[0], HP, outs[0])
        first.add_done_callback(lambda _: in_use_when_done.append(device.pool.in_use))
        second = backend.submit(1, grads[1], HP, outs[1])
        engine.reads_open.set()
        first.result(timeout=TIMEOUT_S)
        # 2 write-backs of shard 0 + both chunks of shard 1 read ahead (without read-ahead: 2).
        assert in_use_when_done == [4]
        engine.writes_open.set()
        second.result(timeout=TIMEOUT_S)
        backend.wait()
        for master, grad, out in zip(masters, grads, outs):
            torch.testing.assert_close(out, _expected(master, grad), rtol=0, atol=0)
    finally:
        engine.writes_open.set()
        engine.reads_open.set()
        backend.close()


def test_read_ahead_never_overtakes_an_update_of_the_same_shard(tmp_path: Path) -> None:
    engine = GatedIO()
    backend, masters = _backend(tmp_path, engine, (3 * CHUNK,))
    try:
        grad, out, after = torch.randn(3 * CHUNK), torch.empty(3 * CHUNK), torch.empty(3 * CHUNK)
        in_use_when_done: list[int] = []
        engine.writes_open.clear()
        engine.reads_open.clear()  # queue the update and the read-back together
        update = backend.submit(0, grad, HP, out)
        update.add_done_callback(lambda _: in_use_when_done.append(backend.devices[0].pool.in_use))
        read_back = backend.read_master(0, after)
        engine.reads_open.set()
        update.result(timeout=TIMEOUT_S)
        # Only the update's 3 held write-backs: no read of the same shard was issued while it was updating
        # (that read could have found a chunk whose write-back was not even submitted yet).
        assert in_use_when_done == [3]
        engine.writes_open.set()
        read_back.result(timeout=TIMEOUT_S)
        backend.wait()
        expected = _expected(masters[0], grad)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(after, expected, rtol=0, atol=0)  # the updated master, every chunk of it
    finally:
        engine.writes_open.set()
        engine.reads_open.set()
        backend.close()


def test_params_never_wait_for_a_buffer_on_behalf_of_the_next_request(tmp_path: Path) -> None:
    engine = GatedIO()
    backend, masters = _backend(tmp_path, engine, (4 * CHUNK, 4 * CHUNK))
    try:
        grads = [torch.randn(4 * CHUNK) for _ in masters]
        outs = [torch.empty(4 * CHUNK) for _ in masters]
        engine.writes_open.clear()  # every write-back holds its buffer: the pool runs dry during shard 0
        engine.reads_open.clear()
        first = backend.submit(0, grads[0], HP, outs[0])
        second = backend.submit(1, grads[1], HP, outs[1])
        engine.reads_open.set()
        # Shard 0 needs all 4 buffers for itself; read-ahead into shard 1 must not take one and block it.
        first.result(timeout=TIMEOUT_S)
        torch.testing.assert_close(outs[0], _expected(masters[0], grads[0]), rtol=0, atol=0)
        engine.writes_open.set()
        second.result(timeout=TIMEOUT_S)
        torch.testing.assert_close(outs[1], _expected(masters[1], grads[1]), rtol=0, atol=0)
    finally:
        engine.writes_open.set()
        engine.reads_open.set()
        backend.close()


def test_a_failed_read_fails_only_its_own_request(tmp_path: Path) -> None:
    engine = GatedIO()
    backend, masters = _backend(tmp_path, engine, (2 * CHUNK, 2 * CHUNK, 2 * CHUNK))
    try:
        grads = [torch.randn(2 * CHUNK) for _ in masters]
        outs = [torch.empty(2 * CHUNK) for _ in masters]
        broken = backend.shards[1].file  # make shard 1's reads fail, as a vanished file would
        real_read = broken.read_into

        def failing_read(buf: torch.Tensor, offset: int) -> None:
            raise OSError(5, f"injected read error in {broken.path}")

        broken.read_into = failing_read  # type: ignore[method-assign]
        engine.reads_open.clear()
        handles = [backend.submit(i, g, HP, o) for i, (g, o) in enumerate(zip(grads, outs))]
        engine.reads_open.set()
        handles[0].result(timeout=TIMEOUT_S)
        assert isinstance(handles[1].exception(timeout=TIMEOUT_S), OSError)
        handles[2].result(timeout=TIMEOUT_S)
        for i in (0, 2):
            torch.testing.assert_close(outs[i], _expected(masters[i], grads[i]), rtol=0, atol=0)
        assert backend.devices[0].drain() is None  # trailing write-backs of shards 0 and 2 succeeded
        assert backend.devices[0].pool.in_use == 0  # the failed request's read-ahead buffers came back
        broken.read_into = real_read  # type: ignore[method-assign]
    finally:
        engine.reads_open.set()
        with contextlib.suppress(OSError):  # `close` re-raises the injected failure through `wait`
            backend.close()
