"""A full disk under the checkpoint callbacks users write: nothing the user asked to keep is deleted.

Each test trains on a real ext4 filesystem (a loop-mounted image of its own) and fills it at one moment, leaving room
for a given number of checkpoints. A save that needs more room may first remove only what ``ModelCheckpoint`` would
certainly delete right after it (its documented ``save_top_k``, ``monitor`` and ``save_last`` rules), and only while
another complete checkpoint stands; any other save is refused before anything is written, naming the space needed and
free. Each test asserts exactly which checkpoints remain, that each verifies, and that the run stopped or finished.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from scripts.ckpt_common import EVERY, train

from lightning_smartinf import checkpoint_folder
from lightning_smartinf.core import StorageError
from lightning_smartinf.strategy_checkpoints import SAVE_MARGIN

#: The filesystem: room for the run's first checkpoints; the ballast then takes all but what a test leaves.
SIZE = "48m"


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
