"""State tiers on this host beside a backend whose devices are elsewhere: host memory and accelerator memory beside
remote device servers.

:class:`LocalTiers` splits a rank's shards between the tiers here (a :class:`~lightning_smartinf.csd.cpu.CpuBackend`
with no storage devices, only its memory and accelerator tiers) and the backend beside them. A local shard's gradient
never crosses the network; the host's cores (or the GPU) update it while the servers update the rest.

Invariants:

- The split is decided when the shards are opened, from the budgets and the shard sizes alone: the accelerator tier
  takes what fits its budget first, then host memory its share, in index order (as :class:`Tiered` places them), and
  the backend beside gets the rest, renumbered ``0..K-1`` in order. Memory's share is what one more device of the
  backend would hold, since the servers update with cores of their own: ``1 / (N + 1)`` of the state beside ``N``.
- The split is not re-planned: moving a shard between a server and this host would carry its whole state over the
  network, which the servers' protocol does not do. So a run resumed with the same settings splits alike.
- A checkpoint records the split (:data:`LOCAL_TIERS_MANIFEST`) and keeps the local shards' state in
  ``local/`` beside the backend's own record; loading under another split is refused, naming what to change.
- Shards in the local tiers never take tentative updates: they are updated right after backward, once the step
  is known to stand, as beside local devices.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from lightning_smartinf.csd.accelerator import Fence
from lightning_smartinf.csd.backend import Backend, BackendStats, DeviceStats, Handle, ShardSpec
from lightning_smartinf.csd.checkpoint import (
    CheckpointError,
    read_json,
    read_manifest,
    saved_shard_masters,
    write_file_atomic,
)
from lightning_smartinf.csd.compression import SparseGrad
from lightning_smartinf.csd.cpu import CpuBackend
from lightning_smartinf.csd.placement import Fixed, Tiered, memory_share
from lightning_smartinf.csd.rules import StepParams
from lightning_smartinf.csd.traffic import TrafficSnapshot

__all__ = ["LOCAL_DIR", "LOCAL_TIERS_MANIFEST", "LocalTiers", "masters_beside"]

log = logging.getLogger(__name__)

#: The checkpoint file that records which shards the local tiers held (beside the backend's own record).
LOCAL_TIERS_MANIFEST = "local_tiers.json"
#: The checkpoint folder of the local tiers' state (the ``cpu`` backend's format).
LOCAL_DIR = "local"


class LocalTiers(Backend):
    """Host (and accelerator) memory tiers beside ``beside``, a backend whose devices are elsewhere.

    Args:
        beside: the backend of the other shards (:class:`~lightning_smartinf.csd.remote.client.RemoteBackend`).
        memory_bytes: bytes of shard state host memory may hold (``0``: no memory tier).
        accelerator_bytes: bytes of shard state accelerator memory may hold (``0``: no accelerator tier).
        chunk_elems, buffer_count, device_timeout_s: the local tiers' devices, as for
            :class:`~lightning_smartinf.csd.cpu.CpuBackend`.
        accelerator_device: the torch device of the accelerator tier (``"cuda"``: the current GPU).

    Device indices (:attr:`assignment`) are those of ``beside``, then memory, then the accelerator.
    """

    def __init__(
        self,
        beside: Backend,
        *,
        memory_bytes: int = 0,
        accelerator_bytes: int = 0,
        chunk_elems: int = 1 << 20,
        buffer_count: int = 16,
        device_timeout_s: float | None = 300.0,
        accelerator_device: torch.device | str = "cuda",
    ) -> None:
        super().__init__()
        for name, value in (("memory_bytes", memory_bytes), ("accelerator_bytes", accelerator_bytes)):
            if value < 0:
                raise ValueError(f"`{name}={value}` must be >= 0.")
        self.beside = beside
        #: The local tiers' backend, built by :meth:`open` when some shard lives here (``None`` until then).
        self.local: CpuBackend | None = None
        self.memory_bytes = memory_bytes
        self.accelerator_bytes = accelerator_bytes
        self._local_options = {
            "chunk_elems": chunk_elems,
            "buffer_count": buffer_count,
            "device_timeout_s": device_timeout_s,
            "accelerator_device": accelerator_device,
        }
        # Each shard's backend and its index there; the global indices of the local shards, in order.
        self._where: list[tuple[Backend, int]] = []
        self._local_shards: list[int] = []
        self._beside_shards: list[int] = []
        # Which backend issued each outstanding handle (their `result` differ: device timeouts, server deadlines).
        self._issuer: weakref.WeakKeyDictionary[Handle, Backend] = weakref.WeakKeyDictionary()

    # ---------------------------------------------------------------------------------------------- views

    @property
    def num_devices(self) -> int:
        return self.beside.num_devices + (self.local.num_devices if self.local is not None else 0)

    @property
    def supports_tentative(self) -> bool:
        return self.beside.supports_tentative

    @property
    def failure(self) -> BaseException | None:
        return self.beside.failure or (self.local.failure if self.local is not None else None)

    @property
    def local_shards(self) -> tuple[int, ...]:
        """The shards whose state lives on this host (memory or accelerator), in order."""
        return tuple(self._local_shards)

    @property
    def assignment(self) -> tuple[int, ...]:
        """The device of each shard: ``beside``'s devices first, then the memory and accelerator tiers here."""
        devices = self.beside.num_devices
        inner = getattr(self.beside, "assignment", None) or [i % devices for i in range(len(self._beside_shards))]
        offset = devices
        local = self.local.assignment if self.local is not None else ()
        return tuple(inner[j] if backend is self.beside else offset + local[j] for backend, j in self._where)

    def hands_off_early(self, shard: int) -> bool:
        backend, index = self._where[shard]
        return backend is self.beside and self.beside.hands_off_early(index)

    # ---------------------------------------------------------------------------------------------- set-up

    def open(self, shards: Sequence[ShardSpec]) -> None:
        if self._where:
            raise RuntimeError("`LocalTiers.open` was already called.")
        chunk = self._local_options["chunk_elems"]
        assert isinstance(chunk, int)
        tiered = Tiered((1.0,), 0, chunk)  # (sizes only)
        state = sum(tiered.state_bytes(spec) for spec in shards)
        devices = self.beside.num_devices
        share = int(memory_share(self.memory_bytes, max(0, state - self.accelerator_bytes), 1.0, devices))
        memory = max(1, share) if self.memory_bytes else 0  # (the tier exists, holding what fits)
        split = Tiered((1.0,), memory, chunk, self.accelerator_bytes).assign(
            shards, 1 + (memory > 0) + (self.accelerator_bytes > 0)
        )
        self._local_shards = [spec.index for spec, d in zip(shards, split) if d > 0]
        self._beside_shards = [spec.index for spec, d in zip(shards, split) if d == 0]
        if self._local_shards:
            self.local = CpuBackend(
                [],
                memory_bytes=self.memory_bytes,
                accelerator_bytes=self.accelerator_bytes,
                placement=Fixed(tuple(split[i] - 1 for i in self._local_shards)),
                **self._local_options,  # type: ignore[arg-type]
            )
            self.local.open([_renumbered(shards[i], j) for j, i in enumerate(self._local_shards)])
        self.beside.open([_renumbered(shards[i], j) for j, i in enumerate(self._beside_shards)])
        place = {i: (self.beside, j) for j, i in enumerate(self._beside_shards)}
        if self.local is not None:
            place.update({i: (self.local, j) for j, i in enumerate(self._local_shards)})
        self._where = [place[spec.index] for spec in shards]
        if self._local_shards:
            here = sum(tiered.state_bytes(shards[i]) for i in self._local_shards)
            log.info(
                "SmartUpdate keeps %d sub-group(s), %.1f MiB of state (%.0f%%), on this host beside %d server(s)",
                len(self._local_shards),
                here / 2**20,
                100 * here / max(state, 1),
                devices,
            )

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
        if tentative and backend is not self.beside:
            raise ValueError(f"Shard {shard} is in a memory tier, which takes no tentative update.")
        handle = backend.submit(index, grad, hp, out, link_dtype=link_dtype, tentative=tentative, ready=ready)
        return self._issued(backend, handle)

    def read_master(self, shard: int, out: Tensor) -> Handle:
        backend, index = self._where[shard]
        return self._issued(backend, backend.read_master(index, out))

    def result(self, handle: Handle) -> None:
        self._issuer.get(handle, self.beside).result(handle)

    def _split(self, shards: Iterable[int]) -> list[tuple[Backend, list[int]]]:
        """``shards`` grouped by backend, in each backend's numbering, in order."""
        grouped: dict[int, tuple[Backend, list[int]]] = {}
        for shard in shards:
            backend, index = self._where[shard]
            grouped.setdefault(id(backend), (backend, []))[1].append(index)
        return list(grouped.values())

    def commit(self, shards: Iterable[int]) -> None:
        for backend, indices in self._split(shards):
            backend.commit(indices)

    def rollback(self, shards: Iterable[int]) -> None:
        shards = list(shards)
        self.wait()
        for backend, indices in self._split(shards):
            backend.rollback(indices)

    def prefetch(self, shards: Sequence[int]) -> None:
        by_backend = {id(backend): indices for backend, indices in self._split(shards)}
        for backend in self._backends():
            backend.prefetch(by_backend.get(id(backend), []))

    def _backends(self) -> list[Backend]:
        return [self.beside] + ([self.local] if self.local is not None else [])

    def check_storage(self) -> None:
        for backend in self._backends():
            backend.check_storage()

    def wait(self) -> None:
        errors = []
        for backend in self._backends():
            try:
                backend.wait()
            except BaseException as exc:  # noqa: BLE001 - the first is raised below, once both are waited for
                errors.append(exc)
        if errors:
            raise errors[0]

    # ---------------------------------------------------------------------------------------------- checkpoints

    def save(self, directory: Path) -> None:
        """``beside``'s record of its shards, the local tiers' state under ``local/``, and the split."""
        directory = Path(directory)
        self.wait()
        self.beside.save(directory)
        if self.local is not None:
            self.local.save(directory / LOCAL_DIR)
        split = {"format": 1, "local": self._local_shards, "beside": self._beside_shards}
        write_file_atomic(directory / LOCAL_TIERS_MANIFEST, json.dumps(split).encode())

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
        self.beside.load(directory)
        if self.local is not None:
            self.local.load(directory / LOCAL_DIR)

    # ---------------------------------------------------------------------------------------------- release

    def close(self, *, keep_claims: bool = False) -> None:
        """Close both sides (see the backends' own ``close``); the first error is raised once both are closed."""
        errors = []
        for backend in self._backends():
            try:
                backend.close(keep_claims=keep_claims)  # type: ignore[call-arg]
            except BaseException as exc:  # noqa: BLE001 - raised below
                errors.append(exc)
        if errors:
            raise errors[0]

    def release_storage(self) -> None:
        for backend in self._backends():
            backend.release_storage()  # type: ignore[attr-defined]

    # ---------------------------------------------------------------------------------------------- telemetry

    def traffic_snapshot(self) -> TrafficSnapshot:
        """Both sides' counters, summed: the local tiers count ``memory_*`` and ``accelerator_*`` bytes."""
        total = self.beside.traffic_snapshot()
        return total + self.local.traffic_snapshot() if self.local is not None else total

    def stats(self, *, reset_peaks: bool = False) -> BackendStats:
        beside = self.beside.stats(reset_peaks=reset_peaks)
        if self.local is None:
            return beside
        local = self.local.stats(reset_peaks=reset_peaks)
        offset = self.beside.num_devices
        return BackendStats(
            traffic=beside.traffic + local.traffic,
            buffer_bytes=beside.buffer_bytes + local.buffer_bytes,
            devices=beside.devices + tuple(_shifted(d, offset) for d in local.devices),
            prefetch_used_bytes=beside.prefetch_used_bytes + local.prefetch_used_bytes,
            prefetch_dropped_bytes=beside.prefetch_dropped_bytes + local.prefetch_dropped_bytes,
        )


def saved_local_shards(directory: Path) -> list[int]:
    """The shards a checkpoint's local tiers held (none when it has no :data:`LOCAL_TIERS_MANIFEST`)."""
    path = Path(directory) / LOCAL_TIERS_MANIFEST
    if not path.is_file():
        return []
    local = read_json(path, "the local tiers' split", ("local", "beside"))["local"]
    if not isinstance(local, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in local):
        raise CheckpointError(f"{path} does not list the local tiers' shards as integers.")
    return local


def masters_beside(read_beside: Callable[[Path], list[Tensor]]) -> Callable[[Path], list[Tensor]]:
    """A reader of one rank's fp32 masters whose state a :class:`LocalTiers` saved: ``read_beside`` gives those of the
    backend beside (by its own numbering), the local tiers' come from ``local/``, CRC-checked."""

    def read(directory: Path) -> list[Tensor]:
        directory = Path(directory)
        local = saved_local_shards(directory)
        beside = read_beside(directory)
        if not local:
            return beside
        manifest = read_manifest(directory / LOCAL_DIR)
        here = [saved_shard_masters(directory / LOCAL_DIR, j, manifest=manifest) for j in range(len(local))]
        masters: list[Tensor | None] = [None] * (len(local) + len(beside))
        for index, master in zip(local, here):
            if not 0 <= index < len(masters):
                raise CheckpointError(f"{directory / LOCAL_TIERS_MANIFEST} names shard {index}, out of range.")
            masters[index] = master
        others = iter(beside)
        return [master if master is not None else next(others) for master in masters]

    return read


def _renumbered(spec: ShardSpec, index: int) -> ShardSpec:
    return ShardSpec(index=index, numel=spec.numel, rule=spec.rule)


def _shifted(device: DeviceStats, offset: int) -> DeviceStats:
    return dataclasses.replace(device, index=device.index + offset)
