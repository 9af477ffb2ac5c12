"""The planner's printed snippets paste: the Python builds the strategy, the YAML is a valid `smartinf fit` config.

Each case runs `smartinf plan` as a user would, cuts the Python and YAML out of what it printed, swaps the
``/mnt/csd*`` placeholders for real directories (the strategy checks that storage paths exist), and then runs the
Python with the real ``lightning_smartinf`` imports and the YAML through ``smartinf fit --print_config``. Both must
carry every setting of the plan, which ``--json`` prints for the same invocation.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.cli import main as smartinf
from lightning_smartinf.core.compression import TopKCompression
from lightning_smartinf.plan.planner import PYTHON_HEADER, STORAGE_PLACEHOLDER, YAML_HEADER

PLACEHOLDER = re.compile(re.escape(STORAGE_PLACEHOLDER).replace(r"\{\}", r"(\d+)"))

GPT2_CONFIG = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257}

#: (planner arguments, devices expected, compression expected in the snippets)
INVOCATIONS = {
    "33B-6-devices-compressed": (["--model", "33B", "--devices", "6", "--compression", "0.01"], 6, 0.01),
    "350M-devvm-recommended": (["--model", "350M", "--profile", "devvm-2cpu"], 2, None),
    "8.4B-a100-10-devices": (["--model", "8.4B", "--profile", "paper-a100", "--devices", "10"], 10, 0.01),
    "1.3B-1-device-5%": (["--model", "1.3B", "--devices", "1", "--compression", "0.05"], 1, 0.05),
    "7B-devvm-tiny-ratio": (["--model", "7B", "--profile", "devvm-2cpu", "--compression", "0.00001"], 2, 1e-5),
    "gpt2-config-fp32-link": (["--model", "GPT2_CONFIG", "--transfer-bytes", "4", "--devices", "3"], 3, 0.01),
    "100B-recommended-devices": (["--model", "100B"], 9, 0.01),
    "25M-devvm-1-device": (["--model", "25M", "--profile", "devvm-2cpu", "--devices", "1"], 1, None),
}


def plan_output(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    capsys.readouterr()
    assert smartinf(["plan", *argv]) == 0
    return capsys.readouterr().out


def section(out: str, header: str) -> str:
    """The snippet printed under ``header``: up to the next header, or the end."""
    lines = out.splitlines()
    start = lines.index(header) + 1
    headers = [i for i, line in enumerate(lines) if line in (PYTHON_HEADER, YAML_HEADER) and i >= start]
    return "\n".join(lines[start : headers[0] if headers else len(lines)]).strip("\n") + "\n"


def with_real_paths(snippet: str, root: Path, devices: int) -> tuple[str, list[Path]]:
    """The snippet with each placeholder storage path replaced by a new directory under ``root``."""
    numbers = sorted({int(n) for n in PLACEHOLDER.findall(snippet)})
    assert numbers == list(range(devices)), snippet
    paths = [root / f"csd{i}" for i in numbers]
    for path in paths:
        path.mkdir(exist_ok=True)
    return PLACEHOLDER.sub(lambda m: str(paths[int(m.group(1))]), snippet), paths


@pytest.fixture(params=list(INVOCATIONS), ids=list(INVOCATIONS))
def planned(request, tmp_path, capsys) -> tuple[str, dict, int, float | None]:
    """(printed text, --json plan, devices, compression) of one planner invocation."""
    argv, devices, compression = INVOCATIONS[request.param]
    if "GPT2_CONFIG" in argv:
        (tmp_path / "gpt2").mkdir()
        (tmp_path / "gpt2" / "config.json").write_text(json.dumps(GPT2_CONFIG))
        argv = [str(tmp_path / "gpt2") if a == "GPT2_CONFIG" else a for a in argv]
    out = plan_output(capsys, argv)
    return out, json.loads(plan_output(capsys, [*argv, "--json"])), devices, compression


def test_snippets_carry_every_recommended_setting_and_no_stale_text(planned):
    out, plan, devices, compression = planned
    assert "not yet" not in out and "SmartComp) -" not in out
    assert plan["devices"] == devices and plan["compression"] == compression
    expected = {
        "storage_paths": [STORAGE_PLACEHOLDER.format(i) for i in range(devices)],
        "sub_group_size": plan["sub_group_size"],
        "buffer_count": plan["buffer_count"],
    }
    if compression is not None:
        expected.update(compression=compression, overlap_backward=False)
    assert plan["strategy"] == expected
    init_args = yaml.safe_load(section(out, YAML_HEADER))["trainer"]["strategy"]["init_args"]
    assert init_args == expected
    python = section(out, PYTHON_HEADER)
    for name in expected:
        assert re.search(rf"^    {name}=", python, re.MULTILINE), name


def test_printed_python_builds_the_strategy(planned, tmp_path):
    out, plan, devices, compression = planned
    code, paths = with_real_paths(section(out, PYTHON_HEADER), tmp_path, devices)
    namespace: dict = {}
    exec(compile(code, "<smartinf plan python>", "exec"), namespace)  # noqa: S102 (the planner's own output)
    strategy = namespace["strategy"]
    assert type(strategy) is SmartInfinityStrategy
    assert strategy.settings.storage_paths == tuple(p.resolve() for p in paths)
    assert strategy.config["zero_optimization"]["sub_group_size"] == plan["sub_group_size"]
    assert strategy.settings.buffer_count == plan["buffer_count"]
    if compression is None:
        assert strategy.settings.compression is None and strategy.settings.overlap
    else:
        assert strategy.settings.compression == TopKCompression(compression)
        assert not strategy.settings.overlap


def test_printed_yaml_is_a_smartinf_fit_config(planned, tmp_path, capsys):
    """The snippet, as a second ``--config`` after a recipe without a strategy, parses against the real signatures;
    its ``init_args`` then build the strategy."""
    out, plan, devices, compression = planned
    recipe = yaml.safe_load((REPO_ROOT / "recipes" / "gpt2-pretrain-cpu.yaml").read_text())
    del recipe["trainer"]["strategy"]
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe))
    snippet, paths = with_real_paths(section(out, YAML_HEADER), tmp_path, devices)
    (tmp_path / "strategy.yaml").write_text(snippet)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        smartinf(["fit", "--config", str(recipe_file), "--config", str(tmp_path / "strategy.yaml"), "--print_config"])
    assert exc.value.code == 0
    strategy = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_smartinf.SmartInfinityStrategy"
    init_args = yaml.safe_load(snippet)["trainer"]["strategy"]["init_args"]
    assert init_args["storage_paths"] == [str(p) for p in paths]
    assert {name: strategy["init_args"][name] for name in init_args} == init_args
    built = SmartInfinityStrategy(**init_args)
    assert built.settings.buffer_count == plan["buffer_count"]
    assert built.settings.compression == (None if compression is None else TopKCompression(compression))
