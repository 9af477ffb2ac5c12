"""A device with no request to serve reads ahead the state it was told comes next; results never depend on it.

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

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.streaming.device import HostCoreDevice
from lightning_smartinf.devices.cpu import CpuBackend
from tests.core.gated_io import CHUNK, HP, RULE, TIMEOUT_S, GatedIO


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
    # 5 buffers, 1 reader: at most 3 chunks prefetched at once (buffer_count - 1 - io_threads).
    backend = CpuBackend(
        [tmp_path / "csd0"], chunk_elems=CHUNK, buffer_count=5, io_threads=1, io_factory=lambda: engine, **kwargs
    )
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


def _settle(device: HostCoreDevice, *shards: int) -> None:
    """Wait until the device holds finished prefetched reads of exactly these shards' chunks, in this order.

    The worker owns the deque: a snapshot that races with it is retried.
    """
    deadline = time.monotonic() + TIMEOUT_S
    entries: list = []
    while time.monotonic() < deadline:
        with contextlib.suppress(RuntimeError):
            entries = list(device.prefetch_plan.held)  # observing the device, not driving it
            if [e.shard.spec.index for e in entries] == list(shards) and all(e.pending.done() for e in entries):
                return
        time.sleep(0.001)
    seen = [(e.shard.spec.index, e.slot, e.k) for e in entries]
    raise AssertionError(f"prefetched chunks of shards {list(shards)} never settled: {seen}")


def _record_bytes(chunks: int) -> int:
    return chunks * CHUNK * 3 * 4  # master, m, v


def test_prefetched_chunks_are_the_next_requests_first_reads(tmp_path: Path) -> None:
    engine = GatedIO()
    backend, reference = _open(tmp_path, engine, (2 * CHUNK, 2 * CHUNK))
    device = backend.devices[0]
    try:
        _step(backend, reference, [0, 1])
        backend.prefetch([0, 1])
        _settle(device, 0, 0, 1)  # the cap: both chunks of shard 0, the first of shard 1
        before = backend.traffic_snapshot()
        engine.reads_open.clear()
        grads = reference.grads()
        reference.apply(grads)
        hp = replace(HP, step=reference.step)
        outs = [torch.empty(2 * CHUNK) for _ in range(2)]
        first = backend.submit(0, grads[0], hp, outs[0])
        # Every read is held back, yet shard 0 completes: it ran on the two chunks read between the steps.
        first.result(timeout=TIMEOUT_S)
        # Idle until shard 1 comes, the device starts reading shard 1's second chunk (held back by the gate).
        second = backend.submit(1, grads[1], hp, outs[1])
        engine.reads_open.set()
        second.result(timeout=TIMEOUT_S)
        backend.wait()
        for out, master in zip(outs, reference.masters):
            torch.testing.assert_close(out, master, rtol=0, atol=0)
        # Prefetched bytes count with the step that used them: the step's traffic is exactly the state, once.
        delta = backend.traffic_snapshot() - before
        assert delta.storage_read_bytes == delta.storage_write_bytes == _record_bytes(4)
        assert backend.prefetch_stats() == (_record_bytes(4), 0)  # all of the state, before its requests came
        assert device.pool.in_use == 0
    finally:
        engine.reads_open.set()
        backend.close()


def test_requests_out_of_the_advised_order_still_use_their_chunks(tmp_path: Path) -> None:
    engine = GatedIO()
    backend, reference = _open(tmp_path, engine, (4 * CHUNK, 4 * CHUNK))
    device = backend.devices[0]
    try:
        _step(backend, reference, [0, 1])
        backend.prefetch([1, 0])
        _settle(device, 1, 1, 1)  # the cap: 3 of shard 1's 4 chunks
        before = backend.traffic_snapshot()
        # Shard 0 first: shard 1's chunks stay valid and wait for it, holding 3 of the 5 buffers; shard 0 still
        # streams its 4 chunks through the rest (with one more held, it would have no buffer left to read into).
        _step(backend, reference, [0, 1])
        backend.wait()
        assert backend.prefetch_stats() == (_record_bytes(3), 0)
        assert (backend.traffic_snapshot() - before).storage_read_bytes == _record_bytes(8)
        assert device.pool.in_use == 0
    finally:
        backend.close()


def test_new_advice_and_writes_drop_chunks_read_ahead(tmp_path: Path) -> None:
    engine = GatedIO()
    backend, reference = _open(tmp_path, engine, (3 * CHUNK, 3 * CHUNK))
    device = backend.devices[0]
    try:
        _step(backend, reference, [0, 1])
        backend.prefetch([1])
        _settle(device, 1, 1, 1)
        backend.prefetch([0])  # replaces the advice: shard 1's chunks go, shard 0's are read instead
        _settle(device, 0, 0, 0)
        assert backend.prefetch_stats() == (0, _record_bytes(3))
        # A request that does not read the state (here: overwriting it) drops its shard's chunks, unused.
        backend.initialize(0, reference.masters[0]).result(timeout=TIMEOUT_S)
        reference.states[0] = [torch.zeros(3 * CHUNK), torch.zeros(3 * CHUNK)]
        assert backend.prefetch_stats() == (0, _record_bytes(6))
        before = backend.traffic_snapshot()
        _step(backend, reference, [0, 1])  # from the rewritten state of shard 0, not from the dropped chunks
        backend.wait()
        # A read that happened is traffic even if unused; these were counted when dropped, not in this step.
        assert (backend.traffic_snapshot() - before).storage_read_bytes == _record_bytes(6)
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
        _settle(backend.devices[0], 0, 0)
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
        _settle(backend.devices[0], 0, 0, 1)  # the state after the second step, about to be replaced
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
    _settle(device, 0, 0, 0)
    backend.close()
    assert not device.running
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
