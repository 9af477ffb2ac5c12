"""Activation offload to storage (after SSDTrain): saved activations go to files during forward and come back,
prefetched, during backward."""

from lightning_smartinf.activations.offload import ActivationOffloader, OffloadStats, cleanup_stale_dirs, find_layers

__all__ = ["ActivationOffloader", "OffloadStats", "cleanup_stale_dirs", "find_layers", "ActivationOffload"]


def __getattr__(name: str):  # the callback imports Lightning: load it only when asked for
    if name == "ActivationOffload":
        from lightning_smartinf.activations.callback import ActivationOffload

        return ActivationOffload
    raise AttributeError(name)
