"""What ``SmartInfinityStrategy``'s checkpoint hooks do, written on the strategy's public API.

A checkpoint is a directory (:mod:`lightning_smartinf.core.format.checkpoint_folder`): DeepSpeed's files with
Lightning's client state, and one device-state directory per rank (:mod:`lightning_smartinf.core.format.rank_state`),
sealed by rank 0.
Invariants: a save replaces the checkpoint at its name whole (every rank writes into one staging directory, rank 0
seals and swaps it in), and nothing is read from a checkpoint before it was verified against its seal; nothing in
it is unpickled beyond tensors and a few DeepSpeed data classes.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities import rank_zero_warn

from lightning_smartinf.core.format import checkpoint_folder
from lightning_smartinf.core.format.checkpoint_folder import CheckpointError
from lightning_smartinf.core.format.masters import MastersReader, saved_masters
from lightning_smartinf.core.format.rank_state import read_host_state
from lightning_smartinf.core.io.leftovers import remove_leftovers, temporary_path
from lightning_smartinf.core.io.storage import StorageError, disk_bytes, nearest_existing, readable_size
from lightning_smartinf.zero.safe_load import (
    ensure_offload_folder,
    load_deepspeed_file,
    model_states_for_new_ranks,
    safe_checkpoint_engine,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_smartinf.lightning.strategy import SmartInfinityStrategy


def save(
    strategy: SmartInfinityStrategy,
    checkpoint: dict[str, Any],
    filepath: str | os.PathLike,
    storage_options: Any | None,
    write_engine: Callable[[dict[str, Any], Path], None],
) -> None:
    """Save a checkpoint directory at ``filepath`` (all ranks), replacing any checkpoint there whole and atomically.

    Every rank writes its part (DeepSpeed's files and Lightning's client state, through ``write_engine(checkpoint,
    directory)``, then its device state) into one staging directory beside ``filepath``; rank 0 seals it (global
    step, every file's size and CRC-32) and swaps it in. A kill at any instant leaves the previous checkpoint or the
    new one at ``filepath``.

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
        refusal = StorageError(
            f"`save_checkpoint({str(filepath)!r})` refused: a device failed earlier, so the state on the devices may "
            "be torn, and a checkpoint of it would be worse than none. The last good checkpoint is as it was; resume "
            f"from it once the storage is fixed. The error was: {failure}",
            path=getattr(failure, "path", None),
            operation=getattr(failure, "operation", None),
            errno=getattr(failure, "errno", None),
        )
        module = strategy.lightning_module
        interrupted = module is not None and module.trainer.state.status == TrainerStatus.INTERRUPTED
        if interrupted and strategy.has_smart_update:
            # A save on the way out of the failed run, before teardown (`OnExceptionCheckpoint`): raising here would
            # keep Lightning from tearing the run down and releasing the devices; the run's own error follows.
            rank_zero_warn(str(refusal))
            return
        raise refusal
    if strategy.state_released:
        raise StorageError(
            f"`save_checkpoint({str(filepath)!r})` refused: this trainer's optimizer state was temporary (kept after "
            "`fit` in private directories, host memory or remote sessions) and was removed when a later run started "
            "in this process. Save before starting another run, or give `storage_paths` to keep the state on disk.",
            path=str(filepath),
            operation="save",
        )
    global_step = int(checkpoint["global_step"])
    target = Path(strategy.broadcast(os.path.abspath(filepath)))
    freed = _make_room(strategy, target)
    staging: str | None = None
    made: tuple[int, str, str] | None = None  # rank 0's error making the staging directory, for every rank
    if strategy.is_global_zero:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            staging_dir = temporary_path(target)
            staging_dir.mkdir(mode=0o700)
            staging = str(staging_dir)
        except OSError as exc:  # errno and all, as `OSError(errno, strerror, filename)` takes them
            made = (exc.errno or errno.EIO, exc.strerror or str(exc), exc.filename)
    staging, made = strategy.broadcast((staging, made))
    if made is not None:
        raise _failed(target, OSError(*made), freed)
    staging_dir = Path(staging)
    try:
        write_engine(checkpoint, staging_dir)
        smart_update.save(checkpoint_folder.rank_state_dir(staging_dir, strategy.global_rank), global_step=global_step)
        strategy.barrier("smartinf_save_checkpoint")
        if strategy.is_global_zero:
            checkpoint_folder.seal(staging_dir, global_step=global_step, world_size=strategy.world_size)
            checkpoint_folder.install(staging_dir, target)
    except BaseException as exc:
        error = exc
        if isinstance(exc, RuntimeError) and (free := _free_bytes(staging_dir)) < SAVE_MARGIN:
            # torch's writer reports a full disk without an errno ("unexpected pos 128 vs 0"): named for what it is
            error = OSError(errno.ENOSPC, f"No space left ({readable_size(free)} free; torch.save said: {exc}).")
        if strategy.is_global_zero:
            shutil.rmtree(staging_dir, ignore_errors=True)
        if isinstance(error, OSError):  # StorageError included: say which checkpoint, and what stands
            raise _failed(target, error, freed) from exc
        raise
    strategy.barrier("smartinf_checkpoint_installed")
    if (module := strategy.lightning_module) is not None:
        strategy.rotation.remember(module.trainer)


#: Room for DeepSpeed's files, the manifests, host states and seal beside the device state (under ZeRO-3 they hold
#: no parameters: kilobytes).
SAVE_MARGIN = 1 << 20


@dataclass(frozen=True)
class _Kept:
    """What one ``ModelCheckpoint`` keeps: its ``last`` checkpoint, its best, its top k (absolute paths)."""

    last: Path | None
    best: Path | None
    top_k: frozenset[Path]

    @classmethod
    def of(cls, callback: ModelCheckpoint) -> _Kept:
        top_k = frozenset(Path(os.path.abspath(path)) for path in callback.best_k_models)
        return cls(_absolute(callback.last_model_path), _absolute(callback.best_model_path), top_k)

    def paths(self) -> set[Path]:
        return {path for path in (self.last, self.best, *self.top_k) if path is not None}


class Rotation:
    """Which checkpoints ``ModelCheckpoint`` will certainly delete right after the save under way, judged from each
    callback's documented settings.

    After a save, and only inside its ``dirpath`` and never the checkpoint the run resumed from, ``ModelCheckpoint``
    deletes:

    - with ``save_top_k=1`` and no ``monitor``: the checkpoint it saved before, when the new one has another name;
    - with a ``monitor`` and ``save_top_k=k > 0``: the k-th best, when it keeps k already and the new one enters them;
    - with ``save_last``: the previous ``last`` checkpoint, when the new one has another name.

    ``save_top_k=-1`` deletes nothing, and a save no callback is making now (``trainer.save_checkpoint``) makes
    nothing obsolete. A rotating run needs room for one checkpoint more than it keeps; these are the only ones a
    save may remove before it, instead of after it, to make that room.
    """

    def __init__(self) -> None:
        self._before: dict[int, _Kept] = {}

    def remember(self, trainer: pl.Trainer) -> None:
        """Note what each checkpoint callback keeps now (at the start of training, after every save)."""
        self._before = {id(callback): _Kept.of(callback) for callback in _model_checkpoints(trainer)}

    def dropped(self, trainer: pl.Trainer, target: Path) -> list[Path]:
        """The checkpoints a callback will delete right after saving ``target`` (see the class), that exist, that no
        callback keeps otherwise, and other than the one the run resumed from."""
        target = Path(os.path.abspath(target))
        resumed = _absolute(trainer.ckpt_path)
        kept = kept_checkpoints(trainer)
        doomed: set[Path] = set()
        for callback in _model_checkpoints(trainer):
            before = self._before.get(id(callback))
            if before is None or not callback.dirpath:
                continue
            folder = Path(os.path.abspath(callback.dirpath))
            doomed |= {path for path in _deleted_after(callback, before, target) if folder in path.parents}
        return sorted(path for path in doomed if os.path.lexists(path) and path != resumed and path not in kept)


class RoomWatch:
    """Warns once per checkpoint folder, as soon as its free space falls below what the next save needs: a disk that
    fills while training goes on is noticed before it costs a checkpoint, not at the save."""

    def __init__(self) -> None:
        self._warned: set[Path] = set()

    def check(self, trainer: pl.Trainer, needed: int) -> None:
        """Compare each checkpoint callback's folder's free space with ``needed`` bytes (one save of every rank)."""
        for callback in _model_checkpoints(trainer):
            if not callback.dirpath or (callback.save_top_k == 0 and not callback.save_last):  # saves nothing
                continue
            folder = Path(os.path.abspath(callback.dirpath))
            if folder in self._warned or (free := _free_bytes(folder / "next")) >= needed:
                continue
            self._warned.add(folder)
            rank_zero_warn(
                f"The checkpoint folder {str(folder)!r} has {readable_size(free)} free, less than its next save needs "
                f"({readable_size(needed)}: the optimizer state of every rank, plus DeepSpeed's files). That save "
                "will be refused, unless the callback rotates and what it deletes right after the save frees enough. "
                "Free space there now, or save elsewhere."
            )


def _deleted_after(callback: ModelCheckpoint, before: _Kept, target: Path) -> set[Path]:
    """What ``callback`` deletes right after it saves ``target`` (nothing when the save is not its own)."""
    now = _Kept.of(callback)
    if callback.save_last and now.last == target:  # its `last` checkpoint
        return {before.last} if before.last not in (None, target) else set()
    if callback.monitor is None and callback.save_top_k == 1 and now.best == target:
        return {before.best} if before.best not in (None, target) else set()
    if callback.monitor is not None and callback.save_top_k > 0 and target in now.top_k:
        return set(before.top_k - now.top_k)  # the k-th best it let go for this one
    return set()


def _model_checkpoints(trainer: pl.Trainer) -> list[ModelCheckpoint]:
    return [callback for callback in trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint)]


def _absolute(path: str | os.PathLike | None) -> Path | None:
    return Path(os.path.abspath(path)) if path else None


def kept_checkpoints(trainer: pl.Trainer) -> set[Path]:
    """The checkpoints the trainer's ``ModelCheckpoint`` callbacks keep (top k, best, last), as absolute paths."""
    return {path for callback in _model_checkpoints(trainer) for path in _Kept.of(callback).paths()}


def _make_room(strategy: SmartInfinityStrategy, target: Path) -> list[Path]:
    """Refuse a save the checkpoint's filesystem has no room for, before any rank writes anything; returns the
    checkpoints removed first to make room.

    The device state of every rank goes into one staging directory beside ``target`` (so onto one filesystem), whole
    even where it is cloned (a clone's blocks become its own as soon as training rewrites the state). What killed
    saves left in the folder goes first. If that is not enough, the checkpoints this save makes obsolete (the one at
    ``target``, which it replaces, and those ``ModelCheckpoint`` deletes right after it) are removed before it, but
    only while another complete checkpoint the callbacks keep stands (a kill during the save then leaves that one),
    and only when their blocks would make room: a save refused for want of space otherwise removes nothing.
    """
    # On the rank's device: NCCL takes no host tensor (gloo does, so a CPU run cannot tell).
    mine = torch.tensor(
        [float(strategy.smart_update.backend.checkpoint_bytes())], dtype=torch.float64, device=strategy.root_device
    )
    needed = int(strategy.reduce(mine, reduce_op="sum").item()) + SAVE_MARGIN
    verdict: str | None = None
    freed: list[Path] = []
    if strategy.is_global_zero:
        try:
            verdict, freed = _make_room_on_rank_zero(strategy, target, needed)
        except OSError as exc:
            verdict = f"Saving checkpoint {str(target)!r} refused before writing anything: {exc}"
    verdict, freed = strategy.broadcast((verdict, [str(path) for path in freed]))
    if verdict is not None:
        raise StorageError(verdict, path=str(target), operation="save", errno=errno.ENOSPC)
    return [Path(path) for path in freed]


def _make_room_on_rank_zero(
    strategy: SmartInfinityStrategy, target: Path, needed: int
) -> tuple[str | None, list[Path]]:
    remove_leftovers(target.parent)
    if (free := _free_bytes(target)) >= needed:
        return None, []
    module = strategy.lightning_module
    obsolete: list[Path] = []
    standing: list[Path] = []
    if module is not None:
        trainer = module.trainer
        obsolete = strategy.rotation.dropped(trainer, target)
        if os.path.isdir(target) and not os.path.islink(target) and target not in obsolete:
            obsolete.append(target)
        gone = {path.resolve() for path in obsolete}
        standing = sorted(
            path
            for path in kept_checkpoints(trainer)
            if path != target and path.resolve() not in gone and checkpoint_folder.is_sealed(path)
        )
    reclaimable = sum(disk_bytes(path) for path in obsolete)
    why, removed = "", []
    if obsolete and standing and free + reclaimable >= needed:
        for path in obsolete:
            checkpoint_folder.retire(path)
        rank_zero_warn(
            f"Removed {_names(obsolete)} before saving checkpoint {str(target)!r} instead of after it, to make room "
            f"for it ({readable_size(needed)} needed, {readable_size(free)} free); {str(standing[0])!r} stands "
            "meanwhile."
        )
        if (free := _free_bytes(target)) >= needed:
            return None, obsolete
        why = (
            f" Removing {_names(obsolete)}, which this save makes obsolete, freed less than their size "
            "(blocks shared with other files, or the disk filled meanwhile): not enough. "
            f"{str(standing[0])!r} stands: resume from it (`fit(ckpt_path={str(standing[0])!r})`)."
        )
        removed = obsolete
    elif obsolete and not standing:
        why = (
            f" This save makes {_names(obsolete)} obsolete, but they were kept: no other complete checkpoint of this "
            "run would stand while it is written (keep one more: `ModelCheckpoint(save_last=True)` or a larger "
            "`save_top_k`)."
        )
    elif obsolete:
        why = (
            f" Removing {_names(obsolete)}, which this save makes obsolete, would free {readable_size(reclaimable)}: "
            "not enough, so they were kept."
        )
    untouched = "" if removed else " The previous checkpoint, if any, is untouched."
    return (
        f"Saving checkpoint {str(target)!r} refused before writing anything: it needs {readable_size(needed)} "
        f"(the optimizer state of every rank, even where it is cloned, plus DeepSpeed's files) and its "
        f"filesystem has {readable_size(free)} free.{why} Free space there (e.g. fewer checkpoints: "
        f"`ModelCheckpoint(save_top_k=...)`), or save elsewhere.{untouched}",
        removed,
    )


def _free_bytes(target: Path) -> int:
    """Free bytes where ``target`` would be written; raises where they cannot be known (a save then stops)."""
    return shutil.disk_usage(nearest_existing(target.parent)).free


def _failed(target: Path, error: OSError, freed: list[Path]) -> StorageError:
    """The error of a save that failed once it had started (``error``): which checkpoint, and what stands."""
    before = (
        f"the checkpoints {_names(freed)} were removed before the save to make room for it"
        if freed
        else "the previous checkpoint there, if any, is untouched"
    )
    return StorageError(
        f"Saving checkpoint {str(target)!r} failed: {error} Nothing was written at that name; {before}.",
        path=getattr(error, "path", None) or error.filename or str(target),
        operation=getattr(error, "operation", None) or "save",
        errno=error.errno,
    )


def _names(paths: list[Path]) -> str:
    return ", ".join(repr(str(path)) for path in paths)


def load(strategy: SmartInfinityStrategy, checkpoint_path: str | os.PathLike) -> dict[str, Any]:
    """Verify the checkpoint against its seal, then load it; returns Lightning's client state.

    ``fit`` restores DeepSpeed's and Lightning's state and every rank's device state; ``validate``, ``test`` and
    ``predict`` load the trained weights (the fp32 masters on the devices, cast to the model's dtypes).

    Raises:
        CheckpointError: the checkpoint is not as it was saved, or its parts come from different saves, or it holds
            state that cannot be re-sharded onto this run's layout; the message names the file or what differs.
    """
    root = Path(checkpoint_path).resolve()  # the path itself may be a link (`save_last="link"`); nothing inside
    module = strategy.lightning_module
    assert module is not None
    try:
        seal = checkpoint_folder.verify(root)
        model_states = root / checkpoint_folder.TAG / checkpoint_folder.MODEL_STATES
        if module.trainer.state.fn == "fit":
            client_state = _load_for_fit(strategy, root, seal)
        else:
            client_state = load_deepspeed_file(model_states)
            load_trained_weights(module, root, elsewhere=strategy.settings.checkpoint_masters())
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
    """DeepSpeed's state (the module's buffers; ZeRO's optimizer files are not read with the optimizer state on
    devices, so another number of ranks loads), then this rank's device state, re-sharded if the checkpoint's layout
    differs (its host state, the same on every saved rank, from rank 0's directory when this rank did not exist)."""
    saved_world = int(seal["world_size"])
    rank_dirs = [checkpoint_folder.rank_state_dir(root, r) for r in range(saved_world)]
    directory = rank_dirs[strategy.global_rank if strategy.global_rank < saved_world else 0]
    state = read_host_state(directory, global_step=seal["global_step"], sealed_by=root / checkpoint_folder.SEAL)
    engine = strategy.deepspeed_engine
    module = strategy.lightning_module
    assert module is not None
    ensure_offload_folder(engine, root, checkpoint_folder.TAG)
    with safe_checkpoint_engine(engine), model_states_for_new_ranks(engine):
        _, client_state = engine.load_checkpoint(
            str(root),
            tag=checkpoint_folder.TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
            load_module_strict=module.strict_loading,
        )
    if client_state is None:
        raise CheckpointError(f"{root} holds no DeepSpeed model states for this rank.")
    strategy.smart_update.restore(directory, state, rank_dirs=rank_dirs)
    return client_state


def load_trained_weights(module: pl.LightningModule, root: Path, elsewhere: MastersReader | None = None) -> None:
    """Put the checkpoint's fp32 masters (cast to each parameter's dtype) into ``module``, whose parameters are
    ZeRO-3 partitioned (the evaluation engine's). Parameters the devices never held (frozen ones) keep their values.
    ``elsewhere`` reads the masters of a checkpoint that kept them on its devices (remote servers).

    Invariant: the parameters are gathered (whole on every rank's device) a group at a time, a group never larger
    than the largest parameter (:func:`gather_groups`), and only rank 0 reads masters (``modifier_rank=0`` scatters
    its values): device and host memory grow by about one large parameter, whatever the model's size.
    """
    import deepspeed

    seal = checkpoint_folder.verify(root, checksum_shards=False)  # shard files: CRC-checked as their masters are read
    rank_dirs = [checkpoint_folder.rank_state_dir(root, r) for r in range(seal["world_size"])]
    weights = saved_masters(rank_dirs, elsewhere=elsewhere)
    params = dict(module.named_parameters())
    if unknown := sorted(set(weights.shapes) - set(params)):
        raise CheckpointError(
            f"{root} holds weights for {unknown[:5]}, which this module does not have. Evaluate it with the module "
            "it was trained with."
        )
    reads = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    sizes = {name: getattr(params[name], "ds_numel", params[name].numel()) for name in weights.shapes}
    for group in gather_groups(sizes):
        with deepspeed.zero.GatheredParameters([params[name] for name in group], modifier_rank=0), torch.no_grad():
            for name, value in weights.read(group) if reads else ():
                params[name].copy_(value.view(params[name].shape).to(params[name].dtype))


def gather_groups(sizes: dict[str, int]) -> list[list[str]]:
    """``sizes``' names (elements by name) in order, in consecutive groups of at most the largest one's elements: what
    a whole-model gather takes at a time (one large parameter, or several small ones together)."""
    bound = max(sizes.values(), default=0)
    groups: list[list[str]] = []
    total = 0
    for name, numel in sizes.items():
        if not groups or total + numel > bound:
            groups.append([])
            total = 0
        groups[-1].append(name)
        total += numel
    return groups
