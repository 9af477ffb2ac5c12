"""``benchmarks/held_disk.py``: the benchmarks' steady disk. Its command runs in a cgroup that holds the disk to the
rates asked, and every byte that command moves on the disk is counted against that cgroup; nothing is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.machine import lacking, small_ext4

from benchmarks.held_disk import HoldError, current_hold, whole_disk

HELD_DISK = Path(__file__).parents[1] / "benchmarks" / "held_disk.py"

# Run inside the held cgroup: report the cgroup's limits and what it counted after a 4 MiB direct write.
CHILD = textwrap.dedent(
    """
    import json, mmap, os, sys
    from pathlib import Path
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = [l.split(":", 2)[2] for l in lines if l.split(":")[1] == "blkio"]
    group = Path("/sys/fs/cgroup/blkio" + v1[0]) if v1 else Path("/sys/fs/cgroup" + lines[0].split(":", 2)[2])
    names = ("blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device", "io.max")
    limits = {n: (group / n).read_text() for n in names if (group / n).exists()}
    buf = mmap.mmap(-1, 4 << 20)
    buf.write(b"x" * (4 << 20))
    fd = os.open(os.path.join(sys.argv[1], "probe"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    os.write(fd, buf)
    os.fsync(fd)
    os.close(fd)
    stat = group / ("blkio.throttle.io_service_bytes" if v1 else "io.stat")
    sys.path.insert(0, sys.argv[2])
    from held_disk import current_hold
    report = {"group": str(group), "limits": limits, "stat": stat.read_text(), "hold": current_hold()}
    print(json.dumps(report))
    """
)


def test_a_process_outside_any_hold_reports_none() -> None:
    assert current_hold() is None


def test_a_path_off_any_disk_is_refused_naming_it() -> None:
    with pytest.raises(HoldError, match=r"--path /proc .*not a block device"):
        whole_disk(Path("/proc"))


def test_the_disk_is_the_whole_disk_the_directory_lives_on(tmp_path: Path) -> None:
    major, minor = whole_disk(tmp_path)
    sysfs = Path(f"/sys/dev/block/{major}:{minor}")
    assert not (sysfs / "partition").exists()
    here = os.stat(tmp_path).st_dev
    own = Path(f"/sys/dev/block/{os.major(here)}:{os.minor(here)}")
    assert (major, minor) == (os.major(here), os.minor(here)) or own.resolve().parent == sysfs.resolve()


def test_the_command_runs_held_and_its_bytes_count_against_the_hold(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        lacking("holding a disk's rate needs root (CI runs as root)")
    with small_ext4(tmp_path / "disk", "64m") as mounted:
        major, minor = whole_disk(mounted)
        done = subprocess.run(
            [sys.executable, str(HELD_DISK), "--path", str(mounted), "--read-mbps", "50", "--write-mbps", "40.5",
             "--", sys.executable, "-c", CHILD, str(mounted), str(HELD_DISK.parent)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"disk {major}:{minor} held to 50 MB/s read, 40.5 MB/s write" in done.stderr
        report = json.loads(done.stdout)
        device = f"{major}:{minor}"
        limits = " ".join(report["limits"].values())
        assert f"{device} 50000000" in limits or "rbps=50000000" in limits, limits
        assert f"{device} 40500000" in limits or "wbps=40500000" in limits, limits
        assert report["hold"] == {name: text.strip() for name, text in report["limits"].items() if text.strip()}
        counted = [line.split() for line in report["stat"].splitlines() if line.startswith(device + " ")]
        if "/blkio/" in report["group"]:  # v1: "M:m Write N", one line per kind of operation
            wbytes = sum(int(fields[2]) for fields in counted if fields[1] == "Write")
        else:  # v2: "M:m rbytes=N wbytes=N ..."
            wbytes = int(next(f for f in counted[0] if f.startswith("wbytes=")).split("=")[1])
        assert wbytes >= 4 << 20
        assert not Path(report["group"]).exists(), "the cgroup outlived its command"
        groups = Path(report["group"]).parent
        before = set(groups.glob("smartinf-held-*"))  # (another run's hold may be there: only ours must go)
        missing = subprocess.run(
            [sys.executable, str(HELD_DISK), "--path", str(mounted), "--read-mbps", "50", "--", "no-such-command"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert missing.returncode == 127
        assert "cannot run 'no-such-command'" in missing.stderr and "Traceback" not in missing.stderr
        assert set(groups.glob("smartinf-held-*")) <= before, "a cgroup outlived a failed command"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--read-mbps", "0"], "above 0"),
        (["--read-mbps", "fast"], "expected a rate in MB/s"),
        (["--read-mbps", "600"], "give the command to run after --"),
    ],
)
def test_bad_arguments_are_refused_naming_the_fix(tmp_path: Path, args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, str(HELD_DISK), "--path", str(tmp_path), *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert message in done.stderr


def test_a_kill_of_the_wrapper_ends_the_command_and_removes_the_hold(tmp_path: Path) -> None:
    """``kill``, ``timeout`` or a scheduler stop the wrapper with SIGTERM: it passes it on, the command ends, the
    wrapper exits as a shell would say (143) and no cgroup is left holding the disk."""
    if os.geteuid() != 0:
        lacking("holding a disk's rate needs root (CI runs as root)")
    with small_ext4(tmp_path / "disk", "64m") as mounted:
        wrapper = subprocess.Popen(
            [sys.executable, str(HELD_DISK), "--path", str(mounted), "--read-mbps", "50", "--", "sleep", "60"],
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        line = wrapper.stderr.readline()  # "held_disk: disk M:m held to ... (<cgroup>)": the command has started
        group = Path(line.rsplit("(", 1)[1].rstrip(")\n"))
        assert group.is_dir(), line
        wrapper.terminate()
        assert wrapper.wait(timeout=30) == 143
        assert not group.exists(), "the hold outlived its killed wrapper"
