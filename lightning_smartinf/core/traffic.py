"""Byte counters of the two data paths: the shared host link and the device-internal storage path."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class TrafficSnapshot:
    """Cumulative bytes at one instant.

    Attributes:
        link_write_bytes: host → device over the shared link (gradients, initial weights).
        link_read_bytes: device → host over the shared link (updated low-precision parameters).
        storage_read_bytes: storage → device compute, inside the device (master weights, states).
        storage_write_bytes: device compute → storage, inside the device.
        memory_read_bytes: host memory → update, for shards of the memory tier (no storage I/O).
        memory_write_bytes: update → host memory, for shards of the memory tier.
        accelerator_read_bytes: accelerator memory → update, for shards of the accelerator tier.
        accelerator_write_bytes: update → accelerator memory, for shards of the accelerator tier.
        param_read_bytes: storage → host, low-precision parameters fetched for forward and backward
            (``offload_parameters="storage"``; 0 otherwise).
        param_write_bytes: host → storage, updated low-precision parameters stored after each step.
    """

    link_write_bytes: int = 0
    link_read_bytes: int = 0
    storage_read_bytes: int = 0
    storage_write_bytes: int = 0
    memory_read_bytes: int = 0
    memory_write_bytes: int = 0
    param_read_bytes: int = 0
    param_write_bytes: int = 0
    accelerator_read_bytes: int = 0
    accelerator_write_bytes: int = 0

    def __add__(self, other: TrafficSnapshot) -> TrafficSnapshot:
        return TrafficSnapshot(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: TrafficSnapshot) -> TrafficSnapshot:
        return TrafficSnapshot(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: Counter names, also the suffixes of the logged metrics ``smartinf/<name>``.
COUNTERS = tuple(f.name for f in fields(TrafficSnapshot))


class Traffic:
    """Thread-safe cumulative byte counters; devices add, anyone reads a :class:`TrafficSnapshot`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)

    def add(self, **nbytes: int) -> None:
        with self._lock:
            for name, n in nbytes.items():
                self._counts[name] += n

    def snapshot(self) -> TrafficSnapshot:
        with self._lock:
            return TrafficSnapshot(**self._counts)
