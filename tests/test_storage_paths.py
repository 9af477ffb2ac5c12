"""`storage_paths` that do not exist yet: checked at construction, created (0700) by the rank using them at set-up."""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path

import pytest
from helpers.models import LMModule, adamw_factory, fit
from helpers.unwritable import unwritable_dir
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.core import StorageError
from lightning_smartinf.core.io.storage import create_storage_path, validate_storage_path

adamw = adamw_factory(lr=1e-3)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_missing_paths_are_created_private_at_setup_and_training_runs(tmp_path, caplog):
    storage = [tmp_path / "nvme0", tmp_path / "nvme1"]
    strategy = SmartInfinityStrategy(storage_paths=storage, sub_group_size=2000, io_engine="threads")
    assert not any(p.exists() for p in storage), "construction only checks; it creates nothing"

    caplog.set_level(logging.INFO, logger="lightning_smartinf.core.placement")
    trainer, _ = fit(LMModule(adamw), strategy, steps=2)

    assert trainer.strategy.traffic.link_read_bytes > 0
    for path in storage:
        assert path.is_dir() and mode_of(path) == 0o700
        assert any((path / "smartinf" / "rank000").iterdir()), "the device's state lives there"
        created = [
            r for r in caplog.records if str(path) in r.getMessage() and "created storage path" in r.getMessage()
        ]
        assert len(created) == 1 and created[0].levelno == logging.INFO


def test_existing_directory_is_used_as_it_is(tmp_path):
    existing = tmp_path / "shared"
    existing.mkdir(mode=0o755)
    os.chmod(existing, 0o755)
    assert validate_storage_path(existing, missing_ok=True) == existing.resolve()
    assert create_storage_path(existing) is False
    assert mode_of(existing) == 0o755, "the user's own directory keeps its mode"


def test_missing_path_is_accepted_only_with_missing_ok(tmp_path):
    with pytest.raises(ValueError, match="does not exist. Create the directory"):
        validate_storage_path(tmp_path / "new")
    assert validate_storage_path(tmp_path / "new", missing_ok=True) == (tmp_path / "new").resolve()
    assert not (tmp_path / "new").exists()


def test_link_to_a_missing_directory_creates_its_target(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "target")
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path / "link"])
    assert strategy.settings.storage_paths == ((tmp_path / "target").resolve(),)
    assert create_storage_path(strategy.settings.storage_paths[0]) is True
    assert (tmp_path / "link").is_dir() and mode_of(tmp_path / "target") == 0o700


def _file(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("x")
    return tmp_path / "file"


def _loop(tmp_path: Path) -> Path:
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    return tmp_path / "loop_a"


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda t: t / "absent" / "ssd", r"does not exist and cannot be created: its parent .*absent' does not exist"),
        (lambda t: t / "absent" / "deeper" / "ssd", r"cannot be created: its parent .*deeper' does not exist"),
        (lambda t: _file(t) / "ssd", r"cannot be created: its parent .*file' is a file, not a directory"),
        (lambda t: _file(t) / "sub" / "ssd", r"cannot be created: .*file' is a file, not a directory"),
        (_file, r"is not a directory"),
        (_loop, r"goes through a symbolic link loop"),
        (lambda t: _loop(t) / "ssd", r"goes through a symbolic link loop"),
    ],
    ids=[
        "parent-missing",
        "ancestors-missing",
        "under-a-file",
        "under-a-file-deeper",
        "a-file",
        "link-loop",
        "in-loop",
    ],
)
def test_uncreatable_paths_are_refused_by_name_at_construction(tmp_path, make, why):
    path = make(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(MisconfigurationException, match=why) as info:
        SmartInfinityStrategy(storage_paths=[tmp_path, path])
    assert f"`storage_paths` entry {str(path)!r}" in str(info.value)
    assert sorted(tmp_path.rglob("*")) == before, "refusing creates nothing"


def test_path_under_a_parent_that_is_not_writable_is_refused(tmp_path):
    parent = tmp_path / "parent"
    with unwritable_dir(parent) as read_only:
        why = r"its parent .*parent' is " + ("on a read-only filesystem" if read_only else "not writable by this user")
        with pytest.raises(MisconfigurationException, match=why):
            SmartInfinityStrategy(storage_paths=[parent / "ssd"])
        with pytest.raises(StorageError, match=r"Cannot create storage path .*ssd'"):
            create_storage_path(parent / "ssd")  # what set-up says if the parent changed after construction


def test_something_in_the_way_at_setup_is_refused(tmp_path):
    """Accepted at construction, then a file took the name before set-up: set-up refuses, naming it."""
    path = tmp_path / "ssd"
    validate_storage_path(path, missing_ok=True)
    path.write_text("x")
    with pytest.raises(StorageError, match=r"'.*ssd' exists but is not a directory"):
        create_storage_path(path)
    path.unlink()
    path.symlink_to(tmp_path / "nowhere" / "ssd")  # a broken link
    with pytest.raises(StorageError, match=r"'.*ssd' exists but is not a directory .*broken symbolic link"):
        create_storage_path(path)


def test_ranks_creating_one_path_at_once_all_succeed(tmp_path):
    """Nodes sharing a filesystem may create the same path together: exactly one creates it, none fails."""
    path = tmp_path / "shared"
    start = threading.Barrier(8)
    results: list[bool] = []

    def create() -> None:
        start.wait()
        results.append(create_storage_path(path))

    threads = [threading.Thread(target=create) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 7 + [True]
    assert mode_of(path) == 0o700
