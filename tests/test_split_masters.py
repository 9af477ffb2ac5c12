"""`SmartInfinityStrategy(split_masters=True)` as users run it: a bf16 fit with clipping that fires and that does not,
its checkpoints, resumes with it on and off, and the settings it refuses. Split masters are exact, so every run here
must equal, bit for bit, the same run with whole masters."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.launch import SCRIPTS, python, worker_env
from helpers.models import assert_identical
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from scripts.ckpt_common import EVERY, train

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.commands.export import consolidate_fp32_state_dict
from lightning_smartinf.core import split_masters
from lightning_smartinf.core.format import checkpoint_folder
from lightning_smartinf.core.format.state_files import read_manifest, shard_file_name
from lightning_smartinf.core.io.direct import IO_ALIGN, round_up

STEPS = 8
SPLIT = {"split_masters": True}


def _storage_bytes_per_step(trainer, split: bool) -> int:
    """What one step reads (and writes) of every shard's records, from their padded sizes."""
    total = 0
    for shard in trainer.strategy.smart_update.backend.shards:
        layout = shard.layout
        for k in range(layout.num_chunks):
            padded = layout.padded_len(k)
            master = round_up(split_masters.region_bytes(padded), IO_ALIGN) if split else 4 * padded
            total += master + 8 * padded
    return total


@pytest.mark.parametrize("clip", [None, 1e-3], ids=["no-clipping", "clipping-fires"])
def test_a_bf16_fit_equals_whole_masters_bit_for_bit_and_moves_fewer_bytes(tmp_path, clip):
    trainers: list = []
    split = train(
        tmp_path / "a", steps=STEPS, every=None, precision="bf16-mixed", gradient_clip_val=clip,
        strategy_kwargs=SPLIT, trainers=trainers,
    )  # fmt: skip
    whole = train(
        tmp_path / "b", steps=STEPS, every=None, precision="bf16-mixed", gradient_clip_val=clip, trainers=trainers
    )
    assert_identical(split, whole)
    controllers = [t.strategy.smart_update for t in trainers]
    # Both kept their hand-offs without clipping, and rolled them back and redid them where clipping fired.
    assert [c.early_kept > 0 for c in controllers] == [clip is None] * 2
    assert [c.early_rolled_back > 0 for c in controllers] == [clip is not None] * 2
    per_step = [t.callback_metrics["smartinf/storage_read_bytes"] for t in trainers]
    assert per_step == [_storage_bytes_per_step(trainers[0], True), _storage_bytes_per_step(trainers[1], False)]
    assert per_step[0] < per_step[1]
    assert trainers[0].callback_metrics["smartinf/storage_write_bytes"] == per_step[0]


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_each_state_format_over_split_masters_equals_whole_masters(tmp_path, precision):
    """Users' AdamW (not fused) in bf16 and int8 state: the devices' kernels read and write the split masters in
    their one pass, and hand-offs kept and rolled back (clipping that fires at the end) give the same bits."""
    kwargs = {"state_precision": precision}
    for clip in (None, 1e-3):
        split = train(
            tmp_path / f"a{clip}", steps=4, every=None, precision="bf16-mixed", gradient_clip_val=clip,
            strategy_kwargs={**kwargs, **SPLIT},
        )  # fmt: skip
        whole = train(
            tmp_path / f"b{clip}", steps=4, every=None, precision="bf16-mixed", gradient_clip_val=clip,
            strategy_kwargs=kwargs,
        )  # fmt: skip
        assert_identical(split, whole)


def test_compressed_gradients_update_split_masters_as_whole_ones(tmp_path):
    """With top-k compression the devices take sparse gradients after backward: the same masters either way."""
    kwargs = {"compression": 0.3}
    split = train(tmp_path / "a", steps=4, every=None, precision="bf16-mixed", strategy_kwargs={**kwargs, **SPLIT})
    whole = train(tmp_path / "b", steps=4, every=None, precision="bf16-mixed", strategy_kwargs=kwargs)
    assert_identical(split, whole)


def test_checkpoints_hold_whole_masters_and_resume_with_split_masters_on_or_off(tmp_path):
    split = train(tmp_path / "a", steps=STEPS, precision="bf16-mixed", strategy_kwargs=SPLIT)
    whole = train(tmp_path / "b", steps=STEPS, precision="bf16-mixed")
    assert_identical(split, whole)
    # The checkpoints' device state is the same bytes as a whole run's: it loads without the parameters.
    saved = [checkpoint_folder.rank_state_dir(tmp_path / run / "ckpts" / f"step={EVERY}.ckpt", 0) for run in "ab"]
    manifest = read_manifest(saved[0])
    assert manifest == read_manifest(saved[1])
    for entry in manifest["shards"]:
        name = shard_file_name(entry["index"])
        assert (saved[0] / name).read_bytes() == (saved[1] / name).read_bytes()
    checkpoint = tmp_path / "a" / "ckpts" / f"step={EVERY}.ckpt"
    exported = consolidate_fp32_state_dict(checkpoint)
    for name, weight in consolidate_fp32_state_dict(tmp_path / "b" / "ckpts" / f"step={EVERY}.ckpt").items():
        assert torch.equal(exported[name], weight), name
    for source, kwargs in (("a", SPLIT), ("a", {}), ("b", SPLIT)):
        resumed = train(
            tmp_path / f"resume-{source}-{bool(kwargs)}",
            steps=STEPS,
            ckpt_path=tmp_path / source / "ckpts" / f"step={EVERY}.ckpt",
            every=None,
            precision="bf16-mixed",
            strategy_kwargs=kwargs,
        )
        assert_identical(resumed, whole)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_launched_by_lightning_crash_and_resume_with_split_masters(tmp_path, free_port):
    """`Trainer(devices=2)`, `save_last=True`: a run with split masters and part of each rank's state in host memory
    crashes, resumes with split masters all on the storage paths, and ends where a run with whole masters ends."""
    bf16 = {"precision": "bf16-mixed"}
    for mode, settings in (
        ("full", bf16),
        ("crash", {**bf16, **SPLIT, "state_memory_budget": 40_000}),
        ("resume", {**bf16, **SPLIT}),
    ):
        env = worker_env(MASTER_PORT=str(free_port()))
        done = python(
            SCRIPTS / "train_two_ranks_save_last.py", tmp_path, mode, json.dumps(settings), env=env, check=False
        )
        assert done.returncode == (3 if mode == "crash" else 0), done.stdout[-2000:] + done.stderr[-4000:]
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert_identical(torch.load(tmp_path / "resumed.pt", weights_only=True), full)


@pytest.mark.slow
def test_a_resume_onto_other_sub_groups_sets_the_parameters_it_splits(tmp_path):
    """A re-sharding load writes the split records and the parameters that hold their other halves."""
    whole = train(
        tmp_path / "a", steps=STEPS, precision="bf16-mixed", strategy_kwargs={**SPLIT, "state_precision": "bf16"}
    )
    resumed = train(
        tmp_path / "b",
        steps=STEPS,
        ckpt_path=tmp_path / "a" / "ckpts" / f"step={EVERY}.ckpt",
        every=None,
        precision="bf16-mixed",
        strategy_kwargs={**SPLIT, "state_precision": "bf16", "sub_group_size": 1700},
    )
    assert_identical(resumed, whole)


def test_runs_whose_parameters_cannot_hold_half_a_master_are_refused_before_training(tmp_path):
    with pytest.raises(MisconfigurationException, match=r"`split_masters='yes'` is a str: it must be True or False"):
        SmartInfinityStrategy(split_masters="yes")
    with pytest.raises(MisconfigurationException, match=r"`split_masters=True` with `backend='remote'`"):
        SmartInfinityStrategy(
            backend="remote", split_masters=True, remote_devices=["127.0.0.1:1"], remote_token_file=str(tmp_path)
        )
    for precision, where in (("32-true", "in the precision of `precision='32-true'`"),):
        with pytest.raises(MisconfigurationException, match=f"keeps its parameters {where}"):
            train(tmp_path / precision, steps=1, every=None, precision=precision, strategy_kwargs=SPLIT)
    # The parameters on storage are the strategy's own argument: refused when it is built, before any model loads.
    with pytest.raises(MisconfigurationException, match=r"on storage \(`offload_parameters='storage'`\)"):
        SmartInfinityStrategy(**SPLIT, offload_parameters="storage")
    assert not any(tmp_path.rglob("*.state"))
