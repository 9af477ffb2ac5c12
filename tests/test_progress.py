"""Long operations show their progress: a bar on a terminal, one line each when stderr is not one, nothing when
switched off, and nothing from a rank but the first.

Each test runs ``tests/scripts/progress_journey.py`` (a fit that writes its initial state and saves a checkpoint,
a resume that loads it, one that re-shards it; with ``--hf``, a pretrained load, an export and a token cache) in a
fresh process, as a user's script runs, and reads what it printed.
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest
from helpers.launch import worker_env

SCRIPT = Path(__file__).parent / "scripts" / "progress_journey.py"
#: The operations of the journey without ``--hf``, each with the number of times it runs.
FIT = {
    "Writing the initial optimizer state on 1 device": 3,
    "Saving the optimizer state": 2,  # the step's checkpoint, and `last.ckpt`
    "Loading the optimizer state": 1,
    "Re-sharding the optimizer state": 1,
}
#: Those ``--hf`` adds (with its own fit's initial state and checkpoint).
HF = {
    "Loading the pretrained weights": 1,  # of <directory>
    "Reading the optimizer state": 1,  # of the checkpoint exported (its shard files, checked)
    "Writing the weights": 1,  # to <directory>
    "Tokenising python_docs.txt into the token cache": 1,
}
#: One line when an operation ends: what, how much, how long, the rate.
END = re.compile(
    r"^(?P<what>[A-Z][^:]*?)(?: of \S+| to \S+)?: [\d.,]+ (?:[kMG]?B|tokens) in [\d.]+ s \([\d.,]+ [^)]*/s\)$"
)


def journey(tmp_path: Path, *args: str, env: dict[str, str] | None = None, tty: bool = False) -> str:
    """What the journey printed on stderr (on a pseudo-terminal with ``tty``)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(SCRIPT), str(tmp_path), *args]
    environment = worker_env(**(env or {}))
    if not tty:
        done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-5000:]
        return done.stderr
    controller, terminal = os.openpty()
    # A terminal of 120 columns, as a user's window has (a new pseudo-terminal has none).
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the terminal side closed: everything was read
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        done = subprocess.run(command, env=environment, stdout=subprocess.DEVNULL, stderr=terminal, timeout=600)
    finally:
        os.close(terminal)
    reader.join(timeout=60)
    os.close(controller)
    text = b"".join(chunks).decode(errors="replace")
    assert done.returncode == 0, text[-5000:]
    return text


def ended(stderr: str) -> dict[str, int]:
    """How many end lines each operation printed."""
    counts: dict[str, int] = {}
    for line in stderr.splitlines():
        match = END.match(line.strip())
        if match:
            counts[match["what"]] = counts.get(match["what"], 0) + 1
    return counts


@pytest.mark.slow
def test_each_long_operation_says_once_when_it_ends_where_stderr_is_not_a_terminal(tmp_path):
    stderr = journey(tmp_path, "--hf")
    counts = ended(stderr)
    expected = {**FIT, **HF, "Writing the initial optimizer state on 1 device": 4, "Saving the optimizer state": 4}
    assert counts == expected, stderr[-4000:]
    # The wait before the first step has its reason, said before it starts: what, and how big.
    assert re.search(r"^Writing the initial optimizer state on 1 device: [\d.]+ kB \.\.\.$", stderr, re.MULTILINE)
    assert not re.search(r"optimizer state[^\n]*%\|", stderr)  # no bar of ours


@pytest.mark.slow
def test_switched_off_nothing_is_said(tmp_path):
    stderr = journey(tmp_path, env={"SMARTINF_PROGRESS": "0"})
    assert ended(stderr) == {} and "Writing the initial" not in stderr, stderr[-3000:]


@pytest.mark.slow
def test_on_a_terminal_each_operation_is_a_bar_and_the_trainers_setting_decides(tmp_path):
    """With the Trainer's progress bar on, bars (what, how much, rate) and no end lines; with it off, the lines."""
    shown = journey(tmp_path / "bars", tty=True)
    for what in FIT:
        assert re.search(rf"{re.escape(what)}: 100%\|.*\| [\d.]+k/[\d.]+k \[", shown), (what, shown[-3000:])
    assert ended(shown.replace("\r", "\n")) == {}
    lines = journey(tmp_path / "lines", "--bar", "off", tty=True)
    assert ended(lines.replace("\r\n", "\n")) == FIT and "%|" not in lines


@pytest.mark.slow
def test_only_the_first_rank_says_anything(tmp_path):
    """Two ranks launched by Lightning, each writing, saving, loading and re-sharding its own state: the lines of
    one rank (rank 0), not two, each saying that its bytes are that rank's share."""
    stderr = journey(tmp_path, "--devices", "2")
    assert ended(stderr) == {f"{what}, rank 0's share of 2 ranks": n for what, n in FIT.items()}, stderr[-4000:]


@pytest.mark.slow
def test_calibration_says_what_it_measures_and_when_it_is_done(tmp_path):
    """`smartinf plan --calibrate` (a minute on a real disk): announced, then one line with its count and time."""
    (tmp_path / "disk").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "lightning_smartinf.plan", "--calibrate", str(tmp_path / "disk"), "--calibrate-mb", "8",
         "-o", str(tmp_path / "machine.json")],
        env=worker_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Measuring this machine: 10 measurements ..." in done.stderr
    assert re.search(r"^Measuring this machine: 10 measurements in [\d.]+ s \([\d.,]+ measurements/s\)$", done.stderr,
                     re.MULTILINE), done.stderr[-3000:]  # fmt: skip
