"""`smartinf report`: reads CSV and TensorBoard logs, draws loss, throughput and traffic, refuses empty logs."""

from __future__ import annotations

import os

import matplotlib.image
import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_smartinf.commands.cli import main
from lightning_smartinf.commands.report import ReportError, figure, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PARAMS = 1000


def monitor_rows(steps: int = 5) -> list[tuple[int, dict[str, float]]]:
    """What TrainingMonitor and the strategy log per step for a 1000-parameter model in bf16 (values exact in fp32)."""
    rows = []
    for step in range(steps):
        rows.append(
            (
                step,
                {
                    "smartinf/loss": 4.0 - 0.25 * step,
                    "smartinf/tokens_per_s": 1000.0 + 100 * step,
                    "smartinf/link_bytes_per_param": 4.0,
                    "smartinf/storage_bytes_per_param": 24.0,
                    "smartinf/link_write_bytes": 2.0 * PARAMS,
                    "smartinf/link_read_bytes": 2.0 * PARAMS,
                    "smartinf/storage_read_bytes": 12.0 * PARAMS,
                    "smartinf/storage_write_bytes": 12.0 * PARAMS,
                    "smartinf/zero_infinity_link_bytes_per_param": 32.0,
                    "smartinf/zero_infinity_link_bytes_per_step": 32.0 * PARAMS,
                },
            )
        )
    rows.append((steps - 1, {"val_loss": 3.5}))
    return rows


def write_log(kind: str, root, rows) -> str:
    logger = CSVLogger(root, name="run") if kind == "csv" else TensorBoardLogger(root, name="run")
    logger.log_hyperparams({"lr": 1e-3})
    for step, metrics in rows:
        logger.log_metrics(metrics, step=step)
    logger.save()
    logger.finalize("success")
    return logger.log_dir


@pytest.mark.parametrize("kind", ["csv", "tensorboard"])
def test_reads_every_series_of_both_log_kinds(tmp_path, kind):
    write_log(kind, tmp_path, monitor_rows())
    metrics = read_metrics(tmp_path)
    assert metrics.series["smartinf/loss"] == ([0, 1, 2, 3, 4], [4.0, 3.75, 3.5, 3.25, 3.0])
    assert metrics.series["smartinf/link_bytes_per_param"][1] == [4.0] * 5
    assert metrics.series["val_loss"] == ([4], [3.5])
    assert "hp_metric" not in metrics.series and "epoch" not in metrics.series


@pytest.mark.parametrize("kind", ["csv", "tensorboard"])
def test_report_writes_a_png(tmp_path, capsys, kind):
    log_dir = write_log(kind, tmp_path / "logs", monitor_rows())
    out = tmp_path / "plots" / "run.png"
    assert main(["report", str(tmp_path / "logs"), "-o", str(out)]) == 0
    assert f"wrote {out} (5 steps from " in capsys.readouterr().out
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = matplotlib.image.imread(out).shape
    assert (width, height) == (800, 1000)  # 8 x 10 inches at 100 dpi
    # Without -o the PNG goes into the log directory.
    assert main(["report", log_dir]) == 0
    assert (tmp_path / "logs" / "run" / "version_0" / "report.png").read_bytes()[:8] == PNG_SIGNATURE


def test_panels_show_loss_throughput_and_traffic_against_zero_infinity(tmp_path):
    write_log("csv", tmp_path, monitor_rows())
    loss, speed, traffic = figure(read_metrics(tmp_path)).axes
    assert [line.get_label() for line in loss.get_lines()] == ["train (smartinf/loss)", "validation (val_loss)"]
    assert speed.get_title() == "Throughput (median 1,200 tokens/s)"
    labels = {line.get_label(): list(line.get_ydata()) for line in traffic.get_lines()}
    assert labels["host link (ours)"] == [4.0] * 5
    assert labels["inside the devices (storage)"] == [24.0] * 5
    assert labels["host link, ZeRO-Infinity (same model)"] == [32.0, 32.0]  # the reference line
    assert "8.0x less over the host link than ZeRO-Infinity" in traffic.get_title()
    assert traffic.get_ylabel() == "bytes per parameter"


def test_traffic_falls_back_to_the_strategys_raw_bytes(tmp_path):
    """Without TrainingMonitor the strategy's own per-step byte counts are plotted, in MB."""
    rows = [(s, {k: v for k, v in m.items() if "per_param" not in k}) for s, m in monitor_rows()]
    write_log("csv", tmp_path, rows)
    traffic = figure(read_metrics(tmp_path)).axes[2]
    labels = {line.get_label(): list(line.get_ydata()) for line in traffic.get_lines()}
    assert labels["host link (ours)"] == [4 * PARAMS / 1e6] * 5
    assert labels["host link, ZeRO-Infinity (same model)"] == [32 * PARAMS / 1e6] * 2
    assert traffic.get_ylabel() == "MB (this rank)"


def test_newest_log_under_the_directory_is_used(tmp_path):
    write_log("tensorboard", tmp_path, monitor_rows(steps=2))
    newest = write_log("csv", tmp_path, monitor_rows(steps=3))
    csv_file = os.path.join(newest, "metrics.csv")
    os.utime(csv_file, (os.path.getmtime(csv_file) + 10,) * 2)
    metrics = read_metrics(tmp_path)
    assert metrics.source.name == "metrics.csv" and len(metrics.series["smartinf/loss"][0]) == 3


def test_directory_without_metrics_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir()
    assert main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"smartinf report: error: {tmp_path} holds no metrics.csv and no TensorBoard event file" in err
    assert main(["report", str(tmp_path / "missing")]) == 1
    assert "missing does not exist" in capsys.readouterr().err


def test_an_output_that_cannot_be_written_is_refused_before_the_logs_are_read(tmp_path, capsys):
    """A directory failed in PIL (`IsADirectoryError`), a path under a file in `mkdir` (`FileExistsError`), both after
    the logs were read; a missing folder is still created."""
    (tmp_path / "file").write_text("")
    unread = str(tmp_path / "no-logs")  # would be "does not exist", but the output is refused first
    with pytest.raises(SystemExit) as exited:
        main(["report", unread, "-o", str(tmp_path)])
    assert exited.value.code == 2
    expected = f"the output {str(tmp_path)!r} is a directory: name the PNG file, e.g. `-o {tmp_path / 'report.png'}`"
    assert expected in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["report", unread, "-o", str(tmp_path / "file" / "report.png")])
    assert exited.value.code == 2
    assert f"cannot be written: {str(tmp_path / 'file')!r} is a file, not a folder" in capsys.readouterr().err
    log_dir = write_log("csv", tmp_path / "logs", monitor_rows())
    out = tmp_path / "new" / "deeper" / "report.png"
    assert main(["report", log_dir, "-o", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_log_without_plottable_metrics_names_what_it_has(tmp_path):
    write_log("csv", tmp_path, [(0, {"lr": 0.1})])
    with pytest.raises(ReportError, match=r"has no loss, `smartinf/tokens_per_s` or `smartinf/\*` traffic metrics"):
        figure(read_metrics(tmp_path))
