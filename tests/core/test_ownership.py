"""One owner per device directory, and private directories created without following links.

Real processes, real files: a second backend on a directory in use (in this process or another) is refused before it
touches anything, a killed holder never blocks, and temporary directories of killed runs are found and removed.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from helpers.leftovers import left_over

from lightning_smartinf.core import StorageError
from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.io.direct import ThreadedIO
from lightning_smartinf.core.io.ownership import (
    LOCK_FILE,
    OWNER_FILE,
    DirectoryClaim,
    check_unclaimed,
    claim_directories,
    make_temp_device_dir,
    read_owner,
    remove_stale_temp_dirs,
)
from lightning_smartinf.core.io.storage import ensure_private_dir, make_private_dirs
from lightning_smartinf.core.rules import Adam, StepParams
from lightning_smartinf.devices.cpu import CpuBackend

CHUNK = 1024
NUMEL = 3 * CHUNK + 10

# A process that holds a backend on argv[1] (or on a new temporary device directory if argv[1] is "TEMP", removed at
# close) with state written, prints "READY <dir>", and closes it when its stdin closes.
HOLD = textwrap.dedent(
    f"""
    import sys
    from pathlib import Path
    import torch
    from lightning_smartinf.devices.cpu import CpuBackend
    from lightning_smartinf.core.backend import ShardSpec
    from lightning_smartinf.core.io.ownership import make_temp_device_dir
    from lightning_smartinf.core.rules import Adam
    temp = sys.argv[1] == "TEMP"
    directory = make_temp_device_dir(0) if temp else Path(sys.argv[1])
    backend = CpuBackend([directory], chunk_elems={CHUNK}, buffer_count=2, owned_dirs=[directory] if temp else [])
    backend.open([ShardSpec(0, {NUMEL}, Adam())])
    backend.initialize(0, torch.randn({NUMEL}))
    backend.wait()
    print("READY", directory, flush=True)
    sys.stdin.read()
    backend.close()
    """
)

# A process that tries to build a backend on argv[1]: prints the StorageError and exits 3 if refused.
TRY = textwrap.dedent(
    f"""
    import sys
    from lightning_smartinf.core import StorageError
    from lightning_smartinf.devices.cpu import CpuBackend
    try:
        backend = CpuBackend([sys.argv[1]], chunk_elems={CHUNK}, buffer_count=2)
    except StorageError as exc:
        print(exc, flush=True)
        sys.exit(3)
    backend.close()
    """
)


def _python(script: str, *args: str, tmpdir: Path | None = None, **kwargs) -> subprocess.Popen:
    env = dict(os.environ)
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def _start_holder(directory: str, tmpdir: Path | None = None) -> tuple[subprocess.Popen, Path]:
    proc = _python(HOLD, directory, tmpdir=tmpdir)
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        proc.kill()
        raise AssertionError(f"holder failed: {line}{proc.communicate()[0]}")
    return proc, Path(line.split(maxsplit=1)[1].strip())


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def _snapshot(directory: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``directory``: content hash and modification time."""
    return {
        str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _temp_device_dir_in(root: Path, rank: int) -> Path:
    """:func:`make_temp_device_dir` under ``root`` (as with ``TMPDIR=root``, which Python reads once per process)."""
    saved, tempfile.tempdir = tempfile.tempdir, str(root)
    try:
        return make_temp_device_dir(rank)
    finally:
        tempfile.tempdir = saved


def _device_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("csd"))


def _backend_with_state(directory: Path) -> CpuBackend:
    backend = CpuBackend([directory], chunk_elems=CHUNK, buffer_count=2)
    backend.open([ShardSpec(0, NUMEL, Adam())])
    backend.initialize(0, torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)))
    backend.wait()
    return backend


def _update(backend: CpuBackend, step: int) -> torch.Tensor:
    out = torch.empty(NUMEL)
    backend.submit(0, torch.ones(NUMEL), StepParams(step=step, lr=1e-2), out).result()
    backend.wait()
    return out


# ------------------------------------------------------------------------------------------------ one owner


def test_second_backend_in_this_process_is_refused_and_the_first_is_unaffected(tmp_path):
    first = _backend_with_state(tmp_path / "dev0")
    try:
        before = _snapshot(tmp_path / "dev0")
        threads = _device_threads()
        # Multi-device: the free directory is claimed first, then released when the busy one is refused.
        with pytest.raises(StorageError) as info:
            CpuBackend([tmp_path / "free", tmp_path / "dev0"], chunk_elems=CHUNK, buffer_count=2)
        message = str(info.value)
        assert str(tmp_path / "dev0") in message
        assert socket.gethostname() in message and f"pid {os.getpid()}" in message
        assert "Close that backend first" in message
        assert info.value.path == tmp_path / "dev0"
        assert _snapshot(tmp_path / "dev0") == before
        assert _device_threads() == threads  # the refused backend started none
        check_unclaimed([tmp_path / "free"])
        # The first one keeps training.
        assert not torch.equal(_update(first, 1), _update(first, 2))
    finally:
        first.close()
    assert not (tmp_path / "dev0" / OWNER_FILE).exists()
    _backend_with_state(tmp_path / "dev0").close()  # free again once closed


def test_second_process_is_refused_and_leaves_the_first_state_files_unchanged(tmp_path):
    first = _backend_with_state(tmp_path / "dev0")
    try:
        before = _snapshot(tmp_path / "dev0")
        proc = _python(TRY, str(tmp_path / "dev0"))
        output = proc.communicate(timeout=120)[0]
        assert proc.returncode == 3, output
        assert str(tmp_path / "dev0") in output
        assert f"pid {os.getpid()} on host {socket.gethostname()!r}" in output
        assert "Wait for that training to finish, stop it, or choose another storage path" in output
        assert _snapshot(tmp_path / "dev0") == before
        _update(first, 1)
    finally:
        first.close()


def test_a_killed_holder_never_blocks(tmp_path):
    directory = tmp_path / "dev0"
    proc, _ = _start_holder(str(directory))
    try:
        with pytest.raises(StorageError, match=rf"in use by pid {proc.pid} on host") as info:
            CpuBackend([directory], chunk_elems=CHUNK, buffer_count=2)
        assert str(directory) in str(info.value)
    finally:
        _kill(proc)
    assert read_owner(directory).pid == proc.pid  # the dead process's record stays, and does not matter
    backend = _backend_with_state(directory)
    try:
        assert read_owner(directory).pid == os.getpid()
    finally:
        backend.close()


def test_failed_construction_releases_every_claim_and_thread(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    threads = _device_threads()
    engines = []

    def second_engine_fails() -> ThreadedIO:
        if engines:
            raise RuntimeError("no second I/O engine")
        engines.append(ThreadedIO())
        return engines[0]

    with pytest.raises(RuntimeError, match="no second I/O engine"):
        CpuBackend(dirs, chunk_elems=CHUNK, buffer_count=2, io_factory=second_engine_fails)
    assert _device_threads() == threads  # the first device's threads were stopped
    check_unclaimed(dirs)  # and both claims released
    engines.clear()
    with pytest.raises(RuntimeError, match="no second I/O engine"):
        CpuBackend(dirs, chunk_elems=CHUNK, buffer_count=2, io_factory=second_engine_fails, owned_dirs=dirs)
    assert not any(d.exists() for d in dirs)  # owned directories removed, as `close` would


def test_claims_are_exclusive_within_a_process_and_released_by_release(tmp_path):
    claim = DirectoryClaim(tmp_path)
    assert claim.held and read_owner(tmp_path).pid == os.getpid()
    with pytest.raises(StorageError, match="this process"):
        DirectoryClaim(tmp_path)
    with pytest.raises(StorageError):
        check_unclaimed([tmp_path])
    other = ensure_private_dir(tmp_path / "other")
    with pytest.raises(StorageError):
        claim_directories([other, tmp_path])  # all or none
    check_unclaimed([other])
    claim.release()
    claim.release()  # idempotent
    assert not claim.held and (tmp_path / LOCK_FILE).exists() and not (tmp_path / OWNER_FILE).exists()
    with DirectoryClaim(tmp_path) as again:
        assert again.held


# ------------------------------------------------------------------------------------- temporary directories


def test_stale_temporary_directories_are_removed_and_live_ones_kept(tmp_path):
    root = tmp_path / "tmp"
    root.mkdir()
    dead, dead_dir = _start_holder("TEMP", tmpdir=root)
    _kill(dead)
    live, live_dir = _start_holder("TEMP", tmpdir=root)
    try:
        assert dead_dir.parent == root and read_owner(dead_dir).pid == dead.pid
        young = _temp_device_dir_in(root, 1)  # created by this live process, not claimed yet
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "keep").write_text("x")
        link = left_over(root / "smartinf-rank7", "run")
        link.symlink_to(elsewhere)  # a dead run's name on a link: the link goes, never what it points to
        other_host = left_over(root / "smartinf-rank8", "run", host="some-other-host")
        other_host.mkdir()  # its process may live: this host cannot tell
        (root / "other-dir").mkdir()

        removed = remove_stale_temp_dirs(root)

        assert sorted(removed) == sorted([dead_dir, link])
        assert not dead_dir.exists() and not os.path.lexists(link)
        assert live_dir.exists() and young.exists() and (elsewhere / "keep").exists()
        assert other_host.exists() and (root / "other-dir").exists()
        assert read_owner(live_dir).pid == live.pid
    finally:
        live.stdin.close()
        assert live.wait(timeout=60) == 0
    assert not live_dir.exists()  # the live run removed its own at close


def test_a_claimed_temporary_directory_is_kept_whatever_its_name_says(tmp_path):
    """A run in another PID namespace (a container of the same host name sharing /tmp) names its directory with a pid
    that here is another process or none: its claim, held, keeps the directory from being removed as a leftover."""
    root = tmp_path / "tmp"
    root.mkdir()
    held = left_over(root / "smartinf-rank0", "run")
    held.mkdir(mode=0o700)
    claim = DirectoryClaim(held)
    released = left_over(root / "smartinf-rank1", "run")
    released.mkdir(mode=0o700)
    DirectoryClaim(released).release()  # a killed run's: the lock file stays, nobody holds it
    try:
        assert remove_stale_temp_dirs(root) == [released]
        assert held.exists() and claim.held
    finally:
        claim.release()
    assert remove_stale_temp_dirs(root) == [held]


# ----------------------------------------------------------------------------------------- private directories


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_directories_are_created_private_all_the_way_down(tmp_path, umask_022):
    base = tmp_path / "ssd"
    base.mkdir(mode=0o755)
    (base / "smartinf").mkdir(mode=0o755)  # an existing component is made private too
    leaf = make_private_dirs(base, ("smartinf", "rank000", "engine-swap"))
    assert leaf == base / "smartinf" / "rank000" / "engine-swap"
    for path in (base / "smartinf", base / "smartinf" / "rank000", leaf):
        assert _mode(path) == 0o700, path
    assert _mode(base) == 0o755  # the storage path itself is the user's

    deep = ensure_private_dir(tmp_path / "x" / "y" / "z")
    assert [_mode(tmp_path / p) for p in ("x", "x/y", "x/y/z")] == [0o700] * 3
    assert deep == tmp_path / "x" / "y" / "z"


@pytest.mark.parametrize("planted", ["smartinf", "smartinf/rank000"])
def test_a_symlink_planted_where_a_directory_belongs_is_refused(tmp_path, planted, umask_022):
    base, target = tmp_path / "ssd", tmp_path / "target"
    base.mkdir()
    target.mkdir(mode=0o755)
    link = base / planted
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    with pytest.raises(StorageError, match="is a symbolic link") as info:
        make_private_dirs(base, ("smartinf", "rank000"))
    assert str(link) in str(info.value) and info.value.path == link
    assert _mode(target) == 0o755 and not any(target.iterdir())  # neither chmodded nor written through the link
    with pytest.raises(StorageError, match="is a symbolic link"):
        CpuBackend([link], chunk_elems=CHUNK, buffer_count=2)


def test_a_file_where_a_directory_belongs_is_refused(tmp_path):
    (tmp_path / "smartinf").write_text("x")
    with pytest.raises(StorageError, match="exists but is not a directory"):
        make_private_dirs(tmp_path, ("smartinf", "rank000"))


@pytest.mark.parametrize("part", ["", ".", "..", "a/b"])
def test_parts_must_be_single_components(tmp_path, part):
    with pytest.raises(ValueError, match="one path component"):
        make_private_dirs(tmp_path, ("smartinf", part))
