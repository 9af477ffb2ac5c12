"""The ``cpu`` kind: computational-storage devices emulated on host cores, one per storage path."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_smartinf.devices.cpu.backend import CpuBackend

__all__ = ["CpuBackend"]


def __getattr__(name: str) -> Any:
    if name == "CpuBackend":  # loaded on first use: registering the kind imports nothing heavy
        from lightning_smartinf.devices.cpu.backend import CpuBackend

        return CpuBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
