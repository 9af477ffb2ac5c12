"""``offload_parameters="storage"``: ZeRO-3's 16-bit parameter partitions live in files on the storage paths.

The reference is the same run with ``offload_parameters=True`` (partitions in host memory): results must be bit for bit
the same. At ``DIM = 512`` the MLP weights' partitions (512 x 1024) are 1 MiB in bf16 and go to storage, the attention
weights (512 KiB) and the small tensors stay in memory, so sub-groups mix both kinds.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.launch import SCRIPTS, python, worker_env
from helpers.machine import tmpfs
from helpers.models import LMModule, TinyGPT, adamw_factory, assert_identical, fit, token_loader
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.core import StorageError
from lightning_smartinf.zero.param_storage import swap_buffer_settings

DIM = 512
SWAPPED = 1 << 20  # DeepSpeed keeps partitions below 1 MiB in memory


adamw = adamw_factory()


def strategy(path: Path, offload: bool | str, **kwargs) -> SmartInfinityStrategy:
    return SmartInfinityStrategy(
        storage_paths=[path], offload_parameters=offload, sub_group_size=400_000, io_engine="threads", **kwargs
    )


def stored_bytes(module: L.LightningModule, element_size: int, world_size: int = 1) -> int:
    """Bytes of one rank's partitions that live on storage (each file padded to 1 KiB)."""
    sizes = [math.ceil(getattr(p, "ds_numel", p.numel()) / world_size) * element_size for p in module.parameters()]
    return sum(math.ceil(n / 1024) * 1024 for n in sizes if n >= SWAPPED)


def param_files(root: Path) -> list[Path]:
    return sorted(root.glob("smartinf/rank*/params/**/*.swp"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "extra"),
    [
        ("bf16-true", {}),
        ("bf16-true", {"compression": 0.05}),
        ("bf16-true", {"offload_activations": True, "overlap_backward": False}),
    ],
    ids=["bf16", "compressed", "activations"],
)
def test_parameters_on_storage_train_bit_for_bit_like_parameters_in_memory(tmp_path, precision, extra) -> None:
    """Accumulation, clipping and the hand-offs during backward included; the parameters' traffic is counted."""
    steps, accumulate = 3, 2
    module = LMModule(adamw, dim=DIM)
    memory_trainer, reference = fit(
        LMModule(adamw, dim=DIM),
        strategy(tmp_path / "memory", True, **extra),
        steps=steps,
        accumulate=accumulate,
        precision=precision,
        clip=0.5,
    )
    trainer, ours = fit(
        module,
        strategy(tmp_path / "disk", "storage", **extra),
        steps=steps,
        accumulate=accumulate,
        precision=precision,
        clip=0.5,
    )
    assert_identical(ours, reference)
    stored = stored_bytes(module, element_size=2)
    assert stored > 0 and param_files(tmp_path / "disk"), "some partitions live on storage"
    assert not param_files(tmp_path / "memory")
    traffic = trainer.strategy.traffic
    assert traffic.param_write_bytes == steps * stored, "every stored partition is written once per step"
    # Each micro-batch reads every stored partition for forward and again for backward (the last layer's once);
    # the end-of-training capture gathers them once more.
    passes = steps * accumulate
    assert passes * stored < traffic.param_read_bytes <= (2 * passes + 1) * stored
    memory = memory_trainer.strategy.traffic
    assert (memory.param_read_bytes, memory.param_write_bytes) == (0, 0)


class LoggedTraffic(L.Callback):
    """What the strategy logs of the parameters' traffic after each step (its monitor logs first)."""

    def __init__(self) -> None:
        self.logged: list[tuple[float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        self.logged.append((float(metrics["smartinf/param_read_bytes"]), float(metrics["smartinf/param_write_bytes"])))


def test_the_parameters_traffic_is_logged_each_step(tmp_path) -> None:
    """The per-step ``smartinf/param_*_bytes`` metrics (TensorBoard, ``smartinf report``) are the strategy's own
    counts: each step writes every stored partition once, and reads them for forward and backward."""
    logged = LoggedTraffic()
    module = LMModule(adamw, dim=DIM)
    trainer, _ = fit(module, strategy(tmp_path, "storage"), steps=2, precision="bf16-true", callbacks=[logged])
    stored = stored_bytes(module, element_size=2)
    assert stored > 0
    assert [written for _, written in logged.logged] == [stored, stored]
    assert all(stored <= read <= 2 * stored for read, _ in logged.logged)
    assert sum(read for read, _ in logged.logged) <= trainer.strategy.traffic.param_read_bytes


class BuiltInConfigureModel(LMModule):
    """The model is built in ``configure_model``, under ZeRO's ``Init``, as a model larger than memory must be. At
    width 768 its MLP weights (1.2M elements) are larger than the swapper's buffers while the model is built."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.make_optimizer = adamw
        self.model: TinyGPT | None = None

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
            self.model = TinyGPT(dim=768)
            # As Hugging Face's `_init_weights` does under ZeRO's Init: change partitions already on storage.
            import deepspeed

            weights = [block.fc1.weight for block in self.model.blocks]
            with deepspeed.zero.GatheredParameters(weights, modifier_rank=0), torch.no_grad():
                for weight in weights:
                    weight.mul_(0.5)


@pytest.mark.slow
def test_a_model_built_in_configure_model_goes_straight_to_storage_and_trains_bit_for_bit(tmp_path) -> None:
    _, reference = fit(
        BuiltInConfigureModel(), strategy(tmp_path / "memory", True), steps=3, accumulate=2, precision="bf16-true"
    )
    trainer, ours = fit(
        BuiltInConfigureModel(), strategy(tmp_path / "disk", "storage"), steps=3, accumulate=2, precision="bf16-true"
    )
    assert_identical(ours, reference)
    files = param_files(tmp_path / "disk")
    assert files and all(f.is_relative_to(tmp_path / "disk" / "smartinf" / "rank000" / "params") for f in files)
    # Building the model wrote every stored partition once, and the changed MLP weights again; each step writes them
    # all again.
    stored = stored_bytes(trainer.lightning_module, element_size=2)
    changed = 2 * 768 * 1536 * 2
    assert trainer.strategy.traffic.param_write_bytes == (1 + 3) * stored + changed


class Evaluated(LMModule):
    def validation_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = torch.nn.functional.cross_entropy(self.model(tokens).float().flatten(0, 1), targets.flatten())
        self.log("val_loss", loss)
        return loss

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0]).float().argmax(-1)


def _trainer(path: Path, offload: bool | str, steps: int, callbacks=(), **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy(path, offload),
        precision="bf16-true",
        max_steps=steps,
        logger=False,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        callbacks=list(callbacks),
        **kwargs,
    )


@pytest.mark.slow
def test_save_last_resume_and_evaluation_with_parameters_on_storage(tmp_path) -> None:
    """Stock ``ModelCheckpoint(save_last=True)`` saves over ``last.ckpt``; ``fit(ckpt_path=...)`` resumes bit for bit,
    with the parameters on storage or in memory; validate, test and predict run on the stored parameters."""
    loader = token_loader(2)  # epochs of 2 batches: checkpoints every 2 steps sit on epoch boundaries

    def run(name: str, offload: bool | str, steps: int, ckpt_path: Path | None = None) -> tuple[L.Trainer, Evaluated]:
        module = Evaluated(adamw, dim=DIM)
        saves = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True, every_n_train_steps=2)
        trainer = _trainer(tmp_path / name, offload, steps, callbacks=[saves] if ckpt_path is None else [])
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return trainer, module

    full_trainer, full_module = run("full", "storage", 6)
    expected = full_trainer.validate(full_module, loader, verbose=False)[0]["val_loss"]
    run("first", "storage", 4)
    last = tmp_path / "ckpts" / "last.ckpt"
    for name, offload in (("resumed", "storage"), ("resumed_in_memory", True)):
        trainer, module = run(name, offload, 6, ckpt_path=last)
        assert trainer.validate(module, loader, verbose=False)[0]["val_loss"] == expected, name
    assert trainer.test(module, loader, verbose=False)[0]["val_loss"] == expected
    predictions = full_trainer.predict(full_module, loader)
    assert len(predictions) == 2 and predictions[0].shape == (4, 12)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_ranks_launched_by_lightning_with_parameters_on_storage(tmp_path, free_port) -> None:
    """``Trainer(devices=2)``: each rank stores its own partitions; ``save_last``, a crash and a resume."""

    script = SCRIPTS / "train_two_ranks_save_last.py"
    options = (
        '{"offload_parameters": "storage", "model": {"dim": 1024}, "precision": "bf16-true"}'  # 1-2 MiB partitions
    )
    for mode in ("full", "crash", "resume"):
        done = python(script, tmp_path, mode, options, env=worker_env(MASTER_PORT=str(free_port())), check=False)
        assert done.returncode == (3 if mode == "crash" else 0), done.stdout[-2000:] + done.stderr[-4000:]
    for rank in (0, 1):
        assert list(tmp_path.glob(f"ssd_full{rank}/smartinf/rank00{rank}/params/**/*.swp")), f"rank {rank} stored none"
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert_identical(torch.load(tmp_path / "resumed.pt", weights_only=True), full)


# ------------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("value", ["nvme", "Storage", 2, None, 1.0])
def test_offload_parameters_takes_false_true_or_storage(value) -> None:
    with pytest.raises(MisconfigurationException, match=r"offload_parameters=.*False.*True.*'storage'"):
        SmartInfinityStrategy(offload_parameters=value)


def test_a_deepspeed_offload_param_block_to_nvme_points_to_storage() -> None:
    config = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/tmp"}}}
    with pytest.raises(MisconfigurationException, match=r"offload_parameters='storage'"):
        SmartInfinityStrategy(config=config)


def test_fp32_with_parameters_on_storage_trains_in_fp32_or_is_refused_where_deepspeed_would_store_bf16(
    tmp_path,
) -> None:
    """DeepSpeed 0.19 gives the swapper bf16 for an fp32 model where the accelerator lacks fp16 (this CPU): that is
    refused, before anything is written. Where the accelerator has fp16, the parameters stay fp32 and train."""
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        with pytest.raises(MisconfigurationException, match=r"precision='32-true'.*bf16-true"):
            fit(LMModule(adamw, dim=DIM), strategy(tmp_path, "storage"), steps=1, precision="32-true")
        assert not param_files(tmp_path)
        return
    trainer, ours = fit(LMModule(adamw, dim=DIM), strategy(tmp_path, "storage"), steps=2, precision="32-true")
    assert param_files(tmp_path) and trainer.strategy.smart_update.link_dtype == torch.float32
    assert all(torch.isfinite(p).all() for p in ours.values())


def test_a_disk_without_room_for_parameters_and_state_is_refused_before_anything_is_written(tmp_path) -> None:
    """A real 4 MiB tmpfs; the model's bf16 parameters alone take 13 MB."""
    with tmpfs(tmp_path / "small", "4m") as mount_point:
        with pytest.raises(
            StorageError,
            match=r"No space left on the filesystem of .* for `offload_parameters='storage'` \(.* 16-bit parameters, "
            r".* for their gradients and .* of optimizer state\): it needs [\d.]+ MiB and the filesystem has",
        ):
            fit(LMModule(adamw, dim=DIM), strategy(mount_point, "storage"), steps=1, precision="bf16-true")
        assert not list(mount_point.rglob("*.swp")) and not list(mount_point.rglob("*.state"))


@pytest.mark.parametrize("model", ["built_in_init", "built_in_configure_model"])
def test_a_machine_without_libaio_is_refused_before_anything_is_written(tmp_path, monkeypatch, model) -> None:
    """DeepSpeed's parameter swapper reads and writes the parameter files through its async_io op; without libaio (the
    first GPU machine this ran on had none) DeepSpeed raised from deep inside ``deepspeed.initialize``. DeepSpeed's
    own probe is made to answer as it does there (this machine has libaio)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    monkeypatch.setattr(AsyncIOBuilder, "has_function", lambda self, name, libraries: False)
    module = LMModule(adamw, dim=DIM) if model == "built_in_init" else BuiltInConfigureModel()
    refused = r"offload_parameters='storage'\)` needs DeepSpeed's async_io"
    with pytest.raises(MisconfigurationException, match=refused) as info:
        fit(module, strategy(tmp_path, "storage"), steps=1, precision="bf16-true")
    assert "libaio-dev" in str(info.value) and "`offload_parameters=True`" in str(info.value)
    assert not param_files(tmp_path) and not list(tmp_path.rglob("*.state"))


def test_a_model_built_in_configure_model_is_refused_before_its_state_is_written(tmp_path) -> None:
    """Built in ``configure_model``, the parameters are written as the model is built, before its size is known;
    then the gradients and the state must still fit, and are refused before anything more is written. Found at
    5.7B parameters on this machine: the state filled the disk, then the gradients' file could not be reserved."""
    numel = sum(p.numel() for p in TinyGPT(dim=768).parameters())
    size_mib = (2 * numel >> 20) + 8  # the parameters and some room; not the gradients (2 B) and state (12 B)
    with tmpfs(tmp_path / "small", f"{size_mib}m") as mount_point:
        refused = r"\(the \(already written\) 16-bit parameters, .* for their gradients .*\): it needs .* and the"
        with pytest.raises(StorageError, match=refused):
            fit(BuiltInConfigureModel(), strategy(mount_point, "storage"), steps=1, precision="bf16-true")
        assert param_files(mount_point), "the parameters were written as the model was built"
        assert not list(mount_point.rglob("*.state"))


def test_swap_buffers_are_sized_from_the_model() -> None:
    """The largest stored partition sets the buffer size; the module gathering the most stored partitions sets the
    count. Meta tensors: only sizes are read."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.LSTM(1024, 1024))
    settings = swap_buffer_settings(model.modules(), world_size=2, element_size=2, block_size=1 << 20)
    assert settings["buffer_size"] == 4096 * 4096 // 2
    assert settings["buffer_count"] == 3 * 2 + 2  # the LSTM's two weight matrices, three modules in flight, 2 spare
    small = swap_buffer_settings(torch.nn.Linear(8, 8).modules(), world_size=1, element_size=2, block_size=1 << 20)
    assert small["buffer_size"] == (1 << 20) // 2  # nothing is stored: the swapper's minimum


def test_a_working_set_larger_than_memory_is_refused_with_the_mib_needed_and_available(tmp_path) -> None:
    class Huge(LMModule):
        def __init__(self) -> None:
            super().__init__(adamw, dim=DIM)
            self.table = torch.nn.Parameter(torch.empty(0))

        def setup(self, stage: str) -> None:
            # Only its size is read before the engine is built: ten trillion elements.
            self.table = torch.nn.Parameter(torch.empty(10**13, device="meta"))

    class Shrink(L.Callback):
        def on_exception(self, trainer, pl_module, exception) -> None:
            pl_module.table = torch.nn.Parameter(torch.empty(0))  # Lightning's teardown moves the module to the CPU

    with pytest.raises(
        MisconfigurationException, match=r"needs \d+ MiB of host memory .*swap buffers.*\d+ MiB available"
    ):
        fit(Huge(), strategy(tmp_path, "storage"), steps=1, precision="bf16-true", callbacks=[Shrink()])
    assert not param_files(tmp_path)


def test_the_staging_check_uses_the_sub_group_size_deepspeed_will_use(tmp_path) -> None:
    """A user's config overrides `sub_group_size`; the staging for updated sub-groups is sized by the config's (a
    trillion elements here: refused), not by the argument's (400,000 elements: it would pass)."""

    class Wide(LMModule):
        def __init__(self) -> None:
            super().__init__(adamw, dim=DIM)
            self.tables = torch.nn.ModuleList()

        def setup(self, stage: str) -> None:
            # Only their sizes are read before the engine is built: 10**11 elements, one partition of 10**8 per module,
            # so the swap buffers (about 1 GB) fit and only the staging (3 x 10**11 x 2 bytes) does not.
            self.tables = torch.nn.ModuleList(torch.nn.Embedding(10**5, 1000, device="meta") for _ in range(1000))

    class Shrink(L.Callback):
        def on_exception(self, trainer, pl_module, exception) -> None:
            pl_module.tables = torch.nn.ModuleList()  # Lightning's teardown moves the module to the CPU

    config = {"zero_optimization": {"sub_group_size": 1e12}}
    with pytest.raises(MisconfigurationException, match=r"needs (\d+) MiB of host memory .*staging") as refused:
        fit(Wide(), strategy(tmp_path, "storage", config=config), steps=1, precision="bf16-true", callbacks=[Shrink()])
    needed_mib = int(re.search(r"needs (\d+) MiB", str(refused.value)).group(1))
    assert needed_mib >= 3 * 10**11 * 2 // (1 << 20)  # the staging of the config's sub-groups
    assert not param_files(tmp_path)


# ------------------------------------------------------------------------------------------------ host memory


def _peak_rss(root: Path, layers: int, offload: str, port: int, *extra: str) -> dict:

    script = Path(__file__).parent / "scripts" / "param_storage_rss.py"
    root.mkdir()
    done = subprocess.run(
        [sys.executable, str(script), str(root), "2048", str(layers), offload, *extra],
        env={**worker_env(), "MASTER_PORT": str(port)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_peak_rss_stays_flat_while_the_model_grows_four_times(tmp_path, free_port) -> None:
    """Width 2048, 8 then 32 layers (34M, then 134M parameters), each run in a fresh process built in
    ``configure_model``: the peak RSS moves by at most 10%. With the parameters in host memory the larger model's peak
    is higher by more than its 16-bit parameters (2 B each; they and their gradients stay there), so the measure can
    tell."""
    small = _peak_rss(tmp_path / "small", 8, "storage", free_port())
    large = _peak_rss(tmp_path / "large", 32, "storage", free_port())
    in_memory = _peak_rss(tmp_path / "in_memory", 32, "memory", free_port())
    assert large["params"] == 4 * small["params"]
    assert abs(large["peak_rss"] / small["peak_rss"] - 1) <= 0.10, (small, large)
    assert in_memory["peak_rss"] - large["peak_rss"] > 2 * large["params"], (in_memory, large)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_peak_rss_stays_flat_with_compression_and_a_checkpoint(tmp_path, free_port) -> None:
    """Top-1% with error feedback keeps a fp32 residual as large as the gradients (4 B/param: 0.54 GB at 32 layers),
    and a stock ``ModelCheckpoint`` saves it at the last step: with the parameters on storage the residual lives in a
    file beside the gradients, is written to the checkpoint a block at a time, and peak RSS still moves by at most
    10% while the model grows 4x."""
    small = _peak_rss(tmp_path / "small", 8, "storage", free_port(), "compressed")
    large = _peak_rss(tmp_path / "large", 32, "storage", free_port(), "compressed")
    assert large["checkpoints"] == ["epoch=0-step=2.ckpt"], large
    assert abs(large["peak_rss"] / small["peak_rss"] - 1) <= 0.10, (small, large)


def test_the_gradients_file_keeps_its_contents_out_of_the_process_and_its_blocks_after_a_punch(tmp_path) -> None:
    from helpers.leftovers import left_over

    from lightning_smartinf.zero.param_storage import FILE_BUFFER, FileBuffer

    killed = left_over(tmp_path / FILE_BUFFER)  # a process killed between making its file and unlinking it
    killed.write_bytes(b"")
    numel = 3 << 20
    gradients = FileBuffer(tmp_path, numel, torch.bfloat16)
    assert not list(tmp_path.iterdir()), "the file is unlinked at once, and a killed process's is removed"
    reserved = os.fstat(gradients._fd).st_blocks * 512
    assert reserved >= 2 * numel
    gradients.tensor.fill_(1.5)
    gradients.release()  # out of the process, still in the file
    assert torch.equal(gradients.tensor, torch.full((numel,), 1.5, dtype=torch.bfloat16))
    gradients.discard(1000, numel - 1000)  # the whole pages inside are dropped and read as zeros
    page = mmap.PAGESIZE // 2
    inside = gradients.tensor[page : numel - page]
    assert not inside.any() and gradients.tensor[:1000].eq(1.5).all() and gradients.tensor[-1000:].eq(1.5).all()
    assert os.fstat(gradients._fd).st_blocks * 512 == reserved, "punched blocks are reserved again"


def test_a_gradients_file_that_does_not_fit_is_a_storage_error(tmp_path) -> None:
    from lightning_smartinf.zero.param_storage import FileBuffer

    with tmpfs(tmp_path / "small", "1m") as mount_point:
        with pytest.raises(
            StorageError,
            match=r"No space left on the filesystem of .* for the file of the gradients: it needs 8 MiB and .*Free "
            "space",
        ):
            FileBuffer(mount_point, 4 << 20, torch.bfloat16)
        assert not list(mount_point.iterdir())
