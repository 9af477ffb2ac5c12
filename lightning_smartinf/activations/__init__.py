"""Activation offload to storage (after SSDTrain): saved activations go to files during forward and come back,
prefetched, during backward. The engine, free of Lightning; its Lightning callback is
:class:`lightning_smartinf.ActivationOffload`."""

from lightning_smartinf.activations.offload import ActivationOffloader, OffloadStats, cleanup_stale_dirs, find_layers

__all__ = ["ActivationOffloader", "OffloadStats", "cleanup_stale_dirs", "find_layers"]
