"""Strategy surface: registration, exact traffic accounting, host memory, and clear errors for bad input."""

from __future__ import annotations

import os
import re
import stat
import sys

import lightning as L
import pytest
import torch
from helpers.launch import run, worker_env
from helpers.models import LMModule, adamw_factory, fit, max_relative_error, token_loader
from helpers.unwritable import unwritable_dir
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_smartinf
from lightning_smartinf import SmartInfinityPrecision, SmartInfinityStrategy

adamw = adamw_factory(lr=1e-3)


def test_import_registers_strategy_and_exports():
    assert {"smart_infinity", "smart_infinity_comp"} <= set(StrategyRegistry)
    assert isinstance(StrategyRegistry.get("smart_infinity"), SmartInfinityStrategy)
    assert StrategyRegistry.get("smart_infinity_comp").settings.compression.ratio == 0.01
    assert {"SmartInfinityStrategy", "SmartInfinityPrecision"} <= set(lightning_smartinf.__all__)
    assert all(getattr(lightning_smartinf, name) is not None for name in lightning_smartinf.__all__)


@pytest.mark.parametrize(("precision", "link_bytes"), [("bf16-mixed", 2), ("32-true", 4)])
def test_traffic_is_exact_per_parameter(tmp_path, precision, link_bytes):
    """Link: grad in + param out in the training dtype. Storage: fp32 master + 2 Adam moments, read and written."""
    steps = 3
    module = LMModule(adamw, dim=64)  # every partition size is then a multiple of 1024: no padding
    numel = sum(p.numel() for p in module.parameters())
    # 2 groups (decay/no-decay); sub-groups close at 4096 elements, chunks of 2048 split them further.
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=4096, chunk_size=2048)
    trainer, _ = fit(module, strategy, steps=steps, precision=precision)

    shards = trainer.strategy.smart_update.backend.shards
    padded = sum(
        s.layout.num_chunks and sum(s.layout.padded_len(k) for k in range(s.layout.num_chunks)) for s in shards
    )
    traffic = trainer.strategy.traffic
    init_link = numel * link_bytes  # initial masters are upcast from the low-precision partitions
    assert traffic.link_write_bytes == init_link + steps * numel * link_bytes
    assert traffic.link_read_bytes == steps * numel * link_bytes
    # Between steps the devices read the next step's first chunks (`prefetch_state`): those count with the step
    # that uses them; the last step's advice is never used, and its reads count when teardown drops them.
    used, dropped = trainer.strategy.smart_update.backend.prefetch_stats()
    assert used > 0 and 0 < dropped <= padded * 12
    assert traffic.storage_read_bytes == steps * padded * 12 + dropped
    assert traffic.storage_write_bytes == padded * 12 + steps * padded * 12
    # Per-step metrics are the per-step deltas.
    metrics = trainer.callback_metrics
    assert metrics["smartinf/link_write_bytes"] == numel * link_bytes
    assert metrics["smartinf/storage_read_bytes"] == padded * 12
    assert padded - numel < 1024 * len(shards)


def test_state_files_live_on_storage_paths_and_are_private(tmp_path):
    paths = [tmp_path / "ssd0", tmp_path / "ssd1"]
    for p in paths:
        p.mkdir()
    strategy = SmartInfinityStrategy(storage_paths=paths, sub_group_size=2000)
    trainer, _ = fit(LMModule(adamw), strategy, steps=1)
    shards = trainer.strategy.smart_update.backend.shards
    assert len(shards) >= 4
    for shard in shards:
        device_dir = paths[shard.spec.index % 2] / "smartinf" / "rank000"
        assert shard.file.path.parent == device_dir
        assert shard.file.path.stat().st_size == shard.layout.file_bytes
        assert stat.S_IMODE(device_dir.stat().st_mode) == 0o700


def test_default_storage_is_a_private_temporary_directory_removed_at_the_end():
    """Kept after `fit` (for `trainer.save_checkpoint`), removed when the next run starts or at exit."""
    strategy = SmartInfinityStrategy(sub_group_size=2000)
    trainer, _ = fit(LMModule(adamw), strategy, steps=2)
    backend_dirs = [d.directory for d in trainer.strategy.smart_update.backend.devices]
    assert trainer.strategy.traffic.link_read_bytes > 0
    assert all(d.is_dir() and not d.stat().st_mode & 0o077 for d in backend_dirs)
    fit(LMModule(adamw), SmartInfinityStrategy(sub_group_size=2000), steps=1)
    assert all(not d.exists() for d in backend_dirs)


# ------------------------------------------------------------------------------------------------ bad input


def test_missing_storage_path_under_a_missing_parent(tmp_path):
    """A missing path is created at set-up only below an existing parent (tests/test_storage_paths.py)."""
    with pytest.raises(MisconfigurationException, match=r"storage_paths.*does not exist and cannot be created"):
        SmartInfinityStrategy(storage_paths=[tmp_path / "nope" / "ssd"])


def test_storage_path_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(MisconfigurationException, match="is not a directory"):
        SmartInfinityStrategy(storage_paths=[tmp_path / "f"])


def test_storage_path_not_writable(tmp_path):
    with unwritable_dir(tmp_path / "ro"), pytest.raises(MisconfigurationException, match="not writable"):
        SmartInfinityStrategy(storage_paths=[tmp_path / "ro"])


def test_duplicate_storage_paths(tmp_path):
    with pytest.raises(MisconfigurationException, match="same directory"):
        SmartInfinityStrategy(storage_paths=[tmp_path, tmp_path / "."])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "gpu"}, r"backend='gpu'.*must be one of: 'cpu'"),
        ({"chunk_size": 1000}, r"chunk_size=1000.*multiple of\s+1024"),
        ({"buffer_count": 1}, r"buffer_count=1.*>= 2"),
        ({"io_threads": 0}, r"io_threads=0.*>= 1"),
        ({"sub_group_size": 0}, r"sub_group_size=0"),
        (
            {"config": {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}},
            r"offload_optimizer.*storage_paths",
        ),
        ({"config": {"zero_optimization": {"stage": 2}}}, r"\['stage'\]=2"),
        ({"config": {"optimizer": {"type": "Adam"}}}, r"configure_optimizers"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(MisconfigurationException, match=match):
        SmartInfinityStrategy(**kwargs)


def test_unsupported_precision():
    with pytest.raises(ValueError, match=r"precision='64-true'.*must be one of"):
        SmartInfinityPrecision("64-true")


@pytest.mark.parametrize("shape", ["tuner", "callback"])
def test_the_learning_rate_finder_is_refused_before_anything_is_built(tmp_path, shape):
    """Users call ``Tuner(trainer).lr_find(model)`` (or add the callback): refused at set-up, naming the way out,
    before the engine is built or the finder's checkpoint written (it failed in torch, mid-sweep)."""
    from lightning.pytorch.callbacks import LearningRateFinder
    from lightning.pytorch.tuner import Tuner

    module = LMModule(adamw_factory())
    module.lr = 1e-3
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path / "state"])
    callbacks = [LearningRateFinder()] if shape == "callback" else []
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
    )
    loader = token_loader(4)
    with pytest.raises(MisconfigurationException, match=r"lr_find.*strategy='auto'.*configure_optimizers"):
        if shape == "tuner":
            Tuner(trainer).lr_find(module, train_dataloaders=loader)
        else:
            trainer.fit(module, loader)
    assert not strategy.has_smart_update
    assert not list(tmp_path.glob(".lr_find_*"))


def test_unsupported_optimizer_lists_the_supported_ones(tmp_path):
    def rmsprop(model):
        return torch.optim.RMSprop(model.parameters(), lr=1e-3), None

    with pytest.raises(
        MisconfigurationException, match=r"RMSprop.*torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD"
    ):
        fit(LMModule(rmsprop), SmartInfinityStrategy(storage_paths=[tmp_path]), steps=1)


def test_no_optimizer_is_refused_with_the_way_to_evaluate(tmp_path):
    """`configure_optimizers` returning None: Lightning trains without an optimizer; this strategy's state is the
    optimizer's, so it is refused before anything is built (DeepSpeed failed with an IndexError of its own)."""
    module = LMModule(lambda model: (None, None))  # its `configure_optimizers` returns None
    with pytest.raises(MisconfigurationException, match=r"returned no optimizer.*torch.optim.Adam.*trainer.validate"):
        fit(module, SmartInfinityStrategy(storage_paths=[tmp_path]), steps=1)
    assert not list(tmp_path.rglob("*.state"))


class PreBatched(torch.utils.data.IterableDataset):
    """Batches the dataset makes itself, as streaming LLM pipelines do: loaded with `DataLoader(batch_size=None)`."""

    def __iter__(self):
        tokens, targets = token_loader(4).dataset.tensors
        yield from zip(tokens.split(4), targets.split(4))


@pytest.mark.parametrize("shape", ["batch_size=None", "batch_sampler"])
def test_loaders_without_a_batch_size_train_as_torch_does(tmp_path, shape):
    """A loader with no `batch_size` of its own (batches made by the dataset, or a `batch_sampler` of index lists)
    trains: the engine's batch size is for its throughput log only (Lightning's DeepSpeed strategy failed with an
    AttributeError reading it)."""
    dataset = token_loader(4).dataset

    def loader():
        if shape == "batch_sampler":
            return torch.utils.data.DataLoader(dataset, batch_sampler=[list(range(i, i + 4)) for i in (0, 4, 8, 12)])
        return torch.utils.data.DataLoader(PreBatched(), batch_size=None)

    _, reference = fit(LMModule(adamw_factory()), "auto", steps=4, loader=loader())
    trainer, ours = fit(
        LMModule(adamw_factory()), SmartInfinityStrategy(storage_paths=[tmp_path]), steps=4, loader=loader()
    )
    assert trainer.global_step == 4
    assert max(max_relative_error(ours, reference).values()) < 1e-5


@pytest.mark.parametrize("accumulate", [0, -1, 2.5, True])
def test_accumulating_other_than_a_whole_number_of_batches_is_refused_naming_it(tmp_path, accumulate):
    with pytest.raises(
        MisconfigurationException, match=re.escape(f"`Trainer(accumulate_grad_batches={accumulate!r})`")
    ):
        fit(
            LMModule(adamw_factory()),
            SmartInfinityStrategy(storage_paths=[tmp_path]),
            steps=1,
            accumulate=accumulate,
            batches=4,
        )
    assert not list(tmp_path.rglob("*.state"))


def test_not_enough_free_space_is_reported_before_training(tmp_path, monkeypatch):
    import shutil as shutil_module

    real = shutil_module.disk_usage
    monkeypatch.setattr("lightning_smartinf.core.io.storage.shutil.disk_usage", lambda p: real(p)._replace(free=1024))
    with pytest.raises(
        lightning_smartinf.core.StorageError,
        match=r"for the optimizer state placed there: it needs .*iB and the filesystem has 1 KiB free",
    ):
        fit(LMModule(adamw), SmartInfinityStrategy(storage_paths=[tmp_path]), steps=1)
    assert not list((tmp_path / "smartinf" / "rank000").glob("*.state"))


def test_unsupported_deepspeed_version(tmp_path):
    """An environment whose first `deepspeed` on the path is another release (a package with its metadata): building
    the strategy is refused, naming the version found and the install command."""
    site = tmp_path / "site"
    (site / "deepspeed").mkdir(parents=True)
    (site / "deepspeed" / "__init__.py").write_text('__version__ = "0.18.0"\n')
    (site / "deepspeed-0.18.0.dist-info").mkdir()
    (site / "deepspeed-0.18.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.18.0\n"
    )
    env = worker_env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    code = "from lightning_smartinf.zero import check_deepspeed_version\ncheck_deepspeed_version()\n"
    done = run([sys.executable, "-c", code], env=env, check=False)
    assert done.returncode == 1
    assert re.search(
        r"tested with deepspeed>=0.19.8,<0.20, but deepspeed 0.18.0 is installed.*pip install", done.stderr
    )


class NonFiniteAtStep(LMModule):
    """Produces a non-finite loss (so non-finite gradients) on one batch."""

    def __init__(self, bad_batch: int) -> None:
        super().__init__(adamw)
        self.bad_batch = bad_batch

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx == self.bad_batch else loss


class StepTraffic(L.Callback):
    """Each step's storage bytes (read, written), as the monitor logs them."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []
        self._last = None

    def on_train_batch_end(self, trainer, *_) -> None:
        traffic = trainer.strategy.traffic
        if self._last is not None:
            delta = traffic - self._last
            self.steps.append((delta.storage_read_bytes, delta.storage_write_bytes))
        self._last = traffic


@pytest.mark.parametrize(
    ("clip", "fires"), [(None, False), (1e6, False), (1e-3, True)], ids=["no-clipping", "never-fires", "fires-always"]
)
def test_clipping_costs_no_second_pass_over_the_state(tmp_path, clip, fires):
    """A hand-off during backward speculates that the step will not clip; a miss redoes the update (a second pass
    over the state, 48 B/param). Where clipping fires on every step, only the first step pays it: every later step
    moves the state's bytes once (24 B/param for Adam), as without overlap. Where it never fires, every step is
    handed off and kept, as before. Exact byte counts (the state's records padded to whole blocks)."""
    steps = 6
    module = LMModule(adamw, dim=64)
    numel = sum(p.numel() for p in module.parameters())
    probe = StepTraffic()
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=4096, chunk_size=2048)
    trainer, _ = fit(module, strategy, steps=steps, clip=clip, callbacks=[probe])
    smart_update = trainer.strategy.smart_update
    state = 12 * sum(s.layout.padded_len(k) for s in smart_update.backend.shards for k in range(s.layout.num_chunks))
    redone = 1 if fires else 0  # the first step's hand-offs, rolled back and redone
    traffic = trainer.strategy.traffic
    assert traffic.storage_write_bytes == state * (1 + steps + redone)  # the initial state, then each pass
    assert traffic.link_write_bytes == 4 * numel * (1 + steps + redone)
    # Steps 2..6 (the probe sees deltas from the end of step 1): one pass over the state each, written once.
    assert [written for _, written in probe.steps] == [state] * (steps - 1)
    groups = len(smart_update.sub_groups)
    expected = (0, groups) if fires else (steps * groups, 0)
    assert (smart_update.early_kept, smart_update.early_rolled_back) == expected
    assert trainer.callback_metrics["smartinf/speculating"] == (0.0 if fires else 1.0)


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_non_finite_gradients_skip_the_step_and_leave_device_state_untouched(tmp_path, overlap):
    class Probe(L.Callback):
        def __init__(self) -> None:
            self.snapshots = []

        def on_train_batch_end(self, trainer, pl_module, *_):
            backend = trainer.strategy.smart_update.backend
            backend.wait()
            files = b"".join(s.file.path.read_bytes() for s in backend.shards)
            params = [p.ds_tensor.clone() for p in pl_module.parameters()]
            self.snapshots.append((trainer.strategy.traffic, files, params))

    probe = Probe()
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=3000, overlap_backward=overlap)
    trainer, _ = fit(
        NonFiniteAtStep(bad_batch=1), strategy, steps=3, batches=4, precision="bf16-mixed", callbacks=[probe]
    )
    (t0, f0, p0), (t1, f1, p1), (t2, f2, p2) = probe.snapshots[:3]
    if overlap:  # devices updated during backward, tentatively; the step rolled that back
        assert (t1 - t0).storage_write_bytes > 0
        optimizer = trainer.strategy.deepspeed_engine.optimizer
        assert optimizer.smart_update.early_rolled_back == len(optimizer.fp16_groups)  # every sub-group, that step only
    else:
        assert (t1 - t0).link_write_bytes == 0 and (t1 - t0).storage_write_bytes == 0  # nothing reached a device
    assert f1 == f0  # every committed state file byte-identical across the skipped step
    assert all(torch.equal(a, b) for a, b in zip(p1, p0))  # and so are the parameters
    assert (t2 - t1).storage_write_bytes > 0 and f2 != f1  # the next finite step updates again
    assert not all(torch.equal(a, b) for a, b in zip(p2, p1))
    # Three optimizer steps were taken, one skipped: the devices applied two (Adam bias correction sees t=2).
    assert trainer.strategy.smart_update.group_steps == {0: 2, 1: 2}


@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_fp16_trains_where_the_accelerator_has_it_and_is_refused_clearly_where_not(tmp_path, precision):
    """Either way something is asserted: an accelerator with fp16 trains in it (finite, moved parameters), one without
    refuses before anything is built, naming bf16."""
    from deepspeed.accelerator import get_accelerator

    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=3000)
    if not get_accelerator().is_fp16_supported():
        with pytest.raises(MisconfigurationException, match=rf"precision='{precision}'.*bf16-mixed"):
            fit(LMModule(adamw), strategy, steps=1, precision=precision)
        assert not list(tmp_path.rglob("*.state"))
        return
    initial = {n: p.detach().float().clone() for n, p in LMModule(adamw).named_parameters()}
    trainer, ours = fit(LMModule(adamw), strategy, steps=3, precision=precision)
    assert trainer.strategy.smart_update.link_dtype == torch.float16
    assert all(torch.isfinite(p).all() for p in ours.values())
    assert min(max_relative_error(ours, initial).values()) > 0


@pytest.mark.parametrize("options", [{"threshold_bytes": 1024}, {}], ids=["arguments", "defaults"])
def test_offload_activations_argument_installs_the_callback(tmp_path, options):
    from lightning_smartinf.lightning.activation_offload import ActivationOffload

    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], offload_activations=options)
    trainer, _ = fit(LMModule(adamw), strategy, steps=2)
    offload = [c for c in trainer.callbacks if isinstance(c, ActivationOffload)]
    assert len(offload) == 1
    if options:
        assert trainer.callback_metrics["smartinf/activation_write_bytes"] > 0
    else:  # the defaults judge this tiny model's activations not worth offloading, and say so in the metrics
        assert "smartinf/activation_write_bytes" in trainer.callback_metrics


def test_reduce_bucket_follows_sub_group_size_when_updates_overlap_backward(tmp_path):
    def bucket(**kwargs) -> int:
        strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=8_000_000, **kwargs)
        return strategy.config["zero_optimization"]["reduce_bucket_size"]

    assert bucket() == 8_000_000  # gradients reach the devices one sub-group at a time
    assert bucket(overlap_backward=False) == 200_000_000
    assert bucket(reduce_bucket_size=5_000_000) == 5_000_000
    assert bucket(config={"zero_optimization": {"reduce_bucket_size": 7}}) == 7
    with pytest.raises(MisconfigurationException, match=r"`reduce_bucket_size=0` is too small"):
        bucket(reduce_bucket_size=0)
    with pytest.raises(MisconfigurationException, match=r"`overlap_backward='yes'` is a str: it must be True or False"):
        bucket(overlap_backward="yes")


def test_prefetch_state_can_be_turned_off_and_is_validated(tmp_path):
    with pytest.raises(MisconfigurationException, match=r"`prefetch_state=1` is an int: it must be True or False"):
        SmartInfinityStrategy(storage_paths=[tmp_path], prefetch_state=1)
    steps = 2
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=4096, prefetch_state=False)
    trainer, _ = fit(LMModule(adamw, dim=64), strategy, steps=steps)
    backend = trainer.strategy.smart_update.backend
    assert backend.prefetch_stats() == (0, 0)
    state_bytes = sum(s.layout.file_bytes for s in backend.shards)
    assert trainer.strategy.traffic.storage_read_bytes == steps * state_bytes


def test_the_settings_are_the_strategys_own_arguments_with_the_same_defaults(tmp_path):
    """Every field of `SmartUpdateSettings` is a keyword argument of the strategy (LightningCLI's shape) with the same
    default, and the strategy's `settings` hold exactly what it was given."""
    import dataclasses
    import inspect

    from lightning_smartinf import SmartUpdateSettings
    from lightning_smartinf.core import registry

    parameters = inspect.signature(SmartInfinityStrategy).parameters
    for field in dataclasses.fields(SmartUpdateSettings):
        if field.name == "device":  # the kind's own settings: each of its arguments is the strategy's, default None
            kind_arguments = [a for name in registry.kinds() for a in registry.kind(name).arguments]
            assert kind_arguments and all(parameters[a].default is None for a in kind_arguments), kind_arguments
            continue
        assert field.name in parameters, field.name
        assert parameters[field.name].default == field.default, field.name
    assert SmartInfinityStrategy().settings == SmartUpdateSettings()
    given = {"storage_paths": [tmp_path], "buffer_count": 4, "chunk_size": 2048, "compression": 0.05}
    assert SmartInfinityStrategy(**given).settings == SmartUpdateSettings(**given)
    with pytest.raises(dataclasses.FrozenInstanceError):
        SmartInfinityStrategy().settings.buffer_count = 3


def test_a_cpu_run_gives_deepspeed_its_accelerator_back(tmp_path):
    """Issue 23, item 6. DeepSpeed's accelerator is process-wide, and a CPU run switches it to CPU. A later CUDA run
    in the same process (a notebook, a test suite) must find the accelerator it had, not DeepSpeed on CPU. The
    accelerator here is DeepSpeed's CUDA one, which it builds without a GPU."""
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    before = get_accelerator()
    cuda = CUDA_Accelerator()
    set_accelerator(cuda)
    try:
        fit(LMModule(adamw), SmartInfinityStrategy(storage_paths=[tmp_path]), steps=1)
        assert get_accelerator() is cuda
    finally:
        set_accelerator(before)
