"""One owner per storage path, end to end: two ``Trainer``s on one path, and temporary storage of killed runs.

The per-backend behaviour (claims, killed holders, private directories) is tested in tests/core/test_ownership.py.
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
from pathlib import Path

import pytest
from helpers.launch import run, worker_env
from helpers.models import LMModule, adamw_factory, fit

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.core import StorageError
from lightning_smartinf.core.io.ownership import read_owner

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

# Trains two steps on storage argv[1] and waits after the first until the file argv[2] exists.
TRAIN = textwrap.dedent(
    f"""
    import os, sys, time
    from pathlib import Path
    sys.path.insert(0, {str(TESTS)!r})
    import lightning as L
    import torch
    from helpers.models import LMModule, param_groups, token_loader
    from lightning_smartinf import SmartInfinityStrategy

    os.umask(0o022)
    storage, go = Path(sys.argv[1]), Path(sys.argv[2])

    class PauseAfterFirstStep(L.Callback):
        def on_train_batch_end(self, trainer, *_):
            if trainer.global_step == 1:
                print("READY", flush=True)
                while not go.exists():
                    time.sleep(0.05)

    def adamw(model):
        return torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3), None

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[PauseAfterFirstStep()],
        strategy=SmartInfinityStrategy(storage_paths=[storage], sub_group_size=2000, io_engine="threads"),
    )
    trainer.fit(LMModule(adamw), token_loader(2))
    print("DONE", trainer.global_step, flush=True)
    """
)

# Trains one step on temporary storage, prints its directory and ends, as a user's script ends.
FIT_THEN_EXIT = textwrap.dedent(
    f"""
    import sys
    sys.path.insert(0, {str(TESTS)!r})
    from helpers.models import LMModule, adamw_factory, fit
    from lightning_smartinf import SmartInfinityStrategy

    trainer, _ = fit(LMModule(adamw_factory(lr=1e-3)), SmartInfinityStrategy(sub_group_size=2000), steps=1)
    print("DIR", trainer.strategy.smart_update.backend.devices[0].directory, flush=True)
    """
)

# Holds a backend on a new temporary device directory (removed at close) until stdin closes.
HOLD_TEMP = textwrap.dedent(
    """
    import sys
    from lightning_smartinf.devices.cpu import CpuBackend
    from lightning_smartinf.core.io.ownership import make_temp_device_dir
    directory = make_temp_device_dir(0)
    backend = CpuBackend([directory], chunk_elems=1024, buffer_count=2, owned_dirs=[directory])
    print("READY", directory, flush=True)
    sys.stdin.read()
    backend.close()
    """
)


adamw = adamw_factory(lr=1e-3)


def _python(script: str, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        env=worker_env(**env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_ready(proc: subprocess.Popen) -> str:
    lines = []
    for line in proc.stdout:
        if line.startswith("READY"):
            return line
        lines.append(line)
    proc.wait()
    raise AssertionError(f"the child exited with {proc.returncode} before it was ready:\n{''.join(lines[-40:])}")


def _snapshot(directory: Path) -> dict[str, tuple[str, int]]:
    return {
        str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
def test_second_trainer_on_a_storage_path_in_use_stops_before_touching_it(tmp_path):
    storage, go = tmp_path / "ssd", tmp_path / "go"
    storage.mkdir(mode=0o755)
    first = _python(TRAIN, str(storage), str(go))
    try:
        _wait_ready(first)
        device_dir = storage / "smartinf" / "rank000"
        before = _snapshot(device_dir)
        assert any(name.startswith("shard") for name in before), before

        with pytest.raises(StorageError) as info:
            fit(LMModule(adamw), SmartInfinityStrategy(storage_paths=[storage], sub_group_size=2000), steps=1)
        message = str(info.value)
        assert str(device_dir) in message
        assert f"pid {first.pid} on host {socket.gethostname()!r}" in message
        assert "Wait for that training to finish, stop it, or choose another storage path" in message
        assert _snapshot(device_dir) == before

        go.touch()  # the first training goes on to its last step
        output = first.communicate(timeout=300)[0]
        assert first.returncode == 0 and "DONE 2" in output, output[-4000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    # Created private from the storage path down (the child ran with umask 022), and released at the end.
    for path in (storage / "smartinf", device_dir, device_dir / "engine-swap"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert read_owner(device_dir) is None


@pytest.mark.parametrize("planted", ["smartinf", "smartinf/rank000"])
def test_a_symlink_under_the_storage_path_is_refused(tmp_path, planted):
    storage, target = tmp_path / "ssd", tmp_path / "elsewhere"
    storage.mkdir()
    target.mkdir()
    link = storage / planted
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    with pytest.raises(StorageError, match="is a symbolic link") as info:
        fit(LMModule(adamw), SmartInfinityStrategy(storage_paths=[storage], sub_group_size=2000), steps=1)
    assert str(link) in str(info.value)
    assert not any(target.iterdir())


@pytest.mark.slow
def test_temporary_storage_of_a_killed_run_is_removed_at_the_next_start(tmp_path, monkeypatch):
    root = tmp_path / "tmp"
    root.mkdir()
    dead = _python(HOLD_TEMP, TMPDIR=str(root))
    live = _python(HOLD_TEMP, TMPDIR=str(root))
    try:
        dead_dir = Path(_wait_ready(dead).split(maxsplit=1)[1].strip())
        live_dir = Path(_wait_ready(live).split(maxsplit=1)[1].strip())
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=60)
        assert dead_dir.exists()

        monkeypatch.setattr(tempfile, "tempdir", str(root))  # as `TMPDIR=root` would, for this process
        trainer, _ = fit(LMModule(adamw), SmartInfinityStrategy(sub_group_size=2000), steps=1)

        assert trainer.global_step == 1
        assert not dead_dir.exists()
        own = [p for p in root.iterdir() if p != live_dir]
        assert len(own) == 1 and read_owner(own[0]).pid == os.getpid()  # kept for `trainer.save_checkpoint`
        trainer, _ = fit(LMModule(adamw), SmartInfinityStrategy(sub_group_size=2000), steps=1)
        assert not own[0].exists()  # removed when the next run started
        newer = [p for p in root.iterdir() if p != live_dir]
        assert len(newer) == 1 and read_owner(newer[0]).pid == os.getpid()
        # A run in an interpreter that then exits, as a script ends: its temporary storage goes with it; the other
        # runs' (this process's, and the live one's) stay.
        done = run([sys.executable, "-c", FIT_THEN_EXIT], env=worker_env(TMPDIR=str(root)))
        gone = Path(done.stdout.split("DIR", 1)[1].split()[0])
        assert gone.parent == root and not gone.exists(), done.stdout[-2000:]
        assert sorted(root.iterdir()) == sorted([live_dir, newer[0]])
        assert read_owner(live_dir).pid == live.pid
    finally:
        live.stdin.close()
        live.wait(timeout=60)
        if dead.poll() is None:
            dead.kill()
            dead.wait()
