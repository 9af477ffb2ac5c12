"""Streaming backends: shard state in files of chunk records, streamed through devices.

A :class:`StreamingBackend` owns the shards, their state files and slots, tentative updates, the pending work, the
device timeout and failure latch, placement over its devices and moves between them, save, load and prefetch. Its
devices (:class:`~lightning_smartinf.core.streaming.device.StreamingDevice`) run the chunk pipeline.

A new kind of streaming backend implements :meth:`StreamingBackend.make_device`: build device ``index`` over its
directory. Devices whose state is in memory (the tiers of :mod:`lightning_smartinf.core.tiers`) are attached after
the storage devices (:meth:`StreamingBackend.attach`).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import stat
import warnings
from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch
from torch import Tensor

from lightning_smartinf.core.accelerator import (
    Fence,
    on_cuda,
    record_fence,
)
from lightning_smartinf.core.arguments import Problems
from lightning_smartinf.core.backend import (
    BackendStats,
    DeviceStats,
    Handle,
    LatchingBackend,
    ShardSpec,
)
from lightning_smartinf.core.compression import SparseGrad
from lightning_smartinf.core.format.layout import ChunkLayout, saved_form
from lightning_smartinf.core.format.reshard import Reshard
from lightning_smartinf.core.format.state_files import (
    MANIFEST,
    SaveStats,
    ShardState,
    load_state,
    save_state,
    shard_file_name,
)
from lightning_smartinf.core.io.direct import StateFile, aligned_empty
from lightning_smartinf.core.io.ownership import claim_directories, release_claims
from lightning_smartinf.core.io.storage import (
    StorageError,
    check_free_space,
    disk_full_error,
    ensure_private_dir,
    is_disk_full,
)
from lightning_smartinf.core.placement import (
    Fixed,
    Placement,
    RoundRobin,
    TieredPlacement,
    check_assignment,
    measure_write_read,
)
from lightning_smartinf.core.rules import StepParams
from lightning_smartinf.core.settings import check_pool_shape
from lightning_smartinf.core.streaming.device import StreamingDevice
from lightning_smartinf.core.streaming.pipeline import (
    PlanEntry,
    Request,
    Shard,
)

log = logging.getLogger(__name__)
#: Change in a storage device's share of the measured update rate (in share points: 0.1 is from 50% to below 40% or
#: above 60%) that makes :meth:`StreamingBackend.replan` move shards.
REPLAN_DRIFT = 0.1
#: Bytes copied at a time when a shard moves between devices.
MOVE_BLOCK = 4 << 20


def check_device_timeout(device_timeout_s: object) -> float | None:
    """``device_timeout_s`` as seconds, or ``None`` (wait forever); ``ValueError`` naming the fix otherwise."""
    if device_timeout_s is None:
        return None
    if (
        isinstance(device_timeout_s, bool)
        or not isinstance(device_timeout_s, (int, float))
        or not math.isfinite(device_timeout_s)
        or device_timeout_s <= 0
    ):
        raise ValueError(
            f"`device_timeout_s={device_timeout_s!r}` must be a positive, finite number of seconds (int or float), "
            "or None to wait for a device forever. Pass e.g. `device_timeout_s=300`."
        )
    return float(device_timeout_s)


class StreamingBackend(LatchingBackend):
    """Shards streamed through devices, one per directory in ``device_dirs``; subclasses say what a device is.

    Args:
        device_dirs: one private directory per device; state files are created inside. Empty only where
            :attr:`needs_storage` is false: devices whose state is in memory are then attached (:meth:`attach`).
        chunk_elems: elements per streamed chunk (a multiple of 1024).
        buffer_count: chunk buffers per device (at least 2: one updating, one in I/O).
        owned_dirs: directories the backend created and removes on :meth:`close`.
        tentative_slots: keep a second state file per shard so that :meth:`submit` can take ``tentative=True``
            updates, undone by :meth:`rollback` or made current by :meth:`commit`. Doubles the disk space of the
            state (not its traffic).
        prefetch_state: act on :meth:`prefetch` advice (``False`` ignores it: for comparisons).
        device_timeout_s: seconds a device may show no progress (no chunk read, written or updated) while the host
            waits for it, before :meth:`result`, :meth:`wait` and the others raise :class:`StorageError` and the
            backend stops (see :attr:`failure`). ``None`` waits forever.
        placement: which device holds each shard, decided at :meth:`open`. ``None``: :class:`TieredPlacement` over the
            storage devices by their weights (:meth:`storage_weights`); with none to weigh, shard ``s`` on device
            ``s mod N``.
        device_weights: relative speed of each storage device (``None``: equal, or measured, see ``placement``).

    The constructor claims the directories, then builds device ``i`` with :meth:`make_device` for each, in order.
    Device errors are final: the first one reported to the host (an I/O error, or a device that stopped answering)
    latches the backend as failed; see :attr:`failure`.
    """

    #: Whether the backend needs at least one storage directory (a backend of in-memory devices only does not).
    needs_storage: bool = True
    # Set by `release_storage`: the directories are no longer this backend's, and state in memory is freed.
    _released = False

    def __init__(
        self,
        device_dirs: Sequence[Path],
        *,
        chunk_elems: int,
        buffer_count: int,
        owned_dirs: Sequence[Path] = (),
        tentative_slots: bool = False,
        prefetch_state: bool = True,
        device_timeout_s: float | None = 300.0,
        placement: Placement | None = None,
        device_weights: Sequence[float] | None = None,
        problems: Problems | None = None,
    ) -> None:
        """``problems``: a subclass's findings about its own arguments, reported in the one error with these."""
        super().__init__(tentative_slots)  # a second state file per shard for tentative updates
        problems = problems or Problems(type(self).__name__)
        if not device_dirs and self.needs_storage:
            problems.add(
                "`device_dirs` is empty: it must name at least one directory (or give the state a memory tier)."
            )
        check_pool_shape(problems, chunk_elems, buffer_count, names=("chunk_elems", "buffer_count"))
        try:
            #: Seconds without progress before waiting on a device fails (``None``: forever).
            self.device_timeout_s = check_device_timeout(device_timeout_s)
        except ValueError as exc:
            problems.add(str(exc))
        if device_weights is not None:
            weights = problems.within("device_weights")
            if problems.instance("device_weights", device_weights, (list, tuple), "a list of relative speeds, or None"):
                if len(device_weights) != len(device_dirs):
                    problems.add(
                        f"`device_weights` has {len(device_weights)} weight(s) for {len(device_dirs)} storage "
                        "device(s): give one weight per storage path."
                    )
                for i, weight in enumerate(device_weights):
                    weights.number(i, weight, low=0.0, above=True, example=1.0)
        problems.raise_if_any()
        #: Elements per streamed chunk.
        self.chunk_elems = chunk_elems
        #: Chunk buffers per device.
        self.buffer_count = buffer_count
        #: Whether :meth:`prefetch` advice is acted on.
        self.prefetch_state = prefetch_state
        self.placement = placement
        self.device_weights = None if device_weights is None else tuple(device_weights)
        # Weights this backend measured for its placement (re-planned by `replan`), and its rate counters then.
        self._measured_weights: tuple[float, ...] | None = None
        self._rate_marks: dict[int, tuple[float, int]] = {}
        # Each device's last measured update rate (state bytes per second).
        self._rates: dict[int, float] = {}
        # Emulated storage devices' probed speeds (state bytes per second), for a device that has not updated yet.
        self._probed: dict[int, float] = {}
        #: A re-plan was refused by a full disk (:meth:`keep_placement`): said once.
        self._placement_kept = False
        self._assignment: tuple[int, ...] = ()
        self._owned_dirs = [Path(d) for d in owned_dirs]
        self._shards: list[Shard] = []
        self.devices: list[StreamingDevice] = []
        #: How the last :meth:`save` moved the state files (bytes cloned, copied, checksummed); ``None`` before one.
        self.last_save: SaveStats | None = None
        # Each shard's bf16 parameters, where its masters are split (:meth:`bind_parameters`), and per shard that took
        # a tentative update, the copy of them it overwrote (made at the first, reused: up to 2 bytes per parameter).
        self._params_of: Callable[[int], Tensor] | None = None
        self._params_aside: dict[int, Tensor] = {}
        # One owner per directory: claimed before any file in them is created or truncated, held until `close`.
        self._claims = claim_directories([ensure_private_dir(d) for d in device_dirs])
        #: The device directories, in device order.
        self.device_dirs = tuple(Path(d) for d in device_dirs)
        try:
            for i, directory in enumerate(self.device_dirs):
                self.devices.append(self.make_device(i, directory))
        except BaseException:
            for device in self.devices:
                device.close()
            release_claims(self._claims, remove=self._owned_dirs)
            raise

    @abstractmethod
    def make_device(self, index: int, directory: Path) -> StreamingDevice:
        """Build device ``index`` over ``directory`` (claimed already), with :attr:`chunk_elems`,
        :attr:`buffer_count` and :attr:`traffic`; the constructor calls it once per directory, in order.

        On an exception the devices built so far are closed and the directories released.
        """

    def attach(self, device: StreamingDevice) -> None:
        """Add ``device``, whose state is in memory (:attr:`StreamingDevice.in_memory`), after the devices there are,
        before :meth:`open`. It must be built as device :attr:`num_devices` over this backend's :attr:`traffic`;
        the backend closes it with its own."""
        if self._shards:
            raise RuntimeError("Devices are attached before the shards are opened.")
        if not device.in_memory or device.index != len(self.devices):
            raise ValueError(
                f"An attached device keeps its state in memory and is device {len(self.devices)}; got device "
                f"{device.index} ({device.label})."
            )
        self.devices.append(device)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def storage_devices(self) -> list[StreamingDevice]:
        """The devices whose state is in files on a storage path: devices ``0..len(device_dirs) - 1``."""
        return [d for d in self.devices if not d.in_memory]

    @property
    def assignment(self) -> tuple[int, ...]:
        """The device index of each shard, fixed by :meth:`open` (changed by :meth:`relocate`)."""
        return self._assignment

    @property
    def shards(self) -> tuple[Shard, ...]:
        """The shards passed to :meth:`open`, in order, with their state files."""
        return tuple(self._shards)

    def _settle(self, future: Future, device: StreamingDevice | None = None, what: str = "") -> BaseException | None:
        """Wait for ``future`` of ``device`` (a request's handle names both: every handle is one of
        :meth:`StreamingDevice.enqueue`); its error, or ``None``.

        Raises (and latches) the :class:`StorageError` of a device that stopped answering.
        """
        try:
            return (device or future.device).wait_for(future, what or future.what, self.device_timeout_s)
        except StorageError as exc:
            raise self.latch_error(exc)  # noqa: B904 - the timeout is the error, not a consequence of it

    def result(self, handle: Handle) -> None:
        """Wait for ``handle``; raise its error (a device error latches :attr:`failure`), or a timeout error.

        Raises:
            StorageError: the request's I/O failed, or its device showed no progress for ``device_timeout_s``.
        """
        exc = self._settle(handle)
        if exc is not None:
            self.pending_work.reported(handle)  # reported here: `wait` does not repeat it
            raise self.latch_error(exc)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of all devices' buffers: pools and scratch (fixed after :meth:`open`)."""
        return sum(device.allocated_bytes for device in self.devices)

    def prefetch_stats(self) -> tuple[int, int]:
        """Bytes prefetched so far, summed over devices: (used by their request, dropped unused)."""
        return (
            sum(d.stats.prefetch_used_bytes for d in self.devices),
            sum(d.stats.prefetch_dropped_bytes for d in self.devices),
        )

    def stats(self, *, reset_peaks: bool = False) -> BackendStats:
        """Traffic, buffer bytes, per-device seconds and pool use, and prefetched bytes (see :class:`BackendStats`)."""
        devices = tuple(
            DeviceStats(
                index=d.index,
                read_s=d.stats.read_s,
                write_s=d.stats.write_s,
                compute_s=d.stats.compute_s,
                pool_size=d.pool.size,
                pool_peak_in_use=d.pool.reset_peak() if reset_peaks else d.pool.peak_in_use,
            )
            for d in self.devices
        )
        used, dropped = self.prefetch_stats()
        return BackendStats(
            traffic=self.traffic_snapshot(),
            buffer_bytes=self.buffer_bytes,
            devices=devices,
            prefetch_used_bytes=used,
            prefetch_dropped_bytes=dropped,
        )

    def device_of(self, shard: int) -> StreamingDevice:
        """The device that holds ``shard`` (see :attr:`assignment`)."""
        return self.devices[self.assignment[shard]]

    def open(self, shards: Sequence[ShardSpec]) -> None:
        if self._shards:
            raise RuntimeError(f"`{type(self).__name__}.open` was already called.")
        if not self.devices:
            raise ValueError("The backend has no device: give it a directory, or attach a device before `open`.")
        if [s.index for s in shards] != list(range(len(shards))):
            raise ValueError(
                f"`ShardSpec.index` values must be 0..{len(shards) - 1} in order, got {[s.index for s in shards]}."
            )
        layouts = [s.layout(self.chunk_elems) for s in shards]
        placement = self.placement
        if placement is None:  # by the storage devices' weights; round-robin when there is nothing to weigh
            weights = self.storage_weights()
            placement = RoundRobin() if weights is None else TieredPlacement(weights, chunk_elems=self.chunk_elems)
        self._assignment = check_assignment(placement, shards, self.num_devices)
        self._warn_of_idle_paths(shards)
        self._check_capacity(repr(placement), layouts, self.assignment)
        for device in self.storage_devices:
            self._check_space(device, shards, layouts)
        try:
            for spec, layout in zip(shards, layouts):
                device = self.device_of(spec.index)
                self._shards.append(Shard(spec, layout, self._create_files(device, spec.index, layout.file_bytes)))
        except BaseException as exc:
            # Files made here hold no state yet: they go, and with them the blocks the next attempt needs.
            for shard in self._shards:
                for file in shard.files:
                    file.discard()
            self._shards.clear()
            if is_disk_full(exc) and device.directory is not None:
                raise self._full(device, layouts) from exc
            raise
        if len(self.devices) > 1:
            self.log_shares()
        tensors = max((lay.pool_tensors for lay in layouts), default=1)
        for device in self.devices:
            device.allocate(tensors)

    def bind_parameters(self, params_of: Callable[[int], Tensor]) -> None:
        """See :meth:`Backend.bind_parameters`. Every device here runs on this host; the parameters must be bf16 host
        tensors of their shard's size (``ValueError`` otherwise)."""
        for shard in self._shards:
            if not shard.layout.split_masters:
                continue
            params = params_of(shard.spec.index)
            if params.dtype != torch.bfloat16 or params.device.type != "cpu" or params.numel() != shard.spec.numel:
                raise ValueError(
                    f"Shard {shard.spec.index} splits its masters, so its parameters must be a bf16 host tensor of "
                    f"{shard.spec.numel} elements; got {params.numel()} {params.dtype} on {params.device}. Split "
                    "masters need bf16 parameters in host memory (`precision='bf16-mixed'` with the parameters "
                    "offloaded to host memory)."
                )
            if self.device_of(shard.spec.index).tier == "accelerator":
                raise ValueError(
                    f"Shard {shard.spec.index} is in accelerator memory, whose updates do not read host memory: split "
                    "masters are for state on storage and in host memory. Drop `state_accelerator_budget` or "
                    "`split_masters`."
                )
        self._params_of = params_of

    def _split_params(self, shard: Shard) -> Tensor | None:
        """``shard``'s parameters where it splits its masters; ``None`` where it keeps them whole."""
        if not shard.layout.split_masters:
            return None
        if self._params_of is None:
            raise RuntimeError(
                f"Shard {shard.spec.index} splits its masters but has no parameters: call `bind_parameters` after "
                "`open`."
            )
        return self._params_of(shard.spec.index)

    def _full(self, device: StreamingDevice, layouts: Sequence[ChunkLayout]) -> StorageError:
        """The error of a state file of ``device`` a full filesystem refused while :meth:`open` made them."""
        assert device.directory is not None  # a storage device
        slots = self._slots(device)
        needed = slots * sum(lay.file_bytes for i, lay in enumerate(layouts) if self.assignment[i] == device.index)
        copies = " (two copies with `overlap_backward`; `overlap_backward=False` needs half)" if slots == 2 else ""
        return disk_full_error(
            device.directory,
            f"the optimizer state files{copies}",
            needed,
            "Something else filled it since the check before writing. Nothing was kept: free space and run again, "
            "add `storage_paths` to spread the state, or choose a larger disk.",
        )

    def _slots(self, device: StreamingDevice) -> int:
        """State files a shard keeps on ``device``: two for tentative updates, except in memory (never tentative)."""
        return 2 if self.tentative_slots and not device.in_memory else 1

    def _check_capacity(self, what: str, layouts: Sequence[ChunkLayout], assignment: Sequence[int]) -> None:
        for device in self.devices:
            held = sum(lay.file_bytes for lay, d in zip(layouts, assignment) if d == device.index)
            if device.capacity is not None and held > device.capacity:
                raise ValueError(
                    f"{what} puts {held} B of state in {device.label} (device {device.index}), over its budget "
                    f"({device.capacity} B)."
                )

    def _drop_all_prefetched(self) -> None:
        """Drop what every device read ahead, once no prefetch read is in flight (before state files change)."""
        for device, dropped in [(device, device.drop_prefetched()) for device in self.devices]:
            if (exc := self._settle(dropped, device, "dropping the state read ahead")) is not None:
                raise exc

    def storage_weights(self) -> tuple[float, ...] | None:
        """The relative update speed of each storage device: as given, or measured (once, and kept for :meth:`replan`)
        when the paths are on different filesystems (paths on one filesystem share its disk, so they are equal);
        ``None`` when there is nothing to weigh."""
        if self.device_weights is not None or self._measured_weights is not None:
            return self.device_weights or self._measured_weights
        storage = self.storage_devices
        if len({os.stat(d.directory).st_dev for d in storage if d.directory is not None}) > 1:
            self._measured_weights = tuple(measure_write_read(d.directory, d.io) for d in storage if d.directory)
            shown = ", ".join(f"{w / 1e9:.2f} GB/s" for w in self._measured_weights)
            log.info("SmartUpdate measured its storage paths: %s", shown)
        return self._measured_weights

    def _warn_of_idle_paths(self, shards: Sequence[ShardSpec]) -> None:
        """Warn where fewer shards than storage paths leave a path without state: a drive the user gave sits idle."""
        storage = self.storage_devices
        idle = [d.label for d in storage if d.index not in self.assignment]
        if not idle or len(shards) >= len(storage):
            return
        numel = sum(s.numel for s in shards)
        warnings.warn(
            f"SmartUpdate holds no optimizer state on {', '.join(map(repr, idle))}: this rank's {numel:,} elements "
            f"make {len(shards)} sub-group(s), fewer than its {len(storage)} storage paths (a sub-group, the unit of "
            f"work of a device, is not split). Lower `sub_group_size` to at most {max(1, numel // len(storage)):,} "
            "to use every path, or give fewer paths.",
            stacklevel=2,
        )

    def log_shares(self) -> None:
        """Log each device's shards and state bytes."""
        layouts = [s.layout for s in self._shards]
        total = sum(lay.file_bytes for lay in layouts) or 1
        for device in self.devices:
            held = [i for i, d in enumerate(self.assignment) if d == device.index]
            nbytes = sum(layouts[i].file_bytes for i in held)
            log.info(
                "SmartUpdate device %d (%s): %d shard(s), %.1f MiB of state (%.0f%%)",
                device.index,
                device.label,
                len(held),
                nbytes / 2**20,
                100 * nbytes / total,
            )

    def replan(self) -> list[int]:
        """Re-place the shards on the storage devices from the update rates they showed since the last call, when this
        backend chose their weights from speeds it measured (paths on different filesystems) and a path's share
        drifted by more than :data:`REPLAN_DRIFT` share points; returns the shards moved (see :meth:`relocate`:
        between steps only). Given weights stay, a device that never updated gives no rate, and shards on devices
        whose state is in memory stay where they are.
        """
        if self.failure is not None or not self._shards:
            return []
        rates = self.measure_rates()
        weights = self._measured_weights
        storage = self.storage_devices
        if weights is None or not all(d.index in rates for d in storage):
            return []
        measured = tuple(rates[d.index] for d in storage)
        if not shares_drifted(measured, weights):
            return []
        self._measured_weights = measured
        placed = [i for i, d in enumerate(self.assignment) if not self.devices[d].in_memory]
        spread = TieredPlacement(measured, chunk_elems=self.chunk_elems, keep=tuple(self.assignment[i] for i in placed))
        assignment = list(self.assignment)
        for i, device in zip(placed, spread.assign([self._shards[i].spec for i in placed], len(storage))):
            assignment[i] = device
        try:
            moved = self.relocate(assignment)
        except StorageError as exc:
            if not is_disk_full(exc):
                raise
            self.keep_placement(exc)
            return []
        speeds = ", ".join(f"{rates[d.index] / 1e9:.2f} GB/s ({d.label})" for d in storage)
        was = ", ".join(f"{o:.0%}" for o in _shares(weights))
        log.info(
            "SmartUpdate re-placed %d shard(s): the storage devices update at %s; their shares were %s",
            len(moved),
            speeds,
            was,
        )
        self.log_shares()
        return moved

    def keep_placement(self, exc: StorageError) -> None:
        """A re-plan a full disk refused: the shards stay where they are, and training goes on as placed. Said once
        as a warning, then at debug level: a disk that stays full refuses every later re-plan too."""
        log.log(
            logging.DEBUG if self._placement_kept else logging.WARNING,
            "SmartUpdate keeps the shards where they are: %s",
            exc,
        )
        self._placement_kept = True

    @property
    def update_rates(self) -> dict[int, float]:
        """Each device's update rate as :meth:`measure_rates` last measured it: state bytes read and written per second
        of its worker's update time, by device index (empty before the first measure)."""
        return dict(self._rates)

    def measure_rates(self) -> dict[int, float]:
        """Each device's update rate since the last call (state bytes read and written per second of its worker's
        update time); a device that updated nothing since keeps the rate it last showed."""
        for device in self.devices:
            mark = (device.stats.update_s, device.stats.update_bytes)
            seconds, nbytes = (now - then for now, then in zip(mark, self._rate_marks.get(device.index, (0.0, 0))))
            self._rate_marks[device.index] = mark
            if seconds > 0 and nbytes > 0:
                self._rates[device.index] = nbytes / seconds
        return dict(self._rates)

    def probe_rate(self, device: StreamingDevice) -> float:
        """The state bytes per second ``device``'s storage path moves, by a write and read probe shared by the devices
        on its filesystem (measured once): a storage device's rate before it has updated."""
        if device.directory is None:
            raise ValueError(f"Device {device.index} ({device.label}) has no storage path to probe.")
        if device.index not in self._probed:
            here = os.stat(device.directory).st_dev
            sharing = sum(os.stat(d.directory).st_dev == here for d in self.storage_devices if d.directory)
            self._probed[device.index] = measure_write_read(device.directory, device.io) / sharing
        return self._probed[device.index]

    def relocate(self, assignment: Sequence[int]) -> list[int]:
        """Move shards between devices so that shard ``i`` lives on device ``assignment[i]``; returns those moved.

        Between steps: waits for all work, and is refused while a shard holds a tentative update. Exact: a moved
        shard's committed record is copied byte for byte to its new device, then its old files are removed (or its
        memory freed); on an error the shard being moved stays where it was. Moved bytes count as state traffic of
        the devices they leave and enter.

        Raises:
            ValueError: ``assignment`` names a missing device, or puts more state on a device than its
                :attr:`~StreamingDevice.capacity`.
            StorageError: a device lacks the space, or a copy fails.
        """
        self.check_usable("relocate")
        self.wait()
        self.tentative_updates.refuse_held("moving shards")
        fixed = check_assignment(Fixed(tuple(assignment)), [s.spec for s in self._shards], self.num_devices)
        self._check_capacity("`relocate`", [s.layout for s in self._shards], fixed)
        moves = [(s, self.devices[d]) for s, d in zip(self._shards, fixed) if d != self.assignment[s.spec.index]]
        for device in {id(d): d for _, d in moves if d.directory is not None}.values():
            needed = sum(s.layout.file_bytes for s, d in moves if d is device)
            check_free_space(device.directory, self._slots(device) * needed)
        self._drop_all_prefetched()
        placed = list(self.assignment)
        for shard, device in moves:
            self._move(shard, self.device_of(shard.spec.index), device)
            placed[shard.spec.index] = device.index
            self._assignment = tuple(placed)
        return [shard.spec.index for shard, _ in moves]

    def _create_files(self, device: StreamingDevice, shard: int, size: int) -> tuple[StateFile, ...]:
        """New state files of ``shard`` on ``device``, one per slot, of ``size`` bytes; on an error, none is left."""
        files: list[StateFile] = []
        try:
            for slot in range(self._slots(device)):
                files.append(device.create_file(shard_file_name(shard, slot), size))
        except BaseException:
            for file in files:
                file.discard()
            if device.directory is not None:  # the file whose creation failed, if it got that far
                (device.directory / shard_file_name(shard, len(files))).unlink(missing_ok=True)
            raise
        return tuple(files)

    def _move(self, shard: Shard, source: StreamingDevice, target: StreamingDevice) -> None:
        size = shard.layout.file_bytes
        files: tuple[StateFile, ...] = ()
        try:
            files = self._create_files(target, shard.spec.index, size)
            buf = aligned_empty(min(size, MOVE_BLOCK))
            for offset in range(0, size, MOVE_BLOCK):
                piece = buf[: min(MOVE_BLOCK, size - offset)]
                shard.file.read_into(piece, offset)
                files[0].write_from(piece, offset)
        except BaseException as exc:
            for file in files:
                file.discard()
            if is_disk_full(exc) and target.directory is not None:
                raise disk_full_error(
                    target.directory,
                    f"shard {shard.spec.index} moved there",
                    self._slots(target) * size,
                    f"The shard stays on {source.label}, whole. Free space there, or leave the shards where they are.",
                ) from exc
            raise
        self.traffic.add(**{source.read_counter: size, target.write_counter: size})
        for file in shard.files:
            file.discard()
        shard.files, shard.slot = files, 0
        shard.writes.clear()

    def takes_hand_off(self, shard: int) -> bool:
        """Whether ``shard`` takes a hand-off (a tentative update during backward): not on a device whose state is in
        memory, which updates fast enough after backward and so keeps one copy of its state."""
        return self.tentative_slots and not self.device_of(shard).in_memory

    def _check_space(self, device: StreamingDevice, shards: Sequence[ShardSpec], layouts: list[ChunkLayout]) -> None:
        assert device.directory is not None  # a storage device
        ensure_private_dir(device.directory)
        slots = self._slots(device)
        needed = slots * sum(
            lay.file_bytes for s, lay in zip(shards, layouts) if self.assignment[s.index] == device.index
        )
        reusable = [device.directory / shard_file_name(s.index, slot) for s in shards for slot in range(slots)]
        try:
            check_free_space(device.directory, needed, reusable=reusable)
        except StorageError as exc:
            if slots == 1:
                raise
            raise StorageError(
                f"{exc} (Overlapping the update with backward keeps two copies of the state; "
                "`overlap_backward=False` needs half the space.)"
            ) from None

    def _enqueue(self, request: Request, tentative: bool = False) -> Handle:
        shard = request.shard
        held = shard.spec.index in self.tentative_updates
        if tentative and self.tentative_slots and len(shard.files) < 2 and not held:
            where = self.device_of(shard.spec.index).label
            raise ValueError(f"Shard {shard.spec.index} is in {where}, which takes no tentative update.")
        self.tentative_updates.start(shard.spec.index, tentative)
        request.read_slot = shard.slot
        request.write_slot = 1 - shard.slot if tentative else shard.slot
        handle = self.device_of(request.shard.spec.index).enqueue(request)
        # Keep unfinished and failed requests for `wait`; finished ones have nothing left to report.
        return self.pending_work.add(handle)

    def _shard(self, index: int, numel: int, what: str) -> Shard:
        shard = self._shards[index]
        if numel != shard.spec.numel:
            raise ValueError(f"{what} of shard {index} has {numel} elements, expected {shard.spec.numel}.")
        return shard

    def initialize(self, shard: int, master: Tensor) -> Handle:
        self.check_usable("initialize")
        entry = self._shard(shard, master.numel(), "`master`")
        rule, layout = entry.spec.rule, entry.layout
        init_values = [rule.initial_state_value(name) for name in rule.state_names]

        copies = self.device_of(shard).copies
        written = record_fence(master.device) if on_cuda(master) else None  # by the caller's stream, maybe not yet
        params = self._split_params(entry)
        if params is not None and not _rounds_to(master, params):
            raise ValueError(
                f"Shard {shard}'s initial masters do not round to its parameters, which hold half of each split "
                "master: the parameters must be the masters' bf16 rounding when training starts."
            )

        def fill(record: Tensor, m: Tensor, states: list[Tensor], start: int, n: int) -> None:
            m.copy_(copies.to_host(master[start : start + n], after=written))
            for name, state, value in zip(rule.state_names, states, init_values):
                if value != 0.0 and layout.state_format == "fp32":
                    state.fill_(value)
                elif value != 0.0:  # the record is zeroed: only a non-zero state is stored through its format
                    values = torch.zeros(layout.format.elements(state.numel()))
                    values[:n] = value
                    layout.format.store(values, state, name)

        link = self.device_of(shard).initialize_link_bytes(entry, master)
        return self._enqueue(Request(shard=entry, read=False, write=True, compute=fill, link_write=link))

    def check_storage(self) -> None:
        """Raise :class:`StorageError` if a device's directory has disappeared (unmounted, deleted).

        That latches :attr:`failure`: the state there can no longer be saved.
        """
        self.check_usable("check_storage")
        for device in self.storage_devices:
            assert device.directory is not None
            try:
                code = None if stat.S_ISDIR(os.stat(device.directory).st_mode) else errno.ENOTDIR
            except OSError as exc:
                code = exc.errno
            if code is not None:
                raise self.latch_error(
                    StorageError(
                        f"Storage path {str(device.directory)!r} of device {device.index} disappeared during training "
                        f"(unmounted or deleted): `stat` found {StorageError.errno_label(code)}. Restore it and "
                        "resume from the last checkpoint.",
                        path=device.directory,
                        operation="stat",
                        errno=code,
                    )
                )

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
        """See :meth:`Backend.submit`; the device's :meth:`~StreamingDevice.update_work` says what each chunk does."""
        self.check_usable("submit")
        sparse = isinstance(grad, SparseGrad)
        entry = self._shard(shard, grad.numel if sparse else grad.numel(), "`grad`")
        self._shard(shard, out.numel(), "`out`")
        work = self.device_of(shard).update_work(entry, grad, hp, out, link_dtype or grad.dtype)
        params = self._split_params(entry)  # an update of split masters rebuilds them from the parameters it writes
        if params is not None and (out.data_ptr() != params.data_ptr() or out.numel() != params.numel()):
            raise ValueError(
                f"Shard {shard} splits its masters: an update of it writes its own parameters (`out` must be the "
                "tensor `bind_parameters` gave)."
            )
        request = Request(
            shard=entry,
            read=True,
            write=True,
            compute=work.compute,
            link_write=work.link_write,
            link_read=work.link_read,
            ready=ready,
            params=params,
            compute_split=work.compute_split,
        )
        if tentative and params is not None:
            request.params_aside = self._params_aside.get(shard)
            if request.params_aside is None:
                request.params_aside = self._params_aside[shard] = torch.empty_like(params)
        return self._enqueue(request, tentative)

    def prefetch(self, shards: Sequence[int]) -> None:
        """Advice: each device's next requests are for its ``shards``, in this order.

        Whenever a device has no request to serve, it reads the next chunks of the advised shards not yet
        requested into free buffers: between steps, and while it waits for the next hand-off during backward.
        A request adopts the chunks of its shard as its first reads if they are of the state it reads; otherwise
        they are dropped, unused. At most ``buffer_count - 1 - io_threads`` chunks (at least 1) are held per
        device at once, so the pool's memory stays fixed and the request being served always has room to read.
        Shards with an uncommitted tentative update are skipped (their committed state may change). New advice
        replaces the old; :meth:`load` and :meth:`close` drop what was read ahead. Ignored after a device error
        (:attr:`failure`).
        """
        shards = list(shards)
        if unknown := [i for i in shards if not 0 <= i < len(self._shards)]:
            raise ValueError(
                f"`prefetch` names shard {unknown[0]}, but the shards are 0..{len(self._shards) - 1}: advise only "
                "shards passed to `open`."
            )
        if not self.prefetch_state or self.failure is not None:
            return
        targets: list[list[PlanEntry]] = [[] for _ in self.devices]
        for index in shards:
            shard = self._shards[index]
            if index not in self.tentative_updates and not shard.file.in_memory:  # memory is read where it lies
                targets[self.assignment[index]].append(PlanEntry(shard, shard.slot))
        for device, device_targets in zip(self.devices, targets):
            device.prefetch(device_targets)  # every device: new advice, even empty, replaces the old

    def read_master(self, shard: int, out: Tensor) -> Handle:
        self.check_usable("read_master")
        entry = self._shard(shard, out.numel(), "`out`")
        copies = self.device_of(shard).copies

        def copy_out(record: Tensor, m: Tensor, states: list[Tensor], start: int, n: int) -> None:
            copies.put(out[start : start + n], m)

        link = out.numel() * 4
        request = Request(
            shard=entry, read=True, write=False, compute=copy_out, link_read=link, params=self._split_params(entry)
        )
        return self._enqueue(request)

    def commit(self, shards: Iterable[int]) -> None:
        """Make the tentative updates of ``shards`` the current state (their handles need not be done yet)."""
        self.check_usable("commit")
        shards = self.tentative_updates.check_commit(shards)
        for index in shards:
            shard = self._shards[index]
            shard.slot = 1 - shard.slot
        self.tentative_updates.end(shards)

    def rollback(self, shards: Iterable[int]) -> None:
        """Forget the tentative updates of ``shards``: waits for every request, then the committed state is as it was.

        The ``out`` tensors of those updates hold the discarded parameters; :meth:`read_master` restores them. Where
        a shard splits its masters the parameters are half of its committed state: they are put back here.
        """
        shards = list(shards)
        try:
            self.wait()
            for index in shards:
                if index in self.tentative_updates and (params := self._split_params(self._shards[index])) is not None:
                    params.copy_(self._params_aside[index])
        finally:
            self.tentative_updates.end(shards)

    def wait(self) -> None:
        """Block until every request and write-back is done; raise the first error not reported yet.

        Raises:
            StorageError: a device's I/O failed, or a device showed no progress for ``device_timeout_s``; either
                latches :attr:`failure`.
        """
        pending = self.pending_work.take()
        errors = [exc for h in pending if (exc := self._settle(h)) is not None]
        for device in self.devices:
            try:
                if (exc := device.drain(self.device_timeout_s)) is not None:
                    errors.append(exc)
            except StorageError as exc:
                raise self.latch_error(exc)  # noqa: B904 - the timeout is the error
        if errors:
            raise self.latch_error(errors[0])

    def _state_files(self) -> list[ShardState]:
        return [
            ShardState(
                s.spec,
                s.layout,
                s.file.path,
                dict(s.file.checksums) if s.file.keeps_checksums else None,
                params=self._split_params(s),
            )
            for s in self._shards
        ]

    def _staged_files(self) -> list[StateFile]:
        """The state files a checkpoint reads and writes through a host copy (the accelerator tier's)."""
        return [file for shard in self._shards for file in shard.files if file.needs_host_copy]

    def checkpoint_bytes(self) -> int:
        """Bytes of every shard's state file as :meth:`save` writes it (clones, copies, or rebuilds whole masters)."""
        return sum(saved_form(shard.layout).file_bytes for shard in self._shards)

    def save(self, directory: Path) -> None:
        """Write every shard's state under ``directory`` (waits first); refused after a device error.

        Works after :meth:`close` too (the state files stay on the storage): the directories are claimed again for
        the copy if :meth:`close` released them, so no other run can be writing them meanwhile.
        """
        self.check_usable("save")
        self.wait()
        claims = []
        if self._released:
            if self._owned_dirs or any(device.in_memory for device in self.devices):
                raise StorageError(
                    "The device state was in temporary directories or in memory (host or accelerator), freed when the "
                    "backend closed; save before closing it (or close with `keep_claims=True`)."
                )
            claims = claim_directories(list(self.device_dirs))
        staged = self._staged_files()
        try:
            for file in staged:
                file.stage(copy=True)
            self.last_save = save_state(self._state_files(), Path(directory), chunk_elems=self.chunk_elems)
        finally:
            for file in staged:
                file.unstage()
            release_claims(claims)

    def loads_as_saved(self, directory: Path) -> bool:
        """Only state files saved in ``directory`` (its manifest); a checkpoint whose devices kept the state (remote
        servers) goes through :meth:`load_resharded`, with the files the controller fetches."""
        return (Path(directory) / MANIFEST).is_file()

    def load(self, directory: Path, *, manifest: dict | None = None) -> None:
        """Replace every shard's state with the copy under ``directory`` (``manifest``: its manifest, as a caller
        that checked its digest read it; read from the directory otherwise).

        Refused after a device error (:attr:`failure`), like :meth:`save`: threads may still hang on the failed
        storage and its files may be unusable, so the process must restart and resume there.
        """
        self._replace_state(
            lambda shards: load_state(shards, Path(directory), chunk_elems=self.chunk_elems, manifest=manifest)
        )

    def load_resharded(self, reshard: Reshard) -> None:
        """Replace every shard's state from a checkpoint of another layout, element runs as ``reshard`` maps them."""
        self._replace_state(reshard.write)

    def _replace_state(self, write: Callable[[list[ShardState]], None]) -> None:
        """Let ``write`` rewrite every shard's live file (by path), with no transfer in flight and no file open."""
        self.check_usable("load")
        self.wait()
        # Refused before any file is closed, so the backend stays usable after the error.
        self.tentative_updates.refuse_held("loading a checkpoint")
        # Chunks read ahead hold the state being replaced, and no read may be in flight while files change.
        self._drop_all_prefetched()
        on_disk = [shard for shard in self._shards if not shard.file.in_memory]
        for shard in on_disk:
            for file in shard.files:
                file.close()
        staged = self._staged_files()
        loaded = False
        try:
            for file in staged:
                file.stage(copy=False)
            write(self._state_files())
            loaded = True
        finally:
            for file in staged:
                file.unstage(copy_back=loaded)
            for shard in on_disk:
                shard.files = tuple(StateFile(f.path, shard.layout.file_bytes, create=False) for f in shard.files)

    def _close_devices(self) -> None:
        """Stop the devices' threads, waiting at most ``device_timeout_s`` per device for threads a hung transfer holds
        (then leaving them behind), and close the state files. (``close(keep_claims=True)`` keeps the device
        directories, and temporary ones with the state in them, until :meth:`release_storage`; a later :meth:`save`
        without it claims them again for the copy.)"""
        # A device whose transfer still hangs keeps its files open: a piece not yet started must not reach another
        # file through a reused descriptor.
        hung = {device.index for device in self.devices if not device.close(self.device_timeout_s)}
        for shard in self._shards:
            if self.assignment[shard.spec.index] not in hung:
                for file in shard.files:
                    file.close()

    def release_storage(self) -> None:
        """Give up the device directories: the owned (temporary) ones are removed first, while still held.

        Called by :meth:`close` unless it kept them; idempotent. Every state file is closed by then.
        """
        claims, self._claims = self._claims, []
        self._released = True
        # State on storage outlives the backend (its files are the state); state in memory ends with it.
        for shard in self._shards:
            for file in shard.files:
                if file.in_memory:
                    file.discard()
        release_claims(claims, remove=self._owned_dirs)


def _rounds_to(master: Tensor, params: Tensor) -> bool:
    """Whether ``params`` are the bf16 roundings of ``master``: NaN for NaN (ZeRO's partitions pad with whatever the
    memory held, which a split master keeps as some NaN, never read as a parameter)."""
    rounded = master.to(params.device, torch.bfloat16).view(-1)
    return bool(((rounded == params) | (rounded.isnan() & params.isnan())).all())


def _shares(values: Sequence[float]) -> list[float]:
    total = sum(values)
    return [v / total for v in values]


def shares_drifted(measured: Sequence[float], weights: Sequence[float]) -> bool:
    """Whether some device's share of ``measured`` differs from its share of ``weights`` by more than
    :data:`REPLAN_DRIFT`: the hysteresis that keeps :meth:`StreamingBackend.replan` from moving shards over noise."""
    return max(abs(n - o) for n, o in zip(_shares(measured), _shares(weights))) > REPLAN_DRIFT
