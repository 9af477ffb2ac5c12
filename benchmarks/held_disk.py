"""Run a command with the disk under a directory held to a steady rate, so that two runs minutes apart see the
same disk.

A cloud VM's disk changes its rate from one minute to the next (this project's own VM: reads and writes at once
1.9 to 3.1 GB/s within one calibration), which moves a disk-bound step by as much, so that a ratio of two steps
timed minutes apart, or a prediction from a calibration taken before the run, measures the disk's minute as much as
the software. Linux's block throttling caps the bytes per second a group of processes may read and write on one
disk; held below the disk's slowest minute, the disk is the same for every run::

    sudo .venv/bin/python benchmarks/held_disk.py --path /mnt/nvme/bench --read-mbps 600 --write-mbps 600 -- \\
        .venv/bin/python benchmarks/bench_step.py --storage /mnt/nvme/bench ...

The command and every process it starts run in a cgroup of their own (cgroup v1's ``blkio`` controller where it is
mounted, else v2's ``io``), removed when the command ends. Rates are in MB/s (10^6 bytes per second, as ``dd``
prints them) and apply to the whole disk the directory lives on (a partition's disk; a loop or device-mapper device
as it is). Direct I/O and reads are held; on cgroup v1 buffered writes are not (the kernel writes them back from
its own threads): the devices' and ZeRO-Infinity's swap traffic is direct. Needs root. The throttle is the
kernel's; this script only finds the disk and writes the cgroup's files (``systemd-run -p IOReadBandwidthMax=...``
does the same where systemd runs the machine and cgroup v2 is mounted; on machines without it, such as this
project's VMs, nothing else is needed).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from lightning_smartinf.core.io.storage import disk_of

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: Signals this script passes on to the command it holds, then waits for it.
FORWARDED = (signal.SIGTERM, signal.SIGHUP)


class HoldError(RuntimeError):
    """The disk cannot be held here (not a block device, no throttling controller, not root)."""


def whole_disk(path: Path) -> tuple[int, int]:
    """``(major, minor)`` of the disk ``path`` lives on (:func:`~lightning_smartinf.core.io.storage.disk_of`: a
    partition's whole disk, any other block device as is)."""
    disk = disk_of(path)
    if disk is None:
        dev = os.stat(path).st_dev
        raise HoldError(
            f"--path {path} is on device {os.major(dev)}:{os.minor(dev)}, which is not a block device (a tmpfs, "
            "overlay or network filesystem): only a disk's rate can be held; point --path at a directory on the disk "
            "you benchmark"
        )
    major, minor = (disk / "dev").read_text().split(":")
    return int(major), int(minor)


def controller() -> tuple[str, Path]:
    """``("v1", blkio mount)`` where cgroup v1's blkio controller is mounted, else ``("v2", unified root)`` where
    v2's io controller is available."""
    blkio = CGROUP_ROOT / "blkio"
    if (blkio / "blkio.throttle.read_bps_device").exists():
        return "v1", blkio
    controllers = CGROUP_ROOT / "cgroup.controllers"
    if controllers.exists() and "io" in controllers.read_text().split():
        return "v2", CGROUP_ROOT
    raise HoldError(
        "no block throttling here: neither cgroup v1's blkio controller (/sys/fs/cgroup/blkio) nor v2's io "
        "controller (/sys/fs/cgroup/cgroup.controllers) is available"
    )


def own_group() -> Path | None:
    """This process's cgroup in the throttling controller's hierarchy (``None`` where there is none)."""
    v1 = (CGROUP_ROOT / "blkio" / "blkio.throttle.read_bps_device").exists()  # as :func:`controller` decides
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (v1 and "blkio" in controllers.split(",")) or (not v1 and controllers == ""):
            return (CGROUP_ROOT / "blkio" if v1 else CGROUP_ROOT) / path.lstrip("/")
    return None


def hold(disk: tuple[int, int], read_bps: int, write_bps: int) -> tuple[Path, Path]:
    """Create a cgroup that holds ``disk`` to ``read_bps`` and ``write_bps`` bytes per second and move this process
    into it (processes it starts from now on inherit it); returns the cgroup and the one this process left, for
    :func:`release`."""
    if os.geteuid() != 0:
        raise HoldError("holding a disk's rate writes the kernel's cgroup files, which needs root: run with sudo")
    version, root = controller()
    home = own_group() or root
    group = root / f"smartinf-held-{os.getpid()}"
    device = f"{disk[0]}:{disk[1]}"
    if version == "v2":
        # The root's children get the io controller only once the root hands it down.
        (root / "cgroup.subtree_control").write_text("+io")
    group.mkdir(exist_ok=True)
    try:
        if version == "v1":
            (group / "blkio.throttle.read_bps_device").write_text(f"{device} {read_bps}")
            (group / "blkio.throttle.write_bps_device").write_text(f"{device} {write_bps}")
        else:
            (group / "io.max").write_text(f"{device} rbps={read_bps} wbps={write_bps}")
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        group.rmdir()  # the kernel refused a limit (e.g. a device it cannot throttle): no empty cgroup left behind
        raise
    return group, home


def release(group: Path, home: Path) -> None:
    """Move this process back to ``home`` and remove ``group`` (left in place, with a warning, while a process the
    command started still runs in it)."""
    (home / "cgroup.procs").write_text(str(os.getpid()))
    try:
        group.rmdir()
    except OSError as exc:
        print(f"held_disk: left {group} in place: {exc}", file=sys.stderr)


def held_rates(group: Path) -> dict[str, str]:
    """The limits ``group`` holds, as the kernel reports them."""
    names = ("blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device", "io.max")
    return {n: (group / n).read_text().strip() for n in names if (group / n).exists()}


def current_hold() -> dict[str, str] | None:
    """The limits this process runs under (as :func:`held_rates` gives them), or ``None`` where its disk is not
    held: what a benchmark records beside its figures."""
    group = own_group()
    limits = {name: text for name, text in held_rates(group).items() if text} if group else {}
    return limits or None


def positive_mbps(text: str) -> float:
    """An argparse type: a rate in MB/s above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a rate in MB/s (e.g. 600), got {text!r}") from None
    if not 0 < value < 1e7:
        raise argparse.ArgumentTypeError(f"expected a rate in MB/s above 0 and below 10,000,000, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="the command follows --")
    parser.add_argument("--path", type=Path, required=True, help="a directory on the disk to hold")
    parser.add_argument("--read-mbps", type=positive_mbps, required=True, help="reads, MB/s (10^6 bytes/s)")
    parser.add_argument("--write-mbps", type=positive_mbps, help="writes, MB/s (default: --read-mbps)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --, e.g. -- python benchmarks/bench_step.py ...")
    if not args.path.is_dir():
        parser.error(f"--path {args.path} is not a directory: give a directory on the disk to hold")
    read_bps = int(args.read_mbps * 1e6)
    write_bps = int((args.write_mbps or args.read_mbps) * 1e6)
    try:
        disk = whole_disk(args.path)
        group, home = hold(disk, read_bps, write_bps)
    except (HoldError, OSError) as exc:
        print(f"held_disk: {exc}", file=sys.stderr)
        return 2
    started = (
        f"held_disk: disk {disk[0]}:{disk[1]} held to {read_bps / 1e6:g} MB/s read, {write_bps / 1e6:g} MB/s write "
        f"({group})"
    )
    try:
        return run_held(command, started)
    except OSError as exc:  # not found, not executable
        print(f"held_disk: cannot run {command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return 127
    finally:
        release(group, home)


def run_held(command: list[str], started: str) -> int:
    """Run ``command`` to its end and return its exit status, printing ``started`` once it runs. ``kill``,
    ``timeout`` or a scheduler's SIGTERM (and SIGHUP) are passed on to it, and Ctrl-C, which the terminal sends it
    too, is left to it: either way this process outlives it, so the hold is removed."""
    child: subprocess.Popen[bytes] | None = None
    early: list[int] = []  # signals from before the command started: passed on once it has

    def forward(signum: int, _frame: object) -> None:
        if child is None:
            early.append(signum)
        else:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        child = subprocess.Popen(command)
        # Ignored only now: an ignored signal would stay ignored in the command across exec.
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
        for signum in early:
            child.send_signal(signum)
        print(started, file=sys.stderr, flush=True)
        status = child.wait()
        return 128 - status if status < 0 else status  # killed by a signal: as a shell says it (SIGTERM: 143)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
