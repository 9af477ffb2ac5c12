"""The `smartinf` command line: dispatch, errors, and the README's demo."""

from __future__ import annotations

import pytest

from lightning_smartinf.cli import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_unknown_command_is_exit_2_with_the_choices(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'; choose one of: demo, plan, export" in capsys.readouterr().err


def test_plan_subcommand(capsys):
    assert main(["plan", "--model", "350M", "--devices", "2"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-Infinity" in out and "SmartInfinityStrategy(" in out


def test_demo_trains_and_reports_traffic(capsys):
    assert main(["demo", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "step    3  loss" in out
    assert "less over the shared link" in out


@pytest.mark.parametrize("argv", [["plan", "--model", "seven"], ["demo", "--steps", "x"]])
def test_bad_arguments_exit_non_zero(argv):
    with pytest.raises(SystemExit) as exc:
        if main(argv) != 0:
            raise SystemExit(2)
    assert exc.value.code != 0
