"""Activation offload (issue 9): exact gradients, dedup, forwarding, keep-last, back-pressure, clean files,
bad input."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
import threading

import pytest
import torch
from helpers.leftovers import dead_pid, left_over
from helpers.models import SEQ, VOCAB, LMModule, TinyGPT, adamw_factory, fit
from torch import nn

from lightning_smartinf.activations import SavedTensorOffloader, find_layers, tuning
from lightning_smartinf.activations import offload as offload_mod
from lightning_smartinf.activations.costs import PREDICTION_MARGIN
from lightning_smartinf.activations.spill import SPILL_FILE_NAME
from lightning_smartinf.core.io.direct import StateFile
from lightning_smartinf.core.io.storage import StorageError
from lightning_smartinf.lightning.activation_offload import ActivationOffload


@pytest.fixture(autouse=True)
def _deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


def _batch(seed: int = 1, batch: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


def _grads(offloader: SavedTensorOffloader | None, micro_batches: int = 2, **model_kwargs) -> dict[str, torch.Tensor]:
    """Gradient accumulation over ``micro_batches`` forward/backward passes, with or without offload."""
    torch.manual_seed(0)
    model = TinyGPT(**model_kwargs)
    if offloader is not None:
        offloader.attach(model)
    for i in range(micro_batches):
        tokens = _batch(seed=i)
        if offloader is None:
            _loss(model, tokens).backward()
        else:
            with offloader:
                _loss(model, tokens).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_clean(offloader: SavedTensorOffloader) -> None:
    """No record is left: nothing in memory, nothing in the spill files (which stay, for the next micro-batch)."""
    assert {f.name for f in offloader.files()} <= {SPILL_FILE_NAME}
    assert offloader.stats.resident_bytes == 0
    assert offloader._records == {}


@pytest.mark.parametrize("budget", [1 << 14, 64 << 20])
def test_gradients_bitwise_identical_with_accumulation(tmp_path, budget):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    reference = _grads(None, dim=64, layers=4)
    off = SavedTensorOffloader(
        [tmp_path / "a", tmp_path / "b"], threshold_bytes=4096, keep_last=1, max_inflight_bytes=budget
    )
    parents = set()
    real_write = off._io.write
    off._io.write = lambda f, b, o: (parents.add(f.path.parent), real_write(f, b, o))
    ours = _grads(off, dim=64, layers=4)
    for name in reference:
        assert torch.equal(ours[name], reference[name]), name
    s = off.stats
    assert s.tensors_offloaded > 0 and s.bytes_written > 0
    assert 0 < s.bytes_read <= s.bytes_written
    _assert_clean(off)
    assert parents == set(off.run_dirs)  # striped over both storage paths
    off.close()
    assert not any(list((tmp_path / p / offload_mod.ROOT_DIR_NAME).iterdir()) for p in ("a", "b"))


def test_memory_reduced_and_keep_last_ordering(tmp_path):
    peaks, offloaded = {}, {}
    for label, kwargs in {
        "off": dict(enabled=False),
        "k0": dict(keep_last=0),
        "k1": dict(keep_last=1),
        "k4": dict(keep_last=4),
    }.items():
        off = SavedTensorOffloader([tmp_path], threshold_bytes=4096, max_inflight_bytes=1 << 16, **kwargs)
        _grads(off, micro_batches=1, dim=64, layers=4)
        peaks[label], offloaded[label] = off.stats.peak_resident_bytes, off.stats.tensors_offloaded
        _assert_clean(off)
        off.close()
    assert offloaded["off"] == 0
    assert offloaded["k4"] < offloaded["k1"] < offloaded["k0"]  # the last layers' activations stay in memory
    assert peaks["k1"] < 0.6 * peaks["off"]


def test_dedup_by_storage_and_forwarding(tmp_path):
    """One tensor saved by two nodes (and through a view) is written once; a pending write is forwarded, not read."""
    off = SavedTensorOffloader([tmp_path], threshold_bytes=0)
    gate = threading.Event()
    real_write = off._io.write

    def slow_write(file, buf, offset):
        gate.wait(10)
        real_write(file, buf, offset)

    off._io.write = slow_write
    w1 = torch.randn(256, requires_grad=True)
    w2 = torch.randn(256, requires_grad=True)
    with off:
        h = torch.randn(64, 256).exp()  # saved by exp's backward (its result)
        y = (h * w1).sum() + (h * w2).sum() + (h.view(64, 256) * w1).sum()
        assert off.stats.dedup_hits >= 2
        y.backward()
        gate.set()
    off.clear()
    assert off.stats.forwarded >= 1 and off.stats.bytes_read == 0
    _assert_clean(off)
    off.close()


def test_backpressure_bounds_inflight_bytes(tmp_path):
    budget = 1 << 15
    off = SavedTensorOffloader([tmp_path], threshold_bytes=4096, max_inflight_bytes=budget)
    seen = []
    real_write, real_read = off._io.write, off._io.read
    off._io.write = lambda f, b, o: (seen.append(off._inflight), real_write(f, b, o))
    off._io.read = lambda f, b, o: (seen.append(off._inflight), real_read(f, b, o))
    _grads(off, micro_batches=1, dim=64, layers=4)
    largest = max(r.nbytes for r in off._order)
    assert seen and max(seen) <= max(budget, 2 * largest)
    _assert_clean(off)
    off.close()


def test_no_file_left_after_exception_in_backward(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(dim=64, layers=4)
    off = SavedTensorOffloader([tmp_path], threshold_bytes=4096, keep_last=0).attach(model)

    def boom(grad):
        raise RuntimeError("boom in backward")

    with pytest.raises(RuntimeError, match="boom in backward"), off:
        loss = _loss(model, _batch())
        [r.future.result() for r in off._order]
        assert off.files()  # the activations are on disk now
        model.blocks[0].fc1.weight.register_hook(boom)
        loss.backward()
    assert off.files() == []
    del loss
    off.close()
    assert list((tmp_path / offload_mod.ROOT_DIR_NAME).iterdir()) == []


def test_stale_dir_of_dead_process_removed(tmp_path):
    root = tmp_path / offload_mod.ROOT_DIR_NAME
    dead = dead_pid()
    stale = left_over(root / "activations", "run", pid=dead)
    alive = left_over(root / "activations", "run", pid=os.getppid())
    other_host = left_over(root / "activations", "run", pid=dead, host="some-other-host")
    for d in (stale, alive, other_host):
        d.mkdir(parents=True)
        (d / "3.act").write_bytes(b"x" * 10)
    off = SavedTensorOffloader([tmp_path])
    assert not stale.exists() and alive.exists() and other_host.exists()
    assert oct(os.stat(off.run_dirs[0]).st_mode & 0o777) == "0o700"
    assert oct(os.stat(root).st_mode & 0o777) == "0o700"
    off.close()


@pytest.mark.parametrize(("arg", "value"), [("threshold_bytes", -1), ("keep_last", -2), ("max_inflight_bytes", 0)])
def test_bad_arguments_name_the_argument(tmp_path, arg, value):
    with pytest.raises(ValueError, match=arg):
        SavedTensorOffloader([tmp_path], **{arg: value})
    with pytest.raises(ValueError, match=arg):
        ActivationOffload(storage_paths=[tmp_path], **{arg: value})


def test_model_without_layers_falls_back_to_size_only(tmp_path):
    def run(off):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        x = torch.randn(32, 64)
        if off is None:
            model(x).square().sum().backward()
        else:
            with pytest.warns(UserWarning, match="size-only"):
                off.attach(model)
            with off:
                model(x).square().sum().backward()
        return [p.grad for p in model.parameters()]

    assert find_layers(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []
    off = SavedTensorOffloader([tmp_path], threshold_bytes=4096, keep_last=3)
    ours = run(off)
    assert all(torch.equal(a, b) for a, b in zip(ours, run(None)))
    assert off.stats.tensors_offloaded >= 2  # keep_last is ignored without layers
    _assert_clean(off)
    off.close()


def test_storage_full_is_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    """Every spill refused (the file cannot grow): the step stops with the full-disk error, the parameters are
    untouched and no record or file is left."""

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(StateFile, "reserve", full)  # the spill file cannot grow: the disk is full
    torch.manual_seed(0)
    model = TinyGPT(dim=64, layers=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    off = SavedTensorOffloader([tmp_path], threshold_bytes=4096, keep_last=0).attach(model)
    with pytest.raises(StorageError, match="No space left on the filesystem"), off:
        _loss(model, _batch()).backward()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    _assert_clean(off)
    off.close()


def test_a_real_full_disk_stops_the_step_with_one_error(tmp_path, ext4_fs):
    """Spilling to a real filesystem with 16 KiB left: the step stops with one error naming the path, what and the
    bytes; the parameters are untouched and no spill file is left."""
    fs = ext4_fs("8m")
    with open(fs / "ballast", "wb") as f:
        f.write(b"\0" * (shutil.disk_usage(fs).free - (16 << 10)))
    torch.manual_seed(0)
    model = TinyGPT(dim=64, layers=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    off = SavedTensorOffloader([fs / "spill"], threshold_bytes=4096, keep_last=0).attach(model)
    with (
        pytest.raises(
            StorageError,
            match=r"No space left on the filesystem of .*spill.* for an activation offloaded during forward: it "
            r"needs [\d.]+ [KM]?i?B and the filesystem has [\d.]+ [KM]?i?B free\. The step stopped before the "
            "optimizer ran",
        ),
        off,
    ):
        _loss(model, _batch()).backward()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert off._records == {} and {f.name for f in off.files()} <= {SPILL_FILE_NAME}
    off.close()
    assert sorted(p.name for p in fs.iterdir()) == ["ballast", "spill"] and not list((fs / "spill").rglob("*.bin"))


def test_layers_named_where_none_are_found(tmp_path):
    """A model whose layers the search misses (no repeated list with parameters) names them with `layers=`: no
    size-only fallback, same gradients; a name that holds no list is refused with the lists there are."""
    import warnings

    def run(off, layers):
        torch.manual_seed(0)
        model = nn.Module()
        model.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        x = torch.randn(32, 64)
        if off is None:
            model.net(x).square().sum().backward()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no size-only warning
                off.attach(model, layers)
            with off:
                model.net(x).square().sum().backward()
        return [p.grad for p in model.parameters()]

    off = SavedTensorOffloader([tmp_path], threshold_bytes=4096, keep_last=1)
    assert all(torch.equal(a, b) for a, b in zip(run(off, "net"), run(None, None)))
    assert off.stats.tensors_offloaded >= 1
    with pytest.raises(ValueError, match=r"`layers='net.0'`: Module has a Linear, not a list of layers.*'net'"):
        run(off, "net.0")
    with pytest.raises(ValueError, match=r"`layers='blocks'`: Module has no such submodule.*found: 'net'"):
        run(off, "blocks")
    off.close()
    with pytest.raises(ValueError, match=r"`layers=3` is an int: it must be the name of the module list"):
        ActivationOffload(layers=3)


@pytest.mark.parametrize("layers", [None, "model.blocks", "model.nowhere"])
def test_the_callbacks_layers_reach_the_offloader(tmp_path, layers, recwarn):
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_smartinf import SmartInfinityStrategy

    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], offload_activations={"layers": layers, "keep_last": 0})
    if layers == "model.nowhere":
        with pytest.raises(MisconfigurationException, match=r"`ActivationOffload`: `layers='model.nowhere'`"):
            fit(LMModule(_adamw, dim=64), strategy, steps=1)
        return
    trainer, _ = fit(LMModule(_adamw, dim=64), strategy, steps=1)
    assert trainer.callback_metrics["smartinf/activation_write_bytes"] >= 0
    assert not [w for w in recwarn if "size-only" in str(w.message)]


_adamw = adamw_factory(lr=1e-3)


def test_callback_in_trainer_with_smart_infinity_strategy(tmp_path):
    from lightning_smartinf import SmartInfinityStrategy

    state, act = tmp_path / "state", tmp_path / "act"
    state.mkdir(), act.mkdir()
    _, reference = fit(LMModule(_adamw, dim=64), SmartInfinityStrategy(storage_paths=[state]), steps=2, accumulate=2)
    callback = ActivationOffload(threshold_bytes=4096, keep_last=0, max_inflight_bytes=1 << 16)
    trainer, ours = fit(
        LMModule(_adamw, dim=64),
        SmartInfinityStrategy(storage_paths=[act]),
        steps=2,
        accumulate=2,
        callbacks=[callback],
    )
    for name in reference:
        assert torch.equal(ours[name], reference[name]), name
    assert callback.stats.bytes_written > 0 and callback.stats.resident_bytes == 0
    assert callback.offloader is None
    assert list((act / offload_mod.ROOT_DIR_NAME).iterdir()) == []


@pytest.mark.parametrize("reentrant", [True, False])
def test_with_activation_checkpointing(tmp_path, reentrant):
    """Checkpointed blocks: only their inputs are saved in forward (offloaded); the recomputation in backward is
    packed while backward runs and stays in memory. Gradients are unchanged."""
    from torch.utils.checkpoint import checkpoint

    def run(off):
        torch.manual_seed(0)
        model = TinyGPT(dim=64, layers=4)
        for block in model.blocks:
            block.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=reentrant))(block.forward)
        tokens = _batch()
        if off is None:
            _loss(model, tokens).backward()
        else:
            off.attach(model)
            with off:
                _loss(model, tokens).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    reference = run(None)
    off = SavedTensorOffloader([tmp_path], threshold_bytes=4096, keep_last=0)
    ours = run(off)
    assert all(torch.equal(ours[n], reference[n]) for n in reference)
    assert off.stats.tensors_offloaded > 0
    _assert_clean(off)
    off.close()


# --------------------------------------------------------------------------------------------------- issue 22


def test_spill_file_reused_every_micro_batch_and_bounded(tmp_path):
    """Records of every micro-batch go to one spill file per path, from offset 0 again: its size stops growing."""
    off = SavedTensorOffloader([tmp_path], threshold_bytes=4096, keep_last=0, max_inflight_bytes=1 << 16)
    torch.manual_seed(0)
    model = TinyGPT(dim=64, layers=4)
    off.attach(model)
    sizes = []
    for i in range(3):
        with off:
            _loss(model, _batch(seed=i)).backward()
        (spill,) = off.files()
        assert spill.name == SPILL_FILE_NAME and oct(spill.stat().st_mode & 0o777) == "0o600"
        sizes.append(spill.stat().st_size)
        _assert_clean(off)
    assert sizes[0] == sizes[1] == sizes[2] >= off.stats.bytes_written // 3
    off.close()
    assert not off.run_dirs[0].exists()


def test_graph_kept_across_micro_batches_is_not_overwritten(tmp_path):
    """A forward whose backward runs after a later micro-batch: its records stay in the spill file, and the later
    micro-batch's records go after them, not over them."""

    def losses(off):
        torch.manual_seed(0)
        model = TinyGPT(dim=64, layers=4)
        if off is not None:
            off.attach(model)
        ctx = off if off is not None else contextlib.nullcontext()
        with ctx:
            first = _loss(model, _batch(seed=1))  # its backward comes last
        with ctx:
            _loss(model, _batch(seed=2)).backward()
        with ctx:
            first.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = losses(None)
    off = SavedTensorOffloader([tmp_path], threshold_bytes=4096, keep_last=0, max_inflight_bytes=1 << 16)
    ours = losses(off)
    assert all(torch.equal(ours[n], reference[n]) for n in reference)
    assert off.stats.bytes_read > 0
    _assert_clean(off)
    off.close()


class _Keep(torch.autograd.Function):
    """Saves its input as it is (any layout) and checks in backward that it comes back bit for bit."""

    @staticmethod
    def forward(ctx, x, expected):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x)
        ctx.expected = expected
        return x.sum()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        (x,) = ctx.saved_tensors
        assert x.shape == ctx.expected.shape and x.stride() == ctx.expected.stride()
        assert torch.equal(x, ctx.expected)
        return grad.expand_as(x).clone(), None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unaligned_and_permuted_tensors_come_back_exactly(tmp_path, dtype):
    """Tensors are written from where they lie, with the bytes around them in their first and last pages: a tensor
    starting mid-page, one ending mid-page and a permuted one all come back bit for bit."""
    base = torch.randn(3 * 4096 + 7).to(dtype)
    cube = torch.randn(8, 16, 33).to(dtype)
    cases = [(base, base[5:]), (base, base[: 4096 + 3]), (cube, cube.permute(2, 0, 1))]
    off = SavedTensorOffloader([tmp_path], threshold_bytes=0, keep_last=0)
    heads = set()
    for whole, part in cases:
        leaf = whole.clone().requires_grad_()
        with off:
            full = leaf * 1  # not a leaf: its views are saved activations
            view = full.as_strided(part.shape, part.stride(), part.storage_offset())
            heads.add(view.data_ptr() % 4096)
            y = _Keep.apply(view, part)
            [r.future.result() for r in off._order]  # on disk before backward: it is read back, not forwarded
            y.backward()
        assert leaf.grad is not None
    assert heads != {0}
    assert off.stats.tensors_offloaded >= 3 and off.stats.bytes_read == off.stats.bytes_written
    _assert_clean(off)
    off.close()


def test_write_overtaken_by_backward_is_skipped(tmp_path):
    """A write that has not started when backward begins is never done: the tensor stays in memory for backward."""
    off = SavedTensorOffloader([tmp_path], threshold_bytes=4096, keep_last=0, io_threads=1)
    gate = threading.Event()
    real_write = off._io.write

    def held_write(file, buf, offset):  # the first write waits until backward has started
        gate.wait(10)
        real_write(file, buf, offset)

    off._io.write = held_write
    torch.manual_seed(0)
    model = TinyGPT(dim=64, layers=4)
    reference = _grads(None, micro_batches=1, dim=64, layers=4)
    off.attach(model)
    with off:
        loss = _loss(model, _batch(seed=0))
        threading.Timer(0.2, gate.set).start()
        loss.backward()
    s = off.stats
    assert s.writes_skipped > 0 and s.bytes_written < s.tensors_offloaded * 4096 * 64
    assert all(torch.equal(p.grad, reference[n]) for n, p in model.named_parameters())
    _assert_clean(off)
    off.close()


def test_read_buffers_come_back_to_the_pool(tmp_path):
    off = SavedTensorOffloader([tmp_path], threshold_bytes=4096, keep_last=0, max_inflight_bytes=1 << 20)
    _grads(off, micro_batches=3, dim=64, layers=4)
    s = off.stats
    assert s.pooled_reads > 0
    assert 0 < s.peak_pooled_bytes <= off.max_inflight_bytes
    assert off._read_pooled == 0  # emptied when each micro-batch ends: forward runs without idle buffers
    off.close()


@pytest.mark.slow
def test_settings_left_to_none_are_chosen_from_measurements(tmp_path, caplog):
    """threshold_bytes, keep_last and max_inflight_bytes chosen after the measured micro-batches, logged, and the
    gradients stay bitwise equal through the switch."""
    from lightning_smartinf.activations import tuning

    # Through the choice and its re-check (which pauses offload every other micro-batch).
    batches = tuning.MEASURE_AT + tuning.MEASURE_COUNT + 2 * tuning.RECHECK_COUNT
    kwargs = dict(dim=256, layers=4)

    def run(off):
        torch.manual_seed(0)
        model = TinyGPT(**kwargs)
        if off is not None:
            off.attach(model)
        grads = []
        for i in range(batches):
            model.zero_grad()
            tokens = _batch(seed=i, batch=64)
            if off is None:
                _loss(model, tokens).backward()
            else:
                with off:
                    _loss(model, tokens).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        return grads

    reference = run(None)
    off = SavedTensorOffloader([tmp_path])
    with caplog.at_level("INFO", logger="lightning_smartinf.activations.offload"):
        ours = run(off)
    for mine, theirs in zip(ours, reference):
        assert all(torch.equal(mine[n], theirs[n]) for n in theirs)
    chosen = off.tuning
    assert chosen is not None and off.measured_overhead is not None  # re-checked, bit for bit all the same
    assert len(off._paused_walls) == len(off._walls) == tuning.RECHECK_COUNT
    assert (off.keep_last, off.threshold_bytes, off.max_inflight_bytes) == (
        chosen.keep_last,
        chosen.threshold_bytes,
        chosen.max_inflight_bytes,
    )
    # Within the budget's margin (10% x 0.8): offloading all it can there, or less (said as a warning) or nothing.
    assert chosen.predicted.share <= chosen.budget * PREDICTION_MARGIN + 1e-12 and not chosen.given
    assert chosen.threshold_bytes >= tuning.MIN_THRESHOLD and chosen.max_inflight_bytes >= tuning.MIN_BUDGET
    assert chosen.io.compute_on_host and chosen.io.write_bytes_per_s > 0 and chosen.io.cpu_s_per_byte > 0
    assert chosen.predicted.offloaded_bytes > 0 or chosen.held_back
    said = [r for r in caplog.records if "keep_last=" in r.getMessage() and "predicted" in r.getMessage()]
    assert 1 <= len(said) <= 2  # the choice, and the re-check's if it tightened it
    assert said[-1].levelname == ("WARNING" if chosen.held_back else "INFO")
    assert off.stats.tensors_offloaded > 0
    _assert_clean(off)
    off.close()

    # A setting the user gives is kept; the others are still chosen.
    off = SavedTensorOffloader([tmp_path], keep_last=3)
    run(off)
    assert off.tuning is not None and off.keep_last == 3 and off.tuning.keep_last == 3
    off.close()
    # All given: kept as given, measured against the budget (a warning where they are predicted to break it).
    off = SavedTensorOffloader([tmp_path], threshold_bytes=1 << 20, keep_last=1, max_inflight_bytes=1 << 26)
    run(off)
    assert off.tuning is not None and off.tuning.given and (off.threshold_bytes, off.keep_last) == (1 << 20, 1)
    assert off.max_inflight_bytes == 1 << 26 and off.measured_overhead is None  # given settings are not re-checked
    off.close()


@pytest.mark.parametrize(
    ("arg", "value", "match"),
    [
        ("keep_last", "auto", r"keep_last='auto'.*or None"),
        ("threshold_bytes", 1.5, r"threshold_bytes=1.5.*or None"),
        ("max_inflight_bytes", True, r"max_inflight_bytes=True"),
        ("io_threads", None, r"io_threads=None"),
    ],
)
def test_automatic_settings_bad_input(tmp_path, arg, value, match):
    with pytest.raises(ValueError, match=match):
        SavedTensorOffloader([tmp_path], **{arg: value})
    with pytest.raises(ValueError, match=arg):
        ActivationOffload(storage_paths=[tmp_path], **{arg: value})


def test_huge_settings_keep_everything_in_memory(tmp_path):
    off = SavedTensorOffloader([tmp_path], threshold_bytes=2**62, keep_last=2**40, max_inflight_bytes=2**62)
    reference = _grads(None, micro_batches=1, dim=64, layers=4)
    ours = _grads(off, micro_batches=1, dim=64, layers=4)
    assert all(torch.equal(ours[n], reference[n]) for n in reference)
    assert off.stats.tensors_offloaded == 0 and off.files() == []
    off.close()


def test_callback_with_temporary_strategy_storage(tmp_path):
    """`SmartInfinityStrategy()` keeps its state in temporary directories; activation offload then writes to the
    temporary directory too, and leaves nothing there."""
    import tempfile

    from lightning_smartinf import SmartInfinityStrategy

    callback = ActivationOffload(threshold_bytes=4096, keep_last=0)
    fit(LMModule(_adamw, dim=64), SmartInfinityStrategy(), steps=2, callbacks=[callback])
    assert callback.stats.bytes_written > 0 and callback.stats.resident_bytes == 0
    root = os.path.join(tempfile.gettempdir(), offload_mod.ROOT_DIR_NAME)
    mine = [d for d in os.listdir(root) if d.split("-")[-2] == str(os.getpid())]
    assert mine == []


def _measured_run(off: SavedTensorOffloader, batches: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT(dim=256, layers=4)
    off.attach(model)
    for i in range(batches):
        model.zero_grad()
        with off:
            _loss(model, _batch(seed=i, batch=64)).backward()


def test_given_settings_that_break_the_budget_are_kept_and_said(tmp_path, caplog):
    """A budget no offload can keep (0.01%), settings given: they stay, with one warning naming the budget."""
    off = SavedTensorOffloader(
        [tmp_path], threshold_bytes=4096, keep_last=0, max_inflight_bytes=1 << 20, overhead_budget=1e-4
    )
    with caplog.at_level("INFO", logger="lightning_smartinf.activations.offload"):
        _measured_run(off, tuning.MEASURE_AT + tuning.MEASURE_COUNT)
    assert (off.threshold_bytes, off.keep_last, off.max_inflight_bytes) == (4096, 0, 1 << 20)
    warned = [r for r in caplog.records if "over its 0% budget" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelname == "WARNING" and "Kept as given" in warned[0].getMessage()
    off.close()


def test_a_budget_nothing_can_keep_offloads_nothing_and_says_so(tmp_path, caplog):
    off = SavedTensorOffloader([tmp_path], overhead_budget=1e-9)
    with caplog.at_level("INFO", logger="lightning_smartinf.activations.offload"):
        _measured_run(off, tuning.MEASURE_AT + tuning.MEASURE_COUNT + 1)
    assert off.tuning is not None and off.tuning.offloads_nothing and off.keep_last == len(off.layers)
    said = [r for r in caplog.records if "offloads nothing" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING"
    written = off.stats.bytes_written
    _measured_run(off, 1)  # from here on every activation stays in memory
    assert off.stats.bytes_written == written
    off.close()


def test_the_choice_is_rechecked_once_against_the_measured_steps(tmp_path, caplog):
    """After the choice, the overhead the next micro-batches showed on the offloader's own clocks: above the
    prediction by more than half the budget, the choice is made again with the difference charged to each offloaded
    byte (less leaves memory), once; below it, the choice stays (a cheap-looking step is no room to offload more)."""
    budget = 10.0  # a budget any machine keeps while offloading something
    off = SavedTensorOffloader([tmp_path], overhead_budget=budget)
    _measured_run(off, tuning.MEASURE_AT + tuning.MEASURE_COUNT - 1)
    chosen = off.tuning
    assert chosen is not None and off.measured_overhead is None and chosen.predicted.offloaded_bytes > 0
    assert chosen.io.compute_on_host

    def recheck(measured: float) -> None:
        """The next micro-batches as measured: the model's step each, with I/O-thread CPU time adding ``measured``."""
        wall, count = chosen.predicted.step_s, offload_mod.RECHECK_COUNT
        added = measured * wall / (1 + measured)
        off._walls, off._paused_walls = [wall] * count, []  # no room to pause: the offloader's own clocks
        off._recheck_from = dataclasses.replace(
            off.stats, io_cpu_s=off.stats.io_cpu_s - added * count / offload_mod.HOST_CPU_FACTOR
        )
        off._rechecked = False
        off._recheck()

    recheck(chosen.predicted.share / 2)  # cheaper than predicted: kept
    assert off.tuning is chosen and off.measured_overhead == pytest.approx(chosen.predicted.share / 2)
    with caplog.at_level("INFO", logger="lightning_smartinf.activations.offload"):
        recheck(chosen.predicted.share + budget)
    assert off.measured_overhead == pytest.approx(chosen.predicted.share + budget)
    assert off.tuning is not chosen and off.tuning.held_bytes > chosen.held_bytes
    assert any("re-checked" in r.getMessage() for r in caplog.records)
    again = off.tuning
    _measured_run(off, 2 * offload_mod.RECHECK_COUNT + 2)  # once only
    assert off.tuning is again
    # Measured directly where memory has room: the median micro-batch against one with offload paused beside it.
    off._walls, off._paused_walls = [1.3] * 3, [1.0] * 3
    off._rechecked = False
    off._recheck()
    assert off.measured_overhead == pytest.approx(0.3)
    off.close()


@pytest.mark.parametrize("budget", [0, -0.1, "10%", None, float("nan"), True])
def test_a_bad_overhead_budget_is_refused_naming_it(tmp_path, budget):
    with pytest.raises(ValueError, match=r"overhead_budget=.*\(the share of the step activation offload may add"):
        SavedTensorOffloader([tmp_path], overhead_budget=budget)
