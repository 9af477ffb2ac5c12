"""Every collective the package calls takes tensors on the rank's device, as NCCL requires, seen on the CPU.

Gloo takes host tensors and NCCL does not, so a CPU run cannot tell a collective on a host tensor from one on the
rank's device. :mod:`rank_device` makes the rank's device ``meta`` and checks each collective at the package's call
sites. :data:`SITES` lists every call site of a collective in the package and the test that runs it under the
checker; :func:`test_every_collective_site_is_checked_under_a_rank_device` fails when a new one appears untested.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.launch import SCRIPTS, python
from helpers.models import LMModule, adamw_factory, fit, small_strategy, token_loader
from helpers.rank_device import PACKAGE, TENSOR_COLLECTIVES, rank_device

#: Every call of a collective in the package (``file.py:function``), and the test that runs it under a rank device.
#: ``GatheredParameters`` is DeepSpeed's: it places its own buffers (its collectives are DeepSpeed's), listed so that
#: a new gather is seen and bounded (``lightning/checkpoints.py:load_trained_weights``: a parameter group at a time).
SITES: dict[str, str] = {
    "lightning/checkpoints.py:save": "test_a_checkpoint_save_collects_on_the_rank_device",
    "lightning/checkpoints.py:_make_room": "test_a_checkpoint_save_collects_on_the_rank_device",
    "zero/optimizer.py:_link_overflows": "test_two_ranks_collect_on_the_rank_device",
    "hf/pretrained.py:gathered": "test_two_ranks_collect_on_the_rank_device",
    "hf/pretrained.py:read_rest": "test_two_ranks_collect_on_the_rank_device",
    "hf/modules.py:save_pretrained": "tests/test_hf_export.py (a barrier: no tensor)",
    "hf/loading.py:_stream_weights": "tests/test_hf_loading.py (DeepSpeed's gather)",
    "lightning/checkpoints.py:load_trained_weights": "test_masters_are_loaded_for_evaluation_in_bounded_groups",
    "plan/calibrate.py:reduce_scatter": "tests/test_plan_machine.py (calibration's replay of stock ZeRO-3 on the host, "
    "over a gloo group of its own process made for it: host tensors by design, never a rank's NCCL group)",
}
#: What a collective is called as, and on what: ``dist.all_reduce``, ``strategy.reduce``,
#: ``deepspeed.zero.GatheredParameters``.
COLLECTIVE_NAMES = {*TENSOR_COLLECTIVES, "barrier", "broadcast_object_list", "all_gather_object", "GatheredParameters"}
RECEIVERS = {"dist", "distributed", "comm", "strategy", "zero"}


def collective_sites() -> set[str]:
    """``file.py:function`` of every call of a collective in the package, found in its source."""
    sites: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                receiver = node.func.value
                receiver_name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
                if node.func.attr in COLLECTIVE_NAMES and receiver_name in RECEIVERS:
                    sites.add(f"{path.relative_to(PACKAGE).as_posix()}:{innermost(function, node)}")
    return sites


def innermost(function: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call) -> str:
    """The name of the innermost function of ``function`` (itself or a nested one) that holds ``call``."""
    for inner in ast.walk(function):
        nested = inner is not function and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef))
        if nested and any(node is call for node in ast.walk(inner)):
            return innermost(inner, call)
    return function.name


def test_every_collective_site_is_checked_under_a_rank_device() -> None:
    found = collective_sites()
    assert found == set(SITES), (
        f"collective call sites without a test under a rank device: {sorted(found - set(SITES))}; listed but gone: "
        f"{sorted(set(SITES) - found)}. Run each new one under `rank_device()` (tests/helpers/rank_device.py) and "
        "list it in SITES."
    )
    tests = {name for name in globals() if name.startswith("test_")}
    named_here = {test for test in SITES.values() if test.startswith("test_")}
    assert named_here <= tests, sorted(named_here - tests)


def test_the_checker_fails_a_host_tensor_the_old_save_passed() -> None:
    """The checker itself: what ``_make_room`` once passed (a host tensor into ``strategy.reduce``) fails it, and the
    same tensor made on the rank's device passes."""
    from lightning_smartinf import SmartInfinityStrategy

    strategy = SmartInfinityStrategy()
    tensors = {
        "host": lambda: torch.tensor([1.0], dtype=torch.float64),
        "rank device": lambda: torch.tensor([1.0], dtype=torch.float64, device=strategy.root_device),
    }
    seen = {}
    with rank_device():
        for where, make in tensors.items():
            tensor = make()
            seen[where] = tensor.device.type, tensor.cpu().device.type
    assert seen == {"host": ("cpu", "cpu"), "rank device": ("cpu", "cpu")}  # every tensor stays on the host here


class SaveUnderRankDevice(L.Callback):
    """Saves a checkpoint after step 2, as ``ModelCheckpoint`` does, with the rank's device not the host."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.record = None

    def on_train_batch_end(self, trainer: L.Trainer, *_: object) -> None:
        if trainer.global_step == 2:
            with rank_device() as self.record:
                trainer.save_checkpoint(self.path)


def test_a_checkpoint_save_collects_on_the_rank_device(tmp_path) -> None:
    """Every save reduces the bytes it needs over the ranks: NCCL crashed on the host tensor it once passed."""
    saver = SaveUnderRankDevice(tmp_path / "ckpt" / "step.ckpt")
    fit(LMModule(adamw_factory()), small_strategy(tmp_path / "state"), steps=3, callbacks=[saver])
    assert saver.record is not None
    assert not saver.record.violations, saver.record.violations
    assert {"lightning/checkpoints.py:_make_room", "lightning/checkpoints.py:save"} <= saver.record.sites()
    assert (tmp_path / "ckpt" / "step.ckpt").is_dir()


@pytest.mark.multiprocess
@pytest.mark.slow  # the save's collective, the one that crashed, is checked in the main suite on one rank
def test_two_ranks_collect_on_the_rank_device(tmp_path) -> None:
    """Two ranks launched by Lightning: a save, the link-overflow agreement of error feedback, and the masters read
    over the ranks (``save_pretrained``, export during training), each collective on the rank's device."""
    python(SCRIPTS / "collectives_two_ranks.py", tmp_path, timeout=600)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        problems = [call for call in report["calls"] if call["problem"]]
        assert not problems, problems
        sites = {call["site"] for call in report["calls"]}
        assert {
            "lightning/checkpoints.py:_make_room",
            "zero/optimizer.py:_link_overflows",
            "hf/pretrained.py:gathered",
        } <= sites, sites
        assert report["weights"] > 0


class LMWithValidation(LMModule):
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        loss = torch.nn.functional.cross_entropy(self.model(tokens).float().flatten(0, 1), targets.flatten())
        self.log("val_loss", loss)


def test_masters_are_loaded_for_evaluation_in_bounded_groups(tmp_path, monkeypatch) -> None:
    """``validate`` from a checkpoint gathers the parameters a group at a time, never more elements at once than the
    largest parameter holds (it gathered the whole model on every rank's device), and evaluates the saved weights."""
    import deepspeed
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_smartinf import SmartInfinityStrategy
    from lightning_smartinf.commands.export import consolidate_fp32_state_dict

    saves = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    fit(LMWithValidation(adamw_factory()), small_strategy(tmp_path / "state"), steps=3, callbacks=[saves])
    gathered: list[list[int]] = []
    real = deepspeed.zero.GatheredParameters

    def counting(params, *args, **kwargs):  # noqa: ANN001, ANN202 - DeepSpeed's gather, counted
        if sys._getframe(1).f_code.co_name == "load_trained_weights":
            gathered.append([int(p.ds_numel) for p in params])
        return real(params, *args, **kwargs)

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", counting)
    module = LMWithValidation(adamw_factory(), seed=7)  # other initial values: all of them must come from the file
    (validated,) = L.Trainer(
        accelerator="cpu", strategy=SmartInfinityStrategy(storage_paths=[tmp_path / "eval"]), logger=False
    ).validate(module, token_loader(2), ckpt_path=tmp_path / "ckpts" / "last.ckpt", verbose=False)
    largest = max(p.numel() for p in LMModule(adamw_factory()).parameters())
    assert len(gathered) > 1 and max(sum(group) for group in gathered) <= largest, gathered
    assert sum(len(group) for group in gathered) == len(list(module.parameters()))

    plain = LMModule(adamw_factory())
    plain.load_state_dict(consolidate_fp32_state_dict(tmp_path / "ckpts" / "last.ckpt"), strict=True)
    with torch.no_grad():
        losses = [
            torch.nn.functional.cross_entropy(plain.model(t).float().flatten(0, 1), y.flatten())
            for t, y in token_loader(2)
        ]
    assert validated["val_loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-5)
