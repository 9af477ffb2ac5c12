"""Flat buffers the host keeps across steps (the error-feedback residual), in memory or paged out to storage.

A :class:`HostBuffer` is what ``Partitions.host_buffer`` gives the controller. Where the parameters live on storage,
the engine backs it with a file on the storage path (``zero/param_storage.py: FileBuffer``), whose pages leave the
process when :meth:`HostBuffer.release` is called, so host memory does not grow with the model.

Invariant: :meth:`HostBuffer.release` never changes a value; a released element reads back as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

__all__ = ["HostBuffer", "InMemoryBuffer"]


class HostBuffer(Protocol):
    """A flat buffer kept across steps, zeroed when made."""

    @property
    def tensor(self) -> Tensor:
        """The buffer's elements."""

    def release(self, start: int = 0, end: int | None = None) -> None:
        """Elements ``[start, end)`` (default: all) are not needed again soon: their memory may leave this process."""


@dataclass(frozen=True)
class InMemoryBuffer:
    """A :class:`HostBuffer` in memory: its pages stay."""

    tensor: Tensor

    def release(self, start: int = 0, end: int | None = None) -> None:
        """Nothing to release: the buffer is this memory."""
