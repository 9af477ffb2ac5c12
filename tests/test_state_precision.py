"""`SmartInfinityStrategy(state_precision=...)` as users run it: a fit, its checkpoints, a resume in the same format
and in another, and the settings it refuses."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.checkpoints import device_states
from helpers.models import LMModule, adamw_factory, assert_identical, fit, small_strategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from scripts.ckpt_common import EVERY, adamw_cosine, train

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.commands.export import consolidate_fp32_state_dict
from lightning_smartinf.core.format import checkpoint_folder
from lightning_smartinf.core.format.state_files import read_manifest
from lightning_smartinf.core.state_formats import state_format

STEPS = 8


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_fit_keeps_its_state_in_the_format_and_resumes_bit_identically(tmp_path, precision):
    kwargs = {"state_precision": precision}
    whole = train(tmp_path / "a", steps=STEPS, strategy_kwargs=kwargs)
    fp32 = train(tmp_path / "b", steps=STEPS, every=None)
    half = tmp_path / "a" / "ckpts" / f"step={EVERY}.ckpt"
    manifest = read_manifest(checkpoint_folder.rank_state_dir(half, 0))
    assert {e["state_format"] for e in manifest["shards"]} == {precision}
    # Every stored moment is one the format holds: storing it again changes nothing.
    fmt = state_format(precision)
    for states in device_states(half).values():
        for name, value in states.items():
            if name == "master":
                continue
            raw = torch.empty(fmt.stored_bytes(value.numel()), dtype=torch.uint8)
            again = torch.empty_like(value)
            fmt.store(value, raw, name)
            fmt.load(raw, again, name)
            assert torch.equal(again, value), name
    # `smartinf export`'s reader takes every master out of the records in the format, exactly as they were saved.
    exported = torch.cat([w.flatten() for w in consolidate_fp32_state_dict(half).values()])
    saved = torch.cat([states["master"] for states in device_states(half).values()])
    assert exported.dtype == torch.float32 and torch.equal(exported.sort().values, saved.sort().values)
    # Near the fp32 run after a few steps, and not the same.
    assert any(not torch.equal(whole[n], fp32[n]) for n in fp32)
    initial = LMModule(adamw_cosine).state_dict()
    for n in fp32:
        moved = float((fp32[n] - initial[n]).abs().mean())
        assert float((whole[n] - fp32[n]).abs().mean()) <= 0.1 * moved + 1e-6, n

    resumed = train(tmp_path / "c", steps=STEPS, ckpt_path=half, every=None, strategy_kwargs=kwargs)
    assert_identical(resumed, whole)


def test_resume_of_an_fp32_checkpoint_into_int8_converts_with_one_warning(tmp_path, caplog):
    train(tmp_path / "a", steps=EVERY)
    with caplog.at_level(logging.WARNING, logger="lightning_smartinf"):
        params = train(
            tmp_path / "b",
            steps=2 * EVERY,
            ckpt_path=tmp_path / "a" / "ckpts" / f"step={EVERY}.ckpt",
            every=None,
            strategy_kwargs={"state_precision": "int8"},
        )
    converting = [r for r in caplog.records if "converting it to int8" in r.getMessage()]
    assert len(converting) == 1 and "loses precision" in converting[0].getMessage()
    assert all(torch.isfinite(p).all() for p in params.values())


def test_settings_it_refuses_name_the_argument_and_the_fix(tmp_path):
    with pytest.raises(
        MisconfigurationException,
        match=r"`state_precision='fp16'` is not supported: it must be one of: 'fp32', 'bf16', 'int8'",
    ):
        SmartInfinityStrategy(state_precision="fp16")
    (tmp_path / "x.xclbin").touch()
    strategy = SmartInfinityStrategy(backend="xrt", state_precision="int8", xclbin=str(tmp_path / "x.xclbin"))
    assert strategy.settings.state_precision == "int8"  # the SmartSSD kernels hold every format too
    for value in ("fp32", "bf16", "int8"):
        assert SmartInfinityStrategy(state_precision=value).settings.state_precision == value


def test_an_update_without_state_is_refused_before_anything_is_written(tmp_path):
    class SGDModule(LMModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(MisconfigurationException, match=r"'sgd' update keeps no per-element state"):
        fit(SGDModule(adamw_factory()), small_strategy(tmp_path / "a", state_precision="int8"), steps=1)
    assert not any((tmp_path / "a").rglob("*.state"))
    # A rule the arguments name is known without the optimizer: refused when the strategy is built, before a model
    # that may take minutes to load.
    with pytest.raises(MisconfigurationException, match=r"'ef_adafactor' update keeps no per-element state"):
        SmartInfinityStrategy(compression={"ratio": 0.01, "rule": "ef_adafactor"}, state_precision="int8")


@pytest.mark.slow
def test_a_resume_onto_other_sub_groups_re_shards_every_format(tmp_path):
    """bf16 is stored element by element, so re-sharded state is the same state: the resume equals the run that
    never stopped. int8's scales belong to blocks of 256 elements, which re-sharding regroups: each element is
    stored again under its new block's scale (within the format's bound), and training goes on from there."""
    for precision in ("bf16", "int8"):
        kwargs = {"state_precision": precision}
        whole = train(tmp_path / precision / "a", steps=STEPS, strategy_kwargs=kwargs)
        half = tmp_path / precision / "a" / "ckpts" / f"step={EVERY}.ckpt"
        trainers: list = []
        resumed = train(
            tmp_path / precision / "b",
            steps=STEPS,
            ckpt_path=half,
            every=None,
            strategy_kwargs={**kwargs, "sub_group_size": 5000, "chunk_size": 2048},
            trainers=trainers,
        )
        assert len(trainers[0].strategy.smart_update.sub_groups) != len(device_states(half))
        if precision == "bf16":
            assert_identical(resumed, whole)
        else:
            for n in whole:
                assert torch.isfinite(resumed[n]).all()
                assert float((resumed[n] - whole[n]).abs().max()) < 1e-2 * max(1.0, float(whole[n].abs().max())), n
