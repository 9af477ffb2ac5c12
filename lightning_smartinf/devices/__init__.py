"""Device kinds: each package builds one kind of backend and registers it (:mod:`lightning_smartinf.core.registry`).

- ``cpu``: computational-storage devices emulated on host cores, one per storage path (the default);
- ``xrt``: Samsung SmartSSDs through XRT, running the kernels of ``hls_kernels/``;
- ``remote``: device servers on other machines (``smartinf serve``).

Importing this package registers the three; the kind modules import nothing heavy until a backend is built.
"""

from lightning_smartinf.devices.cpu import kind as cpu_kind
from lightning_smartinf.devices.remote import kind as remote_kind
from lightning_smartinf.devices.xrt import kind as xrt_kind

__all__ = ["cpu_kind", "remote_kind", "xrt_kind"]
