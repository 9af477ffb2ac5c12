"""A run is quiet enough for the loss and the figures to stand out (issue 18): the demo and `smartinf fit` print at
most 5 warning lines, the silenced warnings are exactly the known-harmless ones, and only while SmartUpdate runs."""

from __future__ import annotations

import os
import re
import stat
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.machine import lacking
from helpers.models import LMModule, adamw_factory, fit

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.lightning import quiet

REPO = Path(__file__).resolve().parents[1]
#: A line of a warning: Python's and Lightning's format (`file.py:12: ...`), DeepSpeed's (`[WARNING]`), or a
#: `...Warning` category named anywhere.
WARNING_LINE = re.compile(r"^\S+\.py:\d+: |\[WARNING\]|\b[A-Z]\w*Warning\b")


def warning_lines(output: str) -> list[str]:
    """The warning lines of ``output``, with the indented source line Python prints after a warning."""
    lines = output.splitlines()
    found = []
    for i, line in enumerate(lines):
        if WARNING_LINE.search(line) or (i and line.startswith("  ") and WARNING_LINE.search(lines[i - 1])):
            found.append(line)
    return found


@pytest.mark.slow
def test_the_demo_prints_at_most_5_warning_lines(demo_run) -> None:
    assert re.search(r"^step +\d+  loss \d", demo_run, re.M) and "host link, SmartUpdate" in demo_run
    lines = warning_lines(demo_run)
    assert len(lines) <= 5, "\n".join(lines)
    assert not any("reduce_scatter_tensor" in line or "litlogger" in line for line in demo_run.splitlines())


@pytest.mark.slow
def test_smartinf_fit_with_a_cpu_recipe_prints_at_most_5_warning_lines(gpt2_recipe_run) -> None:
    _, output = gpt2_recipe_run
    assert "max_steps=3` reached" in output
    lines = warning_lines(output)
    assert len(lines) <= 5, "\n".join(lines)


class WarnsInTraining(LMModule):
    def training_step(self, batch, batch_idx):
        warnings.warn("the user's own warning", UserWarning, stacklevel=1)
        message = "`torch.distributed.reduce_scatter_tensor` is deprecated, from the user's code"
        warnings.warn(message, FutureWarning, stacklevel=1)
        return super().training_step(batch, batch_idx)


adamw = adamw_factory(lr=1e-3)


def test_only_the_known_messages_are_silenced_and_only_while_the_strategy_runs(tmp_path) -> None:
    """The user's warnings show (even one with a silenced message raised from their own module); after teardown the
    filters are gone."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        filters_before = list(warnings.filters)
        fit(WarnsInTraining(adamw), SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=2000), steps=1)
        filters_after = list(warnings.filters)
    messages = [str(w.message) for w in caught]
    assert "the user's own warning" in messages
    assert any("from the user's code" in m for m in messages)
    assert not any(m.startswith("`torch.distributed.reduce_scatter_tensor` is deprecated. Please") for m in messages)
    assert filters_after == filters_before


def test_deepspeeds_untested_optimizer_line_is_not_shown_for_a_supported_optimizer(tmp_path) -> None:
    """SGD is supported (its update is checked against `torch.optim`); DeepSpeed's "untested optimizer, proceed with
    caution" line, logged for every optimizer outside its own short list, is not shown."""
    import logging

    def sgd(model):  # noqa: ANN001, ANN202 - LMModule's factory
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), None

    logged: list[str] = []  # what DeepSpeed logs, seen by a filter that runs before the strategy's
    shown: list[str] = []  # what reaches the handlers
    catcher = logging.Handler()
    catcher.emit = lambda record: shown.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("DeepSpeed")
    seen = lambda record: logged.append(record.getMessage()) or True  # noqa: E731
    logger.filters.insert(0, seen)  # first: a filter drops a record before later ones see it
    logger.addHandler(catcher)
    try:
        fit(LMModule(sgd), SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=2000), steps=1)
    finally:
        logger.removeHandler(catcher)
        logger.removeFilter(seen)
    assert any("untested optimizer" in message for message in logged)  # DeepSpeed says it
    assert not any("untested optimizer" in message for message in shown)  # and the user does not see it


def test_silence_removes_exactly_its_filters() -> None:
    import logging

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("DeepSpeed", logging.WARNING, __file__, 0, message, None, None)

    silenced, shown = record("Offloading to NVMe can generate heavy write traffic (...)"), record("a user's message")
    before = list(warnings.filters)
    logger = logging.getLogger("DeepSpeed")
    log_filters_before = list(logger.filters)
    handle = quiet.silence(entry_point=True)
    assert len(warnings.filters) == len(before) + len(quiet.WARNINGS)
    assert not logger.filter(silenced) and logger.filter(shown)
    handle.restore()
    handle.restore()  # idempotent
    assert list(warnings.filters) == before
    assert logger.filters == log_filters_before


def _a_block_device_mount() -> str:
    """A mount point of this machine on a block device (the root filesystem, on any machine that boots a disk): one
    whose source is a block-device node, found without the code under test."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        source, mount_point = line.split()[:2]
        mount_point = mount_point.replace("\\040", " ")
        try:
            is_block = stat.S_ISBLK(os.stat(source).st_mode) and os.path.isdir(mount_point)
        except OSError:
            continue
        if is_block:
            return mount_point
    lacking("no filesystem of this machine is on a block device (/proc/self/mounts, /sys/dev/block)")


def test_endurance_note_is_said_once_and_only_for_block_devices(monkeypatch) -> None:
    monkeypatch.setattr(quiet, "_endurance_said", False)
    assert quiet.endurance_note(["/dev/shm"], 10**9) is None  # tmpfs: no drive wears out
    disk = _a_block_device_mount()
    note = quiet.endurance_note(["/dev/shm", disk], 12 * 10**9)
    assert note is not None and "12 GB per step (12 TB per 1000 steps)" in note and disk in note
    assert quiet.endurance_note([disk], 12 * 10**9) is None  # once per process


def test_a_module_without_the_strategy_keeps_every_warning() -> None:
    """Nothing is silenced by importing the package or building a strategy: only set-up to teardown."""
    before = list(warnings.filters)
    SmartInfinityStrategy()
    L.Trainer(logger=False, enable_progress_bar=False)
    assert list(warnings.filters) == before


@pytest.mark.parametrize("entry", quiet.WARNINGS)
def test_every_silenced_warning_says_why(entry) -> None:
    assert len(entry.why) > 20 and re.compile(entry.message) and re.compile(entry.module)
