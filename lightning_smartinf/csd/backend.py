"""The contract between the DeepSpeed adapter and a near-storage update backend.

A backend owns the fp32 master weights and optimizer states of a set of *shards* (one per ZeRO
sub-group partition on this rank), keeps them on its storage, applies update rules there, and hands
back only the updated low-precision parameters. Shard ``s`` lives on device ``s mod N``.

Device errors are loud, early and final. An I/O error on a device's storage reaches the host as a
:class:`~lightning_smartinf.csd.storage.StorageError` naming the path, the operation and the errno, never as a
bare ``OSError`` from a device thread; a device that stops answering raises one after the backend's timeout
instead of hanging the run. The first such error reported to the host stops the backend (:attr:`Backend.failure`):
the state on the devices may then be torn, so it refuses further updates and saves, and the process resumes from
the last good checkpoint.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lightning_smartinf.csd.accelerator import Fence
from lightning_smartinf.csd.compression import SparseGrad
from lightning_smartinf.csd.rules import StepParams, UpdateRule
from lightning_smartinf.csd.traffic import Traffic, TrafficSnapshot

#: A submitted request; its result is ``None`` and it raises the device's error, if any. Wait for it with
#: :meth:`Backend.result`, which applies the backend's device timeout and records a device error.
Handle = Future


@dataclass(frozen=True)
class ShardSpec:
    """One flat partition of trainable parameters whose state a device owns.

    Args:
        index: position of the shard in this rank's shard list; decides the device (``index mod N``).
        numel: number of trainable elements.
        rule: the update rule (and so the state tensors) of the shard's param group.
    """

    index: int
    numel: int
    rule: UpdateRule

    @property
    def state_bytes(self) -> int:
        """Bytes of fp32 master plus states, before any on-disk alignment."""
        return self.numel * self.rule.bytes_per_element


@dataclass(frozen=True)
class DeviceStats:
    """One device's figures at one instant: cumulative seconds of work (summed over its threads) and its pool.

    Attributes:
        index: the device's position (shard ``s`` lives on device ``s mod N``).
        read_s: seconds spent reading state from storage.
        write_s: seconds spent writing state back.
        compute_s: seconds spent updating chunks.
        pool_size: chunk buffers in its pool.
        pool_peak_in_use: most buffers in use at once since the previous ``stats(reset_peaks=True)``.
    """

    index: int
    read_s: float
    write_s: float
    compute_s: float
    pool_size: int
    pool_peak_in_use: int


@dataclass(frozen=True)
class BackendStats:
    """A backend's telemetry at one instant (see :meth:`Backend.stats`); counters are cumulative.

    Attributes:
        traffic: bytes moved so far on the link and the storage path.
        buffer_bytes: host (or device) bytes of the devices' buffers, fixed after ``open``.
        devices: one entry per device, in order; empty for a backend without devices of its own.
        prefetch_used_bytes: state bytes read ahead of their request and used by it.
        prefetch_dropped_bytes: state bytes read ahead and dropped unused.
    """

    traffic: TrafficSnapshot
    buffer_bytes: int = 0
    devices: tuple[DeviceStats, ...] = ()
    prefetch_used_bytes: int = 0
    prefetch_dropped_bytes: int = 0


class Backend(ABC):
    """Near-storage update backend. Methods are called from one host thread; devices work behind it."""

    def __init__(self) -> None:
        self.traffic = Traffic()

    @property
    @abstractmethod
    def num_devices(self) -> int:
        """Number of devices the shards are spread over."""

    @abstractmethod
    def open(self, shards: Sequence[ShardSpec]) -> None:
        """Place the shards on the devices and allocate their storage; checks free space first."""

    @abstractmethod
    def initialize(self, shard: int, master: Tensor) -> Handle:
        """Write ``master`` (any float dtype, upcast to fp32) as the shard's master weights; reset its states."""

    @abstractmethod
    def submit(
        self,
        shard: int,
        grad: Tensor | SparseGrad,
        hp: StepParams,
        out: Tensor,
        link_dtype: torch.dtype | None = None,
        tentative: bool = False,
        ready: Fence | None = None,
    ) -> Handle:
        """Apply one update with the shard's gradient ``grad``, dense or top-k compressed.

        ``grad`` (a dense gradient, or the values of a :class:`SparseGrad`, which the device scatters into
        zeroed chunks) crosses the link in ``link_dtype`` (default: its own dtype): a wider host buffer is
        rounded to it on the way, exactly as a transfer in that dtype would. The updated master weights are written
        into ``out`` (the low-precision partition, any float dtype) before the handle completes; ``grad``
        and ``out`` must stay alive and untouched until then. ``grad`` and ``out`` may live in accelerator memory;
        the device reads ``grad`` only after ``ready`` (a fence after the work that wrote it, see
        :func:`~lightning_smartinf.csd.accelerator.record_fence`) has completed, waiting on its own thread.

        With ``tentative=True`` (only where :attr:`supports_tentative`) the committed state of the shard is
        left as it was until :meth:`commit`; :meth:`rollback` discards the update. A shard takes no other
        request while it holds an uncommitted update.
        """

    @property
    def supports_tentative(self) -> bool:
        """Whether :meth:`submit` takes ``tentative=True`` (the backend keeps a second copy of the state)."""
        return False

    def replan(self) -> list[int]:
        """Between steps: move shards if the devices' measured rates call for another placement; the shards moved."""
        return []

    def note_backward(self, ready: Mapping[int, float]) -> None:
        """At a step's start: how many seconds before it backward completed each shard's gradient (shards missing were
        complete only at the step, or nothing was handed off: without ``overlap_backward``, or when the step undid its
        hand-offs). For :meth:`replan`'s model of how much of the update hides behind backward (default: ignored)."""
        return None

    def hands_off_early(self, shard: int) -> bool:
        """Whether the controller should hand ``shard``'s update over during backward, as a tentative one."""
        return self.supports_tentative

    def commit(self, shards: Iterable[int]) -> None:
        """Make the tentative updates of ``shards`` the current state.

        A backend without :attr:`supports_tentative` never holds one: committing none is a no-op, any other
        shard is an error.
        """
        self._refuse_tentative(shards, "commit")

    def rollback(self, shards: Iterable[int]) -> None:
        """Discard the tentative updates of ``shards``; waits for every request first."""
        self.wait()
        self._refuse_tentative(shards, "roll back")

    def _refuse_tentative(self, shards: Iterable[int], what: str) -> None:
        shards = list(shards)
        if shards:
            raise RuntimeError(
                f"{type(self).__name__} takes no tentative updates, so shards {shards} have none to {what}."
            )

    def result(self, handle: Handle) -> None:
        """Block until ``handle`` is done and raise its error, if any (default: ``handle.result()``).

        Backends with a device timeout raise :class:`~lightning_smartinf.csd.storage.StorageError` once the
        handle's device has shown no progress for that long; a storage error sets :attr:`failure`.
        """
        handle.result()

    @property
    def failure(self) -> BaseException | None:
        """The device error that stopped this backend, or ``None`` (default: a backend that never stops).

        Once set, methods that use or save device state raise, naming this error; :meth:`close` still releases.
        """
        return None

    def prefetch(self, shards: Sequence[int]) -> None:
        """Advice: the next requests are for ``shards``, in this order. Never changes results (default: ignored).

        Called after a step with the order the next step will likely hand shards off in, so that devices
        can read state while they would otherwise wait: during forward, and between hand-offs in backward.
        """
        return None

    @abstractmethod
    def read_master(self, shard: int, out: Tensor) -> Handle:
        """Copy the shard's fp32 master weights into ``out`` (export and inspection; not on the step path)."""

    @abstractmethod
    def check_storage(self) -> None:
        """Raise if a device's storage is gone; called before each step so the failure names the path."""

    @abstractmethod
    def wait(self) -> None:
        """Block until every submitted request, including trailing state write-back, is done.

        Raises the first error of those requests not reported yet (by :meth:`result` or an earlier ``wait``).
        """

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Write a self-describing copy of every shard's state under ``directory`` (waits first)."""

    @abstractmethod
    def load(self, directory: Path) -> None:
        """Replace every shard's state with the copy :meth:`save` wrote under ``directory``."""

    @abstractmethod
    def close(self) -> None:
        """Finish outstanding work and release buffers, threads and temporary storage."""

    def traffic_snapshot(self) -> TrafficSnapshot:
        return self.traffic.snapshot()

    def stats(self, *, reset_peaks: bool = False) -> BackendStats:
        """Telemetry now (default: the traffic counters only).

        ``reset_peaks``: start each device's ``pool_peak_in_use`` again from the buffers in use now, so the next
        call reports the peak since this one.
        """
        return BackendStats(traffic=self.traffic_snapshot())
