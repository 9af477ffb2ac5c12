"""Lightning callbacks of the ``smart_infinity`` strategy."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_smartinf.csd.layout import ELEM_ALIGN
from lightning_smartinf.strategy import SmartInfinityStrategy

MIB = 1 << 20


class BufferPool(Callback):
    """Sizes the devices' chunk-buffer pools at fit start, releases them at the end, and reports how they are used.

    Without arguments the pool keeps the strategy's ``buffer_count`` and shrinks ``chunk_size`` to the
    largest sub-group partition, so small models do not pay for buffers they cannot fill. With
    ``memory_budget`` (bytes of host memory for all pools on this rank) it picks the buffer count that
    fits. Logged each optimizer step:

    - ``smartinf/wait_ms``: time the host spent blocked on devices for updated parameters;
    - ``smartinf/pool_utilisation``: most buffers in use at once, as a fraction of the pool (max over devices);
    - ``smartinf/device{d}_read_ms``, ``..._write_ms``, ``..._compute_ms``: time device ``d`` spent on each.

    Args:
        chunk_size: elements per buffer; ``None`` keeps the strategy's, capped at the largest sub-group.
        buffer_count: buffers per device; ``None`` keeps the strategy's (or derives it from ``memory_budget``).
        memory_budget: host bytes for all buffer pools of this rank; incompatible with ``buffer_count``.
    """

    def __init__(
        self, chunk_size: int | None = None, buffer_count: int | None = None, memory_budget: int | None = None
    ) -> None:
        if buffer_count is not None and memory_budget is not None:
            raise MisconfigurationException(
                "`BufferPool(buffer_count=..., memory_budget=...)`: give one of them; the budget decides the count."
            )
        if chunk_size is not None and (chunk_size <= 0 or chunk_size % ELEM_ALIGN):
            raise MisconfigurationException(
                f"`BufferPool(chunk_size={chunk_size})` must be a positive multiple of {ELEM_ALIGN} elements."
            )
        if buffer_count is not None and buffer_count < 2:
            raise MisconfigurationException(
                f"`BufferPool(buffer_count={buffer_count})` must be at least 2 (one buffer updating, one in I/O)."
            )
        self.chunk_size = chunk_size
        self.buffer_count = buffer_count
        self.memory_budget = memory_budget
        self._last_wait_s = 0.0
        self._last_step = 0
        self._last_stats: list[tuple[float, float, float]] = []

    @staticmethod
    def _strategy(trainer: pl.Trainer) -> SmartInfinityStrategy:
        if not isinstance(trainer.strategy, SmartInfinityStrategy):
            raise MisconfigurationException(
                "The `BufferPool` callback works with `strategy='smart_infinity'`, not "
                f"`{type(trainer.strategy).__name__}`."
            )
        return trainer.strategy

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = self._strategy(trainer)
        # Sub-groups are cut from this rank's partition of each param group, so none exceeds this size.
        trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        per_rank = -(-trainable // max(1, trainer.world_size))
        largest_sub_group = min(strategy.sub_group_size, per_rank)
        chunk = self.chunk_size or strategy.chunk_size
        chunk = max(ELEM_ALIGN, min(chunk, -(-largest_sub_group // ELEM_ALIGN) * ELEM_ALIGN))
        strategy.chunk_size = chunk
        if self.buffer_count is not None:
            strategy.buffer_count = self.buffer_count
        elif self.memory_budget is not None:
            devices = strategy.devices_per_rank
            # fp32 master + up to 3 states per element, plus one fp32 gradient chunk per device.
            per_buffer = chunk * 4 * 4
            count = (self.memory_budget // devices - chunk * 4) // per_buffer
            if count < 2:
                need = devices * (2 * per_buffer + chunk * 4)
                raise MisconfigurationException(
                    f"`BufferPool(memory_budget={self.memory_budget})` is too small for {devices} device(s): two "
                    f"buffers of {chunk} elements need {need / MIB:.1f} MiB. Raise the budget or lower `chunk_size`."
                )
            strategy.buffer_count = int(count)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        backend = self._strategy(trainer).backend
        self._last_step = trainer.global_step
        self._last_wait_s = trainer.strategy.deepspeed_engine.optimizer.smartinf_wait_s
        self._last_stats = [(d.stats.read_s, d.stats.write_s, d.stats.compute_s) for d in backend.devices]
        for device in backend.devices:
            device.pool.reset_peak()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == self._last_step:
            return  # accumulating: no optimizer step on this batch
        self._last_step = trainer.global_step
        backend = self._strategy(trainer).backend
        wait_s = trainer.strategy.deepspeed_engine.optimizer.smartinf_wait_s
        metrics = {"smartinf/wait_ms": (wait_s - self._last_wait_s) * 1e3}
        self._last_wait_s = wait_s
        metrics["smartinf/pool_utilisation"] = max(d.pool.reset_peak() / max(1, d.pool.size) for d in backend.devices)
        stats = [(d.stats.read_s, d.stats.write_s, d.stats.compute_s) for d in backend.devices]
        for index, (now, before) in enumerate(zip(stats, self._last_stats)):
            for name, a, b in zip(("read", "write", "compute"), now, before):
                metrics[f"smartinf/device{index}_{name}_ms"] = (a - b) * 1e3
        self._last_stats = stats
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._strategy(trainer).release_backend()
