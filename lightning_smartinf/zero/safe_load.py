"""DeepSpeed's checkpoint loading without unpickling code: its ``torch.load(weights_only=False)`` replaced.

``engine.load_checkpoint`` reads every file through ``engine.checkpoint_engine.load``, whose torch engine calls
``torch.load(..., weights_only=False)``. :func:`safe_checkpoint_engine` swaps in an engine that reads with
``weights_only=True`` for the duration of one load; the few DeepSpeed classes its own files hold (plain data:
the ZeRO stage enum and loss scalers) are the only globals allowed beyond torch's defaults.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_smartinf.checkpoint_dir import safe_torch_load


def deepspeed_globals() -> list[type]:
    """Classes DeepSpeed pickles into its checkpoint files that carry data only (no ``__reduce__`` of their own)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [ZeroStageEnum, LossScaler, DynamicLossScaler]


def load_deepspeed_file(path: str | Path, map_location: Any = "cpu") -> Any:
    """One DeepSpeed checkpoint file, read with ``weights_only=True`` (see :func:`safe_torch_load`)."""
    return safe_torch_load(path, map_location=map_location, allowed=deepspeed_globals())


@contextlib.contextmanager
def safe_checkpoint_engine(engine: Any) -> Iterator[None]:
    """Make ``engine.load_checkpoint`` read its files with :func:`load_deepspeed_file` inside this block."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    original = engine.checkpoint_engine
    if not isinstance(original, TorchCheckpointEngine):
        raise RuntimeError(
            f"DeepSpeed's checkpoint engine is `{type(original).__name__}`; SmartUpdate loads checkpoints through "
            "`TorchCheckpointEngine` only. Remove the `checkpoint` engine settings from the DeepSpeed config."
        )

    class _WeightsOnly(type(original)):  # type: ignore[misc]
        def load(self, path: str, map_location: Any = None) -> Any:
            return load_deepspeed_file(path, map_location)

    safe = object.__new__(_WeightsOnly)
    safe.__dict__.update(original.__dict__)
    engine.checkpoint_engine = safe
    try:
        yield
    finally:
        engine.checkpoint_engine = original
