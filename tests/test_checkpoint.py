"""Checkpoint, resume, crash consistency and export of the near-storage device state (issue 6).

Training set-up (model, AdamW + cosine schedule, epochs of ``EVERY`` batches, checkpoints every ``EVERY`` steps)
lives in tests/scripts/ckpt_common.py, shared with the crash worker process.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from crc32c import crc32c
from helpers.launch import SCRIPTS, torchrun, worker_env
from helpers.leftovers import left_over
from helpers.models import assert_identical, max_relative_error
from lightning.pytorch.callbacks import ModelCheckpoint
from scripts.ckpt_common import EVERY, TOTAL, checkpoint_step, newest_complete, train

import lightning_smartinf.core.format.state_files as ckpt_module
from lightning_smartinf.commands.export import consolidate_fp32_state_dict, is_complete, save_fp32
from lightning_smartinf.commands.export import main as export_main
from lightning_smartinf.core import SGD, Adam, ShardSpec, StorageError
from lightning_smartinf.core.format import checkpoint_folder
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.format.state_files import MANIFEST, ShardState, load_state, save_state, shard_file_name

WORKER = Path(__file__).parent / "scripts" / "crash_worker.py"
CHUNK = 1024


@pytest.fixture
def reference(checkpoint_reference) -> tuple[Path, dict[str, torch.Tensor]]:
    """An uninterrupted run of TOTAL steps that also saves step=4, 8, 12 checkpoints (made once per test run)."""
    return checkpoint_reference


def ckpt(root: Path, step: int) -> Path:
    return root / "ckpts" / f"step={step}.ckpt"


# ------------------------------------------------------------------------------------------------- exact resume


@pytest.mark.parametrize("step", [EVERY, 2 * EVERY])
def test_resume_is_bit_identical(reference, tmp_path, step) -> None:
    root, expected = reference
    assert is_complete(ckpt(root, step))
    resumed = train(tmp_path, ckpt_path=ckpt(root, step), every=None)
    assert_identical(resumed, expected)


def test_resume_onto_more_storage_paths_and_a_moved_checkpoint(reference, tmp_path) -> None:
    """Saved with 1 storage path, resumed with 3 other paths from a copy of the checkpoint elsewhere."""
    root, expected = reference
    moved = tmp_path / "elsewhere" / "copy.ckpt"
    shutil.copytree(ckpt(root, EVERY), moved)
    storage = [tmp_path / f"nvme{i}" for i in range(3)]
    resumed = train(tmp_path, storage=storage, ckpt_path=moved, every=None)
    assert_identical(resumed, expected)
    for i, path in enumerate(storage):  # shard s lives on path s mod 3
        assert (path / "smartinf" / "rank000" / shard_file_name(i)).is_file()


def test_resume_after_reshard_to_fewer_paths(tmp_path, reference) -> None:
    """3 paths -> checkpoint -> 1 path: the checkpoint saved from several devices is one flat set of shards."""
    root, expected = reference
    first = tmp_path / "first"
    train(first, storage=[first / f"nvme{i}" for i in range(3)], steps=EVERY)
    resumed = train(tmp_path / "second", ckpt_path=ckpt(first, EVERY), every=None)
    assert_identical(resumed, expected)


#: Resumes onto another layout than the checkpoint's, each bit for bit against the run that never stopped.
LAYOUTS = {
    # One change at a time in the slow suite (the main suite's case changes them all at once).
    "sub_group_size": pytest.param({"sub_group_size": 1000}, marks=pytest.mark.slow),
    "chunk_size": pytest.param({"chunk_size": 2048}, marks=pytest.mark.slow),
    "all of it, two paths, half the state in memory": {
        "sub_group_size": 7000,
        "chunk_size": 4096,
        "state_memory_budget": 130_000,
        "storage_paths": ["nvme_a", "nvme_b"],
    },
}


@pytest.mark.parametrize("kwargs", LAYOUTS.values(), ids=LAYOUTS)
def test_resume_on_another_layout_is_bit_identical(reference, tmp_path, kwargs) -> None:
    """The checkpoint's shards (sub-groups of 3000 elements in records of 1M, one path) are re-sharded as they load."""
    root, expected = reference
    kwargs = dict(kwargs)
    if "storage_paths" in kwargs:
        kwargs["storage_paths"] = [tmp_path / name for name in kwargs["storage_paths"]]
        for path in kwargs["storage_paths"]:
            path.mkdir()
    trainers: list[L.Trainer] = []
    resumed = train(tmp_path, ckpt_path=ckpt(root, EVERY), every=None, strategy_kwargs=kwargs, trainers=trainers)
    assert_identical(resumed, expected)
    saved = json.loads((ckpt(root, EVERY) / "checkpoint" / "smartinf" / "rank000" / "host_state.json").read_text())
    backend = trainers[0].strategy.smart_update.backend
    shards, chunk = len(trainers[0].strategy.smart_update.sub_groups), backend.chunk_elems
    assert (shards, chunk) != (saved["num_shards"], 1 << 20), "the layout did change"
    assert ("sub_group_size" in kwargs) == (shards != saved["num_shards"])
    if "state_memory_budget" in kwargs:  # some shards in the memory tier, the others on the two paths
        assert 0 < len(backend.local_shards) < shards


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resume_on_other_numbers_of_ranks(tmp_path, free_port) -> None:
    """2 ranks -> 1 and 1 rank -> 4, each with another `sub_group_size` too, against the run that never stopped.

    The state loads bit for bit (the format tests check every element); the steps after differ from the run that
    never stopped only as much as averaging the same global batch's gradients over another number of ranks makes
    them (summation order), as 2 ranks against 1 do in ``test_multirank.py``: within 1e-5 of each parameter's
    largest magnitude.
    """

    def run(ranks: int, tag: str, *args: str | Path) -> dict[str, torch.Tensor]:
        script = SCRIPTS / "train_ranks_reshard.py"
        torchrun(script, tmp_path, tag, *args, port=free_port(), ranks=ranks, timeout=600)
        return torch.load(tmp_path / f"{tag}.pt", weights_only=True)

    for saved, resumed, sub_group in ((2, 1, "1000"), (1, 4, "7000")):
        full = run(saved, f"full{saved}")
        step = tmp_path / f"ckpts_full{saved}" / f"step={EVERY}.ckpt"
        after = run(resumed, f"resumed{resumed}", "--resume", step, "--sub-group-size", sub_group)
        errors = max_relative_error(after, full)
        assert max(errors.values()) < 1e-5, (saved, resumed, errors)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_compression_residual_is_not_resharded_over_another_number_of_ranks(tmp_path, free_port) -> None:
    """The error-feedback residual is per rank (the gradient each rank has not sent yet): a checkpoint holding one,
    saved by 1 rank, is refused on 2 with a message naming what may change instead; nothing is half-loaded."""
    script = SCRIPTS / "train_ranks_reshard.py"
    torchrun(script, tmp_path, "one", "--steps", str(EVERY), "--compression", "0.05", port=free_port(), ranks=1)
    step = tmp_path / "ckpts_one" / f"step={EVERY}.ckpt"
    done = torchrun(
        script, tmp_path, "two", "--resume", step, "--compression", "0.05", port=free_port(), ranks=2, check=False
    )
    assert done.returncode != 0
    assert re.search(
        r"per-rank host state of gradient compression .* of 1 ranks, which cannot be re-sharded over 2\. "
        r"Resume with 1 ranks \(`sub_group_size` and `chunk_size` may change\)",
        done.stderr,
    ), done.stderr[-3000:]
    checkpoint_folder.verify(step, checksum_shards=True)  # the checkpoint is as it was


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_resume_is_bit_identical_and_exports(tmp_path, free_port) -> None:
    """2 gloo ranks: train 12 steps saving every 4; resume from step 4 onto 4 other paths (2 per rank)."""
    torchrun(SCRIPTS / "train_two_ranks_ckpt.py", tmp_path, port=free_port())
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert_identical(torch.load(tmp_path / "resumed.pt", weights_only=True), full)
    final = ckpt(tmp_path, TOTAL)
    for rank in range(2):
        assert (final / "checkpoint" / "smartinf" / f"rank{rank:03d}" / MANIFEST).is_file()
    assert is_complete(final)
    # Export joins the two ranks' partitions of every parameter.
    assert_identical(consolidate_fp32_state_dict(final), full)


# ----------------------------------------------------------------------------- save/load of state files (unit)


def _live_shards(directory: Path, sizes=(1000, 3 * CHUNK + 7, 1), seed: int = 0) -> list[ShardState]:
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shards = []
    for i, numel in enumerate(sizes):
        rule = Adam() if i % 2 == 0 else SGD()
        layout = ChunkLayout(numel, CHUNK, len(rule.state_names))
        path = directory / f"dev{i % 2}" / shard_file_name(i)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(torch.randint(0, 256, (layout.file_bytes,), dtype=torch.uint8, generator=generator).numpy())
        shards.append(ShardState(ShardSpec(i, numel, rule), layout, path))
    return shards


def _contents(shards: list[ShardState]) -> list[bytes]:
    return [s.path.read_bytes() for s in shards]


def test_save_writes_checksummed_manifest_and_replaces_atomically(tmp_path) -> None:
    shards = _live_shards(tmp_path / "live")
    target = tmp_path / "ckpt" / "rank000"
    save_state(shards, target, chunk_elems=CHUNK)
    manifest = json.loads((target / MANIFEST).read_text())
    assert manifest["format"] == ckpt_module.FORMAT
    for shard, entry in zip(shards, manifest["shards"]):
        assert entry["crc32c"] == crc32c(shard.path.read_bytes())
        assert entry["bytes"] == shard.layout.file_bytes
    first = _contents(shards)
    # A save killed earlier left a temporary sibling; the next save removes it.
    stale = left_over(target)
    stale.mkdir()
    (stale / "junk").write_text("x")
    for shard in shards:  # the state moves on, and is saved again over the previous checkpoint
        shard.path.write_bytes(bytes(reversed(shard.path.read_bytes())))
    second = _contents(shards)
    save_state(shards, target, chunk_elems=CHUNK)
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]
    for shard in shards:
        shard.path.write_bytes(b"\0" * shard.layout.file_bytes)
    load_state(shards, target, chunk_elems=CHUNK)
    assert _contents(shards) == second != first


def _damage(kind: str, target: Path) -> Path:
    victim = target / shard_file_name(2 if kind != "truncate" else 1)
    if kind == "corrupt_byte":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    elif kind == "truncate":
        os.truncate(victim, victim.stat().st_size - 1)
    elif kind == "delete":
        victim.unlink()
    elif kind == "manifest":
        victim = target / MANIFEST
        victim.write_text(victim.read_text()[:-20])
    return victim


@pytest.mark.parametrize("kind", ["corrupt_byte", "truncate", "delete", "manifest"])
def test_damaged_checkpoint_is_refused_naming_the_file_and_live_state_is_untouched(tmp_path, kind) -> None:
    shards = _live_shards(tmp_path / "live")
    target = tmp_path / "ckpt"
    save_state(shards, target, chunk_elems=CHUNK)
    for shard in shards:
        shard.path.write_bytes(bytes(reversed(shard.path.read_bytes())))
    live = _contents(shards)
    victim = _damage(kind, target)
    with pytest.raises(ValueError, match=re.escape(str(victim))) as info:
        load_state(shards, target, chunk_elems=CHUNK)
    expected_word = {"corrupt_byte": "corrupt", "truncate": "truncated", "delete": "missing", "manifest": "corrupt"}
    assert expected_word[kind] in str(info.value)
    assert _contents(shards) == live


def test_corrupt_checkpoint_fails_resume_with_the_file_name(reference, tmp_path) -> None:
    root, _ = reference
    copy = tmp_path / "copy.ckpt"
    shutil.copytree(ckpt(root, EVERY), copy)
    victim = copy / "checkpoint" / "smartinf" / "rank000" / shard_file_name(3)
    data = bytearray(victim.read_bytes())
    data[100] ^= 0x80
    victim.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape(str(victim)) + ".*corrupt"):
        train(tmp_path, ckpt_path=copy, every=None)


# ----------------------------------------------------------------------------------------------------- disk full
# Method: a real size-limited tmpfs (`mount -t tmpfs -o size=...`, the `small_fs` fixture) as the checkpoint target.
# No ENOSPC is injected.


def test_enospc_during_save_is_a_clear_error_and_keeps_the_previous_state(tmp_path, small_fs, monkeypatch) -> None:
    """The filesystem fills up in the middle of copying a shard (the free-space pre-check is fooled)."""
    fs = small_fs("1m")
    shards = _live_shards(tmp_path / "live", sizes=(20_000, 20_000, 20_000))  # 3 x 240 KiB per save
    target = fs / "rank000"
    save_state(shards, target, chunk_elems=CHUNK)
    saved = [(target / shard_file_name(s.spec.index)).read_bytes() for s in shards]
    for shard in shards:
        shard.path.write_bytes(bytes(reversed(shard.path.read_bytes())))
    monkeypatch.setattr(ckpt_module.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 40, 0, 1 << 40))
    with pytest.raises(StorageError, match=re.escape(str(target)) + ".*No space|No space.*" + re.escape(str(target))):
        save_state(shards, target, chunk_elems=CHUNK)
    monkeypatch.undo()
    assert sorted(p.name for p in fs.iterdir()) == [target.name]  # no temporary left behind
    assert [(target / shard_file_name(s.spec.index)).read_bytes() for s in shards] == saved
    load_state(shards, target, chunk_elems=CHUNK)  # the previous checkpoint still loads


class Ballast(L.Callback):
    """After the first checkpoint, fill the checkpoint filesystem so the next one's DeepSpeed files fit but the
    device state does not."""

    def __init__(self, fs: Path) -> None:
        self.fs = fs

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != EVERY + 1:
            return
        first = ckpt(self.fs, EVERY)
        files = [p for p in first.rglob("*") if p.is_file()]
        device = sum(p.stat().st_size for p in files if "smartinf" in p.parts)
        others = sum(p.stat().st_size for p in files if "smartinf" not in p.parts)
        room = others + 64 * 1024 + device // 2
        free = shutil.disk_usage(self.fs).free
        with open(self.fs / "ballast", "wb") as f:
            f.write(b"\0" * (free - room))


def test_disk_full_during_checkpoint_keeps_the_last_one_loadable(reference, tmp_path, small_fs) -> None:
    """A save the filesystem has no room for is refused before any rank writes, naming the space needed and free."""
    _, expected = reference
    fs = small_fs("8m")
    with pytest.raises(
        StorageError, match=r"refused before writing anything: it needs [\d.]+ MiB .* has [\d.]+ [KM]iB free"
    ):
        train(fs, storage=[tmp_path / "ssd"], steps=TOTAL, callbacks=[Ballast(fs)])
    assert sorted(p.name for p in (fs / "ckpts").iterdir()) == [ckpt(fs, EVERY).name]  # nothing half-written left
    assert newest_complete(fs / "ckpts") == ckpt(fs, EVERY)
    resumed = train(tmp_path / "resume", ckpt_path=ckpt(fs, EVERY), every=None)
    assert_identical(resumed, expected)


def _bytes_of(checkpoint: Path) -> int:
    return sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())


def test_rotation_frees_what_it_deletes_before_a_save_that_needs_the_room(reference, tmp_path, small_fs) -> None:
    """What users write, `ModelCheckpoint(save_last=True, every_n_train_steps=4)` (it keeps the newest
    `epoch=E-step=N.ckpt` and `last.ckpt`), on a filesystem with room for two checkpoints and not three: each save
    first removes the checkpoint it makes obsolete while the other stands, and the run ends as it would with room."""
    root, expected = reference
    size = _bytes_of(ckpt(root, EVERY))
    fs = small_fs(str(5 * size // 2 + (1 << 20)))
    with pytest.warns(UserWarning, match=r"before saving checkpoint .* instead of after it.* stands meanwhile"):
        train(fs, storage=[tmp_path / "ssd"], checkpointing="last")
    ckpts = fs / "ckpts"
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=2-step=12.ckpt", "last.ckpt"]  # nothing hidden left
    for checkpoint in ckpts.iterdir():
        checkpoint_folder.verify(checkpoint, checksum_shards=True)
    resumed = train(tmp_path / "resume", ckpt_path=ckpt(root, EVERY), every=None)
    assert_identical(resumed, expected)
    assert_identical(consolidate_fp32_state_dict(ckpts / "last.ckpt"), expected)


def test_rotation_keeps_the_only_checkpoint_and_refuses_the_save_naming_it(reference, tmp_path, small_fs) -> None:
    """`ModelCheckpoint(every_n_train_steps=4)` (the newest checkpoint only) with room for one and a half: removing
    the old one before the new one is written would leave none during the save, so the save is refused."""
    root, _ = reference
    fs = small_fs(str(3 * _bytes_of(ckpt(root, EVERY)) // 2 + (1 << 20)))
    callback = ModelCheckpoint(dirpath=fs / "ckpts", every_n_train_steps=EVERY)
    with pytest.raises(StorageError, match=r"makes '.*epoch=0-step=4\.ckpt' obsolete, but .* kept: no other complete"):
        train(fs, storage=[tmp_path / "ssd"], checkpoint_callback=callback)
    assert sorted(p.name for p in (fs / "ckpts").iterdir()) == ["epoch=0-step=4.ckpt"]
    checkpoint_folder.verify(fs / "ckpts" / "epoch=0-step=4.ckpt", checksum_shards=True)


# ------------------------------------------------------------------------------------------ storage disappears


class RemoveStorage(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 2:
            shutil.rmtree(self.path)


def test_storage_path_removed_mid_run_names_it(tmp_path) -> None:
    storage = [tmp_path / "nvme0", tmp_path / "nvme1"]
    with pytest.raises(StorageError, match=re.escape(str(storage[1])) + ".*disappeared"):
        train(tmp_path, storage=storage, every=None, callbacks=[RemoveStorage(storage[1])])


# ------------------------------------------------------------------------------------------- crash consistency


def _run_killed(root: Path, spec: str) -> None:
    """Run the worker until it is SIGKILLed at ``spec`` (``timer:SECONDS`` kills from here after training starts)."""
    root.mkdir(parents=True, exist_ok=True)
    worker_spec = "none" if spec.startswith("timer:") else spec
    with open(root / "worker.out", "w") as out, open(root / "worker.err", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(root), worker_spec], env=worker_env(), stdout=out, stderr=err
        )
        if spec.startswith("timer:"):
            deadline = time.monotonic() + 120
            while "TRAINING" not in (root / "worker.out").read_text() and proc.poll() is None:
                assert time.monotonic() < deadline, "worker did not start training"
                time.sleep(0.05)
            time.sleep(float(spec.split(":")[1]))
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=300)
    if spec.startswith("timer:") and proc.returncode == 0:
        return  # finished before the timer fired: resuming from its last checkpoint must still match
    assert proc.returncode == -signal.SIGKILL, (
        f"worker was not killed at {spec}: rc={proc.returncode}\n{(root / 'worker.err').read_text()[-3000:]}"
    )


def _crash_and_resume(tmp_path: Path, spec: str, expected: dict[str, torch.Tensor]) -> int:
    root = tmp_path / re.sub(r"[^a-z0-9]+", "_", spec)
    _run_killed(root, spec)
    ckpts = root / "ckpts"
    # Never a mix: every checkpoint at a visible name is whole and sealed, the overwritten `last.ckpt` included.
    for path in sorted(ckpts.iterdir()) if ckpts.is_dir() else []:
        if not path.name.startswith("."):
            checkpoint_folder.verify(path, checksum_shards=True)
    latest = newest_complete(ckpts)
    step = checkpoint_step(latest) if latest else 0  # read now: resuming saves over `last.ckpt`
    if step > EVERY:  # a whole save round (top-k checkpoint, then last.ckpt) completed before the newest one
        assert checkpoint_step(ckpts / "last.ckpt") >= step - EVERY, "`last.ckpt` lost its last complete save"
    if step == TOTAL:
        # Killed after the last checkpoint (e.g. while tearing down): nothing left to train; check its weights.
        assert_identical(consolidate_fp32_state_dict(latest), expected)
    else:
        assert_identical(train(root, ckpt_path=latest, every=EVERY, checkpointing="last"), expected)
    return step


# Kill points (tests/scripts/crash_worker.py) and the step of the newest whole checkpoint they leave. Each epoch end
# saves `epoch=E-step=N.ckpt` (shard copies 1-7), deletes the previous one, then saves over `last.ckpt` (8-14).
SHORT_KILLS = {"update:6:2": EVERY, "save:8:3": EVERY, "install:8": 2 * EVERY}
LONG_KILLS = {
    "forward:1": 0,
    "backward:3": 0,
    "update:4:0": 0,
    "ds_save:4": 0,
    "save:4:1": 0,
    "seal:4": 0,
    "backward:6": EVERY,
    "manifest:8": EVERY,
    "host_state:8": EVERY,
    "save:8:10": 2 * EVERY,
    "update:10:6": 2 * EVERY,
    "seal:12": 2 * EVERY,
    "save:12:5": 2 * EVERY,
    "host_state:12": 2 * EVERY,
    "install:12": TOTAL,
    "timer:0.1": None,
    "timer:0.3": None,
    "timer:0.6": None,
}


@pytest.mark.parametrize(
    # One kill in the main suite (during a save: the state a resume must not trust half-written); the rest, slow.
    "spec",
    [pytest.param(spec, marks=[pytest.mark.slow] * (spec != "save:8:3")) for spec in SHORT_KILLS],
)
def test_sigkill_then_resume_is_bit_identical(reference, tmp_path, spec) -> None:
    """`ModelCheckpoint(save_last=True, every_n_train_steps=4)` into one directory; killed, then resumed from there."""
    _, expected = reference
    assert _crash_and_resume(tmp_path, spec, expected) == SHORT_KILLS[spec]


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["save:8:3"])
def test_sigkill_while_cloning_then_resume_is_bit_identical(reference, reflink_fs, spec) -> None:
    """The same, with the state and the checkpoints on a filesystem that clones: shard files are cloned, their
    checksums combined from the devices' writes; every checkpoint left is verified by reading it whole."""
    _, expected = reference
    assert _crash_and_resume(reflink_fs, spec, expected) == SHORT_KILLS[spec]


@pytest.mark.slow
@pytest.mark.parametrize("filesystem", ["ext4", "reflink"])
def test_sigkill_at_many_points_then_resume_is_bit_identical(request, reference, tmp_path, filesystem) -> None:
    _, expected = reference
    root = tmp_path if filesystem == "ext4" else request.getfixturevalue("reflink_fs")
    kills = {**LONG_KILLS, f"timer:{random.Random(7).uniform(0.05, 1.0):.2f}": None}
    resumed_from = {spec: _crash_and_resume(root, spec, expected) for spec in kills}
    assert len(resumed_from) >= 10
    wrong = {spec: step for spec, step in resumed_from.items() if kills[spec] is not None and kills[spec] != step}
    assert not wrong, f"resumed from other steps than expected: {wrong}"


# ------------------------------------------------------------------------------------------------------ export


def test_export_fp32_equals_trained_parameters(reference, tmp_path) -> None:
    root, expected = reference
    state = consolidate_fp32_state_dict(ckpt(root, TOTAL))
    assert_identical(state, expected)
    out = tmp_path / "model.safetensors"
    assert export_main([str(ckpt(root, TOTAL)), str(out)]) == 0
    from safetensors.torch import load_file

    assert_identical(load_file(str(out)), expected)
    # An earlier checkpoint exports earlier weights.
    assert not all(
        torch.equal(a, b) for a, b in zip(consolidate_fp32_state_dict(ckpt(root, EVERY)).values(), expected.values())
    )


def test_export_bf16_masters_cast_to_the_model_weights(tmp_path) -> None:
    params = train(tmp_path, steps=EVERY, precision="bf16-mixed")
    state = save_fp32(ckpt(tmp_path, EVERY), tmp_path / "out.safetensors")
    assert all(t.dtype == torch.float32 for t in state.values())
    assert_identical({n: t.bfloat16().float() for n, t in state.items()}, params)
    # The masters carry more precision than the bf16 model weights.
    assert any(not torch.equal(t, params[n]) for n, t in state.items())


def test_export_refuses_a_corrupt_file(reference, tmp_path) -> None:
    root, _ = reference
    copy = tmp_path / "copy.ckpt"
    shutil.copytree(ckpt(root, EVERY), copy)
    victim = _damage("corrupt_byte", copy / "checkpoint" / "smartinf" / "rank000")
    with pytest.raises(ValueError, match=re.escape(str(victim))):
        consolidate_fp32_state_dict(copy)
    assert export_main([str(copy), str(tmp_path / "x.safetensors")]) == 1


def test_export_of_a_folder_inside_a_checkpoint_names_the_checkpoint(reference, tmp_path, capsys) -> None:
    """Exporting a folder that is no checkpoint advised to "Resume from another checkpoint"; one inside a checkpoint
    (its `checkpoint/` or `rank000`) is now answered with the checkpoint to pass."""
    source = ckpt(reference[0], EVERY)
    for inner in (source / "checkpoint", checkpoint_folder.rank_state_dir(source, 0)):
        assert export_main([str(inner), str(tmp_path / "x.safetensors")]) == 1
        said = capsys.readouterr().err
        assert f"is a folder inside the checkpoint {str(source.resolve())!r}: pass the checkpoint directory" in said
    (tmp_path / "empty").mkdir()
    assert export_main([str(tmp_path / "empty"), str(tmp_path / "x.safetensors")]) == 1
    said = capsys.readouterr().err
    assert "Resume from or export another checkpoint." in said and "Resume from another" not in said


def test_export_to_a_file_shows_what_it_reads_and_writes(reference, tmp_path) -> None:
    """`smartinf export CKPT out.safetensors` said nothing while it read the shard files and wrote the weights
    (`--save-pretrained` showed its write). Each operation's line is shown here however short (`min_seconds=0`)."""
    from helpers.launch import run
    from safetensors.torch import load_file

    from lightning_smartinf.core.io.storage import readable_size

    source, out = ckpt(reference[0], TOTAL), tmp_path / "model.safetensors"
    forced = "import sys; from lightning_smartinf.core import progress; progress.configure(min_seconds=0.0)"
    command = "from lightning_smartinf.commands.export import main; sys.exit(main(sys.argv[1:]))"
    stderr = run([sys.executable, "-c", f"{forced}; {command}", str(source), str(out)]).stderr
    shard_files = (source / "checkpoint" / "smartinf").glob("rank*/shard*.state")
    read = readable_size(sum(path.stat().st_size for path in shard_files), decimal=True)
    written = readable_size(sum(t.numel() * t.element_size() for t in load_file(out).values()), decimal=True)
    assert re.search(rf"^Reading the optimizer state of {re.escape(str(source))}: {read} in ", stderr, re.M), stderr
    assert re.search(rf"^Writing the weights to {re.escape(str(out))}: {written} in ", stderr, re.M), stderr


def test_export_refuses_to_write_into_a_checkpoint_and_leaves_it_loadable(reference, tmp_path, capsys) -> None:
    """A file exported into a checkpoint directory made it unloadable (its seal lists every file), and the refusal of
    a checkpoint given as the output file suggested `<checkpoint>/model.safetensors`."""
    root, _ = reference
    source, other = tmp_path / "step=4.ckpt", tmp_path / "step=8.ckpt"
    shutil.copytree(ckpt(root, EVERY), source)
    shutil.copytree(ckpt(root, 2 * EVERY), other)
    (tmp_path / "last.ckpt").symlink_to(other)  # as ModelCheckpoint(save_last="link") makes it
    cases = {
        (str(other),): (other, "is", "step=8.safetensors"),
        (str(other / "model.safetensors"),): (other, "is inside", "step=8.safetensors"),
        (str(tmp_path / "last.ckpt" / "model.safetensors"),): (other, "is inside", "step=8.safetensors"),
        ("--save-pretrained", str(source)): (source, "is", "step=4-hf"),
        ("--save-pretrained", str(source / "checkpoint" / "hf")): (source, "is inside", "step=4-hf"),
    }
    for arguments, (checkpoint, where, beside) in cases.items():
        with pytest.raises(SystemExit) as exited:
            export_main([str(source), *arguments])
        assert exited.value.code == 2
        said = capsys.readouterr().err
        assert f"{where} the smart_infinity checkpoint {str(checkpoint.resolve())!r}" in said, said
        assert f"Write beside it, e.g. {str(checkpoint.resolve().with_name(beside))!r}" in said, said
        assert said.count("e.g.") == 1  # no path inside a checkpoint suggested
    with pytest.raises(ValueError, match=r"`out_file=.*` is inside the smart_infinity checkpoint"):
        save_fp32(source, source / "model.safetensors")
    for checkpoint in (source, other):  # nothing was written into either: both still load and export
        checkpoint_folder.verify(checkpoint, checksum_shards=True)
    assert export_main([str(other), str(tmp_path / "step=8.safetensors")]) == 0


# ------------------------------------------------------------------------------------- overlap with backward


class SaveBeforeStep(L.Callback):
    """Saves a checkpoint after backward, before the step: devices have already updated during that backward."""

    def __init__(self, path: Path, at_step: int) -> None:
        self.path, self.at_step = path, at_step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.at_step:
            assert trainer.strategy.smart_update.hand_offs, "nothing was handed off early"
            trainer.save_checkpoint(self.path)


def test_checkpoint_between_backward_and_step_holds_the_state_before_the_step(tmp_path) -> None:
    from helpers.models import LMModule, fit, param_groups

    from lightning_smartinf import SmartInfinityStrategy

    def sgd(model):
        return torch.optim.SGD(param_groups(model, 1e-3), lr=5e-2, momentum=0.9), None

    def strategy(path: Path) -> SmartInfinityStrategy:
        path.mkdir()
        return SmartInfinityStrategy(storage_paths=[path], sub_group_size=3000, chunk_size=2048, buffer_count=3)

    _, after_two = fit(LMModule(sgd), strategy(tmp_path / "two"), steps=2)
    _, after_four = fit(LMModule(sgd), strategy(tmp_path / "four"), steps=4)
    path = tmp_path / "mid-step.ckpt"
    trainer, ours = fit(LMModule(sgd), strategy(tmp_path / "ours"), steps=4, callbacks=[SaveBeforeStep(path, 2)])

    optimizer = trainer.strategy.deepspeed_engine.optimizer
    assert optimizer.smart_update.early_rolled_back == 0  # the save left step 3's tentative updates alone
    assert_identical(consolidate_fp32_state_dict(path), after_two)  # and saved the committed state
    assert_identical(ours, after_four)
