"""``smartinf report <log dir>``: one PNG of a run's loss, throughput and per-step traffic.

Reads the metrics of a CSVLogger directory (``metrics.csv``) or a TensorBoardLogger directory (event files) — the
newest under the given path — and draws three panels:

- loss: the training loss per step (``smartinf/loss`` from
  :class:`~lightning_smartinf.lightning.monitor.TrainingMonitor`, else the module's own ``*loss*`` key) and the
  validation loss, when logged;
- throughput: ``smartinf/tokens_per_s``;
- traffic per optimizer step: bytes per parameter over the host link and inside the storage devices, with
  ZeRO-Infinity's link figure for the same model as a reference line (from the strategy's raw byte counts in MB
  when the monitor's per-parameter metrics are missing).

Command line::

    smartinf report lightning_logs/version_0 [-o report.png]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_smartinf.core.io.storage import nearest_existing

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CSV_NAME = "metrics.csv"
EVENTS_GLOB = "events.out.tfevents.*"
TRAIN_LOSS_KEYS = ("smartinf/loss", "train_loss", "train/loss", "loss")


class ReportError(ValueError):
    """The log directory has nothing ``smartinf report`` can plot."""


@dataclass
class Metrics:
    """Scalar series read from one log: ``series[name] = (steps, values)``, in logging order."""

    source: Path
    series: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)

    def add(self, name: str, step: int, value: float) -> None:
        steps, values = self.series.setdefault(name, ([], []))
        steps.append(step)
        values.append(value)

    def get(self, *names: str) -> tuple[str, list[int], list[float]] | None:
        """The first of ``names`` that was logged, as ``(name, steps, values)``."""
        for name in names:
            if name in self.series:
                return (name, *self.series[name])
        return None


def _read_csv(path: Path) -> Metrics:
    metrics = Metrics(path)
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            step = int(float(row.get("step") or 0))
            for name, text in row.items():
                if name in ("step", "epoch") or name is None or text in (None, ""):
                    continue
                try:
                    metrics.add(name, step, float(text))
                except ValueError:
                    continue  # a non-numeric column is not a metric
    return metrics


def _read_events(directory: Path) -> Metrics:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    metrics = Metrics(directory)
    for tag in accumulator.Tags().get("scalars", []):
        for event in accumulator.Scalars(tag):
            metrics.add(tag, int(event.step), float(event.value))
    metrics.series.pop("hp_metric", None)  # TensorBoardLogger's placeholder, not a metric of the run
    metrics.series.pop("epoch", None)  # Lightning logs it as a scalar to TensorBoard, a column to CSV
    return metrics


def read_metrics(log_dir: str | Path) -> Metrics:
    """Metrics of the newest ``metrics.csv`` or TensorBoard event file under ``log_dir`` (or of that file itself).

    Raises:
        ReportError: ``log_dir`` does not exist, or holds no CSV or TensorBoard log.
    """
    path = Path(log_dir)
    if not path.exists():
        raise ReportError(f"{path} does not exist. Pass the log directory of a run (e.g. lightning_logs/version_0).")
    candidates = [path] if path.is_file() else [*path.rglob(CSV_NAME), *path.rglob(EVENTS_GLOB)]
    candidates = [p for p in candidates if p.name == CSV_NAME or p.name.startswith("events.out.tfevents.")]
    if not candidates:
        raise ReportError(
            f"{path} holds no {CSV_NAME} and no TensorBoard event file ({EVENTS_GLOB}). Point `smartinf report` at "
            "the directory of a CSVLogger or TensorBoardLogger run, e.g. lightning_logs/version_0."
        )
    newest = max(candidates, key=lambda p: p.stat().st_mtime)
    return _read_csv(newest) if newest.name == CSV_NAME else _read_events(newest.parent)


def _traffic(metrics: Metrics) -> tuple[str, dict[str, tuple[list[int], list[float]]], float | None]:
    """Unit, ``{label: (steps, values)}`` and the ZeRO-Infinity link reference of the traffic panel."""
    series = metrics.series
    link = metrics.get("smartinf/link_bytes_per_param")
    storage = metrics.get("smartinf/storage_bytes_per_param")
    reference = metrics.get("smartinf/zero_infinity_link_bytes_per_param")
    if link is not None:
        lines = {"host link (ours)": link[1:]}
        if storage is not None:
            lines["inside the devices (storage)"] = storage[1:]
        return "bytes per parameter", lines, reference[2][-1] if reference else None
    lines = {}
    for label, (a, b) in {
        "host link (ours)": ("smartinf/link_write_bytes", "smartinf/link_read_bytes"),
        "inside the devices (storage)": ("smartinf/storage_read_bytes", "smartinf/storage_write_bytes"),
    }.items():
        if a in series and b in series and series[a][0] == series[b][0]:  # the two logged at the same steps
            lines[label] = (series[a][0], [(x + y) / 1e6 for x, y in zip(series[a][1], series[b][1])])
    reference = metrics.get("smartinf/zero_infinity_link_bytes_per_step")
    return "MB (this rank)", lines, reference[2][-1] / 1e6 if reference else None


def figure(metrics: Metrics) -> Figure:
    """The three panels of ``metrics``: loss, throughput, traffic per step.

    Raises:
        ReportError: ``metrics`` has no loss, throughput or traffic series.
    """
    from matplotlib.figure import Figure  # the Agg canvas, without pyplot's global state
    from matplotlib.ticker import MaxNLocator

    loss_keys = [n for n in metrics.series if "loss" in n and not n.startswith(("val", "test"))]
    train = metrics.get(*TRAIN_LOSS_KEYS, *loss_keys)
    val = metrics.get(*[n for n in metrics.series if n.startswith("val") and "loss" in n])
    throughput = metrics.get("smartinf/tokens_per_s")
    unit, traffic, reference = _traffic(metrics)
    if train is None and throughput is None and not traffic:
        raise ReportError(
            f"{metrics.source} has no loss, `smartinf/tokens_per_s` or `smartinf/*` traffic metrics (it has: "
            f"{', '.join(sorted(metrics.series)) or 'nothing'}). Train with the `TrainingMonitor` callback "
            "(`smartinf fit` adds it) and `strategy='smart_infinity'`."
        )

    fig = Figure(figsize=(8, 10), layout="constrained")
    loss_ax, speed_ax, traffic_ax = fig.subplots(3, 1, sharex=True)
    fig.suptitle(f"smartinf report: {metrics.source}", fontsize=9)

    for kind, series in (("train", train), ("validation", val)):
        if series is not None:
            name, steps, values = series
            loss_ax.plot(steps, values, marker="o" if len(steps) < 30 else None, label=f"{kind} ({name})")
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("Loss")

    if throughput is not None:
        _, steps, values = throughput
        speed_ax.plot(steps, values, marker="o" if len(steps) < 30 else None, color="tab:green")
        speed_ax.set_title(f"Throughput (median {statistics.median(values):,.0f} tokens/s)")
    else:
        speed_ax.set_title("Throughput: no `smartinf/tokens_per_s` logged")
    speed_ax.set_ylabel("tokens / s")

    for label, (steps, values) in traffic.items():
        traffic_ax.plot(steps, values, marker="o" if len(steps) < 30 else None, label=label)
    title = "Traffic per optimizer step"
    if reference is not None:
        traffic_ax.axhline(reference, color="tab:red", linestyle="--", label="host link, ZeRO-Infinity (same model)")
        ours = traffic.get("host link (ours)")
        if ours and statistics.median(ours[1]) > 0:
            title += f": {reference / statistics.median(ours[1]):.1f}x less over the host link than ZeRO-Infinity"
    if not traffic:
        title += ": no `smartinf/*` traffic logged"
    traffic_ax.set_title(title)
    traffic_ax.set_ylabel(unit)
    traffic_ax.set_ylim(bottom=0)
    traffic_ax.set_xlabel("step")
    traffic_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (loss_ax, speed_ax, traffic_ax):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return fig


def plot(metrics: Metrics, output: str | Path) -> Path:
    """Draw :func:`figure` of ``metrics`` into the PNG file ``output`` (its folder is created).

    Raises:
        ReportError: ``metrics`` has no loss, throughput or traffic series.
    """
    fig = figure(metrics)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, format="png", dpi=100)
    return output


def _check_output(parser: argparse.ArgumentParser, output: Path) -> None:
    """Refuse (``parser.error``, exit 2) a PNG ``output`` that cannot be written, before the logs are read: a
    directory, or a path under a file. A missing folder is fine: :func:`plot` creates it."""
    if output.is_dir():
        parser.error(f"the output {str(output)!r} is a directory: name the PNG file, e.g. `-o {output / 'report.png'}`")
    # The nearest existing folder above it is where `plot` creates the rest (`.` or `/` at worst, both existing).
    existing = nearest_existing(output.parent)
    if not existing.is_dir():
        parser.error(
            f"the output {str(output)!r} cannot be written: {str(existing)!r} is a file, not a folder. Write the PNG "
            "elsewhere with `-o`."
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="smartinf report",
        description="Plot loss, tokens/s and per-step link/storage traffic of a run into one PNG.",
    )
    parser.add_argument("log_dir", help="CSVLogger or TensorBoardLogger directory (the newest log under it is used)")
    parser.add_argument("-o", "--output", help="PNG to write (default: <log_dir>/report.png)")
    args = parser.parse_args(argv)
    log_dir = Path(args.log_dir)
    output = Path(args.output) if args.output else (log_dir if log_dir.is_dir() else log_dir.parent) / "report.png"
    if args.output or log_dir.exists():  # (a missing log directory is named by `read_metrics`, not its default PNG)
        _check_output(parser, output)
    try:
        metrics = read_metrics(log_dir)
        plot(metrics, output)
    except ReportError as exc:
        print(f"smartinf report: error: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        print(
            f"smartinf report: error: it needs `{exc.name}`. Install it by running "
            "`pip install -e '.[cli]'` (matplotlib and tensorboard).",
            file=sys.stderr,
        )
        return 1
    series = metrics.get("smartinf/tokens_per_s", "smartinf/link_bytes_per_param", *TRAIN_LOSS_KEYS)
    steps = f"{len(set(series[1]))} steps" if series else "no steps"
    print(f"wrote {output} ({steps} from {metrics.source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
