"""Near-storage core: settings, the SmartUpdate controller, placement, the backend contract and the streaming
backends, state tiers, update rules, on-disk formats, storage I/O, traffic counters (``docs/architecture.md``).

Imports neither Lightning, nor DeepSpeed, nor a device package (``lightning_smartinf.devices``), so it can be used and
tested on its own.
"""

from lightning_smartinf.core.backend import Backend, BackendStats, DeviceStats, Handle, ShardSpec
from lightning_smartinf.core.io.storage import StorageError, validate_storage_path
from lightning_smartinf.core.rules import SGD, Adagrad, Adam, EFAdafactor, EFAdam, StepParams, UpdateRule
from lightning_smartinf.core.streaming.backend import StreamingBackend
from lightning_smartinf.core.streaming.device import StreamingDevice
from lightning_smartinf.core.traffic import COUNTERS, Traffic, TrafficSnapshot

__all__ = [
    "COUNTERS",
    "SGD",
    "Adagrad",
    "Adam",
    "Backend",
    "BackendStats",
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
