"""One naming scheme and one liveness rule for every temporary the package builds beside its final place."""

from __future__ import annotations

import os
import socket

import pytest
from helpers.leftovers import dead_pid, left_over

from lightning_smartinf.core.io.leftovers import is_left_over, remove_leftovers, temporary_path


def test_a_temporary_is_a_hidden_sibling_naming_its_target_host_and_process(tmp_path):
    first, second = temporary_path(tmp_path / "ckpt"), temporary_path(tmp_path / "ckpt")
    assert first != second and first.parent == tmp_path and not first.exists()
    assert first.name.startswith(f".ckpt.tmp-{socket.gethostname()}-{os.getpid()}-")
    assert temporary_path(tmp_path / "ckpt", "old").name.startswith(".ckpt.old-")
    with pytest.raises(ValueError, match=r"`purpose='scratch'` is not one of \('tmp', 'old', 'run'\)"):
        temporary_path(tmp_path / "ckpt", "scratch")


def test_only_a_gone_process_of_this_host_leaves_leftovers(tmp_path):
    assert not is_left_over(temporary_path(tmp_path / "a").name)  # this process
    assert not is_left_over(left_over(tmp_path / "a", pid=os.getppid()).name)  # a live one
    assert is_left_over(left_over(tmp_path / "a").name)  # gone
    assert not is_left_over(left_over(tmp_path / "a", host="other-host.example").name)  # cannot tell: kept
    assert not is_left_over(".a.tmp-host-12-zz")  # not our scheme
    assert not is_left_over("a")


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
