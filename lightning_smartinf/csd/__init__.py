"""Near-storage core: settings, the SmartUpdate controller, placement, backends and devices, update rules, on-disk
state layout and checkpoint format, traffic counters (``docs/architecture.md``).

Imports neither Lightning nor DeepSpeed, so it can be used and tested on its own.
"""

from lightning_smartinf.csd.backend import Backend, BackendStats, DeviceStats, Handle, ShardSpec
from lightning_smartinf.csd.cpu import CpuBackend
from lightning_smartinf.csd.rules import SGD, Adagrad, Adam, EFAdafactor, EFAdam, StepParams, UpdateRule
from lightning_smartinf.csd.storage import StorageError, validate_storage_path
from lightning_smartinf.csd.streaming import StreamingBackend, StreamingDevice
from lightning_smartinf.csd.traffic import COUNTERS, Traffic, TrafficSnapshot

__all__ = [
    "COUNTERS",
    "SGD",
    "Adagrad",
    "Adam",
    "Backend",
    "BackendStats",
    "CpuBackend",
    "DeviceStats",
    "EFAdafactor",
    "EFAdam",
    "Handle",
    "ShardSpec",
    "StepParams",
    "StorageError",
    "StreamingBackend",
    "StreamingDevice",
    "Traffic",
    "TrafficSnapshot",
    "UpdateRule",
    "validate_storage_path",
]
