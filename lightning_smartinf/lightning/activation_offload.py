"""``ActivationOffload``: the Lightning callback around
:class:`~lightning_smartinf.activations.SavedTensorOffloader`."""

from __future__ import annotations

import inspect
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_smartinf.activations.costs import OVERHEAD_BUDGET
from lightning_smartinf.activations.offload import OffloadStats, SavedTensorOffloader, check_arguments
from lightning_smartinf.core.arguments import Problems
from lightning_smartinf.lightning.contract import SmartUpdateStrategy


class ActivationOffload(L.Callback):
    """Offload large saved activations to the storage paths during forward; prefetch them back during backward.

    The saved-tensor hooks are installed in ``on_train_batch_start`` and removed in ``on_after_backward``, so they
    span ``training_step`` and its backward for every micro-batch (gradient accumulation included) and nothing
    else (validation runs without grad). On any exception every activation file is removed.

    Args:
        storage_paths: where to write. ``None``: this rank's share of ``SmartInfinityStrategy(storage_paths=...)``,
            or the system's temporary directory where the strategy's are temporary (``storage_paths=None``).
        threshold_bytes, keep_last, max_inflight_bytes, io_threads: see :class:`SavedTensorOffloader`; ints (byte
            counts in bytes: ``"1MiB"`` is refused, write ``1 << 20``). ``None`` (the default) chooses the first
            three from the model and from the first micro-batches' measurements, within ``overhead_budget``.
        log_stats: log ``smartinf/activation_{peak_bytes,write_bytes,read_bytes}`` per batch.
        overhead_budget: the share of the step offload may add (default 0.1: 10%). The settings left to ``None``
            are chosen to stay within it from what this machine measures, offloading less (more layers kept, a
            higher threshold) or nothing where it cannot hold, and said once; the choice is re-checked once against
            the measured step. Settings given are kept, with a warning where they are predicted to break it.
        layers: the name of the ``ModuleList`` or ``Sequential`` in the LightningModule that holds the model's
            repeated layers (e.g. ``"model.transformer.h"``); ``None`` finds the longest list of same-type layers
            with parameters, and offloads by size alone (with a warning) where there is none.

    With DeepSpeed activation checkpointing on, only the checkpoint inputs are saved in forward (those are what
    gets offloaded); the recomputation during backward is kept in memory. With it off, every activation above the
    threshold outside the last ``keep_last`` layers is offloaded.
    """

    def __init__(
        self,
        storage_paths: Sequence[str | os.PathLike] | None = None,
        threshold_bytes: int | None = None,
        keep_last: int | None = None,
        max_inflight_bytes: int | None = None,
        io_threads: int = 4,
        log_stats: bool = True,
        overhead_budget: float = OVERHEAD_BUDGET,
        layers: str | None = None,
    ) -> None:
        #: The offloader's own arguments.
        self.kwargs = dict(
            threshold_bytes=threshold_bytes,
            keep_last=keep_last,
            max_inflight_bytes=max_inflight_bytes,
            io_threads=io_threads,
            overhead_budget=overhead_budget,
        )
        problems = Problems("ActivationOffload", ValueError)
        check_arguments(
            problems, {"storage_paths": storage_paths, "log_stats": log_stats, "layers": layers, **self.kwargs}
        )
        problems.raise_if_any()
        self.storage_paths = storage_paths
        self.layers = layers
        self.log_stats = log_stats
        self.offloader: SavedTensorOffloader | None = None
        self.stats: OffloadStats | None = None  # the last run's counters, kept after teardown
        self._last = (0, 0)

    def _paths(self, trainer: L.Trainer) -> list[Path]:
        if self.storage_paths is not None:
            paths = self.storage_paths
            return [Path(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
        strategy = trainer.strategy
        if not isinstance(strategy, SmartUpdateStrategy):
            raise MisconfigurationException(
                "`ActivationOffload(storage_paths=None)` needs `SmartInfinityStrategy(storage_paths=[...])` to take "
                "its paths from; pass `storage_paths=` to the callback, or set them on the strategy."
            )
        if strategy.settings.storage_paths is None:  # given, they are never empty: the settings refuse that
            # The strategy keeps its state in temporary directories: activations go to the temporary directory too.
            return [Path(tempfile.gettempdir())]
        # A rank with no path of its own shares them all: activation files are private to the rank's run directory.
        return strategy.rank_storage_paths() or list(strategy.settings.storage_paths)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self.offloader is not None:
            return
        self.offloader = SavedTensorOffloader(self._paths(trainer), **self.kwargs)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Here, not in `setup`: a module that builds its model in `configure_model` (the Hugging Face modules) has
        # no layers before it, and `configure_model` runs after callbacks' `setup`.
        if self.offloader is not None:
            try:
                self.offloader.attach(pl_module, self.layers, warn=rank_zero_warn)
            except ValueError as exc:  # `layers` names no list of layers in this module
                raise MisconfigurationException(f"`ActivationOffload`: {exc}") from None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.offloader is not None:
            self.offloader.reset_peak()
            self.offloader.begin()

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.offloader is not None:
            self.offloader.end()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        off = self.offloader
        if off is None:
            return
        off.end()
        if self.log_stats:
            s = off.stats
            written, read = s.bytes_written - self._last[0], s.bytes_read - self._last[1]
            self._last = (s.bytes_written, s.bytes_read)
            pl_module.log_dict(
                {
                    "smartinf/activation_peak_bytes": float(s.peak_resident_bytes),
                    "smartinf/activation_write_bytes": float(written),
                    "smartinf/activation_read_bytes": float(read),
                },
                on_step=True,
                on_epoch=False,
            )

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._close()  # the run is over: remove every file and the run directories now

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close()

    def _close(self) -> None:
        if self.offloader is not None:
            self.stats = self.offloader.stats
            self.offloader.close()
            self.offloader = None


def check_offload_options(problems: Problems, argument: str, options: Any) -> None:
    """Check ``argument`` (``SmartInfinityStrategy(offload_activations=...)``): a bool, or a dict of
    :class:`ActivationOffload` arguments whose keys and values are checked as the callback would."""
    if isinstance(options, bool):
        return
    if not isinstance(options, dict):
        problems.instance(argument, options, dict, "True, False, or a dict of `ActivationOffload` arguments")
        return
    allowed = list(inspect.signature(ActivationOffload).parameters)
    problems.keys(argument, options, allowed)
    check_arguments(problems.within(argument), {k: v for k, v in options.items() if k in allowed})
