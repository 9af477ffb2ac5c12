"""Torch files read without running code: ``torch.load(weights_only=True)`` with the classes a caller allows."""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Iterable
from typing import Any

from lightning_smartinf.core.format.state_files import CheckpointError

__all__ = ["safe_torch_load"]

_UNSUPPORTED = re.compile(r"(Unsupported global: GLOBAL \S+|Unsupported operand \S+|[^\n]*not an allowed global[^\n]*)")


def safe_torch_load(
    path: str | os.PathLike, *, map_location: Any = "cpu", allowed: Iterable[Any] = (), mmap: bool = False
) -> Any:
    """``torch.load(path, weights_only=True)`` with ``allowed`` classes; a pickle that would run code is refused.

    ``mmap``: the tensors map the file instead of being read into memory (a page is read when touched).

    Refusal raises :class:`CheckpointError` naming the file and the object it would have had to build; the
    pickle's code never runs. A class of your own that you trust can be allowed with
    ``torch.serialization.add_safe_globals([...])``.
    """
    import torch

    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        found = _UNSUPPORTED.search(str(exc))
        what = found.group(1).strip() if found else str(exc).splitlines()[0]
        raise CheckpointError(
            f"{path} holds a pickled object that loading would have to run as code, so it is refused ({what}). "
            "Checkpoints are loaded with `torch.load(weights_only=True)` only. If this file is yours and the class "
            "it names is safe, allow it with `torch.serialization.add_safe_globals([TheClass])` before loading."
        ) from None
    except (RuntimeError, EOFError, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise CheckpointError(f"{path} is missing from the checkpoint.") from None
        raise CheckpointError(f"{path} cannot be read as a torch file ({str(exc).splitlines()[0]}).") from None
