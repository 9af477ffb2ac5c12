"""The contract between the DeepSpeed adapter and a near-storage update backend.

A backend owns the fp32 master weights and optimizer states of a set of *shards* (one per ZeRO
sub-group partition on this rank), keeps them on its storage, applies update rules there, and hands
back only the updated low-precision parameters. Where each shard lives is the backend's placement
(:attr:`Backend.assignment`).

Device errors are loud, early and final. An I/O error on a device's storage reaches the host as a
:class:`~lightning_smartinf.core.io.storage.StorageError` naming the path, the operation and the errno, never as a
bare ``OSError`` from a device thread; a device that stops answering raises one after the backend's timeout
instead of hanging the run. The first such error reported to the host stops the backend (:attr:`Backend.failure`):
the state on the devices may then be torn, so it refuses further updates and saves, and the process resumes from
the last good checkpoint.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_smartinf.core.accelerator import Fence
from lightning_smartinf.core.compression import SparseGrad
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.io.storage import StorageError
from lightning_smartinf.core.rules import StepParams, UpdateRule
from lightning_smartinf.core.state_formats import state_format
from lightning_smartinf.core.traffic import Traffic, TrafficSnapshot

if TYPE_CHECKING:
    from lightning_smartinf.core.format.reshard import Fetch, Reshard

#: A submitted request; its result is ``None`` and it raises the device's error, if any. Wait for it with
#: :meth:`Backend.result`, which applies the backend's device timeout and records a device error.
Handle = Future


@dataclass(frozen=True)
class ShardSpec:
    """One flat partition of trainable parameters whose state a device owns.

    Args:
        index: position of the shard in this rank's shard list.
        numel: number of trainable elements.
        rule: the update rule (and so the state tensors) of the shard's param group.
        state_format: how the states are stored (:data:`~lightning_smartinf.core.state_formats.FORMATS`).
        master_format: how the masters are stored (:data:`~lightning_smartinf.core.format.layout.MASTER_FORMATS`):
            ``"split"`` keeps half of each in the shard's bf16 parameters
            (:mod:`~lightning_smartinf.core.split_masters`).
    """

    index: int
    numel: int
    rule: UpdateRule
    state_format: str = "fp32"
    master_format: str = "fp32"

    @property
    def state_bytes(self) -> int:
        """Bytes of master plus states on the device, before any on-disk alignment."""
        master = -(-self.numel * 17 // 8) if self.master_format == "split" else 4 * self.numel
        return master + len(self.rule.state_names) * state_format(self.state_format).stored_bytes(self.numel)

    def layout(self, chunk_elems: int) -> ChunkLayout:
        """The shard's chunk records in chunks of ``chunk_elems`` (``ValueError`` if that is not a valid size)."""
        return ChunkLayout(
            self.numel, chunk_elems, len(self.rule.state_names), self.state_format, master_format=self.master_format
        )


@dataclass(frozen=True)
class DeviceStats:
    """One device's figures at one instant: cumulative seconds of work (summed over its threads) and its pool.

    Attributes:
        index: the device's position (see :attr:`Backend.assignment`).
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

    def bind_parameters(self, params_of: Callable[[int], Tensor]) -> None:
        """Give the shards that split their masters (``ShardSpec.master_format == "split"``) their other halves:
        ``params_of(shard)`` is the shard's flat bf16 parameter partition in host memory, which every read of its
        masters takes and every update writes. Called after :meth:`open`, before the first request. A backend whose
        devices cannot reach host memory keeps whole masters and refuses."""
        raise ValueError(
            f"{type(self).__name__} keeps whole fp32 masters on its devices: `split_masters=True` is not available "
            "with it. Drop `split_masters`."
        )

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
        :func:`~lightning_smartinf.core.accelerator.record_fence`) has completed, waiting on its own thread.

        With ``tentative=True`` (only where :attr:`supports_tentative`) the committed state of the shard is
        left as it was until :meth:`commit`; :meth:`rollback` discards the update. A shard takes no other
        request while it holds an uncommitted update.
        """

    @property
    @abstractmethod
    def assignment(self) -> tuple[int, ...]:
        """The device index of each shard, in shard order, as :meth:`open` placed them (empty before it)."""

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

    def takes_hand_off(self, shard: int) -> bool:
        """Whether ``shard`` takes a hand-off: its update handed to its device during backward, as a tentative one."""
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

        Backends with a device timeout raise :class:`~lightning_smartinf.core.io.storage.StorageError` once the
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

    def loads_as_saved(self, directory: Path) -> bool:
        """Whether :meth:`load` reads the device state saved under ``directory`` as it is; else (state another
        backend saved) it goes through :meth:`load_resharded`, whatever the layout."""
        return True

    def fetch_saved_state(self, rank_dirs: Sequence[Path], into: Path) -> tuple[list[Path], Fetch] | None:
        """For a checkpoint whose device state the devices that saved it kept (no state files in ``rank_dirs``):
        write each saved rank's manifest and host state into a directory of its own under ``into`` and return those
        directories, in rank order, with the :data:`~lightning_smartinf.core.format.reshard.Fetch` that brings a
        saved shard's file there when re-sharding reads it. ``None`` (the default): this backend cannot reach them."""
        return None

    def checkpoint_bytes(self) -> int:
        """Bytes :meth:`save` writes into a checkpoint on this host (0 where the state is saved elsewhere: remote
        servers keep theirs)."""
        return 0

    def load_resharded(self, reshard: Reshard) -> None:
        """Replace every shard's state from a checkpoint saved under another layout (ranks, ``sub_group_size``,
        ``chunk_size``), as ``reshard`` maps it. A backend whose state is not in files on this host refuses."""
        raise ValueError(
            f"The checkpoint was saved under another layout (ranks, `sub_group_size` or `chunk_size`), and a "
            f"{type(self).__name__} cannot re-shard device state. Resume with the layout it was saved with."
        )

    @abstractmethod
    def close(self, *, keep_claims: bool = False) -> None:
        """Finish outstanding work and release buffers and threads.

        ``keep_claims``: keep owning the storage (and state that lives only while it is owned: temporary
        directories, memory, remote sessions) until :meth:`release_storage`, so that :meth:`save` can still copy the
        final state. Without it the storage is released now. Closing again does nothing.
        """

    def release_storage(self) -> None:
        """Give up what :meth:`close` kept (``keep_claims=True``); idempotent (default: nothing is kept)."""
        return None

    def traffic_snapshot(self) -> TrafficSnapshot:
        return self.traffic.snapshot()

    def stats(self, *, reset_peaks: bool = False) -> BackendStats:
        """Telemetry now (default: the traffic counters only).

        ``reset_peaks``: start each device's ``pool_peak_in_use`` again from the buffers in use now, so the next
        call reports the peak since this one.
        """
        return BackendStats(traffic=self.traffic_snapshot())


# ---------------------------------------------------------------------------------------------- shared bookkeeping


class PendingWork:
    """Handles whose errors the host has not been told yet: :meth:`Backend.wait` settles them."""

    def __init__(self) -> None:
        self._handles: list[Handle] = []

    def add(self, handle: Handle) -> Handle:
        """Keep ``handle`` (and drop those that finished without an error: nothing left to report)."""
        self._handles = [h for h in self._handles if not h.done() or h.exception() is not None]
        self._handles.append(handle)
        return handle

    def reported(self, handle: Handle) -> None:
        """``handle``'s error was raised to the host already: :meth:`take` does not return it again."""
        self._handles = [h for h in self._handles if h is not handle]

    def take(self) -> list[Handle]:
        """Every handle kept, now forgotten: the caller settles them."""
        handles, self._handles = self._handles, []
        return handles


class TentativeUpdates:
    """Which shards hold an uncommitted tentative update (:meth:`Backend.submit`), and the rules every backend keeps:
    a shard takes no request while it holds one, only a backend that keeps a second copy takes one, and only a shard
    that holds one commits."""

    def __init__(self, supported: bool) -> None:
        self.supported = supported
        self._held: set[int] = set()

    def __contains__(self, shard: object) -> bool:
        return shard in self._held

    def start(self, shard: int, tentative: bool) -> None:
        """Before a request on ``shard`` (``tentative``: an update to hold until :meth:`end`)."""
        if shard in self._held:
            raise RuntimeError(f"Shard {shard} has an uncommitted tentative update; `commit` or `rollback` it first.")
        if tentative and not self.supported:
            raise ValueError("`tentative=True` needs a backend built with `tentative_slots=True`.")
        if tentative:
            self._held.add(shard)

    def check_commit(self, shards: Iterable[int]) -> list[int]:
        """``shards``, each checked to hold a tentative update."""
        shards = list(shards)
        for shard in shards:
            if shard not in self._held:
                raise RuntimeError(f"Shard {shard} has no tentative update to commit.")
        return shards

    def end(self, shards: Iterable[int]) -> None:
        """``shards`` hold no tentative update any more (committed or rolled back)."""
        self._held.difference_update(shards)

    def refuse_held(self, what: str) -> None:
        """Raise if a shard holds a tentative update: ``what`` needs every shard's state committed."""
        if self._held:
            raise RuntimeError(
                f"Shards {sorted(self._held)} hold tentative updates; commit or roll back each uncommitted tentative "
                f"update before {what}."
            )


class LatchingBackend(Backend):
    """A backend that stops at its first device error: the base of backends that keep their own requests' bookkeeping.

    Subclasses report a device error through :meth:`latch_error`, begin each request with :meth:`check_usable`, and
    keep the work whose errors the host has not been told yet in :attr:`pending_work` and the uncommitted tentative
    updates in :attr:`tentative_updates` (taken with ``tentative_slots``: a second copy of the state).
    """

    def __init__(self, tentative_slots: bool) -> None:
        super().__init__()
        #: Whether :meth:`submit` takes ``tentative=True``.
        self.tentative_slots = tentative_slots
        self._failure: StorageError | None = None
        self._closed = False
        #: Requests whose errors the host has not been told yet.
        self.pending_work = PendingWork()
        #: Shards holding a tentative update not yet committed or rolled back.
        self.tentative_updates = TentativeUpdates(tentative_slots)

    @property
    def supports_tentative(self) -> bool:
        return self.tentative_slots

    @property
    def failure(self) -> StorageError | None:
        """The device error that stopped this backend, or ``None``.

        Set by the first :class:`StorageError` reported to the host (by :meth:`result`, :meth:`wait`,
        :meth:`check_storage`, ...). From then on the state on the devices may be torn (some chunks updated, others
        not): :meth:`submit`, :meth:`initialize`, :meth:`read_master`, :meth:`commit`, :meth:`save` and :meth:`load`
        raise, :meth:`prefetch` does nothing, :meth:`wait` reports only errors not reported yet, and :meth:`close`
        still releases everything. Requests queued before the error was reported still run. The process must restart
        and resume from the last good checkpoint.
        """
        return self._failure

    def latch_error(self, exc: BaseException) -> BaseException:
        """Remember the first storage error reported to the host; returns ``exc`` for raising."""
        if isinstance(exc, StorageError) and self._failure is None:
            self._failure = exc
        return exc

    def check_usable(self, method: str) -> None:
        """Raise a :class:`StorageError` naming the error that stopped this backend (:attr:`failure`), if one did,
        before ``method`` runs: from then on the state on the devices may be torn (some chunks updated, others not)."""
        failure = self._failure
        if failure is None:
            return
        raise StorageError(
            f"`{type(self).__name__}.{method}` refused: a device failed earlier and the state on the devices may be "
            "torn (some chunks updated, others not), so the backend takes no further update and saves nothing (a "
            "checkpoint of torn state is worse than none). Restart the process and, once the storage is fixed, resume "
            f"from the last good checkpoint. The error was: {failure}",
            path=failure.path,
            operation=failure.operation,
            errno=failure.errno,
        ) from failure

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (the storage may still be claimed: ``keep_claims``)."""
        return self._closed

    def close(self, *, keep_claims: bool = False) -> None:
        """Finish outstanding work (after a device error, :attr:`failure`, only release: that error is not raised
        again), stop talking to the devices (:meth:`_close_devices`), then, without ``keep_claims``, release the
        storage (:meth:`release_storage`). Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.failure is None:
                self.wait()
        finally:
            try:
                self._close_devices()
            finally:
                if not keep_claims:
                    self.release_storage()

    def _close_devices(self) -> None:
        """Release the threads and open files that serve the devices, once their work is done or given up on
        (default: nothing to release)."""
