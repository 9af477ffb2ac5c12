"""State tiers over any backend: host memory and accelerator memory beside the devices of ``cpu``, ``xrt`` or
``remote``.

:class:`TieredBackend` wraps a backend. It owns the split of a rank's shards between the accelerator tier, the
memory tier and the wrapped backend, and the policy that decides it. A shard in a tier is updated on this host (by
its cores, or on the GPU) with the rule's own code; its gradient never crosses to a device.

The tiers' devices are streaming devices over in-memory files (:mod:`~.host_memory`, :mod:`~.accelerator_memory`).
Two designs, chosen once when the backend is built (:func:`~lightning_smartinf.core.build.tiers_over`):

- :class:`AttachedTiers`, over a backend that streams its state through this host (a :class:`StreamingBackend`:
  ``cpu``, ``xrt``): the tiers' devices are attached to it, after its storage devices. A move between tiers is a byte
  copy between two devices of one shard table (so the memory share can be re-planned), and its checkpoint stays one
  record of every shard whatever the split.
- :class:`BesideTiers`, beside a backend whose state is elsewhere (``remote``): the tiers form a backend of their own
  (:class:`~.host_memory.MemoryTiers`) and requests are routed by shard; the state never moves.

Invariants:

- The split: the accelerator takes shards in index order while they fit its budget, then memory its share of its
  budget the same way (:class:`~lightning_smartinf.core.placement.TieredPlacement`), the wrapped backend the rest.
  The first sub-groups are the last whose gradients backward reduces, so the devices get those that can start during
  backward.
- Memory's share: its whole budget, unless the share is measured (``measure_memory_share``, by default where the
  wrapped backend's devices compute): then it starts as one more of those devices (``1 / (N + 1)`` of the state beside
  ``N``), and :meth:`TieredBackend.replan` moves it to the share whose update phase
  :func:`~.update_model.update_tail` predicts shortest from measured rates, when that is more than
  :data:`REPLAN_DRIFT` shorter. State that cannot move (``remote``) is never re-planned.
- Shards in a tier never take tentative updates: they are updated right after backward, once the step is known to
  stand, and keep one copy of their state.
- Device indices (:attr:`TieredBackend.assignment`) are the wrapped backend's, then memory, then the accelerator.
- Checkpoints: attached, the wrapped backend's record of every shard, which does not depend on the split (a run may
  resume with other budgets). Beside, the wrapped backend's record of its shards, the tiers' state under
  :data:`LOCAL_DIR` and the split (:data:`LOCAL_TIERS_MANIFEST`); such a checkpoint loads as saved under the same
  split, and is re-sharded under another where the wrapped backend can reach the state it kept
  (:meth:`~lightning_smartinf.core.backend.Backend.fetch_saved_state`: remote servers fetch theirs and take the tiers'
  from :data:`LOCAL_DIR`). A checkpoint with every shard's state in files on this host is re-sharded into either
  split.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lightning_smartinf.core.accelerator import Fence
from lightning_smartinf.core.backend import Backend, BackendStats, Handle, ShardSpec
from lightning_smartinf.core.compression import SparseGrad
from lightning_smartinf.core.format.reshard import Fetch, Reshard
from lightning_smartinf.core.format.state_files import (
    CheckpointError,
    read_json,
    read_manifest,
    saved_shard_masters,
    write_file_atomic,
)
from lightning_smartinf.core.io.storage import StorageError, is_disk_full
from lightning_smartinf.core.placement import Fixed, TieredPlacement, by_holder, check_assignment, memory_share
from lightning_smartinf.core.rules import StepParams
from lightning_smartinf.core.streaming.backend import REPLAN_DRIFT, StreamingBackend
from lightning_smartinf.core.streaming.device import StreamingDevice
from lightning_smartinf.core.tiers.accelerator_memory import AcceleratorDevice
from lightning_smartinf.core.tiers.host_memory import MemoryDevice, MemoryTiers
from lightning_smartinf.core.tiers.update_model import best_share, memory_candidates, update_tail
from lightning_smartinf.core.traffic import TrafficSnapshot

__all__ = [
    "LOCAL_DIR",
    "LOCAL_TIERS_MANIFEST",
    "AttachedTiers",
    "BesideTiers",
    "Replan",
    "TieredBackend",
    "masters_with_tiers",
    "saved_local_shards",
]

log = logging.getLogger(__name__)

#: The checkpoint file that records which shards the tiers held beside a backend whose state is elsewhere.
LOCAL_TIERS_MANIFEST = "local_tiers.json"
#: The checkpoint folder of those tiers' state (the streaming backends' format).
LOCAL_DIR = "local"
#: Steps of backward timings (:meth:`TieredBackend.note_backward`) kept for the next re-plan.
BACKWARD_SAMPLES = 20
#: Chunk buffers of a tier's device: memory copies need no deep pool (one updating, one read ahead, one written).
TIER_BUFFERS = 4


@dataclass(frozen=True)
class Replan:
    """What :meth:`TieredBackend.replan` decided for the memory tier, and from what."""

    #: Bytes of state the memory tier may hold from now on (its share of its budget).
    memory_share: int
    #: The update phase predicted for that share, and for the placement the re-plan found (seconds after the step
    #: began: :func:`~lightning_smartinf.core.tiers.update_model.update_tail`).
    predicted_s: float
    current_s: float
    #: The rate of each device the prediction used (state bytes per second; measured, or estimated before a device
    #: updated), by device index.
    rates: dict[int, float]
    #: Seconds before the step began that backward completed each shard's gradient (medians over the steps since
    #: the last re-plan; missing: at the step).
    ready: dict[int, float]


class TieredBackend(Backend, ABC):
    """Host memory and accelerator memory tiers over ``inner``: what both designs share (budgets, the tiers' devices,
    the split, requests routed by shard, closing both sides).

    Args:
        inner: the backend of the shards the tiers do not hold (``cpu``, ``xrt``, ``remote``).
        memory_bytes: bytes of shard state host memory may hold (``0``: no memory tier).
        accelerator_bytes: bytes of shard state accelerator memory may hold (``0``: no accelerator tier).
        accelerator_device: the torch device of the accelerator tier (``"cuda"``: the current GPU).
        devices_compute: whether ``inner``'s devices update with compute of their own, beside this host's cores (its
            kind's :attr:`~lightning_smartinf.core.registry.DeviceKind.devices_compute`): a memory tier beside them
            then starts as one more of them.
        measure_memory_share: choose the memory tier's share of ``memory_bytes`` from measured rates (see
            :meth:`AttachedTiers.replan`); ``False``: fill the budget; ``None``: measure where ``devices_compute``.
        chunk_elems, buffer_count: the tiers' devices' chunks and buffers.

    On an error here ``inner`` is closed.
    """

    #: What the last :meth:`replan` decided for the memory tier (``None``: nothing yet, or nothing to decide).
    last_replan: Replan | None = None

    def __init__(
        self,
        inner: Backend,
        *,
        memory_bytes: int = 0,
        accelerator_bytes: int = 0,
        accelerator_device: torch.device | str = "cuda",
        devices_compute: bool = False,
        measure_memory_share: bool | None = None,
        chunk_elems: int = 1 << 20,
        buffer_count: int = 16,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.memory_bytes = memory_bytes
        self.accelerator_bytes = accelerator_bytes
        self._accelerator_device = accelerator_device
        #: Whether the memory tier's share is decided from measurements (else it fills its budget).
        self.devices_compute = devices_compute
        self.measures_memory_share = devices_compute if measure_memory_share is None else measure_memory_share
        self._memory_share = memory_bytes
        #: Elements per streamed chunk of the tiers' devices.
        self.chunk_elems = chunk_elems
        self._buffer_count = buffer_count
        # The tiers' devices' chunk size and buffer count (at most ``TIER_BUFFERS``).
        self._tier_buffers = {"chunk_elems": chunk_elems, "buffer_count": min(buffer_count, TIER_BUFFERS)}
        #: Each shard's backend and its index there.
        self._where: list[tuple[Backend, int]] = []
        # Which backend issued each outstanding handle (their `result` differ: device timeouts, server deadlines).
        self._issuer: weakref.WeakKeyDictionary[Handle, Backend] = weakref.WeakKeyDictionary()

    def _attach_tiers(self, backend: StreamingBackend) -> None:
        """Build the tiers' devices as ``backend``'s next devices: memory, then the accelerator."""
        if self.memory_bytes:
            backend.attach(self.make_memory_device(backend.num_devices, backend))
        if self.accelerator_bytes:
            backend.attach(self.make_accelerator_device(backend.num_devices, backend))

    def make_memory_device(self, index: int, backend: StreamingBackend) -> StreamingDevice:
        """The memory tier's device, device ``index`` of ``backend``: state in host RAM, updated on a host core."""
        return MemoryDevice(index, backend.traffic, **self._tier_buffers, capacity=self.memory_bytes)

    def make_accelerator_device(self, index: int, backend: StreamingBackend) -> StreamingDevice:
        """The accelerator tier's device, device ``index`` of ``backend``: state in accelerator memory, updated there
        with the rule's own torch code."""
        return AcceleratorDevice(
            index,
            backend.traffic,
            **self._tier_buffers,
            device=self._accelerator_device,
            capacity=self.accelerator_bytes,
        )

    @abstractmethod
    def _backends(self) -> list[Backend]:
        """Each side once: ``inner``, and the tiers' own backend where it has one."""

    @abstractmethod
    def _storage_count(self) -> int:
        """The devices of ``inner`` the split spreads its other shards over."""

    def _weights(self) -> tuple[float, ...]:
        return (1.0,) * self._storage_count()

    # ---------------------------------------------------------------------------------------------- views

    @property
    def num_devices(self) -> int:
        return sum(backend.num_devices for backend in self._backends())

    @property
    def supports_tentative(self) -> bool:
        return self.inner.supports_tentative

    @property
    def failure(self) -> BaseException | None:
        return next((backend.failure for backend in self._backends() if backend.failure is not None), None)

    @property
    @abstractmethod
    def local_shards(self) -> tuple[int, ...]:
        """The shards whose state lives in a tier on this host (memory or accelerator), in order."""

    def takes_hand_off(self, shard: int) -> bool:
        backend, index = self._where[shard]
        return backend is self.inner and self.inner.takes_hand_off(index)

    # ---------------------------------------------------------------------------------------------- the split

    def _split(self, shards: Sequence[ShardSpec], share: int, keep: tuple[int, ...] = ()) -> tuple[int, ...]:
        """Each shard's device under memory share ``share``: ``inner``'s (by its weights), memory, the accelerator."""
        held = max(1, share) if self.memory_bytes else 0  # (the tier exists, holding what fits)
        tiered = TieredPlacement(self._weights(), held, self.chunk_elems, self.accelerator_bytes, keep=keep)
        devices = self._storage_count() + (self.memory_bytes > 0) + (self.accelerator_bytes > 0)
        return check_assignment(tiered, shards, devices)

    def _initial_share(self, shards: Sequence[ShardSpec], beside: int) -> int:
        """Memory's share before anything is measured: beside ``beside`` devices that compute and a share that is
        measured, what one more of them would hold; otherwise the whole budget."""
        if not (self.memory_bytes and self.measures_memory_share and self.devices_compute and beside):
            return self.memory_bytes
        state = sum(spec.layout(self.chunk_elems).file_bytes for spec in shards)
        return int(memory_share(self.memory_bytes, max(0, state - self.accelerator_bytes), 1.0, beside))

    # ---------------------------------------------------------------------------------------------- requests

    def _issued(self, backend: Backend, handle: Handle) -> Handle:
        self._issuer[handle] = backend
        return handle

    def initialize(self, shard: int, master: Tensor) -> Handle:
        backend, index = self._where[shard]
        return self._issued(backend, backend.initialize(index, master))

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
        backend, index = self._where[shard]
        if tentative and backend is not self.inner:
            raise ValueError(f"Shard {shard} is in a memory tier, which takes no tentative update.")
        handle = backend.submit(index, grad, hp, out, link_dtype=link_dtype, tentative=tentative, ready=ready)
        return self._issued(backend, handle)

    def read_master(self, shard: int, out: Tensor) -> Handle:
        backend, index = self._where[shard]
        return self._issued(backend, backend.read_master(index, out))

    def result(self, handle: Handle) -> None:
        self._issuer.get(handle, self.inner).result(handle)

    def commit(self, shards: Iterable[int]) -> None:
        for backend, indices in by_holder(self._where, shards).items():
            backend.commit(indices)

    def rollback(self, shards: Iterable[int]) -> None:
        self.wait()
        for backend, indices in by_holder(self._where, shards).items():
            backend.rollback(indices)

    def prefetch(self, shards: Sequence[int]) -> None:
        by_backend = by_holder(self._where, shards)
        for backend in self._backends():
            backend.prefetch(by_backend.get(backend, []))

    def _on_each(self, call: Callable[[Backend], None]) -> None:
        """``call`` on each side, even after one raised; then the first error is raised."""
        errors = []
        for backend in self._backends():
            try:
                call(backend)
            except BaseException as exc:  # noqa: BLE001 - raised below, once every side was called
                errors.append(exc)
        if errors:
            raise errors[0]

    def check_storage(self) -> None:
        for backend in self._backends():
            backend.check_storage()

    def wait(self) -> None:
        self._on_each(lambda backend: backend.wait())

    # ---------------------------------------------------------------------------------------------- checkpoints

    def checkpoint_bytes(self) -> int:
        return sum(backend.checkpoint_bytes() for backend in self._backends())

    def fetch_saved_state(self, rank_dirs: Sequence[Path], into: Path) -> tuple[list[Path], Fetch] | None:
        return self.inner.fetch_saved_state(rank_dirs, into)

    # ---------------------------------------------------------------------------------------------- release

    def close(self, *, keep_claims: bool = False) -> None:
        """Close every side (see the backends' own ``close``); the first error is raised once all are closed."""
        self._on_each(lambda backend: backend.close(keep_claims=keep_claims))

    def release_storage(self) -> None:
        for backend in self._backends():
            backend.release_storage()

    # ---------------------------------------------------------------------------------------------- telemetry

    def traffic_snapshot(self) -> TrafficSnapshot:
        """Every side's counters, summed: the tiers count ``memory_*`` and ``accelerator_*`` bytes."""
        return sum((backend.traffic_snapshot() for backend in self._backends()), TrafficSnapshot())


class AttachedTiers(TieredBackend):
    """The tiers as devices of ``inner``, a backend that streams its state through this host: one shard table, moves
    between tiers are byte copies, and the memory share may be re-planned from measured rates."""

    inner: StreamingBackend

    def __init__(self, inner: StreamingBackend, **options: object) -> None:
        options.update(chunk_elems=inner.chunk_elems, buffer_count=inner.buffer_count)
        super().__init__(inner, **options)  # type: ignore[arg-type]
        self._backward: list[dict[int, float]] = []
        try:
            self._attach_tiers(inner)
        except BaseException:
            inner.close()
            raise

    def _backends(self) -> list[Backend]:
        return [self.inner]

    def _storage_count(self) -> int:
        return len(self.inner.storage_devices)

    def _weights(self) -> tuple[float, ...]:
        return self.inner.storage_weights() or super()._weights()

    @property
    def local_shards(self) -> tuple[int, ...]:
        inner = self.inner
        return tuple(i for i, d in enumerate(inner.assignment) if inner.devices[d].in_memory)

    @property
    def assignment(self) -> tuple[int, ...]:
        """The device of each shard: ``inner``'s storage devices first, then the memory and accelerator tiers."""
        return self.inner.assignment

    @property
    def update_rates(self) -> dict[int, float]:
        """Each device's update rate as :meth:`replan` last measured it (state bytes per second, by device index)."""
        return self.inner.update_rates

    def open(self, shards: Sequence[ShardSpec]) -> None:
        if self._where:
            raise RuntimeError("`TieredBackend.open` was already called.")
        self._memory_share = self._initial_share(shards, self._storage_count())
        self.inner.placement = Fixed(self._split(shards, self._memory_share))
        self.inner.open(shards)
        self._where = [(self.inner, spec.index) for spec in shards]

    def bind_parameters(self, params_of: Callable[[int], Tensor]) -> None:
        """``inner``'s, whose shard table holds the tiers' shards too (in the same numbering)."""
        self.inner.bind_parameters(params_of)

    # ---------------------------------------------------------------------------------------------- re-planning

    def note_backward(self, ready: Mapping[int, float]) -> None:
        """Seconds before this step began that backward completed each sub-group's gradient (see
        :meth:`Backend.note_backward`); :meth:`replan` takes each shard's median over the steps since it last ran."""
        if self.measures_memory_share:  # (only the memory share's model reads them)
            self._backward.append(dict(ready))
            del self._backward[:-BACKWARD_SAMPLES]

    def _accelerator_index(self) -> int | None:
        return self._storage_count() + (self.memory_bytes > 0) if self.accelerator_bytes else None

    def replan(self) -> list[int]:
        """Between steps: re-place the shards from the rates the devices showed since the last call; the shards moved.

        ``inner`` re-plans its own devices first (a streaming backend re-weighs storage paths it measured). Then,
        where :attr:`measures_memory_share`, the memory tier's share: of
        the shares its budget allows, the one whose update phase
        :func:`~lightning_smartinf.core.tiers.update_model.update_tail` predicts shortest from the measured rates and
        from when backward completed each gradient (:meth:`note_backward`), when that phase is more than
        :data:`REPLAN_DRIFT` shorter than the current placement's. A storage device that has never updated gives no
        rate (an emulated one is measured by a write and read probe); a memory tier that has never updated keeps its
        share. :attr:`last_replan` records what was decided.
        """
        moved = self.inner.replan()
        inner, memory = self.inner, self._storage_count()  # (the memory tier's device, where it has one)
        if not self.memory_bytes or not self.measures_memory_share:
            return moved
        if inner.failure is not None or not inner.shards or not memory:
            return moved
        rates = inner.update_rates
        ready, self._backward = _median_ready(self._backward), []
        plan = self._memory_plan(inner, rates, ready) if memory in rates else None
        self.last_replan = plan
        if plan is None or plan.memory_share == self._memory_share:
            return moved
        if not plan.predicted_s < plan.current_s * (1 - REPLAN_DRIFT):
            return moved
        specs = [s.spec for s in inner.shards]
        try:
            more = inner.relocate(self._split(specs, plan.memory_share, keep=inner.assignment))
        except StorageError as exc:
            if not is_disk_full(exc):
                raise
            inner.keep_placement(exc)
            return moved
        self._memory_share = plan.memory_share
        speeds = ", ".join(f"{plan.rates[d.index] / 1e9:.2f} GB/s ({d.tier} {d.index})" for d in inner.devices)
        log.info(
            "SmartUpdate re-placed %d shard(s): the devices update at %s; the update phase is predicted %.3g s, was "
            "%.3g s",
            len(more),
            speeds,
            plan.predicted_s,
            plan.current_s,
        )
        inner.log_shares()
        return sorted({*moved, *more})

    def _memory_plan(self, inner: StreamingBackend, rates: dict[int, float], ready: dict[int, float]) -> Replan | None:
        """The memory share whose update phase is predicted shortest, beside the current placement's; ``None`` while a
        storage device has no rate and none can be estimated."""
        memory_rate = rates[self._storage_count()]
        device_rates = [rates.get(d.index) or self._estimated_rate(inner, d, memory_rate) for d in inner.devices]
        if any(r is None for r in device_rates):
            return None
        early = [inner.tentative_slots and not d.in_memory for d in inner.devices]
        sizes = [s.layout.file_bytes for s in inner.shards]
        specs = [s.spec for s in inner.shards]

        def tail(assignment: Sequence[int]) -> float:
            return update_tail(assignment, sizes, device_rates, early, ready)

        def placed(share: int) -> tuple[int, ...]:
            return self._split(specs, share, keep=inner.assignment)

        # The accelerator fills first: memory chooses among the rest, in index order.
        rest = [sizes[i] for i, d in enumerate(placed(0)) if d != self._accelerator_index()]
        candidates = memory_candidates(rest, self.memory_bytes)
        share, predicted = best_share(candidates, lambda share: tail(placed(share)), self._memory_share)
        return Replan(
            memory_share=share,
            predicted_s=predicted,
            current_s=tail(inner.assignment),
            rates={d.index: r for d, r in zip(inner.devices, device_rates)},
            ready=ready,
        )

    def _estimated_rate(self, inner: StreamingBackend, device: StreamingDevice, memory_rate: float) -> float | None:
        """A device that has not updated yet. An emulated storage device: the slower of its storage (a probe) and the
        memory tier's rate (the same update code on the same host cores). An accelerator tier that holds nothing: no
        time (memory's share cannot change that). ``None`` for any other: a device that computes has a rate of its
        own."""
        if device.index == self._accelerator_index() and device.index not in inner.assignment:
            return math.inf
        if self.devices_compute or device.in_memory:
            return None
        return min(inner.probe_rate(device), memory_rate)

    def relocate(self, assignment: Sequence[int]) -> list[int]:
        """Move shards between tiers and devices so that shard ``i`` lives on device ``assignment[i]`` (see
        :meth:`StreamingBackend.relocate`)."""
        return self.inner.relocate(assignment)

    # ---------------------------------------------------------------------------------------------- checkpoints

    def save(self, directory: Path) -> None:
        """``inner``'s record of every shard, which does not depend on the split."""
        self.inner.save(directory)

    def loads_as_saved(self, directory: Path) -> bool:
        return self.inner.loads_as_saved(directory)

    def load_resharded(self, reshard: Reshard) -> None:
        self.inner.load_resharded(reshard)

    def load(self, directory: Path) -> None:
        self.inner.load(directory)

    def stats(self, *, reset_peaks: bool = False) -> BackendStats:
        return self.inner.stats(reset_peaks=reset_peaks)


class BesideTiers(TieredBackend):
    """The tiers as a backend of their own (:class:`~.host_memory.MemoryTiers`) beside ``inner``, whose state is
    elsewhere (``remote``): requests are routed by shard, the state never moves between the sides, and a checkpoint
    records the split.

    Args:
        inner, memory_bytes, accelerator_bytes, accelerator_device, devices_compute, measure_memory_share, chunk_elems,
            buffer_count: see :class:`TieredBackend`.
        device_timeout_s: the tiers' devices' timeout.

    The tiers' devices are built when :meth:`open` puts a shard in them.
    """

    def __init__(self, inner: Backend, *, device_timeout_s: float | None = 300.0, **options: object) -> None:
        super().__init__(inner, **options)  # type: ignore[arg-type]
        self._device_timeout_s = device_timeout_s
        #: The backend of the tiers' shards, built by :meth:`open` when some shard lives in a tier.
        self.local: StreamingBackend | None = None
        #: The shards each side holds (global indices, in order).
        self._local_shards: list[int] = []
        self._inner_shards: list[int] = []

    def _backends(self) -> list[Backend]:
        return [self.inner] + ([self.local] if self.local is not None else [])

    def _storage_count(self) -> int:
        return 1  # the wrapped backend, as one device of the split

    @property
    def local_shards(self) -> tuple[int, ...]:
        return tuple(self._local_shards)

    @property
    def assignment(self) -> tuple[int, ...]:
        """The device of each shard: ``inner``'s devices first, then the memory and accelerator tiers."""
        inner = self.inner.assignment
        offset = self.inner.num_devices
        local = self.local.assignment if self.local is not None else ()
        return tuple(inner[j] if backend is self.inner else offset + local[j] for backend, j in self._where)

    def open(self, shards: Sequence[ShardSpec]) -> None:
        if self._where:
            raise RuntimeError("`TieredBackend.open` was already called.")
        self._memory_share = self._initial_share(shards, self.inner.num_devices)
        split = self._split(shards, self._memory_share)
        self._local_shards = [spec.index for spec, d in zip(shards, split) if d > 0]
        self._inner_shards = [spec.index for spec, d in zip(shards, split) if d == 0]
        if self._local_shards:
            self.local = MemoryTiers(
                chunk_elems=self.chunk_elems,
                buffer_count=self._buffer_count,
                device_timeout_s=self._device_timeout_s,
                placement=Fixed(tuple(split[i] - 1 for i in self._local_shards)),
            )
            self._attach_tiers(self.local)
            self.local.open([dataclasses.replace(shards[i], index=j) for j, i in enumerate(self._local_shards)])
        self.inner.open([dataclasses.replace(shards[i], index=j) for j, i in enumerate(self._inner_shards)])
        sides = ((self.inner, self._inner_shards), (self.local, self._local_shards))  # (no local shard: no `local`)
        place = {i: (side, j) for side, held in sides for j, i in enumerate(held)}
        self._where = [place[spec.index] for spec in shards]
        if self._local_shards:
            sizes = [spec.layout(self.chunk_elems).file_bytes for spec in shards]
            here = sum(sizes[i] for i in self._local_shards)
            log.info(
                "SmartUpdate keeps %d sub-group(s), %.1f MiB of state (%.0f%%), on this host beside %d server(s)",
                len(self._local_shards),
                here / 2**20,
                100 * here / max(sum(sizes), 1),
                self.inner.num_devices,
            )

    @property
    def update_rates(self) -> dict[int, float]:
        """Nothing measured here: the state beside the tiers cannot move to them."""
        return {}

    def replan(self) -> list[int]:
        """``inner``'s own re-plan: the state beside the tiers cannot move to them."""
        return self.inner.replan()

    def relocate(self, assignment: Sequence[int]) -> list[int]:
        raise RuntimeError(
            f"The state of {type(self.inner).__name__} cannot move between its devices and this host's tiers."
        )

    # ---------------------------------------------------------------------------------------------- checkpoints

    def save(self, directory: Path) -> None:
        """``inner``'s record of its shards, the tiers' state under ``local/``, and the split."""
        directory = Path(directory)
        self.wait()
        self.inner.save(directory)
        if self.local is not None:
            self.local.save(directory / LOCAL_DIR)
        # Format 2 names the wrapped backend's shards `inner` (format 1 said `beside`); only `local` is read back.
        split = {"format": 2, "local": self._local_shards, "inner": self._inner_shards}
        write_file_atomic(directory / LOCAL_TIERS_MANIFEST, json.dumps(split).encode())

    def loads_as_saved(self, directory: Path) -> bool:
        """Only a checkpoint of this run's split: another split goes through :meth:`load_resharded`, which the wrapped
        backend fills from state kept elsewhere (:meth:`fetch_saved_state`) where it can."""
        return saved_local_shards(directory) == self._local_shards and self.inner.loads_as_saved(directory)

    def load_resharded(self, reshard: Reshard) -> None:
        """Each side loads its shards' part of the plan."""
        self.wait()
        self.inner.load_resharded(reshard.only(self._inner_shards))
        if self.local is not None:
            self.local.load_resharded(reshard.only(self._local_shards))

    def load(self, directory: Path) -> None:
        """Refuses a checkpoint whose split differs from this run's before anything is replaced."""
        directory = Path(directory)
        saved = saved_local_shards(directory)
        if saved != self._local_shards:
            raise CheckpointError(
                f"The checkpoint in {str(directory)!r} kept sub-groups {saved or 'none'} of this rank in host or "
                f"accelerator memory beside the remote servers; this run keeps {self._local_shards or 'none'} there. "
                "Resume with the `state_memory_budget`, `state_accelerator_budget` and `remote_devices` it was saved "
                "with."
            )
        self.inner.load(directory)
        if self.local is not None:
            self.local.load(directory / LOCAL_DIR)

    def stats(self, *, reset_peaks: bool = False) -> BackendStats:
        inner = self.inner.stats(reset_peaks=reset_peaks)
        if self.local is None:
            return inner
        local = self.local.stats(reset_peaks=reset_peaks)
        summed = {f.name: getattr(inner, f.name) + getattr(local, f.name) for f in dataclasses.fields(BackendStats)}
        # The tiers' devices come after ``inner``'s.
        offset = self.inner.num_devices
        summed["devices"] = inner.devices + tuple(dataclasses.replace(d, index=d.index + offset) for d in local.devices)
        return BackendStats(**summed)


def saved_local_shards(directory: Path) -> list[int]:
    """The shards a checkpoint's tiers held beside its backend (none when it has no :data:`LOCAL_TIERS_MANIFEST`)."""
    path = Path(directory) / LOCAL_TIERS_MANIFEST
    if not path.is_file():
        return []
    local = read_json(path, "the local tiers' split", ("local",))["local"]
    if not isinstance(local, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in local):
        raise CheckpointError(f"{path} does not list the local tiers' shards as integers.")
    return local


def masters_with_tiers(read_inner: Callable[[Path], list[Tensor]]) -> Callable[[Path], list[Tensor]]:
    """A reader of one rank's fp32 masters whose state a :class:`TieredBackend` saved beside a backend whose state is
    elsewhere: ``read_inner`` gives that backend's (by its own numbering), the tiers' come from ``local/``,
    CRC-checked."""

    def read(directory: Path) -> list[Tensor]:
        directory = Path(directory)
        local = saved_local_shards(directory)
        inner = read_inner(directory)
        if not local:
            return inner
        manifest = read_manifest(directory / LOCAL_DIR)
        here = [saved_shard_masters(directory / LOCAL_DIR, j, manifest=manifest) for j in range(len(local))]
        masters: list[Tensor | None] = [None] * (len(local) + len(inner))
        for index, master in zip(local, here):
            if not 0 <= index < len(masters):
                raise CheckpointError(f"{directory / LOCAL_TIERS_MANIFEST} names shard {index}, out of range.")
            masters[index] = master
        others = iter(inner)
        return [master if master is not None else next(others) for master in masters]

    return read


def _median_ready(samples: Sequence[Mapping[int, float]]) -> dict[int, float]:
    """Each shard's median of ``samples`` (a shard missing from a sample was ready only at that step: 0 s)."""
    shards = {shard for sample in samples for shard in sample}
    return {shard: statistics.median(sample.get(shard, 0.0) for sample in samples) for shard in shards}
