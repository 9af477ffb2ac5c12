"""The ``xrt`` kind: Samsung SmartSSDs through XRT's ``pyxrt``, and a software model of ``pyxrt`` to test it.

``XrtBackend(..., xclbin=path)`` uses the real ``pyxrt`` (imported only then) for an ``.xclbin`` file and the
software model (:mod:`~lightning_smartinf.devices.xrt.software_xrt`, the C simulation of ``hls_kernels/`` through
ctypes) for a model manifest written by :func:`write_model_xclbin`. See ``docs/smartssd.md``. The names load on
first use, so that registering the kind imports nothing heavy.
"""

import importlib
from typing import Any

#: Public name -> the module of this package that defines it.
_PUBLIC = {
    "SMARTSSD_DDR_BYTES": "software_xrt",
    "PathCounters": "software_xrt",
    "SoftwarePyxrt": "software_xrt",
    "XrtBackend": "backend",
    "XrtDevice": "backend",
    "build_csim_library": "software_xrt",
    "check_xrt_settings": "backend",
    "csim_library_path": "software_xrt",
    "forget_platform": "software_xrt",
    "is_model_xclbin": "software_xrt",
    "load_pyxrt": "backend",
    "pair_by_pcie": "backend",
    "platform_for": "software_xrt",
    "write_model_xclbin": "software_xrt",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
