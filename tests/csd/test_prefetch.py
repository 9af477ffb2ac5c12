"""Between steps an idle device reads the state it was told comes next; results never depend on the advice.

Real files, real threads, the real ``ThreadedIO`` behind read/write gates (as in ``test_read_ahead.py``), so a
test can show a request finishing with every read held back: it can only have used chunks read before.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lightning_smartinf.csd.backend import ShardSpec
from lightning_smartinf.csd.cpu import CpuBackend, EmulatedDevice
from tests.csd.test_read_ahead import CHUNK, HP, RULE, TIMEOUT_S, GatedIO


class Reference:
    """The shards' fp32 masters and Adam moments as plain tensors, updated with the same rule."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.masters = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(sizes)]
        self.states = [[torch.zeros(n), torch.zeros(n)] for n in sizes]
        self.step = 0

    def grads(self) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(100 + self.step)
        return [torch.randn(m.numel(), generator=gen) for m in self.masters]

    def apply(self, grads: list[torch.Tensor]) -> None:
        self.step += 1
        for master, states, grad in zip(self.masters, self.states, grads):
            RULE.apply(master, grad.clone(), states, replace(HP, step=self.step))


def _open(tmp_path: Path, engine: GatedIO, sizes: tuple[int, ...], **kwargs) -> tuple[CpuBackend, Reference]:
    backend = CpuBackend([tmp_path / "csd0"], chunk_elems=CHUNK, buffer_count=4, io_factory=lambda: engine, **kwargs)
    backend.open([ShardSpec(i, n, RULE) for i, n in enumerate(sizes)])
    reference = Reference(sizes)
    for i, master in enumerate(reference.masters):
        backend.initialize(i, master)
    backend.wait()
    return backend, reference


def _step(backend: CpuBackend, reference: Reference, order: list[int], **submit) -> list[torch.Tensor]:
    """Submit one update per shard in ``order``, wait, check every result against the reference bit for bit."""
    grads = reference.grads()
    reference.apply(grads)
    hp = replace(HP, step=reference.step)
    outs = [torch.empty_like(m) for m in reference.masters]
    handles = [backend.submit(i, grads[i], hp, outs[i], **submit) for i in order]
    for handle in handles:
        handle.result(timeout=TIMEOUT_S)
    for out, master in zip(outs, reference.masters):
        torch.testing.assert_close(out, master, rtol=0, atol=0)
    return outs


def _settle(device: EmulatedDevice, chunks: int) -> None:
    """Wait until ``chunks`` prefetched reads are done (the worker owns the deque: retry if it moves)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(RuntimeError):
            entries = list(device._prefetched)  # noqa: SLF001 - observing the device, not driving it
            if len(entries) == chunks and all(pending.done() for *_, pending in entries):
                return
        time.sleep(0.001)
    raise AssertionError(f"{chunks} prefetched chunks never settled")


def _record_bytes(chunks: int) -> int:
    return chunks * CHUNK * 3 * 4  # master, m, v


def test_prefetched_chunks_are_the_next_requests_first_reads(tmp_path: Path) -> None:
    engine = GatedIO()
    backend, reference = _open(tmp_path, engine, (2 * CHUNK, 2 * CHUNK))
    device = backend.devices[0]
    try:
        _step(backend, reference, [0, 1])
        backend.prefetch([0, 1])
        _settle(device, 3)  # buffer_count - 1: both chunks of shard 0, the first of shard 1
        before = backend.traffic_snapshot()
        engine.reads_open.clear()
        grads = reference.grads()
        reference.apply(grads)
        hp = replace(HP, step=reference.step)
        outs = [torch.empty(2 * CHUNK) for _ in range(2)]
        first = backend.submit(0, grads[0], hp, outs[0])
        # Every read is held back, yet shard 0 completes: it ran on the two chunks read between the steps.
        first.result(timeout=TIMEOUT_S)
        second = backend.submit(1, grads[1], hp, outs[1])
        engine.reads_open.set()  # shard 1's second chunk still has to be read
        second.result(timeout=TIMEOUT_S)
        backend.wait()
        for out, master in zip(outs, reference.masters):
            torch.testing.assert_close(out, master, rtol=0, atol=0)
        # Prefetched bytes count with the step that used them: the step's traffic is exactly the state, once.
        delta = backend.traffic_snapshot() - before
        assert delta.storage_read_bytes == delta.storage_write_bytes == _record_bytes(4)
        assert backend.prefetch_stats() == (_record_bytes(3), 0)
        assert device.pool.in_use == 0
    finally:
        engine.reads_open.set()
        backend.close()


def test_advice_for_another_shard_is_dropped_before_the_request_runs(tmp_path: Path) -> None:
    engine = GatedIO()
    backend, reference = _open(tmp_path, engine, (CHUNK, 3 * CHUNK))
    device = backend.devices[0]
    try:
        _step(backend, reference, [0, 1])
        backend.prefetch([1])
        _settle(device, 3)
        before = backend.traffic_snapshot()
        _step(backend, reference, [0, 1])  # shard 0 first: the advice was wrong, the chunks of shard 1 go
        backend.wait()
        dropped = _record_bytes(3)
        assert backend.prefetch_stats() == (0, dropped)
        # A read that happened is traffic even if unused: the state once, plus what was read in vain.
        assert (backend.traffic_snapshot() - before).storage_read_bytes == _record_bytes(4) + dropped
        assert device.pool.in_use == 0
    finally:
        backend.close()


def test_prefetch_reads_the_state_a_commit_made_current(tmp_path: Path) -> None:
    engine = GatedIO()
    backend, reference = _open(tmp_path, engine, (2 * CHUNK,), tentative_slots=True)
    try:
        _step(backend, reference, [0], tentative=True)
        backend.prefetch([0])  # uncommitted: its current state is not settled yet, so it is not prefetched
        backend.commit([0])
        backend.prefetch([0])
        _settle(backend.devices[0], 2)
        # The tentative update was written to the other slot; the prefetch must have read that one.
        _step(backend, reference, [0], tentative=True)
        backend.commit([0])
        assert backend.prefetch_stats() == (_record_bytes(2), 0)
    finally:
        backend.close()


def test_load_drops_prefetched_state_it_replaces(tmp_path: Path) -> None:
    engine = GatedIO()
    backend, reference = _open(tmp_path, engine, (2 * CHUNK, CHUNK))
    try:
        _step(backend, reference, [0, 1])
        backend.save(tmp_path / "ckpt")
        saved = (
            [m.clone() for m in reference.masters],
            [[s.clone() for s in states] for states in reference.states],
            reference.step,
        )
        _step(backend, reference, [0, 1])
        backend.prefetch([0, 1])
        _settle(backend.devices[0], 3)  # the state after the second step, about to be replaced
        backend.load(tmp_path / "ckpt")
        reference.masters, reference.states, reference.step = saved
        _step(backend, reference, [0, 1])  # from the loaded state, not from the chunks read before the load
        assert backend.prefetch_stats() == (0, _record_bytes(3))
    finally:
        backend.close()


def test_close_releases_prefetched_chunks_and_counts_their_reads(tmp_path: Path) -> None:
    engine = GatedIO()
    backend, reference = _open(tmp_path, engine, (4 * CHUNK,))
    device = backend.devices[0]
    _step(backend, reference, [0])
    backend.wait()
    before = backend.traffic_snapshot()
    backend.prefetch([0])
    _settle(device, 3)
    backend.close()
    assert not device._worker.is_alive()  # noqa: SLF001
    assert device.pool.in_use == 0 and device.pool.size == 0
    assert (backend.traffic_snapshot() - before).storage_read_bytes == _record_bytes(3)


def test_advice_is_ignored_when_prefetch_is_off(tmp_path: Path) -> None:
    engine = GatedIO()
    backend, reference = _open(tmp_path, engine, (2 * CHUNK,), prefetch_state=False)
    try:
        _step(backend, reference, [0])
        backend.prefetch([0])
        _step(backend, reference, [0])
        backend.wait()
        assert backend.prefetch_stats() == (0, 0)
    finally:
        backend.close()


def test_advice_names_shards_that_exist(tmp_path: Path) -> None:
    backend, _ = _open(tmp_path, GatedIO(), (CHUNK,))
    try:
        with pytest.raises(ValueError, match=r"prefetch.*shard 3.*0\.\.0"):
            backend.prefetch([0, 3])
    finally:
        backend.close()
