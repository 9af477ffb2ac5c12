"""The `smartinf` command line: dispatch, LightningCLI recipes and their errors, logs and reports, the README's demo."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import matplotlib.image
import pytest
import yaml
from conftest import REPO_ROOT
from helpers.cli_models import TinyLM
from helpers.launch import python
from helpers.models import param_groups
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_smartinf.commands.cli import COMMANDS, main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TOKENS_PER_STEP = 2 * 4 * 12  # accumulate_grad_batches x batch_size x sequence length (cli_models.RandomTokens)


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_unknown_command_is_exit_2_with_the_choices(capsys):
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate'; choose one of: fit, validate, test, report, demo, plan, serve, export" in err


def test_plan_subcommand(capsys):
    assert main(["plan", "--model", "350M", "--devices", "2"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-Infinity" in out and "SmartInfinityStrategy(" in out


@pytest.mark.slow
def test_demo_trains_and_reports_traffic(demo_run):
    assert "step    6  loss" in demo_run
    assert "less over the shared link" in demo_run


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--model", "seven"], r"--model.*'seven'"),
        (["demo", "--steps", "x"], r"argument --steps: invalid int value: 'x'"),
        (["demo", "--steps", "0"], r"--steps 0: the demo trains at least 1 step"),
        (["demo", "--devices", "0"], r"--devices 0: the demo emulates 1 to 16 CSDs"),
        (["demo", "--devices", "1000"], r"--devices 1000: the demo emulates 1 to 16 CSDs"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    assert code == 2
    assert re.search(message, capsys.readouterr().err)


# ------------------------------------------------------------------------------------------ LightningCLI recipes


def recipe(tmp_path: Path, logger: str | None = "csv", **trainer: object) -> dict:
    """A `smartinf fit` config for cli_models.TinyLM on random tokens: 2 optimizer steps of 2 micro-batches."""
    config: dict = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "precision": "bf16-mixed",
            "max_steps": 2,
            "accumulate_grad_batches": 2,
            "log_every_n_steps": 1,
            "enable_checkpointing": False,
            "enable_model_summary": False,
            "enable_progress_bar": False,
            **trainer,
        },
        "model": {"class_path": "helpers.cli_models.TinyLM"},
        "data": {"class_path": "helpers.cli_models.RandomTokens", "init_args": {"batches": 4, "batch_size": 4}},
    }
    if logger is not None:
        loggers = {"csv": "CSVLogger", "tensorboard": "TensorBoardLogger"}
        config["trainer"]["logger"] = {
            "class_path": f"lightning.pytorch.loggers.{loggers[logger]}",
            "init_args": {"save_dir": str(tmp_path / "logs"), "name": "run"},
        }
    return config


def write(tmp_path: Path, config: dict, name: str = "recipe.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return str(path)


def csv_metrics(log_dir: Path) -> dict[str, list[float]]:
    with (log_dir / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    return {key: [float(r[key]) for r in rows if r[key] != ""] for key in rows[0] if key not in ("epoch", "step")}


def event_metrics(log_dir: Path) -> dict[str, list[float]]:
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [e.value for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


@pytest.mark.parametrize(
    ("logger", "precision", "link_bytes"), [("csv", "bf16-mixed", 2), ("tensorboard", "32-true", 4)]
)
def test_fit_logs_exact_traffic_and_the_report_plots_it(tmp_path, capsys, logger, precision, link_bytes):
    """`smartinf fit` trains with smart_infinity by default; the monitor's metrics reach CSV and TensorBoard logs."""
    assert main(["fit", "--config", write(tmp_path, recipe(tmp_path, logger, precision=precision))]) == 0
    log_dir = tmp_path / "logs" / "run" / "version_0"
    metrics = csv_metrics(log_dir) if logger == "csv" else event_metrics(log_dir)
    params = sum(p.numel() for p in TinyLM().parameters())
    # Each param group is one ZeRO sub-group here, stored in records padded to 1024 elements on the devices.
    padded = sum(-(-sum(p.numel() for p in g["params"]) // 1024) * 1024 for g in param_groups(TinyLM().model, 0.1))

    # Two optimizer steps, each moving gradients in and parameters out in the training dtype, and nothing else.
    assert metrics["smartinf/link_bytes_per_param"] == [2.0 * link_bytes] * 2
    # fp32 master, m and v read and written inside the devices (metrics are float32 in the loggers).
    assert metrics["smartinf/storage_bytes_per_param"] == pytest.approx([24.0 * padded / params] * 2, rel=1e-7)
    assert metrics["smartinf/link_write_bytes"] == [params * link_bytes] * 2  # the strategy's raw count
    assert metrics["smartinf/zero_infinity_link_bytes_per_param"] == [32.0] * 2
    assert metrics["smartinf/zero_infinity_link_bytes_per_step"] == [32.0 * params] * 2
    tokens = [t * ms / 1e3 for t, ms in zip(metrics["smartinf/tokens_per_s"], metrics["smartinf/step_ms"])]
    assert tokens == pytest.approx([TOKENS_PER_STEP] * 2, rel=1e-4)
    assert len(metrics["smartinf/loss"]) == 2 and len(metrics["val_loss"]) == 1  # the epoch's 4 batches ended

    # The config is saved next to the logs, with the defaults smartinf fit adds.
    saved = yaml.safe_load((log_dir / "config.yaml").read_text())
    assert saved["trainer"]["strategy"] == "smart_infinity"
    assert saved["monitor"] == {"token_key": "input_ids", "progress_bar": True}

    png = tmp_path / "report.png"
    capsys.readouterr()
    assert main(["report", str(tmp_path / "logs"), "-o", str(png)]) == 0
    assert f"wrote {png} (2 steps from " in capsys.readouterr().out
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 100 and image.shape[1] > 100


@pytest.mark.parametrize("strategy", ["smart_infinity", "auto"])
def test_validate_subcommand_runs_the_validation_loop(tmp_path, strategy):
    config = recipe(tmp_path, strategy=strategy, precision="32-true")
    assert main(["validate", "--config", write(tmp_path, config)]) == 0
    assert len(csv_metrics(tmp_path / "logs" / "run" / "version_0")["val_loss"]) == 1


def test_test_subcommand_runs_the_test_loop(tmp_path):
    """`smartinf test` with the strategy: the test loop runs once over the data module's test batches, which are its
    validation batches, so it reports the validation loss of the same model."""
    config = recipe(tmp_path, strategy="smart_infinity", precision="32-true")
    assert main(["validate", "--config", write(tmp_path, config)]) == 0
    assert main(["test", "--config", write(tmp_path, config)]) == 0
    logs = sorted((tmp_path / "logs" / "run").iterdir())
    (val_loss,) = csv_metrics(logs[0])["val_loss"]
    (test_loss,) = csv_metrics(logs[1])["test_loss"]
    assert test_loss == pytest.approx(val_loss, rel=1e-6)


@pytest.mark.slow
def test_python_dash_m_fit_help_lists_recipe_keys():
    result = python("-m", "lightning_smartinf", "fit", "--help", cwd=REPO_ROOT, timeout=300)
    assert "usage: smartinf [options] fit" in result.stdout
    assert "--trainer.strategy" in result.stdout and "smart_infinity" in result.stdout
    assert "--monitor.token_key" in result.stdout and "--data CONFIG" in result.stdout


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_parses_against_the_real_signatures(path, capsys):
    """Each recipe's keys and types match the classes it names (parsed and printed, nothing built)."""
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(path), "--print_config"])
    assert exc.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"] == yaml.safe_load(path.read_text())["model"]["class_path"]
    assert printed["monitor"] == {"token_key": "input_ids", "progress_bar": True}


def test_a_command_prints_no_accelerator_notice_and_names_itself_as_typed():
    """Where DeepSpeed picks its accelerator itself (no `DS_ACCELERATOR`), it logs "Setting accelerator to CPU ..."
    while it is imported, before any command could filter it: every `smartinf` command that imports it printed the
    line, `--help` included. Each command's usage names it as users type it."""
    from helpers.launch import worker_env

    env = {k: v for k, v in worker_env().items() if k != "DS_ACCELERATOR"}
    for command in ("export", "plan"):
        done = python("-m", "lightning_smartinf", command, "--help", env=env)
        assert done.stdout.startswith(f"usage: smartinf {command} "), done.stdout[:200]
        assert "Setting accelerator" not in done.stdout + done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_print_config_writes_yaml_only_on_stdout():
    """`smartinf fit --print_config > config.yaml` gives a config that loads, also where DeepSpeed picks its
    accelerator itself and logs it (on stdout, were it not moved): its logs go to stderr."""
    from helpers.launch import worker_env

    env = {k: v for k, v in worker_env().items() if k != "DS_ACCELERATOR"}
    recipe = REPO_ROOT / "recipes" / "gpt2-pretrain-cpu.yaml"
    done = python("-m", "lightning_smartinf", "fit", "--config", recipe, "--print_config", env=env)
    printed = yaml.safe_load(done.stdout)
    assert printed["model"]["class_path"] == yaml.safe_load(recipe.read_text())["model"]["class_path"]
    assert "Setting accelerator to CPU" not in done.stdout + done.stderr  # silenced before DeepSpeed is imported


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["trainer"].update(max_stepz=3), "does not accept option 'trainer.max_stepz'"),
        (lambda c: c["trainer"].update(max_steps="two"), 'Parser key "trainer.max_steps"'),
        (lambda c: c["model"].update(init_args={"dimm": 8}), "Option 'dimm' is not accepted"),
        (lambda c: c["model"].update(init_args={"lr": "fast"}), 'Parser key "lr"'),
        (lambda c: c.update(monitor={"token_key": ""}), "`TrainingMonitor` got 1 invalid argument"),
        (
            lambda c: c["trainer"].update(
                strategy={"class_path": "lightning_smartinf.SmartInfinityStrategy", "init_args": {"sub_group_size": 0}}
            ),
            "`sub_group_size=0` is too small",
        ),
        (  # refused only once the run meets the precision
            lambda c: c["trainer"].update(
                precision="32-true",
                strategy={
                    "class_path": "lightning_smartinf.SmartInfinityStrategy",
                    "init_args": {"split_masters": True},
                },
            ),
            "keeps its parameters in the precision of `precision='32-true'`",
        ),
    ],
    ids=[
        "unknown-key",
        "wrong-type",
        "unknown-model-arg",
        "wrong-model-arg-type",
        "refused-value",
        "refused-strategy",
        "refused-at-fit",
    ],
)
def test_bad_recipe_is_exit_2_naming_the_key(tmp_path, capsys, edit, message):
    config = recipe(tmp_path)
    edit(config)
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", write(tmp_path, config)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_serve_refuses_bad_secrets_before_listening(tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("secret")
    token.chmod(0o644)
    assert main(["serve", "--storage", str(tmp_path / "s"), "--token-file", str(token)]) == 2
    assert "readable by other users" in capsys.readouterr().err
    token.chmod(0o600)
    assert main(["serve", "--storage", str(tmp_path / "s"), "--token-file", str(token), "--tls-cert", "x.pem"]) == 2
    assert "needs both --tls-cert and --tls-key" in capsys.readouterr().err
    assert not (tmp_path / "s").exists(), "nothing was created"
