"""DeepSpeed's checkpoint loading without unpickling code: its ``torch.load(weights_only=False)`` replaced.

``engine.load_checkpoint`` reads every file through ``engine.checkpoint_engine.load``, whose torch engine calls
``torch.load(..., weights_only=False)``. :func:`safe_checkpoint_engine` swaps in an engine that reads with
``weights_only=True`` for the duration of one load; the few DeepSpeed classes its own files hold (plain data:
the ZeRO stage enum and loss scalers) are the only globals allowed beyond torch's defaults.
"""

from __future__ import annotations

import contextlib
import glob
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_smartinf.core.format.torch_files import safe_torch_load


def load_deepspeed_file(path: str | Path, map_location: Any = "cpu", *, mmap: bool = False) -> Any:
    """One DeepSpeed checkpoint file, read with ``weights_only=True`` (see :func:`safe_torch_load`); ``mmap``: its
    tensors map the file. Allowed beyond torch's defaults: the classes DeepSpeed pickles into its checkpoint files
    that carry data only (no ``__reduce__`` of their own)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    allowed = [ZeroStageEnum, LossScaler, DynamicLossScaler]
    return safe_torch_load(path, map_location=map_location, allowed=allowed, mmap=mmap)


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


@contextlib.contextmanager
def model_states_for_new_ranks(engine: Any) -> Iterator[None]:
    """Inside this block, a rank the checkpoint was not saved with (more ranks than it had) loads the module states
    of rank 0 (``zero_pp_rank_0_mp_rank_00_model_states.pt``).

    Under ZeRO-3 each rank saves its own copy of the module states: the replicated buffers and Lightning's client
    state, the same on every rank (the parameters live in the device state). DeepSpeed looks for this rank's file
    only, so a rank added since the save would find none.
    """
    original = engine._get_all_ckpt_names

    def names(checkpoints_path: str, tag: str) -> list[str]:
        found = original(checkpoints_path, tag)
        if found:
            return found
        pattern = engine._get_ckpt_name(checkpoints_path, tag, mp_placeholder="*", pp_placeholder="0")
        return sorted(glob.glob(pattern))

    engine._get_all_ckpt_names = names
    try:
        yield
    finally:
        del engine._get_all_ckpt_names


def ensure_offload_folder(engine: Any, root: Path, tag: str) -> None:
    """Recreate ``<root>/<tag>/offloaded_tensors/rankNN`` when a copy of the checkpoint dropped it.

    DeepSpeed saves the (always empty) NVMe swap folder of the SmartUpdate optimizer there, and copies it back when it
    loads, failing if it is gone. Git, object stores (``aws s3 sync``) and some sync tools do not keep empty folders,
    so a checkpoint copied with them lacks it. Nothing else is written; the seal lists files only.

    Raises:
        CheckpointError: the folder is missing and cannot be created (a read-only copy of the checkpoint).
    """
    from lightning_smartinf.core.format.state_files import CheckpointError

    rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
    folder = root / tag / "offloaded_tensors" / f"rank{rank:0>2d}"
    if folder.is_dir():
        return
    try:
        folder.mkdir(parents=True, mode=0o700)
    except OSError as exc:
        raise CheckpointError(
            f"{folder} is missing (an empty folder of the checkpoint, which some copy tools drop) and cannot be "
            f"created ({exc.strerror}). Copy the checkpoint to a writable place, or create that empty folder."
        ) from None
