"""The BufferPool callback: pool sizing at fit start, release at the end, and the metrics it logs."""

from __future__ import annotations

import time

import pytest
from helpers.machine import aio_op
from helpers.models import LMModule, adamw_factory, fit
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.lightning.callbacks import BufferPool

adamw = adamw_factory(lr=1e-3)


class KeepBackend(BufferPool):
    """Records the backend before the callback releases it."""

    def on_train_end(self, trainer, pl_module):
        self.backend = trainer.strategy.backend
        self.buffer_bytes = self.backend.buffer_bytes
        self.metrics = dict(trainer.callback_metrics)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # A forward pass this small takes microseconds; a real one gives idle devices the time to read ahead that
        # this pause gives them (the prefetch figure below would otherwise depend on thread scheduling).
        if trainer.global_step > 0:
            time.sleep(0.3)


def test_pool_sized_from_sub_groups_metrics_logged_and_released(tmp_path):
    paths = [tmp_path / "a", tmp_path / "b"]
    for p in paths:
        p.mkdir()
    pool = KeepBackend()
    strategy = SmartInfinityStrategy(storage_paths=paths, sub_group_size=3000, chunk_size=1 << 20, io_engine="threads")
    trainer, _ = fit(LMModule(adamw), strategy, steps=3, precision="bf16-mixed", callbacks=[pool])

    # chunk_size shrinks from 1M to the largest sub-group (3000 elements, rounded up to 1024).
    assert strategy.settings.chunk_size == 3072
    # Per device: buffer_count (16) x (master, m, v) fp32 + an fp32 gradient chunk (ZeRO accumulates bf16 gradients
    # in bf16 here, so no separate link-rounding chunk is needed).
    assert pool.buffer_bytes == 2 * (16 * 3 + 1) * 3072 * 4
    assert pool.backend.buffer_bytes == 0  # freed at teardown
    metrics = pool.metrics
    assert metrics["smartinf/wait_ms"] >= 0
    # Where the step went: the strategy's clocks (host time, per optimizer step).
    phases = [metrics[f"smartinf/{name}_ms"] for name in ("forward", "backward", "after_backward")]
    assert all(ms > 0 for ms in phases)
    assert 0 <= metrics["smartinf/wait_ms"] <= metrics["smartinf/update_ms"] <= metrics["smartinf/after_backward_ms"]
    assert 0 < metrics["smartinf/pool_utilisation"] <= 1
    # No clipping, no schedule: every sub-group of the last step was updated during backward and kept.
    sub_groups = len(trainer.strategy.deepspeed_engine.optimizer.fp16_groups)
    assert metrics["smartinf/early_kept"] == sub_groups > 0
    assert metrics["smartinf/early_rolled_back"] == 0
    # Devices started steps on state read ahead while they waited (`prefetch_state`). When a read happened (before or
    # after the previous step's metrics were taken) is up to thread scheduling, so the per-step figures are only
    # checked to be logged, and the totals to be positive.
    assert metrics["smartinf/prefetch_used_bytes"] >= 0
    assert pool.backend.prefetch_stats()[0] > 0
    for device in (0, 1):
        assert metrics[f"smartinf/device{device}_read_ms"] >= 0
        assert pool.backend.devices[device].stats.read_s > 0
        assert metrics[f"smartinf/device{device}_compute_ms"] > 0
        assert f"smartinf/device{device}_write_ms" in metrics
    # Released at the end: no backend, threads stopped, traffic still readable.
    assert not strategy.has_smart_update
    assert all(not d.running for d in pool.backend.devices)
    assert strategy.traffic.link_read_bytes > 0


def test_memory_budget_decides_the_buffer_count(tmp_path):
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=4096, chunk_size=4096)
    budget = 8 * (4096 * 4 * 4) + 4096 * 4  # eight worst-case (4-tensor) buffers plus the gradient chunk
    trainer, _ = fit(LMModule(adamw), strategy, steps=1, callbacks=[BufferPool(memory_budget=budget)])
    assert strategy.settings.buffer_count == 8


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"buffer_count": 4, "memory_budget": 1 << 30}, "give one of them"),
        ({"chunk_size": 1000}, r"chunk_size=1000.*multiple of 1024"),
        ({"buffer_count": 1}, r"buffer_count=1.*>= 2"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(MisconfigurationException, match=match):
        BufferPool(**kwargs)


def test_budget_too_small_for_two_buffers(tmp_path):
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=4096, chunk_size=4096)
    with pytest.raises(MisconfigurationException, match=r"memory_budget=1000.*too small.*Raise the budget"):
        fit(LMModule(adamw), strategy, steps=1, callbacks=[BufferPool(memory_budget=1000)])


def test_needs_the_smart_infinity_strategy():
    with pytest.raises(MisconfigurationException, match="works with `strategy='smart_infinity'`"):
        fit(LMModule(adamw), "auto", steps=1, callbacks=[BufferPool()])


@pytest.mark.parametrize("engine", ["threads", "aio"])
def test_io_engines_train_to_the_same_parameters(tmp_path, engine):
    if engine == "aio":
        aio_op()  # set-up installs libaio and builds the op
    _, reference = fit(LMModule(adamw), "auto", steps=4)
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=3000, io_engine=engine)
    _, ours = fit(LMModule(adamw), strategy, steps=4)
    assert max(float((ours[n] - reference[n]).abs().max()) for n in ours) < 1e-5


def test_bad_io_engine():
    with pytest.raises(MisconfigurationException, match=r"io_engine='spdk'.*'auto', 'aio', 'threads'"):
        SmartInfinityStrategy(io_engine="spdk")
    with pytest.raises(MisconfigurationException, match=r"io_block_size=100"):
        SmartInfinityStrategy(io_block_size=100)
