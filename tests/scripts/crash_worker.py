"""Trains the checkpoint tests' model in its own process and can SIGKILL itself at a chosen point.

Usage: ``crash_worker.py <root> [<kill point>]``. Checkpoints are what users write,
``ModelCheckpoint(dirpath=<root>/ckpts, save_last=True, every_n_train_steps=EVERY)``: every ``EVERY`` steps (an
epoch) it saves ``epoch=E-step=N.ckpt``, deletes the previous one, then saves over ``last.ckpt``. Device state
lives in ``<root>/ssd``. Kill points (``what:step[:n]``, step = the optimizer step being run, 1-based):

- ``forward:S`` / ``backward:S``: inside the forward / backward pass of step S (a module hook);
- ``update:S:I``: in step S right after shard I was handed to its device (device threads mid-read/update/write);
- ``ds_save:S``: in the checkpoint after step S, after DeepSpeed wrote its files and before any device state;
- ``save:S:N``: while saving the device state after step S, after N shard files were copied;
- ``manifest:S``: after the device-state manifest was written, before the directory is renamed into place;
- ``host_state:S``: after the device-state directory was installed, before ``host_state.json`` is written;
- ``seal:S``: after the staged checkpoint was sealed, before it is moved to its name;
- ``install:S``: after the staged checkpoint was swapped with the one at its name, before the old one is removed;
- ``none``: no kill; prints ``TRAINING`` when training starts (the parent may kill it on a timer).

The parent resumes from the newest complete checkpoint in its own process (see tests/test_checkpoint.py).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ckpt_common  # noqa: E402

import lightning_smartinf.core.format.state_files as ckpt_module  # noqa: E402
from lightning_smartinf.core.format import checkpoint_folder  # noqa: E402


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class KillAt(L.Callback):
    def __init__(self, spec: str) -> None:
        parts = spec.split(":")
        self.what, self.step = parts[0], int(parts[1]) if len(parts) > 1 else -1
        self.n = int(parts[2]) if len(parts) > 2 else 0
        self.trainer: L.Trainer | None = None

    def current_step(self) -> int:
        assert self.trainer is not None
        return self.trainer.global_step + 1  # the step being run

    def saved_step(self) -> int:
        assert self.trainer is not None
        return self.trainer.global_step  # a checkpoint is saved after the step's update

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.trainer = trainer
        print("TRAINING", flush=True)
        model = pl_module.model

        def maybe_die(*args) -> None:  # module hooks must return None
            if self.current_step() == self.step:
                die()

        if self.what == "forward":
            model.blocks[1].register_forward_hook(maybe_die)
        if self.what == "backward":
            model.blocks[0].register_full_backward_hook(maybe_die)
        optimizer = trainer.strategy.deepspeed_engine.optimizer
        backend = optimizer.smart_update.backend
        if self.what == "update":
            submit = backend.submit

            def submit_then_die(shard, *args, **kwargs):
                handle = submit(shard, *args, **kwargs)
                if self.current_step() == self.step and shard == self.n:
                    die()
                return handle

            backend.submit = submit_then_die
        if self.what == "ds_save":
            save = backend.save

            def die_then_save(directory) -> None:
                if self.saved_step() == self.step:
                    die()
                save(directory)

            backend.save = die_then_save
        if self.what == "save":
            copied = [0]

            def then_die(copy):
                def copy_then_die(*args, **kwargs):
                    result = copy(*args, **kwargs)
                    if self.saved_step() == self.step and kwargs.get("exclusive", True):
                        copied[0] += 1
                        if copied[0] == self.n:
                            die()
                    return result

                return copy_then_die

            # A shard file is cloned (its checksum known from the writes) or copied (checksummed on the way).
            ckpt_module.copy_with_crc = then_die(ckpt_module.copy_with_crc)
            ckpt_module.clone_file = then_die(ckpt_module.clone_file)
        if self.what == "seal":
            install = checkpoint_folder.install

            def die_then_install(staging, target) -> None:
                if self.saved_step() == self.step:
                    die()
                install(staging, target)

            checkpoint_folder.install = die_then_install
        if self.what == "install":
            remove = ckpt_module.remove_entry

            def die_then_remove(path) -> None:
                if self.saved_step() == self.step:
                    die()
                remove(path)

            ckpt_module.remove_entry = die_then_remove
        if self.what in ("manifest", "host_state"):
            write = ckpt_module.write_file_atomic
            install = ckpt_module.install_directory

            def install_then_maybe_die(tmp, directory):
                if self.what == "manifest" and self.saved_step() == self.step:
                    die()  # manifest written and fsynced in tmp, not yet renamed into place
                install(tmp, directory)

            def write_then_maybe_die(path, data):
                if (
                    self.what == "host_state"
                    and Path(path).name == "host_state.json"
                    and self.saved_step() == self.step
                ):
                    die()
                write(path, data)

            ckpt_module.install_directory = install_then_maybe_die
            ckpt_module.write_file_atomic = write_then_maybe_die
            # The device-state format imported write_file_atomic by name.
            import lightning_smartinf.core.format.rank_state as device_state

            device_state.write_file_atomic = write_then_maybe_die


def main(root: Path, spec: str) -> None:
    ckpt_common.train(root, callbacks=[KillAt(spec)], checkpointing="last")
    print("FINISHED", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "none")
