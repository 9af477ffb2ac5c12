"""The ``xrt`` backend: Samsung SmartSSDs through XRT's ``pyxrt``, and a software model of ``pyxrt`` to test it.

``XrtBackend(..., xclbin=path)`` uses the real ``pyxrt`` (imported only then) for an ``.xclbin`` file and the
software model (:mod:`lightning_smartinf.csd.xrt.model`, the C simulation of ``hls_kernels/`` through ctypes) for
a model manifest written by :func:`write_model_xclbin`. See ``docs/smartssd.md``.
"""

from lightning_smartinf.csd.xrt.backend import XrtBackend, XrtDevice, check_xrt_settings, load_pyxrt, pair_by_pcie
from lightning_smartinf.csd.xrt.model import (
    SMARTSSD_DDR_BYTES,
    PathCounters,
    SoftwarePyxrt,
    build_csim_library,
    csim_library_path,
    forget_platform,
    is_model_xclbin,
    platform_for,
    write_model_xclbin,
)

__all__ = [
    "SMARTSSD_DDR_BYTES",
    "PathCounters",
    "SoftwarePyxrt",
    "XrtBackend",
    "XrtDevice",
    "build_csim_library",
    "check_xrt_settings",
    "csim_library_path",
    "forget_platform",
    "is_model_xclbin",
    "load_pyxrt",
    "pair_by_pcie",
    "platform_for",
    "write_model_xclbin",
]
