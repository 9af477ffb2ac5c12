"""One naming scheme and one liveness rule for every temporary the package builds beside its final place."""

from __future__ import annotations

import os
import socket

import pytest
from helpers.leftovers import dead_pid, left_over

from lightning_smartinf.core.io.leftovers import _start_ticks, is_left_over, remove_leftovers, temporary_path


def test_a_temporary_is_a_hidden_sibling_naming_its_target_host_and_process(tmp_path):
    first, second = temporary_path(tmp_path / "ckpt"), temporary_path(tmp_path / "ckpt")
    assert first != second and first.parent == tmp_path and not first.exists()
    assert first.name.startswith(f".ckpt.tmp-{socket.gethostname()}-{os.getpid()}.{_start_ticks(os.getpid())}-")
    assert temporary_path(tmp_path / "ckpt", "old").name.startswith(".ckpt.old-")
    with pytest.raises(ValueError, match=r"`purpose='scratch'` is not one of \('tmp', 'old', 'aside', 'run'\)"):
        temporary_path(tmp_path / "ckpt", "scratch")


def test_only_a_gone_process_of_this_host_leaves_leftovers(tmp_path):
    assert not is_left_over(temporary_path(tmp_path / "a").name)  # this process
    assert not is_left_over(left_over(tmp_path / "a", pid=os.getppid()).name)  # a live one
    assert is_left_over(left_over(tmp_path / "a").name)  # gone
    assert not is_left_over(left_over(tmp_path / "a", host="other-host.example").name)  # cannot tell: kept
    assert not is_left_over(".a.tmp-host-12-zz")  # not our scheme
    assert not is_left_over("a")


def test_a_process_that_took_a_dead_ones_pid_does_not_keep_its_leftovers(tmp_path):
    """A restarted container's entrypoint is pid 1 again: what its killed predecessor left is still a leftover, told
    apart by the tick the process started at."""
    mine = os.getpid()
    assert not is_left_over(left_over(tmp_path / "a", pid=mine).name)  # this very process
    predecessor = left_over(tmp_path / "a", pid=mine, start=_start_ticks(mine) - 1)
    assert is_left_over(predecessor.name)
    predecessor.mkdir()
    assert remove_leftovers(tmp_path) == [predecessor]
    # Names without the start tick (written by earlier versions) are told by the pid alone.
    host = socket.gethostname()
    assert not is_left_over(f".a.tmp-{host}-{mine}-0123abcd")
    assert is_left_over(f".a.tmp-{host}-{dead_pid()}-0123abcd")


def test_an_entry_set_aside_by_a_killed_replacement_is_put_back_where_its_name_is_empty(tmp_path):
    """Without `renameat2(RENAME_EXCHANGE)` a replacement renames the old entry aside, then the new one in: killed in
    between, the aside entry is the only copy of what stood at the name, and the next clean-up puts it back."""
    dead = dead_pid()
    only_copy = left_over(tmp_path / "last.ckpt", "aside", pid=dead)
    only_copy.mkdir()
    (only_copy / "state").write_text("step 4")
    staged = left_over(tmp_path / "last.ckpt", pid=dead)  # the new one, never moved in
    staged.mkdir()
    replaced = left_over(tmp_path / "top.ckpt", "aside", pid=dead)  # its replacement did move in
    replaced.mkdir()
    (tmp_path / "top.ckpt").mkdir()
    deleting = left_over(tmp_path / "old.ckpt", "old", pid=dead)  # being deleted (half gone): never put back
    deleting.mkdir()

    assert sorted(remove_leftovers(tmp_path)) == sorted([staged, replaced, deleting])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "top.ckpt"]
    assert (tmp_path / "last.ckpt" / "state").read_text() == "step 4"


def test_remove_leftovers_removes_what_dead_processes_left_and_nothing_else(tmp_path):
    dead = dead_pid()
    tree = left_over(tmp_path / "ckpt", pid=dead)
    tree.mkdir()
    (tree / "shard").write_bytes(b"half")
    file = left_over(tmp_path / "last.ckpt", "old", pid=dead)
    file.write_bytes(b"x")
    elsewhere = tmp_path.parent / f"{tmp_path.name}-outside"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    link = left_over(tmp_path / "linked", pid=dead)
    link.symlink_to(elsewhere)
    live = temporary_path(tmp_path / "ckpt")
    live.mkdir()
    other_host = left_over(tmp_path / "ckpt", pid=dead, host="other-host")
    other_host.mkdir()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / ".ckpt.tmp-notours").mkdir()

    assert remove_leftovers(tmp_path, "last.ckpt") == [file]  # only the temporaries of that name
    assert sorted(remove_leftovers(tmp_path)) == sorted([tree, link])
    assert not tree.exists() and not os.path.lexists(link) and (elsewhere / "keep").exists()
    assert live.exists() and other_host.exists() and (tmp_path / "ckpt").exists()
    assert (tmp_path / ".ckpt.tmp-notours").exists()
    assert remove_leftovers(tmp_path / "missing") == []


def test_a_scratch_directory_is_private_gone_on_leaving_and_its_killed_twin_is_a_leftover(tmp_path):
    from lightning_smartinf.core.io.leftovers import scratch_directory

    with scratch_directory("smartinf-upload", tmp_path) as scratch:
        assert scratch.parent == tmp_path and scratch.name.startswith(".smartinf-upload.run-")
        assert scratch.stat().st_mode & 0o777 == 0o700
        (scratch / "0").write_bytes(b"state")
    assert not scratch.exists()
    with pytest.raises(RuntimeError, match="failed"), scratch_directory("smartinf-upload", tmp_path) as scratch:
        raise RuntimeError("failed")
    assert list(tmp_path.iterdir()) == []
    killed = left_over(tmp_path / "smartinf-upload", "run")
    killed.mkdir()
    assert remove_leftovers(tmp_path) == [killed]


def test_a_tokenizer_trained_again_removes_what_a_killed_training_staged(tmp_path):
    from lightning_smartinf.hf.data import train_bpe_tokenizer

    killed = left_over(tmp_path / "tokenizer")
    killed.mkdir()
    (killed / "tokenizer.json").write_text("{")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to learn a vocabulary from.\n" * 40)
    train_bpe_tokenizer([str(corpus)], tmp_path / "tokenizer", vocab_size=300)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "tokenizer"]


KILLED_BETWEEN_RENAMES = """
import os, sys
from pathlib import Path
from lightning_smartinf.core.format import state_files

state_files._exchange = lambda a, b: False  # as on NFS
renames = []
real = os.rename

def rename(src, dst):
    renames.append(dst)
    if len(renames) == 2:  # the old entry is aside; the new one not yet in
        os._exit(9)
    real(src, dst)

os.rename = rename
state_files.install_directory(Path(sys.argv[1]), Path(sys.argv[2]))
"""


def test_a_replacement_killed_between_its_renames_leaves_the_old_entry_which_is_put_back(tmp_path):
    import subprocess
    import sys

    (tmp_path / "last.ckpt").mkdir()
    (tmp_path / "last.ckpt" / "state").write_text("old")
    new = left_over(tmp_path / "last.ckpt")  # staged by the process killed below
    new.mkdir()
    (new / "state").write_text("new")
    killed = subprocess.run([sys.executable, "-c", KILLED_BETWEEN_RENAMES, str(new), str(tmp_path / "last.ckpt")])
    assert killed.returncode == 9
    [aside] = tmp_path.glob(".last.ckpt.aside-*")
    assert not (tmp_path / "last.ckpt").exists()
    remove_leftovers(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # the staged new one removed, the old one back
    assert (tmp_path / "last.ckpt" / "state").read_text() == "old"


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "rename-aside"])
def test_a_replaced_entry_that_cannot_be_deleted_leaves_the_replacement_standing(tmp_path, monkeypatch, exchange):
    """Deleting what was replaced is clean-up: failing at it (an immutable file, EIO) warns and the save stands."""
    from lightning_smartinf.core.format import state_files

    if not exchange:
        monkeypatch.setattr(state_files, "_exchange", lambda a, b: False)

    def refuse(path, **_):  # noqa: ANN001, ANN202
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(state_files, "remove_entry", refuse)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "state").write_text("old")
    new = temporary_path(tmp_path / "ckpt")
    new.mkdir()
    (new / "state").write_text("new")
    with pytest.warns(UserWarning, match=r"'.*ckpt' is in place, but the entry it replaced.*could not be deleted"):
        state_files.install_directory(new, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "state").read_text() == "new"
    [left] = [p for p in tmp_path.iterdir() if p.name != "ckpt"]
    assert ".aside-" not in left.name  # never put back over the new one
    assert (left / "state").read_text() == "old"


def test_an_atomic_write_removes_what_killed_writes_of_that_file_left(tmp_path):
    """A killed `smartinf export` left a full-size hidden temporary beside the weights; the next write of that file
    removes it (and no other file's)."""
    from lightning_smartinf.core.io.storage import write_file_atomic

    killed = left_over(tmp_path / "model.safetensors")
    killed.write_bytes(b"half of the weights")
    other = left_over(tmp_path / "config.json")
    other.write_bytes(b"{")
    write_file_atomic(tmp_path / "model.safetensors", b"the weights")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other.name, "model.safetensors"])


def test_the_storage_probes_remove_what_killed_probes_left(tmp_path):
    """The speed probe writes 64 MiB beside the state; a run killed while it measured left it until a later probe."""
    from lightning_smartinf.core.io.clone import CLONE_PROBE, can_clone
    from lightning_smartinf.core.io.direct import ThreadedIO
    from lightning_smartinf.core.placement import SPEED_PROBE, measure_write_read

    speed = left_over(tmp_path / SPEED_PROBE)
    speed.write_bytes(b"\0" * 4096)
    clones = [left_over(tmp_path / CLONE_PROBE) for _ in range(2)]
    for probe in clones:
        probe.write_bytes(b"")
    assert measure_write_read(tmp_path, ThreadedIO(), 4 << 20) > 1.0
    can_clone(tmp_path)
    assert list(tmp_path.iterdir()) == []
