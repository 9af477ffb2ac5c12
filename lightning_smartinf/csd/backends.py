"""The backends by name: ``settings.backend`` to a built :class:`~lightning_smartinf.csd.backend.Backend`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor

from lightning_smartinf.csd.backend import Backend
from lightning_smartinf.csd.io import IOEngine, ThreadedIO
from lightning_smartinf.csd.placement import RoundRobin, Tiered
from lightning_smartinf.csd.settings import SmartUpdateSettings

if TYPE_CHECKING:
    from lightning_smartinf.csd.remote.tokens import TlsFiles


def build_backend(
    settings: SmartUpdateSettings,
    device_dirs: Sequence[Path],
    *,
    owned_dirs: Sequence[Path] = (),
    io_factory: Callable[[], IOEngine] = ThreadedIO,
    xrt_devices: Sequence[int | str] | None = None,
    label: str = "rank000",
    device_weights: Sequence[float] | None = None,
    accelerator_training: bool = False,
) -> Backend:
    """The backend ``settings`` ask for, with one device per directory of ``device_dirs`` (claimed here).

    Args:
        settings: the SmartUpdate settings (backend, chunk and pool sizes, timeouts, overlap).
        device_dirs: this rank's device directories.
        owned_dirs: those of ``device_dirs`` the backend removes when it releases its storage (temporary ones).
        io_factory: the I/O engine of each emulated device (``backend='cpu'``; the xrt devices move state P2P).
        xrt_devices: ``backend='xrt'``: the XRT device of each directory; ``None`` pairs them by PCIe topology.
        label: ``backend='remote'``: this rank's name on the servers (its checkpoints are kept under it).
        device_weights: the relative speed of each of ``device_dirs`` (this rank's share of
            ``settings.device_weights``), or with ``backend='remote'`` of each server.
        accelerator_training: forward and backward run on an accelerator, leaving the host cores to the devices
            (``settings.state_memory_share="auto"`` measures the memory tier's share then).
    """
    if settings.backend == "remote":
        return _remote_backend(settings, label, device_weights)
    measured = {"fill": False, "measured": True}.get(settings.state_memory_share, accelerator_training or None)
    if settings.backend == "xrt":
        from lightning_smartinf.csd.xrt import XrtBackend

        return XrtBackend(
            device_dirs,
            xclbin=settings.xclbin,
            devices=xrt_devices,
            chunk_elems=settings.chunk_size,
            buffer_count=settings.buffer_count,
            owned_dirs=owned_dirs,
            prefetch_state=settings.prefetch_state,
            device_timeout_s=settings.device_timeout_s,
            memory_bytes=settings.state_memory_budget or 0,
            device_weights=device_weights,
            accelerator_bytes=settings.state_accelerator_budget or 0,
            measure_memory_share=measured,
        )
    from lightning_smartinf.csd.cpu import CpuBackend

    return CpuBackend(
        device_dirs,
        chunk_elems=settings.chunk_size,
        buffer_count=settings.buffer_count,
        owned_dirs=owned_dirs,
        io_factory=io_factory,
        io_threads=settings.io_threads,
        tentative_slots=settings.overlap,
        prefetch_state=settings.prefetch_state,
        device_timeout_s=settings.device_timeout_s,
        memory_bytes=settings.state_memory_budget or 0,
        device_weights=device_weights,
        accelerator_bytes=settings.state_accelerator_budget or 0,
        measure_memory_share=measured,
    )


def _remote_backend(settings: SmartUpdateSettings, label: str, device_weights: Sequence[float] | None) -> Backend:
    """``backend='remote'``: sessions on the servers, with this host's memory tiers beside them."""
    from lightning_smartinf.csd.local_tiers import LocalTiers
    from lightning_smartinf.csd.remote.client import RemoteBackend

    addresses, token, tls = _remote_access(settings)
    servers = RemoteBackend(
        addresses,
        token,
        label=label,
        chunk_elems=settings.chunk_size,
        buffer_count=settings.buffer_count,
        io_threads=settings.io_threads,
        tentative_slots=settings.overlap,
        prefetch_state=settings.prefetch_state,
        device_timeout_s=settings.device_timeout_s,
        placement=RoundRobin() if device_weights is None else Tiered(tuple(device_weights), 0, settings.chunk_size),
        tls=tls,
    )
    # Always wrapped, so that a checkpoint's split between this host and the servers is checked on resume.
    return LocalTiers(
        servers,
        memory_bytes=settings.state_memory_budget or 0,
        accelerator_bytes=settings.state_accelerator_budget or 0,
        chunk_elems=settings.chunk_size,
        buffer_count=settings.buffer_count,
        device_timeout_s=settings.device_timeout_s,
    )


def remote_checkpoint_masters(settings: SmartUpdateSettings) -> Callable[[Path], list[Tensor]] | None:
    """For ``backend='remote'``: a reader of the masters a checkpoint keeps on the servers of ``settings``."""
    if settings.backend != "remote":
        return None
    from lightning_smartinf.csd.local_tiers import masters_beside
    from lightning_smartinf.csd.remote.client import checkpoint_masters

    addresses, token, tls = _remote_access(settings)
    return masters_beside(checkpoint_masters(addresses, token, tls=tls, timeout=settings.device_timeout_s))


def _remote_access(settings: SmartUpdateSettings) -> tuple[tuple[str, ...], str, TlsFiles | None]:
    """The servers of ``backend='remote'``, the token, and the TLS files (``None``: plain gRPC)."""
    from lightning_smartinf.csd.remote.tokens import read_tls_dir, read_token

    assert settings.remote_devices is not None and settings.remote_token_file is not None
    tls = None if settings.remote_tls_dir is None else read_tls_dir(settings.remote_tls_dir)
    return settings.remote_devices, read_token(settings.remote_token_file), tls
