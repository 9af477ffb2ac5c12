"""A full disk under the checkpoint callbacks users write: nothing the user asked to keep is deleted.

Each test trains on a real ext4 filesystem (a loop-mounted image of its own) and fills it at one moment, leaving room
for a given number of checkpoints. A save that needs more room may first remove only what ``ModelCheckpoint`` would
certainly delete right after it (its documented ``save_top_k``, ``monitor`` and ``save_last`` rules), and only while
another complete checkpoint stands; any other save is refused before anything is written, naming the space needed and
free. Each test asserts exactly which checkpoints remain, that each verifies, and that the run stopped or finished.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.models import LMModule, adamw_factory, fit
from lightning.pytorch.callbacks import ModelCheckpoint
from scripts.ckpt_common import EVERY, train

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.core import StorageError
from lightning_smartinf.core.format import checkpoint_folder
from lightning_smartinf.lightning.checkpoints import SAVE_MARGIN

#: The filesystem: room for the run's first checkpoints; the ballast then takes all but what a test leaves.
SIZE = "48m"
adamw = adamw_factory()


def checkpoint_bytes(folder: Path) -> int:
    """The bytes of the largest complete checkpoint in ``folder`` (links aside)."""
    sizes = [
        sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        for path in folder.iterdir()
        if path.is_dir() and not path.is_symlink()
    ]
    return max(sizes)


class FillAt(L.Callback):
    """At the start of step ``step`` (after the saves before it), fill the filesystem of ``folder`` but for ``room``
    checkpoints' worth of bytes, as another job writing beside the run would."""

    def __init__(self, folder: Path, step: int, room: float) -> None:
        self.folder, self.step, self.room = folder, step, room

    def on_train_batch_start(self, trainer, *_) -> None:  # noqa: ANN001
        if trainer.global_step != self.step:
            return
        leave = int(self.room * checkpoint_bytes(self.folder)) + SAVE_MARGIN  # what a save counts beyond its bytes
        free = shutil.disk_usage(self.folder).free
        with open(self.folder.parent / "ballast", "wb") as f:
            f.write(b"\0" * max(0, free - leave))


Shape = Callable[[Path], list[ModelCheckpoint]]

SHAPES: dict[str, tuple[Shape, int, float, type | None, list[str]]] = {
    # name: (callbacks, fill at step, room left in checkpoints, what the run raises, the checkpoints left)
    "keep-all-with-last": (
        lambda d: [ModelCheckpoint(dirpath=d, save_top_k=-1, every_n_train_steps=EVERY, save_last=True)],
        EVERY + 1,
        1.5,
        StorageError,  # the third save: nothing may go, every checkpoint is kept
        ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"],
    ),
    "keep-all-every-epoch": (  # what users write for one checkpoint per epoch, all kept
        lambda d: [ModelCheckpoint(dirpath=d, save_top_k=-1, every_n_epochs=1, save_last=True)],
        EVERY + 1,
        1.5,
        StorageError,
        ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"],
    ),
    "top-2-by-monitor": (  # the third save enters the top 2: the worst of the two goes first, the other stands
        lambda d: [
            ModelCheckpoint(dirpath=d, monitor="train_loss", save_top_k=2, every_n_train_steps=EVERY, filename="{step}")
        ],
        2 * EVERY + 1,
        0.5,
        None,
        ["step=12.ckpt", "step=8.ckpt"],
    ),
    "top-1-with-last-link": (  # `last.ckpt` is a link to the one top-1 checkpoint: removing it would leave none
        lambda d: [ModelCheckpoint(dirpath=d, save_last="link", every_n_train_steps=EVERY)],
        EVERY + 1,
        0.5,
        StorageError,
        ["epoch=0-step=4.ckpt", "last.ckpt"],
    ),
    "two-callbacks-one-folder": (  # all, by epoch; and the newest, by step: only the latter rotates
        lambda d: [
            ModelCheckpoint(dirpath=d, filename="{step}", save_top_k=-1, every_n_epochs=1),
            ModelCheckpoint(dirpath=d, every_n_train_steps=EVERY),
        ],
        EVERY + 1,
        1.5,
        StorageError,  # the rotating one's third save removed its second first; the keep-all one's third is refused
        ["epoch=2-step=12.ckpt", "step=4.ckpt", "step=8.ckpt"],
    ),
}


#: Shapes whose rule another shape of the main suite already runs: in the slow suite.
SLOW = {"keep-all-every-epoch", "top-1-with-last-link", "two-callbacks-one-folder"}


@pytest.mark.parametrize("shape", [pytest.param(name, marks=[pytest.mark.slow] * (name in SLOW)) for name in SHAPES])
def test_a_full_disk_deletes_no_checkpoint_the_user_kept(tmp_path, ext4_fs, shape) -> None:
    callbacks, step, room, raised, left = SHAPES[shape]
    fs = ext4_fs(SIZE)
    folder = fs / "ckpts"
    made = callbacks(folder)
    run = {
        "storage": [tmp_path / "ssd"],
        "checkpoint_callback": made[0],
        "callbacks": [*made[1:], FillAt(folder, step, room)],
    }
    if raised is None:
        train(fs, **run)
    else:
        with pytest.raises(
            raised, match=r"refused before writing anything: it needs [\d.]+ [KMG]iB .* has [\d.]+ [KMG]iB free"
        ):
            train(fs, **run)
    assert sorted(p.name for p in folder.iterdir()) == left
    for name in left:
        checkpoint_folder.verify(folder / name, checksum_shards=True)


class FillBeforeSave(L.Callback):
    """Fill the filesystem of ``folder`` completely just before save number ``save`` (counting from 1) of the run:
    with ``save_last=True`` both saves of a step run back to back, so the second can meet a disk the first did not."""

    def __init__(self, folder: Path, save: int) -> None:
        self.folder, self.save, self.saves = folder, save, 0

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:  # noqa: ANN001
        self.saves += 1
        if self.saves == self.save:
            fill(self.folder.parent / "ballast")


def fill(ballast: Path) -> None:
    """Write ``ballast`` until its filesystem takes no more (the reserve a root process may use included)."""
    with open(ballast, "ab", buffering=0) as f:
        for block in (1 << 16, 1 << 12, 1 << 10):  # down to ext4's smallest block
            try:
                while True:
                    f.write(b"\0" * block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise


def test_a_save_that_removing_the_obsolete_would_not_make_room_for_removes_nothing(tmp_path, ext4_fs) -> None:
    """`last.ckpt`'s save at step 8 meets a disk another job filled right after `epoch=1-step=8.ckpt` was written:
    removing the `last.ckpt` it replaces would not free enough, so it is kept and the save refused; every checkpoint
    stands (`fit(ckpt_path="last")` still finds one)."""
    fs = ext4_fs(SIZE)
    folder = fs / "ckpts"
    saves = ModelCheckpoint(dirpath=folder, save_top_k=-1, every_n_train_steps=EVERY, save_last=True)
    with pytest.raises(StorageError, match=r"Removing '.*last.ckpt'.* would free [\d.]+ [KMG]iB: not enough, so"):
        train(fs, storage=[tmp_path / "ssd"], checkpoint_callback=saves, callbacks=[FillBeforeSave(folder, 4)])
    left = ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    assert sorted(p.name for p in folder.iterdir()) == left
    for name in left:
        checkpoint_folder.verify(folder / name, checksum_shards=True)
    assert checkpoint_folder.verify(folder / "last.ckpt")["global_step"] == EVERY


def test_a_disk_filled_while_deepspeed_writes_is_a_storage_error(tmp_path, ext4_fs, monkeypatch) -> None:
    """torch.save reports a full disk as a `RuntimeError` without an errno; the save says what it is, removes what
    it staged and leaves the previous checkpoint."""
    fs = ext4_fs(SIZE)
    folder = fs / "ckpts"
    real = SmartInfinityStrategy._write_engine
    writes: list[Path] = []

    def fill_then_write(strategy, checkpoint, directory):  # noqa: ANN001, ANN202 - the method's own
        writes.append(directory)
        if len(writes) == 2:  # another job fills the disk between the check and DeepSpeed's writes
            fill(fs / "ballast")
        real(strategy, checkpoint, directory)

    monkeypatch.setattr(SmartInfinityStrategy, "_write_engine", fill_then_write)
    saves = ModelCheckpoint(dirpath=folder, save_top_k=-1, every_n_train_steps=EVERY)
    with pytest.raises(StorageError, match=r"'.*step=8.ckpt' failed: \[Errno 28\] No space left \(") as raised:
        train(fs, storage=[tmp_path / "ssd"], checkpoint_callback=saves)
    assert raised.value.errno == errno.ENOSPC and isinstance(raised.value.__cause__, RuntimeError)
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=4.ckpt"]  # nothing staged is left
    checkpoint_folder.verify(folder / "epoch=0-step=4.ckpt", checksum_shards=True)


def test_a_disk_filled_before_the_save_starts_is_a_storage_error(tmp_path, ext4_fs, monkeypatch) -> None:
    """Filled between the check and the staging directory, which cannot then be made: the same error, on every rank
    (rank 0 makes the directory and tells the others what happened, instead of leaving them waiting)."""
    from lightning_smartinf.lightning import checkpoints

    fs = ext4_fs(SIZE)
    folder = fs / "ckpts"
    real = checkpoints._make_room
    checks: list[Path] = []

    def room_then_full(strategy, target):  # noqa: ANN001, ANN202 - the check's own
        freed = real(strategy, target)
        checks.append(target)
        if len(checks) == 2:
            fill(fs / "ballast")
        return freed

    monkeypatch.setattr(checkpoints, "_make_room", room_then_full)
    saves = ModelCheckpoint(dirpath=folder, save_top_k=-1, every_n_train_steps=EVERY)
    with pytest.raises(
        StorageError, match=r"'.*step=8.ckpt' failed: \[Errno 28\] No space left on device: '"
    ) as raised:
        train(fs, storage=[tmp_path / "ssd"], checkpoint_callback=saves)
    assert raised.value.errno == errno.ENOSPC
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=4.ckpt"]


class WarningsBefore(L.Callback):
    """How many warnings of the run had been issued when step ``step`` started."""

    def __init__(self, caught: list, step: int) -> None:
        self.caught, self.step, self.seen = caught, step, None

    def on_train_batch_start(self, trainer, *_) -> None:  # noqa: ANN001
        if trainer.global_step == self.step:
            self.seen = [str(w.message) for w in self.caught if "checkpoint folder" in str(w.message)]


def test_a_disk_filling_during_training_is_noticed_before_the_save(tmp_path, ext4_fs) -> None:
    """Another job fills the checkpoint disk after the first save: the run warns once, at the next step, with the
    figures, steps before the save that will be refused."""
    import warnings

    fs = ext4_fs(SIZE)
    folder = fs / "ckpts"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before_save = WarningsBefore(caught, 2 * EVERY - 1)
        callbacks = [FillAt(folder, EVERY + 1, 0.5), before_save]
        saves = ModelCheckpoint(dirpath=folder, save_top_k=-1, every_n_train_steps=EVERY)
        with pytest.raises(StorageError, match="refused before writing anything"):
            train(fs, storage=[tmp_path / "ssd"], checkpoint_callback=saves, callbacks=callbacks)
    assert before_save.seen is not None and len(before_save.seen) == 1, before_save.seen
    assert f"{str(folder)!r} has " in before_save.seen[0] and "less than its next save needs" in before_save.seen[0]
    assert len([w for w in caught if "checkpoint folder" in str(w.message)]) == 1  # once, not at every step
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=4.ckpt"]


def fill_after(monkeypatch, owner: object, name: str, fs: Path, leave: Callable[[int], int]) -> list[int]:
    """Once ``owner.name`` (a check of free space whose second argument is the bytes needed) has passed, another job
    fills ``fs`` but for ``leave(needed)`` bytes: the writes the check let through meet a full disk. Returns the
    ``needed`` of each check."""
    real = getattr(owner, name)
    seen: list[int] = []

    def check_then_fill(directory, needed, *args, **kwargs):  # noqa: ANN001, ANN202 - the check's own
        real(directory, needed, *args, **kwargs)
        seen.append(needed)
        free = shutil.disk_usage(fs).free
        with open(fs / "ballast", "ab") as f:
            f.write(b"\0" * max(0, free - leave(needed)))

    monkeypatch.setattr(owner, name, check_then_fill)
    return seen


def state_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*.state"))


@pytest.mark.parametrize("overlap", [True, False], ids=["two-copies", "one-copy"])
def test_the_initial_state_meets_a_full_disk(tmp_path, ext4_fs, monkeypatch, overlap) -> None:
    """The disk fills between the check of free space and the state files' creation (a third of the bytes left):
    one error names the path, what was written, the bytes needed and free, and the fix; no state file is left; once
    the space is back, the same run trains."""
    from lightning_smartinf.core.streaming import backend

    fs = ext4_fs("16m")
    seen = fill_after(monkeypatch, backend, "check_free_space", fs, lambda needed: needed // 3)
    strategy = SmartInfinityStrategy(storage_paths=[fs / "ssd"], sub_group_size=3000, overlap_backward=overlap)
    copies = r" \(two copies with `overlap_backward`; `overlap_backward=False` needs half\)" if overlap else ""
    with pytest.raises(
        StorageError,
        match=rf"No space left on the filesystem of '{fs / 'ssd'}/smartinf/rank000' for the optimizer state "
        rf"files{copies}: it needs [\d.]+ [KM]iB and the filesystem has [\d.]+ [KM]iB free\. Something else filled "
        "it since the check before writing. Nothing was kept: free space and run again",
    ):
        fit(LMModule(adamw), strategy, steps=1)
    assert seen and state_files(fs) == []
    (fs / "ballast").unlink()
    monkeypatch.undo()
    _, params = fit(LMModule(adamw), SmartInfinityStrategy(storage_paths=[fs / "ssd"], sub_group_size=3000), steps=2)
    assert all(torch.isfinite(p).all() for p in params.values())


def test_the_parameter_files_meet_a_full_disk(tmp_path, ext4_fs, monkeypatch) -> None:
    """``offload_parameters="storage"``: the disk fills once the parameters' space was checked. DeepSpeed reports no
    failed write (it leaves short files a gather would read as the parameters): the strategy finds them before
    anything reads them, and says so once; the next run, with the space back, trains."""
    import lightning_smartinf.lightning.engine_setup as engine_setup

    fs = ext4_fs("128m")
    fill_after(monkeypatch, engine_setup, "check_param_space", fs, lambda _: 1 << 20)
    run = {"offload_parameters": "storage", "overlap_backward": False, "sub_group_size": 400_000}
    with pytest.raises(
        StorageError,
        match=r"No space left on the filesystem of .*/params/.* for the 16-bit parameters \(`offload_parameters="
        r"'storage'`; \d+ of their files are incomplete\): it needs .* free\. Free space on the first storage path",
    ):
        fit(LMModule(adamw, dim=512), SmartInfinityStrategy(storage_paths=[fs / "ssd"], **run), steps=1,
            precision="bf16-true")  # fmt: skip
    (fs / "ballast").unlink()
    monkeypatch.undo()
    _, params = fit(
        LMModule(adamw, dim=512), SmartInfinityStrategy(storage_paths=[fs / "ssd"], **run), steps=2,
        precision="bf16-true",
    )  # fmt: skip
    assert all(torch.isfinite(p).all() for p in params.values())


def test_the_token_cache_meets_a_full_disk(tmp_path, ext4_fs) -> None:
    """Tokenising a corpus into a cache on a nearly full disk: one error with the path, what and the fix; no partial
    entry a later run would read; with the space back, the cache is built and read."""
    from lightning_smartinf.hf import TextDataModule, train_bpe_tokenizer

    corpus = Path(__file__).parents[1] / "recipes" / "data" / "python_docs_train.jsonl"
    tokenizer = train_bpe_tokenizer([corpus], tmp_path / "tokenizer", vocab_size=1024)
    fs = ext4_fs("8m")
    cache_dir = fs / "cache"
    free = shutil.disk_usage(fs).free
    with open(fs / "ballast", "wb") as f:
        f.write(b"\0" * (free - (64 << 10)))  # 64 KiB left: the corpus makes about 200 KiB of tokens
    data = TextDataModule(str(corpus), tokenizer_path=tokenizer.name_or_path, block_size=32, cache_dir=str(cache_dir))
    with pytest.raises(
        StorageError,
        match=rf"No space left on the filesystem of '{cache_dir}' for the token cache of '{corpus}': it needs more "
        r"than [\d.]+ KiB and the filesystem has [\d.]+ KiB free\. Nothing was kept",
    ):
        data.setup("fit")
    assert list(cache_dir.iterdir()) == []
    (fs / "ballast").unlink()
    data = TextDataModule(str(corpus), tokenizer_path=tokenizer.name_or_path, block_size=32, cache_dir=str(cache_dir))
    data.setup("fit")
    assert len(data.train_data) > 0 and len(list(cache_dir.iterdir())) == 1


def test_a_resume_that_reshards_meets_a_full_disk(tmp_path, ext4_fs, monkeypatch, checkpoint_reference) -> None:
    """Resuming onto another sub-group size (the checkpoint's shards are re-sharded as they load) on a disk that
    fills once its space was checked: one error, the checkpoint untouched and whole; with the space back the same
    resume ends bit for bit with the run that never stopped."""
    from helpers.models import assert_identical

    from lightning_smartinf.core.streaming import backend

    root, expected = checkpoint_reference
    saved = root / "ckpts" / f"step={EVERY}.ckpt"
    fs = ext4_fs("16m")
    fill_after(monkeypatch, backend, "check_free_space", fs, lambda needed: needed // 2)
    resume = {"storage": [fs / "ssd"], "ckpt_path": saved, "every": None, "strategy_kwargs": {"sub_group_size": 7000}}
    with pytest.raises(StorageError, match=r"No space left on the filesystem of .* for the optimizer state files"):
        train(tmp_path / "full", **resume)
    assert state_files(fs) == []
    checkpoint_folder.verify(saved, checksum_shards=True)
    (fs / "ballast").unlink()
    monkeypatch.undo()
    assert_identical(train(tmp_path / "freed", **resume), expected)
