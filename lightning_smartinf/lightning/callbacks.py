"""Lightning callbacks of the ``smart_infinity`` strategy."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, LearningRateFinder
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_smartinf.core.arguments import MIB, Problems, show
from lightning_smartinf.core.format.layout import ELEM_ALIGN, POOL_TENSORS, pool_bytes
from lightning_smartinf.core.settings import check_pool_shape
from lightning_smartinf.core.traffic import TrafficSnapshot
from lightning_smartinf.lightning.activation_offload import ActivationOffload
from lightning_smartinf.lightning.contract import SmartUpdateStrategy


class BufferPool(Callback):
    """Sizes the devices' chunk-buffer pools at fit start and releases them at the end.

    Without arguments the pool keeps the strategy's ``buffer_count`` and shrinks ``chunk_size`` to the
    largest sub-group partition, so small models do not pay for buffers they cannot fill. With
    ``memory_budget`` (bytes of host memory for all pools on this rank) it picks the buffer count that
    fits. How the pools are used is logged by :class:`SmartUpdateMonitor`.

    Args:
        chunk_size: elements per buffer; ``None`` keeps the strategy's, capped at the largest sub-group.
        buffer_count: buffers per device; ``None`` keeps the strategy's (or derives it from ``memory_budget``).
        memory_budget: host bytes for all buffer pools of this rank, an int (``"4GiB"`` is refused: write
            ``4 << 30``); at most the host memory available now; incompatible with ``buffer_count``.

    Raises:
        MisconfigurationException: listing every argument of the wrong type or range.
    """

    def __init__(
        self, chunk_size: int | None = None, buffer_count: int | None = None, memory_budget: int | None = None
    ) -> None:
        problems = Problems("BufferPool", MisconfigurationException)
        fits = [
            *check_pool_shape(problems, chunk_size, buffer_count, optional=True),
            problems.integer("memory_budget", memory_budget, low=1, unit="bytes", example=1 << 30, optional=True),
        ]
        if buffer_count is not None and memory_budget is not None:
            problems.add(
                "`buffer_count=...` and `memory_budget=...` were both given: give one of them; the budget decides the "
                "count."
            )
        elif all(fits) and memory_budget is not None:
            problems.fits_in_memory(
                f"`memory_budget={memory_budget}`", memory_budget, "the pools are sized to fill it", "Lower the budget."
            )
        elif all(fits) and chunk_size is not None and buffer_count is not None:
            problems.fits_in_memory(
                f"`buffer_count={buffer_count}` with `chunk_size={chunk_size}`",
                pool_bytes(1, buffer_count, chunk_size),
                f"one device: {buffer_count} buffers x {chunk_size} elements x 4 B x {POOL_TENSORS} fp32 tensors",
                "Lower `buffer_count` (at least 2) or `chunk_size`.",
            )
        problems.raise_if_any()
        self.chunk_size = chunk_size
        self.buffer_count = buffer_count
        self.memory_budget = memory_budget

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The pools are sized later, once the model exists (`configure_model` ran): the strategy calls `size_pools`.
        _smart_strategy(trainer, "BufferPool").before_engine(self.size_pools)

    def size_pools(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Size the pools for ``pl_module``'s trainable parameters; the strategy calls it before it builds the engine.

        That is after ``configure_model``: a module that builds its model there (the Hugging Face modules) has no
        parameters yet when callbacks' ``setup`` runs.
        """
        strategy = _smart_strategy(trainer, "BufferPool")
        # Sub-groups are cut from this rank's partition of each param group, so none exceeds this size.
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in pl_module.parameters() if p.requires_grad)
        per_rank = -(-trainable // max(1, trainer.world_size))
        largest_sub_group = min(strategy.sub_group_size, per_rank)
        chunk = self.chunk_size or strategy.settings.chunk_size
        chunk = max(ELEM_ALIGN, min(chunk, -(-largest_sub_group // ELEM_ALIGN) * ELEM_ALIGN))
        buffer_count = self.buffer_count or strategy.settings.buffer_count
        if self.memory_budget is not None:
            devices = strategy.devices_per_rank
            # fp32 master + up to 3 states per element, plus one fp32 gradient chunk per device.
            per_buffer = pool_bytes(1, 1, chunk, tensors_per_record=4)
            count = (self.memory_budget // devices - chunk * 4) // per_buffer
            if count < 2:
                need = devices * (2 * per_buffer + chunk * 4)
                raise MisconfigurationException(
                    f"`BufferPool(memory_budget={self.memory_budget})` is too small for {devices} device(s): two "
                    f"buffers of {chunk} elements need {need / MIB:.1f} MiB. Raise the budget or lower `chunk_size`."
                )
            buffer_count = int(count)
        strategy.resize_pools(chunk_size=chunk, buffer_count=buffer_count)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _smart_strategy(trainer, "BufferPool").release_backend()


class SmartUpdateMonitor(Callback):
    """Logs what the devices did in each optimizer step; the ``smart_infinity`` strategy adds one to every run.

    Logged per optimizer step (as ``ThroughputMonitor`` does, from the figures the strategy's controller keeps):

    - ``smartinf/link_write_bytes``, ``..._read_bytes``, ``smartinf/storage_read_bytes``, ``..._write_bytes``: bytes
      moved on the host link and inside the devices;
    - ``smartinf/kept_ratio``, ``smartinf/compression_ratio`` (with ``compression``): gradient entries sent, and
      dense gradient bytes over the gradient bytes sent (1.0 when dense, about 33 at 1% with bf16);
    - ``smartinf/forward_ms``, ``smartinf/backward_ms``, ``smartinf/after_backward_ms``: host time in the step's
      forward, backward (gradient reduction included) and what the optimizer step does after them (clipping,
      handing gradients to the devices, waiting for updated parameters), from the strategy's clocks;
    - ``smartinf/update_ms``: of ``after_backward``, the time in the devices' step (hand-off and waits);
    - ``smartinf/wait_ms``: time the host spent blocked on devices for updated parameters;
    - ``smartinf/pool_utilisation``: most buffers in use at once, as a fraction of the pool (max over devices);
    - ``smartinf/device{d}_read_ms``, ``..._write_ms``, ``..._compute_ms``: time device ``d`` spent on each,
      summed over its threads (with ``io_threads=3``, read and write can each reach 3x the step time);
    - ``smartinf/early_kept``, ``smartinf/early_rolled_back``: sub-groups that devices updated during
      backward (``overlap_backward``) and the step kept, or rolled back (clipping, a skipped step, a changed
      learning rate) and redid;
    - ``smartinf/speculating``: 1 while backward hands sub-groups off, 0 while a recent miss (clipping fired, the
      loss scale or learning rate changed after backward) has the steps update once, after backward;
    - ``smartinf/prefetch_used_bytes``: state the devices read ahead while they had nothing to update
      (``prefetch_state``) and this step's updates used.
    """

    def __init__(self) -> None:
        self._step = 0
        self._last: dict[str, float] = {}
        self._traffic = TrafficSnapshot()

    def _totals(self, trainer: pl.Trainer) -> tuple[dict[str, float], TrafficSnapshot]:
        """Cumulative figures of the run so far, and its traffic; pool peaks since the last call."""
        strategy = _smart_strategy(trainer, "SmartUpdateMonitor")
        smart_update = strategy.smart_update
        stats = smart_update.stats(reset_peaks=True)
        totals = {
            **{f"{name}_ms": strategy.clocks.total(name) * 1e3 for name in ("forward", "backward", "after_backward")},
            "update_ms": smart_update.step_s * 1e3,
            "wait_ms": smart_update.wait_s * 1e3,
            "early_kept": float(smart_update.early_kept),
            "early_rolled_back": float(smart_update.early_rolled_back),
            "prefetch_used_bytes": float(stats.prefetch_used_bytes),
        }
        for device in stats.devices:
            for name in ("read", "write", "compute"):
                totals[f"device{device.index}_{name}_ms"] = getattr(device, f"{name}_s") * 1e3
        if stats.devices:
            totals["pool_utilisation"] = max(d.pool_peak_in_use / max(1, d.pool_size) for d in stats.devices)
        if strategy.settings.overlap:
            totals["speculating"] = float(smart_update.speculating)
        return totals, stats.traffic

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step = trainer.global_step
        self._last, self._traffic = self._totals(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == self._step:
            return  # accumulating: no optimizer step on this batch
        self._step = trainer.global_step
        totals, traffic = self._totals(trainer)
        delta, self._traffic = traffic - self._traffic, traffic
        metrics = {f"smartinf/{name}": float(value) for name, value in delta.as_dict().items()}
        for name, value in totals.items():
            # Pool utilisation (a peak over the step) and speculating (a state) are not running totals.
            levels = ("pool_utilisation", "speculating")
            metrics[f"smartinf/{name}"] = value if name in levels else value - self._last.get(name, 0.0)
        self._last = totals
        strategy = _smart_strategy(trainer, "SmartUpdateMonitor")
        if strategy.settings.compression is not None:
            kept, total = strategy.smart_update.last_kept
            metrics["smartinf/kept_ratio"] = kept / max(1, total)
            dense_bytes = total * strategy.smart_update.link_dtype.itemsize
            metrics["smartinf/compression_ratio"] = dense_bytes / max(1, delta.link_write_bytes)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False)


def add_strategy_callbacks(trainer: pl.Trainer, offload_activations: bool | dict[str, Any]) -> None:
    """Add the callbacks the strategy runs with, unless the user gave their own: a :class:`SmartUpdateMonitor`, and
    an ``ActivationOffload`` when ``offload_activations`` asks for one (``True`` or its arguments)."""
    if not any(isinstance(c, SmartUpdateMonitor) for c in trainer.callbacks):
        # First, so that every other callback's `on_train_batch_end` finds this step's figures logged.
        trainer.callbacks.insert(0, SmartUpdateMonitor())
    # `{}` is the callback with its defaults, as `True` is (a recipe writes `offload_activations: {}`).
    if offload_activations is not False and not any(isinstance(c, ActivationOffload) for c in trainer.callbacks):
        options = {} if offload_activations is True else dict(offload_activations)
        trainer.callbacks.append(ActivationOffload(**options))


def refuse_learning_rate_finder(trainer: pl.Trainer) -> None:
    """Refuse Lightning's learning-rate finder before the engine is built, rather than in the middle of its sweep.

    Its sweep builds a torch LR scheduler over the strategy's optimizer, and under ZeRO-3 that is DeepSpeed's
    partitioned optimizer, not a ``torch.optim.Optimizer``: torch refuses it with a ``TypeError`` after the finder
    has saved a full checkpoint (so it fails under Lightning's ``deepspeed`` strategy too)."""
    if any(isinstance(c, LearningRateFinder) for c in trainer.callbacks):
        raise MisconfigurationException(
            "Lightning's learning-rate finder (`Tuner(trainer).lr_find(...)` or the `LearningRateFinder` callback) "
            "does not run under `strategy='smart_infinity'`: its sweep needs a `torch.optim.Optimizer`, and "
            "ZeRO-3 trains through DeepSpeed's partitioned optimizer. Find the rate with `strategy='auto'` on a "
            "smaller configuration of the model, or compare a few short runs, and set it in `configure_optimizers`."
        )


def _smart_strategy(trainer: pl.Trainer, user: str) -> SmartUpdateStrategy:
    if not isinstance(trainer.strategy, SmartUpdateStrategy):
        raise MisconfigurationException(
            f"The `{user}` callback works with `strategy='smart_infinity'`, not `{type(trainer.strategy).__name__}`."
        )
    return trainer.strategy


#: Deep Gradient Compression's warm-up: kept ratios 25%, 6.25%, 1.5625%, 0.390625% (sparsity 75% ... 99.6%).
DGC_SCHEDULE = (0.25, 0.0625, 0.015625, 0.00390625)


class CompressionWarmup(Callback):
    """Eases gradient compression in: dense steps first, then a schedule of falling kept ratios, then the target.

    The target is the strategy's ``compression`` ratio. The kept ratio of optimizer step ``s`` (0-based,
    counted by ``trainer.global_step``, so a resumed run continues the schedule) is: dense while
    ``s < dense_steps``; then each ratio of ``schedule`` that is above the target for ``steps_per_stage``
    steps; then the target.

    Args:
        dense_steps: optimizer steps sent uncompressed first.
        schedule: kept ratios to step through after the dense steps: a sequence, or ``"dgc"`` for
            :data:`DGC_SCHEDULE` (75% → 93.75% → 98.4% → 99.6% sparsity). Ratios not above the target are skipped.
        steps_per_stage: optimizer steps each ratio of ``schedule`` lasts.
    """

    def __init__(
        self, dense_steps: int = 0, schedule: Sequence[float] | str | None = None, steps_per_stage: int = 1
    ) -> None:
        problems = Problems("CompressionWarmup", MisconfigurationException)
        problems.integer("dense_steps", dense_steps, why="optimizer steps", example=0)
        problems.integer("steps_per_stage", steps_per_stage, low=1, why="optimizer steps", example=1)
        if schedule == "dgc":
            schedule = DGC_SCHEDULE
        if isinstance(schedule, Sequence) and not isinstance(schedule, str):
            inside = problems.within("schedule")
            for index, ratio in enumerate(schedule):
                inside.ratio(index, ratio, example=0.25)
        elif schedule is not None:
            problems.add(
                f"`schedule={show(schedule)}` is not supported: it must be 'dgc', a list of kept ratios (each with "
                "0 < ratio <= 1), or None. Pass e.g. `schedule='dgc'` or `schedule=[0.25, 0.0625]`."
            )
        problems.raise_if_any()
        self.dense_steps = dense_steps
        self.schedule = tuple(schedule or ())
        self.steps_per_stage = steps_per_stage
        self._stages: tuple[float, ...] = ()
        self._target = 1.0  # the strategy's ratio, read at fit start

    def warmup_steps(self) -> int:
        """Optimizer steps before the target ratio is reached (known once fit has started)."""
        return self.dense_steps + len(self._stages) * self.steps_per_stage

    def ratio_at(self, step: int) -> float | None:
        """Kept ratio of 0-based optimizer step ``step`` (``None``: dense)."""
        if step < self.dense_steps:
            return None
        stage = (step - self.dense_steps) // self.steps_per_stage
        return self._stages[stage] if stage < len(self._stages) else self._target

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, SmartUpdateStrategy) or strategy.settings.compression is None:
            raise MisconfigurationException(
                "`CompressionWarmup` schedules gradient compression, which is off: use "
                "`SmartInfinityStrategy(compression=0.01)` or `strategy='smart_infinity_comp'`."
            )
        self._target = strategy.settings.compression.ratio
        self._stages = tuple(r for r in self.schedule if r > self._target)
        total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        if math.isfinite(total) and self.warmup_steps() >= total:
            raise MisconfigurationException(
                f"`CompressionWarmup` lasts {self.warmup_steps()} optimizer steps ({self.dense_steps} dense + "
                f"{len(self._stages)} stages x {self.steps_per_stage}) but training has only {int(total)}, so the "
                f"target ratio {self._target} would never be used. Shorten the warm-up or train longer."
            )

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, SmartUpdateStrategy)
        ratio = self.ratio_at(trainer.global_step)
        if ratio != strategy.kept_ratio:
            strategy.set_kept_ratio(ratio)
