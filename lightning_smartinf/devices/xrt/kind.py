"""The ``xrt`` kind: Samsung SmartSSDs through XRT, updating with their FPGAs beside their SSDs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_smartinf.core.arguments import Problems
from lightning_smartinf.core.placement import rank_share
from lightning_smartinf.core.registry import BuildContext, DeviceKind, register
from lightning_smartinf.core.state_formats import FORMATS

if TYPE_CHECKING:
    from lightning_smartinf.core.backend import Backend
    from lightning_smartinf.core.settings import SmartUpdateSettings


class XrtKind(DeviceKind):
    """SmartSSDs: one per storage path, paired by PCIe topology unless ``xrt_devices`` names them; their FPGAs update
    the state they move P2P from their own SSD (no I/O engine of the host, no pools in host memory)."""

    name = "xrt"
    arguments = ("xclbin", "xrt_devices")
    devices_compute = True
    state_formats = FORMATS

    def check(self, problems: Problems, options: Mapping[str, Any], storage_paths: Sequence[Path] | None) -> Any:
        from lightning_smartinf.devices.xrt.backend import check_xrt_settings

        xclbin, xrt_devices = options.get("xclbin"), options.get("xrt_devices")
        try:
            xclbin = check_xrt_settings(xclbin, xrt_devices, storage_paths)
        except (ValueError, FileNotFoundError) as exc:
            problems.add(f"`backend='xrt'`: {exc}")
            return {}
        return {"xclbin": Path(xclbin), "xrt_devices": None if xrt_devices is None else tuple(xrt_devices)}

    def build(self, settings: SmartUpdateSettings, context: BuildContext) -> Backend:
        from lightning_smartinf.devices.xrt.backend import XrtBackend

        node = (context.local_rank, context.ranks_per_node)
        devices = rank_share(settings.option("xrt_devices") or (), *node) or None
        weights = rank_share(settings.device_weights or (), *node) or None
        return XrtBackend(
            context.device_dirs,
            xclbin=settings.option("xclbin"),
            devices=devices,
            chunk_elems=settings.chunk_size,
            buffer_count=settings.buffer_count,
            owned_dirs=context.owned_dirs,
            prefetch_state=settings.prefetch_state,
            device_timeout_s=settings.device_timeout_s,
            device_weights=weights,
        )


register(XrtKind())
