"""Checkpoints in the shapes users write them (issue 17): stock ``ModelCheckpoint`` settings, saves over existing
checkpoints, ``Trainer.save_checkpoint`` after ``fit``, evaluation from a checkpoint, and checkpoints that must be
refused (hostile pickles, links, parts of different saves, damaged files) without running anything from them.

The model, optimizer and data are those of tests/test_checkpoint.py (tests/scripts/ckpt_common.py); ``reference`` is
an uninterrupted run of ``TOTAL`` steps that keeps ``step=4/8/12.ckpt``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.checkpoints import assert_converted
from helpers.launch import SCRIPTS, python, worker_env
from helpers.models import Crash, CrashAt, LMModule, assert_identical, param_groups, token_loader
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from scripts.ckpt_common import EVERY, SUB_GROUP, TOTAL, adamw_cosine, checkpoint_step, train

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.commands.export import consolidate_fp32_state_dict
from lightning_smartinf.commands.export import main as export_main
from lightning_smartinf.core import StorageError
from lightning_smartinf.core.format import checkpoint_folder
from lightning_smartinf.core.format.checkpoint_folder import SEAL, CheckpointError
from lightning_smartinf.core.io.direct import ThreadedIO
from lightning_smartinf.lightning import engine_setup
from lightning_smartinf.zero.io_choice import EngineChoice


@pytest.fixture
def reference(checkpoint_reference) -> tuple[Path, dict[str, torch.Tensor]]:
    return checkpoint_reference


def ckpt(root: Path, step: int) -> Path:
    return root / "ckpts" / f"step={step}.ckpt"


def visible(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# -------------------------------------------------------------------------------- saving over existing checkpoints


def test_save_last_overwrites_last_and_resumes_bit_identically(reference, tmp_path) -> None:
    """`ModelCheckpoint(save_last=True, every_n_train_steps=4)`: rotation, `last.ckpt` saved over, re-run in place."""
    _, expected = reference
    first = tmp_path / "first"
    with pytest.raises(Crash):  # after two saves: last.ckpt written, then written over
        train(first, checkpointing="last", callbacks=[CrashAt(2 * EVERY + 1)])
    ckpts = first / "ckpts"
    assert visible(ckpts) == ["epoch=1-step=8.ckpt", "last.ckpt"]  # default save_top_k=1 deleted step 4's
    assert checkpoint_step(ckpts / "last.ckpt") == 2 * EVERY
    for name in visible(ckpts):
        checkpoint_folder.verify(ckpts / name, checksum_shards=True)
        info = os.lstat(ckpts / name)  # a real directory (not a link) that only its owner may enter
        assert stat.S_ISDIR(info.st_mode) and not info.st_mode & 0o077
    # A re-run into the same directory resumes from last.ckpt and goes on overwriting it.
    resumed = train(first, ckpt_path=ckpts / "last.ckpt", checkpointing="last")
    assert_identical(resumed, expected)
    assert visible(ckpts) == ["epoch=2-step=12.ckpt", "last.ckpt"]
    assert checkpoint_step(ckpts / "last.ckpt") == TOTAL
    assert_identical(consolidate_fp32_state_dict(ckpts / "last.ckpt"), expected)


def test_accumulation_with_a_short_last_window_resumes_bit_identically(tmp_path) -> None:
    """`accumulate_grad_batches=3` over epochs of 4 batches: each epoch steps after its third batch and after its
    last, alone in its window, so a checkpoint every 2 steps is saved at each epoch's end. A run that crashes in the
    second epoch resumes from the first's checkpoint to the uninterrupted run's parameters, bit for bit. (Had the
    engine counted the windows across epochs, the second step would fall in the second epoch, holding a micro-batch's
    gradient the checkpoint does not keep.)"""
    expected = train(tmp_path / "whole", steps=6, every=None, accumulate_grad_batches=3)
    with pytest.raises(Crash):
        train(tmp_path / "crashed", steps=6, every=2, accumulate_grad_batches=3, callbacks=[CrashAt(3)])
    assert checkpoint_step(ckpt(tmp_path / "crashed", 2)) == 2
    resumed = train(
        tmp_path / "crashed", steps=6, every=2, accumulate_grad_batches=3, ckpt_path=ckpt(tmp_path / "crashed", 2)
    )
    assert_identical(resumed, expected)


def test_dataloader_workers_forked_while_the_devices_run_change_nothing(reference, tmp_path) -> None:
    """`DataLoader(num_workers=2)`, as most recipes write it: each epoch forks two workers while the devices' threads,
    their chunk buffers (huge pages where the OS gives them, in the middle of direct transfers) and the state files are
    live. Training, its checkpoints and a resume from one give the uninterrupted run's numbers bit for bit."""
    _, expected = reference
    run = tmp_path / "workers"
    assert_identical(train(run, num_workers=2), expected)
    assert visible(run / "ckpts") == sorted(f"step={n}.ckpt" for n in (EVERY, 2 * EVERY, TOTAL))
    resumed = train(tmp_path / "resumed", ckpt_path=run / "ckpts" / f"step={EVERY}.ckpt", num_workers=2)
    assert_identical(resumed, expected)


def test_save_last_every_epoch_saves_over_last_ckpt(reference, tmp_path) -> None:
    """The set-up that crashed at its second save: `ModelCheckpoint(save_last=True, every_n_epochs=1)`.

    Each `last.ckpt` holds exactly the weights of its step. (Resuming from it is not compared with an uninterrupted
    run: Lightning 2.6 replays one batch when it resumes from a checkpoint saved in `on_train_epoch_end`, with any
    strategy.)
    """
    root, _ = reference
    seen: dict[int, dict[str, torch.Tensor]] = {}

    class Inspect(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            last = tmp_path / "ckpts" / "last.ckpt"
            if last.exists():
                seen[checkpoint_step(last)] = consolidate_fp32_state_dict(last)

    callback = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True, every_n_epochs=1)
    train(tmp_path, checkpoint_callback=callback, callbacks=[Inspect()])
    assert sorted(seen) == [EVERY, 2 * EVERY]
    for step, weights in seen.items():
        assert_identical(weights, consolidate_fp32_state_dict(ckpt(root, step)))
    assert visible(tmp_path / "ckpts") == ["epoch=2-step=12.ckpt", "last.ckpt"]
    assert not hidden(tmp_path / "ckpts")


def test_save_top_k_with_monitor_deletes_rotated_checkpoints_whole(reference, tmp_path) -> None:
    _, expected = reference
    callback = ModelCheckpoint(
        dirpath=tmp_path / "ckpts", monitor="train_loss", save_top_k=2, every_n_train_steps=2, save_last=True
    )
    assert_identical(train(tmp_path, checkpoint_callback=callback), expected)
    ckpts = tmp_path / "ckpts"
    kept = [name for name in visible(ckpts) if name != "last.ckpt"]
    assert len(kept) == 2 and not hidden(ckpts)  # 6 saves, 4 deleted without a trace
    for name in [*kept, "last.ckpt"]:
        checkpoint_folder.verify(ckpts / name, checksum_shards=True)
    assert sorted(Path(p).name for p in callback.best_k_models) == kept


def test_save_last_link_resumes_through_the_link(reference, tmp_path) -> None:
    _, expected = reference
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last="link", every_n_train_steps=EVERY)
    with pytest.raises(Crash):
        train(tmp_path, checkpoint_callback=callback, callbacks=[CrashAt(EVERY + 1)])
    link = tmp_path / "ckpts" / "last.ckpt"
    assert link.is_symlink() and checkpoint_step(link) == EVERY
    resumed = train(
        tmp_path,
        ckpt_path=link,
        checkpoint_callback=ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last="link", every_n_train_steps=EVERY),
    )
    assert_identical(resumed, expected)


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["paths", "temporary"])
def test_trainer_save_checkpoint_after_fit_twice_to_one_path(tmp_path, storage) -> None:
    """`fit` then `trainer.save_checkpoint(path)`, twice; with `storage_paths=None` the state is in a temp dir."""
    trainers: list[L.Trainer] = []
    kwargs = {"strategy_kwargs": {"storage_paths": None}} if storage == "temporary" else {}
    trained = train(tmp_path, steps=EVERY + 2, every=None, trainers=trainers, **kwargs)
    if storage == "temporary":
        temporary = trainers[0].strategy._release_storage
        assert temporary is not None and temporary.alive
    path = tmp_path / "after-fit.ckpt"
    trainers[0].save_checkpoint(path)
    trainers[0].save_checkpoint(path)
    assert visible(tmp_path) == sorted(["after-fit.ckpt", "ssd"]), "a staging directory was left behind"
    assert checkpoint_step(path) == EVERY + 2
    checkpoint_folder.verify(path, checksum_shards=True)
    assert_identical(consolidate_fp32_state_dict(path), trained)
    train(tmp_path / "resume", ckpt_path=path, every=None)  # and it resumes


def test_a_save_after_validate_test_and_predict_is_the_save_after_fit(tmp_path, monkeypatch) -> None:
    """`fit`, then `validate`, `test` and `predict` on the same trainer, then `trainer.save_checkpoint(path)`: Lightning
    evaluates through a DeepSpeed inference engine, which has no optimizer and cannot save (it raised an
    AttributeError from inside DeepSpeed); the save goes through the engine that trained, and holds what it holds."""

    def evaluate(self, batch, batch_idx):  # noqa: ANN001, ANN202 - Lightning's hook
        tokens, targets = batch
        self.log("loss", torch.nn.functional.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten()))

    for hook in ("validation_step", "test_step"):
        monkeypatch.setattr(LMModule, hook, evaluate, raising=False)
    monkeypatch.setattr(LMModule, "predict_step", lambda self, batch, i: self.model(batch[0]).argmax(-1), raising=False)
    trainers: list[L.Trainer] = []
    trained = train(tmp_path, steps=EVERY + 2, every=None, trainers=trainers)
    trainer = trainers[0]
    trainer.save_checkpoint(tmp_path / "fit.ckpt")
    for evaluation in ("validate", "test", "predict"):
        getattr(trainer, evaluation)(trainer.lightning_module, token_loader(2))
        path = tmp_path / f"{evaluation}.ckpt"
        trainer.save_checkpoint(path)
        checkpoint_folder.verify(path, checksum_shards=True)
        assert checkpoint_step(path) == EVERY + 2
        assert_identical(consolidate_fp32_state_dict(path), trained)
        # DeepSpeed's converters read its optimizer files, which hold none of the state: not shipped to fail.
        assert not [name for name in checkpoint_folder.DEEPSPEED_SCRIPTS if (path / name).exists()]
    assert_identical(
        train(tmp_path / "resumed", ckpt_path=tmp_path / "predict.ckpt", every=None),
        train(tmp_path / "reference", ckpt_path=tmp_path / "fit.ckpt", every=None),
    )


@pytest.mark.slow  # the main suite launches `Trainer(devices=2)` in test_param_storage and test_hf_export
@pytest.mark.multiprocess
def test_two_ranks_launched_by_lightning_save_last_and_resume_under_another_budget(tmp_path, free_port) -> None:
    """`Trainer(devices=2)` (Lightning starts rank 1), `save_last=True` saved over: a run with part of each rank's
    state in memory crashes, resumes with all of it on the storage paths under another budget, and ends where a run
    without any memory tier ends."""
    script = SCRIPTS / "train_two_ranks_save_last.py"
    for mode, budget in (("full", None), ("crash", 40_000), ("resume", 10_000_000)):
        settings = json.dumps({"state_memory_budget": budget})
        done = python(script, tmp_path, mode, settings, env=worker_env(MASTER_PORT=str(free_port())), check=False)
        assert done.returncode == (3 if mode == "crash" else 0), done.stdout[-2000:] + done.stderr[-4000:]
        if mode == "crash":
            last = tmp_path / "ckpts" / "last.ckpt"
            seal = checkpoint_folder.verify(last, checksum_shards=True)
            assert (seal["global_step"], seal["world_size"]) == (2 * EVERY, 2)
            assert sorted(p.name for p in (last / "checkpoint" / "smartinf").iterdir()) == [
                "rank000",
                "rank001",
                "seal.json",
            ]
    assert checkpoint_step(tmp_path / "ckpts" / "last.ckpt") == TOTAL
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert_identical(torch.load(tmp_path / "resumed.pt", weights_only=True), full)


# --------------------------------------------------------------------------------------- evaluation from a checkpoint


class EvalCapture(L.Callback):
    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}

    def _capture(self, pl_module: L.LightningModule) -> None:
        import deepspeed

        params = list(pl_module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            self.params = {n: p.detach().float().clone() for n, p in params}

    def on_validation_end(self, trainer, pl_module) -> None:
        self._capture(pl_module)

    def on_test_end(self, trainer, pl_module) -> None:
        self._capture(pl_module)

    def on_predict_end(self, trainer, pl_module) -> None:
        self._capture(pl_module)


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_evaluating_a_checkpoint_uses_its_weights(reference, tmp_path, stage) -> None:
    from helpers.models import LMModule, token_loader

    class Evaluated(LMModule):
        def validation_step(self, batch, batch_idx):
            return self.training_step(batch, batch_idx)

        def test_step(self, batch, batch_idx):
            return self.training_step(batch, batch_idx)

        def predict_step(self, batch, batch_idx):
            return self.model(batch[0]).argmax(-1)

    root, expected = reference
    (tmp_path / "ssd").mkdir()
    capture = EvalCapture()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=SmartInfinityStrategy(storage_paths=[tmp_path / "ssd"], sub_group_size=SUB_GROUP),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[capture],
    )
    getattr(trainer, stage)(Evaluated(adamw_cosine, seed=5), token_loader(2), ckpt_path=str(ckpt(root, TOTAL)))
    assert_identical(capture.params, expected)


# ------------------------------------------------------------------------------------- checkpoints that are refused


class Hostile:
    """Unpickling this runs ``Path.touch(marker)``: the stand-in for any code a pickle can carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _copy(root: Path, step: int, dest: Path) -> Path:
    shutil.copytree(ckpt(root, step), dest)
    return dest


def _reseal(path: Path) -> None:
    """Seal again after tampering, as anyone who writes a hostile checkpoint can: the seal is no signature."""
    seal = json.loads((path / SEAL).read_text())
    checkpoint_folder.seal(path, global_step=seal["global_step"], world_size=seal["world_size"])


def test_hostile_pickle_is_refused_and_never_runs(reference, tmp_path) -> None:
    root, _ = reference
    marker = tmp_path / "pwned"
    copy = _copy(root, EVERY, tmp_path / "hostile.ckpt")
    victim = copy / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    state = torch.load(victim, weights_only=True)
    state["hyper_parameters"] = {"evil": Hostile(marker)}
    torch.save(state, victim)
    _reseal(copy)
    with pytest.raises(CheckpointError, match=re.escape(str(victim)) + ".*refused"):
        train(tmp_path / "resume", ckpt_path=copy, every=None)
    assert export_main([str(copy), "--save-pretrained", str(tmp_path / "hf")]) == 1
    assert not marker.exists(), "code from the checkpoint ran"


def test_symlinks_and_escaping_names_are_refused(reference, tmp_path) -> None:
    root, _ = reference
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    linked = _copy(root, EVERY, tmp_path / "linked.ckpt")
    os.symlink(outside, linked / "checkpoint" / "extra.json")
    with pytest.raises(CheckpointError, match="extra.json is a symlink"):
        checkpoint_folder.verify(linked)

    latest = _copy(root, EVERY, tmp_path / "latest.ckpt")
    (latest / "latest").write_text("../../elsewhere")
    _reseal(latest)
    with pytest.raises(CheckpointError, match="names tag '../../elsewhere'"):
        train(tmp_path / "resume", ckpt_path=latest, every=None)

    escaping = _copy(root, EVERY, tmp_path / "escaping.ckpt")
    seal = json.loads((escaping / SEAL).read_text())
    seal["files"]["../../outside.json"] = {"bytes": 2, "crc32": 0}
    (escaping / SEAL).write_text(json.dumps(seal))
    with pytest.raises(CheckpointError, match=re.escape("'../../outside.json'") + ".*not a file inside"):
        checkpoint_folder.verify(escaping)


def test_parts_of_different_saves_are_refused(reference, tmp_path) -> None:
    root, _ = reference
    mixed = _copy(root, 2 * EVERY, tmp_path / "mixed.ckpt")
    rank_dir = checkpoint_folder.rank_state_dir(mixed, 0)
    shutil.rmtree(rank_dir)
    shutil.copytree(checkpoint_folder.rank_state_dir(ckpt(root, EVERY), 0), rank_dir)  # device state of step 4
    with pytest.raises(CheckpointError, match=re.escape(str(rank_dir)) + ".*(another save|seal records)"):
        train(tmp_path / "a", ckpt_path=mixed, every=None)
    _reseal(mixed)  # even sealed again, the steps recorded in its parts disagree
    with pytest.raises(CheckpointError, match=r"host_state.json records global step 4, but .* records step 8"):
        train(tmp_path / "b", ckpt_path=mixed, every=None)


@pytest.mark.parametrize("victim", ["host_state", "seal", "manifest"])
def test_damaged_json_names_the_file(reference, tmp_path, victim) -> None:
    root, _ = reference
    copy = _copy(root, EVERY, tmp_path / "damaged.ckpt")
    path = {
        "host_state": checkpoint_folder.rank_state_dir(copy, 0) / "host_state.json",
        "seal": copy / SEAL,
        "manifest": checkpoint_folder.rank_state_dir(copy, 0) / "manifest.json",
    }[victim]
    path.write_text(path.read_text()[:-30])
    if victim == "host_state":
        _reseal(copy)  # the damage got past the seal: the file's own check must still name it
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + ".*corrupt") as info:
        train(tmp_path / "resume", ckpt_path=copy, every=None)
    assert "JSONDecodeError" not in str(info.value) and "KeyError" not in str(info.value)


def test_a_save_after_a_later_run_removed_the_temporary_state_is_refused_saying_so(tmp_path) -> None:
    """`storage_paths=None`: a run's state lives in temporary directories until the next run in the process starts.
    `t1.fit(); t2.fit(); t1.save_checkpoint(path)` failed on a missing `engine-swap` directory; it is refused, saying
    what removed the state and how to keep it, and leaves nothing behind."""
    trainers: list[L.Trainer] = []
    temporary = {"strategy_kwargs": {"storage_paths": None}}
    train(tmp_path / "first", steps=2, every=None, trainers=trainers, **temporary)
    train(tmp_path / "second", steps=2, every=None, trainers=trainers, **temporary)
    with pytest.raises(StorageError, match=r"removed when a later run started in this process.*give `storage_paths`"):
        trainers[0].save_checkpoint(tmp_path / "late.ckpt")
    assert not [p for p in tmp_path.iterdir() if "late.ckpt" in p.name]
    trainers[1].save_checkpoint(tmp_path / "latest.ckpt")  # the later run's state is still there
    checkpoint_folder.verify(tmp_path / "latest.ckpt", checksum_shards=True)


def test_resuming_with_another_optimizer_is_refused_naming_both(reference, tmp_path, monkeypatch) -> None:
    """A checkpoint of AdamW resumed with SGD: refused, naming the rule the state is of and this run's, in words (it
    listed every shard's manifest entry twice, and told the user to keep `chunk_size`, which may change)."""
    import scripts.ckpt_common as common

    root, _ = reference
    sgd = lambda model: (torch.optim.SGD(param_groups(model, 0.1), lr=0.1, momentum=0.9), None)  # noqa: E731
    monkeypatch.setattr(common, "adamw_cosine", sgd)
    with pytest.raises(ValueError) as refused:
        train(tmp_path, ckpt_path=ckpt(root, EVERY), every=None)
    message = str(refused.value)
    assert re.search(r"the state of the update rule 'adam' \(exp_avg, exp_avg_sq\), this run's optimizer updates "
                     r"with 'sgd' \(", message), message  # fmt: skip
    assert "`chunk_size` may change" in message and "'index'" not in message


def test_an_unsealed_directory_is_refused_naming_the_seal(reference, tmp_path) -> None:
    root, _ = reference
    copy = _copy(root, EVERY, tmp_path / "unsealed.ckpt")
    (copy / SEAL).unlink()
    with pytest.raises(CheckpointError, match=re.escape(str(copy / SEAL)) + " is missing"):
        train(tmp_path / "resume", ckpt_path=copy, every=None)


# ---------------------------------------------------------------------------------------------- a device I/O error


class FailingWrites(ThreadedIO):
    """The real ``ThreadedIO``, except that writes fail with EIO once step ``fail_at`` has started."""

    trainer: L.Trainer | None = None
    fail_at = 6

    def write(self, file, buf, offset) -> None:
        if self.trainer is not None and self.trainer.global_step + 1 >= self.fail_at:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        super().write(file, buf, offset)


class ArmFailingWrites(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        FailingWrites.trainer = trainer


def test_a_device_error_fails_the_step_refuses_to_save_and_the_last_checkpoint_resumes(
    reference, tmp_path, monkeypatch
) -> None:
    _, expected = reference
    monkeypatch.setattr(engine_setup, "choose_io_engine", lambda settings, dirs: EngineChoice(FailingWrites, "failing"))
    monkeypatch.setattr(FailingWrites, "trainer", None)
    ckpts = tmp_path / "ckpts"
    # Lightning's own OnExceptionCheckpoint would save over last.ckpt with whatever the devices hold.
    on_exception = OnExceptionCheckpoint(dirpath=ckpts, filename="last")
    trainers: list[L.Trainer] = []
    with pytest.warns(UserWarning, match="refused: a device failed earlier"), pytest.raises(StorageError) as info:
        train(tmp_path, checkpointing="last", callbacks=[ArmFailingWrites(), on_exception], trainers=trainers)
    assert not trainers[0].strategy.has_smart_update  # torn down: buffers, threads and the storage claim released
    message = str(info.value)
    assert info.value.errno == errno.EIO and "EIO (5)" in message and "write" in message
    assert str(tmp_path / "ssd") in message
    monkeypatch.undo()
    # The error reached the step that failed; the checkpoint of step 4 is the last good one and untouched.
    assert visible(ckpts) == ["epoch=0-step=4.ckpt", "last.ckpt"] and not hidden(ckpts)
    assert checkpoint_step(ckpts / "last.ckpt") == EVERY
    checkpoint_folder.verify(ckpts / "last.ckpt", checksum_shards=True)
    resumed = train(tmp_path / "resume", ckpt_path=ckpts / "last.ckpt", every=None)
    assert_identical(resumed, expected)


def test_save_checkpoint_after_a_device_error_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(engine_setup, "choose_io_engine", lambda settings, dirs: EngineChoice(FailingWrites, "failing"))
    monkeypatch.setattr(FailingWrites, "trainer", None)
    trainers: list[L.Trainer] = []
    with pytest.raises(StorageError):
        train(tmp_path, every=None, trainers=trainers, callbacks=[ArmFailingWrites()])
    path = tmp_path / "after-error.ckpt"
    with pytest.raises(StorageError, match=r"refused: a device failed earlier.*EIO \(5\)"):
        trainers[0].save_checkpoint(path)
    assert not path.exists() and not hidden(tmp_path)


def test_a_checkpoint_moved_aside_by_an_interrupted_save_is_named(reference, tmp_path) -> None:
    """Where `renameat2(RENAME_EXCHANGE)` is missing, a save renames the old checkpoint aside first; a kill right
    then leaves no checkpoint at the name, and loading says where the old one is."""
    root, _ = reference
    aside = _copy(root, EVERY, tmp_path / ".last.ckpt.aside-123-abcd")
    with pytest.raises(CheckpointError, match=re.escape(str(aside)) + ".*Rename it back to 'last.ckpt'"):
        train(tmp_path / "resume", ckpt_path=tmp_path / "last.ckpt", every=None)


class ParamsAtStart(L.Callback):
    """The full fp32 parameters when training starts (after a resume has loaded its checkpoint)."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        import deepspeed

        params = list(pl_module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            self.params = {n: p.detach().float().clone() for n, p in params}


#: The CPU kernels of torch the fixture's runs computed with: resumed on a machine with the same ones, the run is
#: bit for bit that commit's; elsewhere the steps after the resume round differently (``torch.backends.cpu``).
FIXTURE_CPU_CAPABILITY = "AVX512"


def _computes_like_the_fixtures_cpu() -> bool:
    """Whether this CPU rounds as the one the fixture was made on: AVX-512 without AMX tiles. A CPU with AMX reports
    the same capability, but the steps after the resume rounded differently there (a Sapphire Rapids-class VM,
    within the tolerance below)."""
    return torch.backends.cpu.get_cpu_capability() == FIXTURE_CPU_CAPABILITY and not torch.cpu._is_amx_tile_supported()


def test_a_checkpoint_saved_before_the_restructure_resumes_bit_identically(tmp_path) -> None:
    """`tests/fixtures/checkpoint-c000ce3` was saved at step 4 by the code of commit c000ce3 (before the device state
    moved into `SmartUpdate`), training `scripts.ckpt_common`'s model with `compression=0.05`, so it holds a residual
    too. Loaded by today's code, the parameters are bit for bit the checkpoint's masters; the resumed run ends with
    the parameters that commit's uninterrupted 8-step run ended with (`checkpoint-c000ce3-final.safetensors`): bit
    for bit on a CPU with the fixture's kernels, within rounding elsewhere. DeepSpeed's recovery scripts
    (`zero_to_fp32.py`, `zero_to_torch.py`) were taken out of the fixture and its seal, to keep third-party code out
    of the repository; everything loading reads is as saved. If `ckpt_common`'s model or data change, make the
    fixture again with that commit (see the test's history)."""
    from safetensors.torch import load_file

    fixtures = Path(__file__).parent / "fixtures"
    checkpoint = tmp_path / "step=4.ckpt"
    shutil.copytree(fixtures / "checkpoint-c000ce3", checkpoint)
    # Git keeps no empty folder, so the fixture lacks DeepSpeed's empty `offloaded_tensors/rank00`, as a checkpoint
    # copied with `aws s3 sync` does: loading recreates it.
    assert not (checkpoint / "checkpoint" / "offloaded_tensors").exists()
    saved = consolidate_fp32_state_dict(checkpoint)
    expected = load_file(str(fixtures / "checkpoint-c000ce3-final.safetensors"))
    # That commit's compressed AdamW ran the optimizer's own rule; today's default is EF-Adam.
    compression = {"ratio": 0.05, "rule": "optimizer"}
    at_start = ParamsAtStart()
    resumed = train(
        tmp_path / "run",
        steps=2 * EVERY,
        ckpt_path=checkpoint,
        every=None,
        callbacks=[at_start],
        strategy_kwargs={"compression": compression},
    )
    assert_identical(at_start.params, saved)
    if _computes_like_the_fixtures_cpu():
        assert_identical(resumed, expected)
    else:
        for name, value in expected.items():
            torch.testing.assert_close(resumed[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_a_checkpoint_saved_before_ef_adam_resumes_under_it(tmp_path, caplog) -> None:
    """The same old checkpoint, resumed as users will resume it, with `compression=0.05` and today's default rule:
    its Adam state is converted to EF-Adam's with one warning, and training goes on."""
    checkpoint = tmp_path / "step=4.ckpt"
    shutil.copytree(Path(__file__).parent / "fixtures" / "checkpoint-c000ce3", checkpoint)
    with caplog.at_level("WARNING", logger="lightning_smartinf.core.format.state_files"):
        resumed = train(
            tmp_path / "run", steps=2 * EVERY, ckpt_path=checkpoint, every=None, strategy_kwargs={"compression": 0.05}
        )
    assert "saved by update rule adam; converting it to ef_adam" in caplog.text
    assert all(torch.isfinite(p).all() for p in resumed.values())
    loaded: list = []  # the state the resume made, saved before any step: Adam's first moment dropped
    train(
        tmp_path / "loaded",
        steps=EVERY,
        ckpt_path=checkpoint,
        every=None,
        trainers=loaded,
        strategy_kwargs={"compression": 0.05},
    )
    loaded[0].save_checkpoint(tmp_path / "converted.ckpt")
    assert_converted(checkpoint, tmp_path / "converted.ckpt")
