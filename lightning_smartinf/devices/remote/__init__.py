"""Remote device servers: the device workers of the ``cpu`` backend on another machine, reached over gRPC.

:mod:`~lightning_smartinf.devices.remote.server` runs next to the storage (``smartinf serve``);
:class:`~lightning_smartinf.devices.remote.client.RemoteBackend` is the trainer's side. What crosses the network is
defined in :mod:`~lightning_smartinf.devices.remote.wire`.
"""
