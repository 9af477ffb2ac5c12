"""Streaming backends: the backend's shard bookkeeping (``backend.py``), one device's worker and the host-core device
(``device.py``), and the chunk pipeline's parts (``pipeline.py``)."""
