"""The planner's printed snippets paste: the Python builds the strategy, the YAML is a valid `smartinf fit` config.

Each case runs `smartinf plan` as a user would, cuts the Python and YAML out of what it printed, swaps the
``/mnt/csd*`` placeholders for real directories (the strategy checks that storage paths exist), and then runs the
Python with the real ``lightning_smartinf`` imports and the YAML through ``smartinf fit --print_config``. Both must
carry every setting of the plan, which ``--json`` prints for the same invocation: the Python's keyword arguments and
the YAML's ``init_args`` are exactly its ``strategy``, and the strategy each builds is the one those arguments build.
Machine profiles (``"kind": "local-nvme"``) name real paths, here directories under ``tmp_path``.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.commands.cli import main as smartinf
from lightning_smartinf.core.compression import TopKCompression
from lightning_smartinf.plan.planner import PYTHON_HEADER, STORAGE_PLACEHOLDER, YAML_HEADER

PLACEHOLDER = re.compile(re.escape(STORAGE_PLACEHOLDER).replace(r"\{\}", r"(\d+)"))

GPT2_CONFIG = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257}

#: (planner arguments, devices expected, compression expected in the snippets)
INVOCATIONS = {
    "33B-6-devices-compressed": (["--model", "33B", "--devices", "6", "--compression", "0.01"], 6, 0.01),
    "350M-devvm-recommended": (["--model", "350M", "--profile", "devvm-2cpu"], 1, None),
    "8.4B-a100-10-devices": (["--model", "8.4B", "--profile", "paper-a100", "--devices", "10"], 10, 0.01),
    "1.3B-1-device-5%": (["--model", "1.3B", "--devices", "1", "--compression", "0.05"], 1, 0.05),
    "7B-devvm-tiny-ratio": (["--model", "7B", "--profile", "devvm-2cpu", "--compression", "0.00001"], 1, 1e-5),
    "gpt2-config-fp32-link": (["--model", "GPT2_CONFIG", "--transfer-bytes", "4", "--devices", "3"], 3, 0.01),
    "100B-recommended-devices": (["--model", "100B"], 9, 0.01),
    "25M-devvm-1-device": (["--model", "25M", "--profile", "devvm-2cpu", "--devices", "1"], 1, None),
    "350M-devvm-budget-weights": (
        [
            "--model",
            "350M",
            "--profile",
            "devvm-2cpu",
            "--devices",
            "2",
            "--memory-budget",
            "1GB",
            "--device-weights",
            "2",
            "1",
        ],
        2,
        None,
    ),
    "350M-devvm-int8": (["--model", "350M", "--profile", "devvm-2cpu", "--state-precision", "int8"], 1, None),
}
#: Settings beyond paths, sub-group size, buffer count and compression that an invocation asked for.
EXTRA = {
    "350M-devvm-budget-weights": {"device_weights": [2.0, 1.0], "state_memory_budget": "1GB"},
    "350M-devvm-int8": {"state_precision": "int8"},
}

#: A server with a GPU and two NVMe paths (on two disks); the tests put its paths under ``tmp_path``.
MACHINE = {
    "kind": "local-nvme",
    "name": "test-server",
    "storage": [
        {"path": "nvme0", "read_gbps": 3.0, "write_gbps": 2.5, "disk": "nvme0n1", "free_gb": 3840.0},
        {"path": "nvme1", "read_gbps": 3.0, "write_gbps": 2.5, "disk": "nvme1n1", "free_gb": 3840.0},
    ],
    "host_memory_gb": 64.0,
    "device_update_gparams_per_s": 0.3,
    "host_update_gparams_per_s": 1.5,
    "gpu": {"name": "test GPU", "memory_gb": 80.0, "link_gbps": 25.0, "peak_tflops": 989.0},
}
#: (changes to MACHINE, planner arguments after `--profile`, settings the plan must carry beyond the paths)
MACHINE_INVOCATIONS = {
    "machine-100M-gpu-2-nvme": (
        {},
        ["--model", "100M"],
        {"offload_parameters": False, "gradient_buffer": "accelerator", "overlap_backward": True},
    ),
    "machine-300M-tight-disks-fill": (  # two copies of the state fit only with RAM keeping its whole budget
        {"free_gb": 2.0},
        ["--model", "300M", "--keep-checkpoints", "0"],
        {"state_memory_share": "fill", "overlap_backward": True},
    ),
    "machine-200M-no-gpu-storage-compressed": (
        {"gpu": None},
        ["--model", "200M", "--params-on-storage", "--compression", "0.01"],
        {"offload_parameters": "storage", "compression": 0.01, "overlap_backward": False},
    ),
    "machine-1B-bf16": ({}, ["--model", "1B", "--state-precision", "bf16"], {"state_precision": "bf16"}),
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


def argv_of(name: str, tmp_path: Path) -> list[str]:
    """The planner arguments of INVOCATIONS[name], with the GPT-2 config written under ``tmp_path``."""
    argv = INVOCATIONS[name][0]
    if "GPT2_CONFIG" in argv:
        (tmp_path / "gpt2").mkdir(exist_ok=True)
        (tmp_path / "gpt2" / "config.json").write_text(json.dumps(GPT2_CONFIG))
    return [str(tmp_path / "gpt2") if a == "GPT2_CONFIG" else a for a in argv]


@pytest.fixture(params=list(INVOCATIONS), ids=list(INVOCATIONS))
def planned(request, tmp_path, capsys) -> tuple[str, dict, int, float | None, dict]:
    """(printed text, --json plan, devices, compression, other settings asked for) of one planner invocation."""
    _, devices, compression = INVOCATIONS[request.param]
    argv = argv_of(request.param, tmp_path)
    out = plan_output(capsys, argv)
    plan = json.loads(plan_output(capsys, [*argv, "--json"]))
    return out, plan, devices, compression, EXTRA.get(request.param, {})


def machine_profile(tmp_path: Path, changes: dict) -> Path:
    """MACHINE with ``changes`` (``free_gb`` applies to every path) and its paths under ``tmp_path``, as a file."""
    machine = {**MACHINE, **{k: v for k, v in changes.items() if k != "free_gb"}}
    machine["storage"] = [
        {**entry, "path": str(tmp_path / entry["path"]), "free_gb": changes.get("free_gb", entry["free_gb"])}
        for entry in MACHINE["storage"]
    ]
    for entry in machine["storage"]:
        Path(entry["path"]).mkdir(exist_ok=True)
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(machine))
    return path


@pytest.fixture(params=[*INVOCATIONS, *MACHINE_INVOCATIONS], ids=[*INVOCATIONS, *MACHINE_INVOCATIONS])
def any_plan(request, tmp_path, capsys) -> tuple[str, dict, dict]:
    """(printed text with real paths, --json plan, its `strategy` with real paths) of any planner invocation."""
    if request.param in MACHINE_INVOCATIONS:
        changes, argv, _ = MACHINE_INVOCATIONS[request.param]
        argv = [*argv, "--profile", str(machine_profile(tmp_path, changes))]
        out, plan = plan_output(capsys, argv), json.loads(plan_output(capsys, [*argv, "--json"]))
        return out, plan, plan["strategy"]
    devices, argv = INVOCATIONS[request.param][1], argv_of(request.param, tmp_path)
    out, plan = plan_output(capsys, argv), json.loads(plan_output(capsys, [*argv, "--json"]))
    out, _ = with_real_paths(out, tmp_path, devices)
    strategy = json.loads(with_real_paths(json.dumps(plan["strategy"]), tmp_path, devices)[0])
    return out, plan, strategy


def test_snippets_carry_every_recommended_setting_and_no_stale_text(planned):
    out, plan, devices, compression, extra = planned
    assert "not yet" not in out and "SmartComp) -" not in out
    assert plan["devices"] == devices and plan["compression"] == compression
    expected = {
        "storage_paths": [STORAGE_PLACEHOLDER.format(i) for i in range(devices)],
        "sub_group_size": plan["sub_group_size"],
        "buffer_count": plan["buffer_count"],
        **extra,
    }
    if compression is not None:
        expected.update(compression=compression, overlap_backward=False)
    assert plan["strategy"] == expected
    init_args = yaml.safe_load(section(out, YAML_HEADER))["trainer"]["strategy"]["init_args"]
    assert init_args == expected
    python = section(out, PYTHON_HEADER)
    for name in expected:
        assert re.search(rf"^    {name}=", python, re.MULTILINE), name


def python_arguments(code: str) -> dict:
    """The keyword arguments of the ``SmartInfinityStrategy(...)`` call in ``code``, as values."""
    calls = [
        node
        for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "SmartInfinityStrategy"
    ]
    assert len(calls) == 1 and not calls[0].args, code
    return {kw.arg: ast.literal_eval(kw.value) for kw in calls[0].keywords}


def test_both_snippets_are_exactly_the_plans_strategy_and_build_it(any_plan, tmp_path):
    """Nothing the plan used is left out of either snippet, nothing is added, and pasting builds the same strategy
    as the plan's arguments do (settings and DeepSpeed config)."""
    out, plan, strategy_args = any_plan
    python, snippet = section(out, PYTHON_HEADER), section(out, YAML_HEADER)
    assert python_arguments(python) == strategy_args
    assert yaml.safe_load(snippet)["trainer"]["strategy"]["init_args"] == strategy_args
    namespace: dict = {}
    exec(compile(python, "<smartinf plan python>", "exec"), namespace)  # noqa: S102 (the planner's own output)
    built, reference = namespace["strategy"], SmartInfinityStrategy(**strategy_args)
    assert built.settings == reference.settings and built.config == reference.config
    # The plan's own figures are what the strategy got.
    budget = plan.get("memory_budget_bytes", plan.get("placement", {}).get("memory_bytes"))
    assert (built.settings.state_memory_budget or 0) == (budget or 0)
    assert built.config["zero_optimization"]["sub_group_size"] == plan["sub_group_size"]
    assert built.settings.buffer_count == plan["buffer_count"]
    if plan.get("kind") == "local-nvme":
        assert [str(p) for p in built.settings.storage_paths] == plan["storage_paths"]
        offload = built.config["zero_optimization"].get("offload_param", {}).get("device", "none")
        assert offload == {False: "none", True: "cpu", "storage": "nvme"}[strategy_args["offload_parameters"]]


@pytest.mark.parametrize("name", list(MACHINE_INVOCATIONS))
def test_machine_plans_decide_the_settings_they_were_made_for(name, tmp_path, capsys):
    changes, argv, expected = MACHINE_INVOCATIONS[name]
    profile = machine_profile(tmp_path, changes)
    plan = json.loads(plan_output(capsys, [*argv, "--profile", str(profile), "--json"]))
    assert plan["storage_paths"] == [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    assert {k: plan["strategy"].get(k) for k in expected} == expected
    assert plan["fits"] and plan["memory_budget_bytes"] > 0


def test_printed_python_builds_the_strategy(planned, tmp_path):
    out, plan, devices, compression, _ = planned
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


def test_printed_yaml_is_a_smartinf_fit_config(any_plan, tmp_path, capsys):
    """The snippet, as a second ``--config`` after a recipe without a strategy, parses against the real signatures
    into exactly the plan's arguments; they then build the strategy."""
    out, plan, strategy_args = any_plan
    recipe = yaml.safe_load((REPO_ROOT / "recipes" / "gpt2-pretrain-cpu.yaml").read_text())
    del recipe["trainer"]["strategy"]
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe))
    (tmp_path / "strategy.yaml").write_text(section(out, YAML_HEADER))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        smartinf(["fit", "--config", str(recipe_file), "--config", str(tmp_path / "strategy.yaml"), "--print_config"])
    assert exc.value.code == 0
    strategy = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_smartinf.SmartInfinityStrategy"
    assert {name: strategy["init_args"][name] for name in strategy_args} == strategy_args
    built = SmartInfinityStrategy(**{name: strategy["init_args"][name] for name in strategy_args})
    assert built.settings.buffer_count == plan["buffer_count"]
    compression = strategy_args.get("compression")
    assert built.settings.compression == (None if compression is None else TopKCompression(compression))
