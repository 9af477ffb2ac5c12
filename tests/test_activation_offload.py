"""Activation offload (issue 9): exact gradients, dedup, forwarding, keep-last, back-pressure, clean files,
bad input."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading

import pytest
import torch
from models import SEQ, VOCAB, LMModule, TinyGPT, fit, param_groups
from torch import nn

from lightning_smartinf.activations import ActivationOffload, ActivationOffloader, find_layers
from lightning_smartinf.activations import offload as offload_mod
from lightning_smartinf.activations.spill import SPILL_FILE_NAME
from lightning_smartinf.csd.io import StateFile
from lightning_smartinf.csd.storage import StorageError


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


def _grads(offloader: ActivationOffloader | None, micro_batches: int = 2, **model_kwargs) -> dict[str, torch.Tensor]:
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


def _assert_clean(offloader: ActivationOffloader) -> None:
    """No record is left: nothing in memory, nothing in the spill files (which stay, for the next micro-batch)."""
    assert {f.name for f in offloader.files()} <= {SPILL_FILE_NAME}
    assert offloader.stats.resident_bytes == 0
    assert offloader._records == {}


@pytest.mark.parametrize("budget", [1 << 14, 64 << 20])
def test_gradients_bitwise_identical_with_accumulation(tmp_path, budget):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    reference = _grads(None, dim=64, layers=4)
    off = ActivationOffloader(
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
        off = ActivationOffloader([tmp_path], threshold_bytes=4096, max_inflight_bytes=1 << 16, **kwargs)
        _grads(off, micro_batches=1, dim=64, layers=4)
        peaks[label], offloaded[label] = off.stats.peak_resident_bytes, off.stats.tensors_offloaded
        _assert_clean(off)
        off.close()
    assert offloaded["off"] == 0
    assert offloaded["k4"] < offloaded["k1"] < offloaded["k0"]  # the last layers' activations stay in memory
    assert peaks["k1"] < 0.6 * peaks["off"]


def test_dedup_by_storage_and_forwarding(tmp_path):
    """One tensor saved by two nodes (and through a view) is written once; a pending write is forwarded, not read."""
    off = ActivationOffloader([tmp_path], threshold_bytes=0)
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
    off = ActivationOffloader([tmp_path], threshold_bytes=4096, max_inflight_bytes=budget)
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
    off = ActivationOffloader([tmp_path], threshold_bytes=4096, keep_last=0).attach(model)

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
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(proc.stdout)
    root = tmp_path / offload_mod.ROOT_DIR_NAME
    stale = root / f"{socket.gethostname()}-{dead}-0"
    alive = root / f"{socket.gethostname()}-{os.getppid()}-0"
    other_host = root / f"some-other-host-{dead}-0"
    for d in (stale, alive, other_host):
        d.mkdir(parents=True)
        (d / "3.act").write_bytes(b"x" * 10)
    off = ActivationOffloader([tmp_path])
    assert not stale.exists() and alive.exists() and other_host.exists()
    assert oct(os.stat(off.run_dirs[0]).st_mode & 0o777) == "0o700"
    assert oct(os.stat(root).st_mode & 0o777) == "0o700"
    off.close()


@pytest.mark.parametrize(("arg", "value"), [("threshold_bytes", -1), ("keep_last", -2), ("max_inflight_bytes", 0)])
def test_bad_arguments_name_the_argument(tmp_path, arg, value):
    with pytest.raises(ValueError, match=arg):
        ActivationOffloader([tmp_path], **{arg: value})
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
    off = ActivationOffloader([tmp_path], threshold_bytes=4096, keep_last=3)
    ours = run(off)
    assert all(torch.equal(a, b) for a, b in zip(ours, run(None)))
    assert off.stats.tensors_offloaded >= 2  # keep_last is ignored without layers
    _assert_clean(off)
    off.close()


def test_storage_full_is_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(StateFile, "reserve", full)  # the spill file cannot grow: the disk is full
    torch.manual_seed(0)
    model = TinyGPT(dim=64, layers=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    off = ActivationOffloader([tmp_path], threshold_bytes=4096, keep_last=0).attach(model)
    with pytest.raises(StorageError, match="full"), off:
        _loss(model, _batch()).backward()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    _assert_clean(off)
    off.close()


def _adamw(model):
    return torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3), None


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
    off = ActivationOffloader([tmp_path], threshold_bytes=4096, keep_last=0)
    ours = run(off)
    assert all(torch.equal(ours[n], reference[n]) for n in reference)
    assert off.stats.tensors_offloaded > 0
    _assert_clean(off)
    off.close()
