"""Activation offload to storage (after SSDTrain): saved activations go to files during forward and come back,
prefetched, during backward. The engine, free of Lightning; its Lightning callback is
:class:`lightning_smartinf.ActivationOffload`."""

from lightning_smartinf.activations.offload import OffloadStats, SavedTensorOffloader, cleanup_stale_dirs, find_layers
from lightning_smartinf.core.renamed import old_names

__all__ = ["SavedTensorOffloader", "OffloadStats", "cleanup_stale_dirs", "find_layers"]


#: Renamed; the old name still resolves, with a ``DeprecationWarning``.
__getattr__ = old_names(__name__, {"ActivationOffloader": "SavedTensorOffloader"})
