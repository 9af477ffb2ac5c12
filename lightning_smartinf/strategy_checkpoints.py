"""What ``SmartInfinityStrategy``'s checkpoint hooks do, written on the strategy's public API.

A checkpoint is a directory (:mod:`lightning_smartinf.checkpoint_folder`): DeepSpeed's files with Lightning's client
state, and one device-state directory per rank (:mod:`lightning_smartinf.core.format.rank_state`), sealed by rank 0.
Invariants: a save replaces the checkpoint at its name whole (every rank writes into one staging directory, rank 0
seals and swaps it in), and nothing is read from a checkpoint before it was verified against its seal; nothing in
it is unpickled beyond tensors and a few DeepSpeed data classes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities import rank_zero_warn

from lightning_smartinf import checkpoint_folder
from lightning_smartinf.checkpoint_folder import CheckpointError
from lightning_smartinf.core.format.masters import MastersReader, consolidate_masters, host_state
from lightning_smartinf.core.format.rank_state import read_host_state
from lightning_smartinf.core.io.storage import StorageError
from lightning_smartinf.zero.safe_load import ensure_offload_folder, load_deepspeed_file, safe_checkpoint_engine

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_smartinf.strategy import SmartInfinityStrategy


def save(
    strategy: SmartInfinityStrategy,
    checkpoint: dict[str, Any],
    filepath: str | os.PathLike,
    storage_options: Any | None = None,
) -> None:
    """Save a checkpoint directory at ``filepath`` (all ranks), replacing any checkpoint there whole and atomically.

    Every rank writes its part (DeepSpeed's files, Lightning's client state, its device state) into one staging
    directory beside ``filepath``; rank 0 seals it (global step, every file's size and CRC-32) and swaps it in. A
    kill at any instant leaves the previous checkpoint or the new one at ``filepath``.

    Raises:
        StorageError: a device failed earlier (the state may be torn), or writing failed; the previous checkpoint at
            ``filepath`` is untouched either way.
        TypeError: ``storage_options`` were given (Lightning's ``CheckpointIO`` options do not apply).
    """
    if storage_options is not None:
        raise TypeError(
            "`Trainer.save_checkpoint(..., storage_options=...)` is not supported by `SmartInfinityStrategy`: "
            "checkpoints are directories written by DeepSpeed and the devices. Drop `storage_options`."
        )
    smart_update = strategy.smart_update
    if (failure := smart_update.backend.failure) is not None:
        refusal = _refusal(failure, filepath)
        module = strategy.lightning_module
        interrupted = module is not None and module.trainer.state.status == TrainerStatus.INTERRUPTED
        if interrupted and strategy.has_smart_update:
            # A save on the way out of the failed run, before teardown (`OnExceptionCheckpoint`): raising here would
            # keep Lightning from tearing the run down and releasing the devices; the run's own error follows.
            rank_zero_warn(str(refusal))
            return
        raise refusal
    global_step = int(checkpoint["global_step"])
    target = Path(strategy.broadcast(os.path.abspath(filepath)))
    staging: str | None = None
    if strategy.is_global_zero:
        target.parent.mkdir(parents=True, exist_ok=True)
        checkpoint_folder.remove_leftovers(target.parent)
        staging_dir = checkpoint_folder.staging_path(target)
        staging_dir.mkdir(mode=0o700)
        staging = str(staging_dir)
    staging_dir = Path(strategy.broadcast(staging))
    try:
        strategy.save_engine_checkpoint(checkpoint, staging_dir)
        smart_update.save(checkpoint_folder.rank_state_dir(staging_dir, strategy.global_rank), global_step=global_step)
        strategy.barrier("smartinf_save_checkpoint")
        if strategy.is_global_zero:
            checkpoint_folder.seal(staging_dir, global_step=global_step, world_size=strategy.world_size)
            checkpoint_folder.install(staging_dir, target)
    except BaseException as exc:
        if strategy.is_global_zero:
            shutil.rmtree(staging_dir, ignore_errors=True)
        if isinstance(exc, OSError):  # StorageError included: say which checkpoint, and that the old one stands
            raise StorageError(
                f"Saving checkpoint {str(target)!r} failed: {exc} Nothing was written at that name; the previous "
                "checkpoint there, if any, is untouched.",
                path=getattr(exc, "path", None) or exc.filename,
                operation=getattr(exc, "operation", None) or "save",
                errno=exc.errno,
            ) from exc
        raise
    strategy.barrier("smartinf_checkpoint_installed")


def _refusal(failure: BaseException, filepath: str | os.PathLike) -> StorageError:
    return StorageError(
        f"`save_checkpoint({str(filepath)!r})` refused: a device failed earlier, so the state on the devices may be "
        "torn, and a checkpoint of it would be worse than none. The last good checkpoint is as it was; resume from it "
        f"once the storage is fixed. The error was: {failure}",
        path=getattr(failure, "path", None),
        operation=getattr(failure, "operation", None),
        errno=getattr(failure, "errno", None),
    )


def load(strategy: SmartInfinityStrategy, checkpoint_path: str | os.PathLike) -> dict[str, Any]:
    """Verify the checkpoint against its seal, then load it; returns Lightning's client state.

    ``fit`` restores DeepSpeed's and Lightning's state and every rank's device state; ``validate``, ``test`` and
    ``predict`` load the trained weights (the fp32 masters on the devices, cast to the model's dtypes).

    Raises:
        CheckpointError: the checkpoint is not as it was saved, comes from another number of ranks, or its parts
            come from different saves; the message names the file.
    """
    root = Path(checkpoint_path).resolve()  # the path itself may be a link (`save_last="link"`); nothing inside
    module = strategy.lightning_module
    assert module is not None
    try:
        seal = checkpoint_folder.verify(root)
        if seal["world_size"] != strategy.world_size:
            raise CheckpointError(
                f"{root / checkpoint_folder.SEAL} was saved by {seal['world_size']} ranks, this run has "
                f"{strategy.world_size}. Resume with the same number of ranks, or export the weights "
                "(`smartinf export`) and start a new run from them."
            )
        model_states = root / checkpoint_folder.TAG / checkpoint_folder.MODEL_STATES
        if module.trainer.state.fn == "fit":
            client_state = _load_for_fit(strategy, root, seal)
        else:
            client_state = load_deepspeed_file(model_states)
            load_trained_weights(module, root, remote=strategy.settings.kind.checkpoint_masters(strategy.settings))
        if client_state.get("global_step") != seal["global_step"]:
            raise CheckpointError(
                f"{model_states} holds global step {client_state.get('global_step')!r}, but "
                f"{root / checkpoint_folder.SEAL} records step {seal['global_step']}: the checkpoint's parts come "
                "from different saves. Resume from another checkpoint."
            )
    except CheckpointError:
        raise
    except ValueError as exc:  # the device state's own checks (manifest, sizes, CRC-32), named by file
        raise CheckpointError(str(exc)) from None
    return client_state


def _load_for_fit(strategy: SmartInfinityStrategy, root: Path, seal: dict[str, Any]) -> dict[str, Any]:
    directory = checkpoint_folder.rank_state_dir(root, strategy.global_rank)
    state = read_host_state(directory, global_step=seal["global_step"], sealed_by=root / checkpoint_folder.SEAL)
    engine = strategy.deepspeed_engine
    module = strategy.lightning_module
    assert module is not None
    ensure_offload_folder(engine, root, checkpoint_folder.TAG)
    with safe_checkpoint_engine(engine):
        _, client_state = engine.load_checkpoint(
            str(root),
            tag=checkpoint_folder.TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
            load_module_strict=module.strict_loading,
        )
    if client_state is None:
        raise CheckpointError(f"{root} holds no DeepSpeed model states for this rank.")
    strategy.smart_update.restore(directory, state)
    return client_state


def load_trained_weights(module: pl.LightningModule, root: Path, remote: MastersReader | None = None) -> None:
    """Put the checkpoint's fp32 masters (cast to each parameter's dtype) into ``module``, whose parameters are
    ZeRO-3 partitioned (the evaluation engine's). Parameters the devices never held (frozen ones) keep their values.
    ``remote`` reads masters the checkpoint keeps on remote device servers.
    """
    import deepspeed

    checkpoint_folder.verify(root, checksum_shards=False)  # shard files: CRC-checked as their masters are read
    size = int(host_state(checkpoint_folder.rank_state_dir(root, 0))["world_size"])
    weights = consolidate_masters([checkpoint_folder.rank_state_dir(root, r) for r in range(size)], elsewhere=remote)
    params = dict(module.named_parameters())
    if unknown := sorted(set(weights) - set(params)):
        raise CheckpointError(
            f"{root} holds weights for {unknown[:5]}, which this module does not have. Evaluate it with the module "
            "it was trained with."
        )
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0), torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value.view(params[name].shape).to(params[name].dtype))
