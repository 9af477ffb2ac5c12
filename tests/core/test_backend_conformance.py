"""Conformance of every backend with plain ``torch.optim``: traffic, storage, checkpoints and failure handling.

The suite runs once per backend: ``cpu`` (emulated devices) and ``xrt`` (the SmartSSD host code on the software
model of pyxrt, which runs the C simulation of ``hls_kernels/``). Where the two must differ the test says so:

- The kernels' sqrt is IEEE-754 (correctly rounded); torch's vectorised CPU sqrt is not on every build (1 ulp off
  in ~15 % of elements on AVX-512). For ``xrt`` the reference ``torch.optim`` step runs with a correctly rounded
  ``Tensor.sqrt``/``sqrt_`` patched in, so every comparison stays **bitwise** (``rtol=0, atol=0``).
- The kernels have no ``max_exp_avg_sq`` port: ``xrt`` runs Adam with L2 decay where ``cpu`` runs ``amsgrad``.
- ``xrt`` reports true link bytes: :meth:`initialize` writes whole fp32 records through the P2P mapping, and a
  gradient whose dtype differs from the output's crosses the link in fp32 (the fp32 kernel runs).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from helpers import format_reference
from helpers.hang_guard import run_with_timeout
from helpers.ieee import TORCH_SQRT_IS_IEEE, ieee_sqrt
from helpers.unwritable import unwritable_dir
from torch.testing import assert_close

from lightning_smartinf.core.backend import Backend, ShardSpec
from lightning_smartinf.core.compression import SparseGrad
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.format.state_files import MANIFEST, shard_file_name
from lightning_smartinf.core.io.storage import StorageError, check_free_space, validate_storage_path
from lightning_smartinf.core.rules import SGD, Adagrad, Adam, StepParams
from lightning_smartinf.devices.cpu import CpuBackend
from lightning_smartinf.devices.xrt import XrtBackend, forget_platform, write_model_xclbin
from tests.core.backends import OPTIMIZERS, changing_lr

CHUNK = 4096
BACKENDS = ("cpu", "xrt")
#: Devices of the modelled machine (the tests use at most 3 storage paths).
MODEL_DEVICES = 4

#: What each backend runs in place of an optimizer it lacks.
SUBSTITUTES = {"xrt": {"adam_amsgrad": "adam_l2_maximize"}}

#: Odd sizes: one element, just under and over the 1024-element alignment, exactly one chunk, several chunks.
ODD_SIZES = [1, 1023, 1025, CHUNK, 3 * CHUNK + 5]
ODD_OPTS = ["adamw", "sgd_nesterov", "adagrad", "adam_amsgrad", "sgd_plain", "ef_adamw", "ef_adafactor"]


def _kind(backend: Backend) -> str:
    return "xrt" if isinstance(backend, XrtBackend) else "cpu"


def _opt_names(kind: str, names: Sequence[str]) -> list[str]:
    return [SUBSTITUTES.get(kind, {}).get(name, name) for name in names]


class Model:
    """Shards on a backend beside deep-copied reference parameters stepped by plain ``torch.optim``."""

    def __init__(
        self,
        backend: Backend,
        sizes: Sequence[int],
        opts: Sequence[str],
        *,
        seed: int = 0,
        init_dtype: torch.dtype = torch.float32,
        initialize: bool = True,
    ) -> None:
        self.backend = backend
        self.kind = _kind(backend)
        self.sizes = list(sizes)
        self.opts = [OPTIMIZERS[o] for o in _opt_names(self.kind, opts)]
        self.gen = torch.Generator().manual_seed(seed)
        self.specs = [ShardSpec(i, n, opt[0]) for i, (n, opt) in enumerate(zip(self.sizes, self.opts))]
        backend.open(self.specs)
        inits = [torch.randn(n, generator=self.gen).to(init_dtype) for n in self.sizes]
        self.refs = [torch.nn.Parameter(x.float()) for x in inits]
        self.torch_opts = [
            cls([ref], lr=changing_lr(1), foreach=False, **kw) for ref, (_, cls, kw, _) in zip(self.refs, self.opts)
        ]
        self.step_count = 0
        if initialize:
            for i, x in enumerate(inits):
                backend.initialize(i, x)
            backend.wait()

    def reference_sqrt(self) -> contextlib.AbstractContextManager:
        """The sqrt the device computes with: IEEE for the kernels, torch's own for the CPU backend."""
        return ieee_sqrt() if self.kind == "xrt" and not TORCH_SQRT_IS_IEEE else contextlib.nullcontext()

    def step(
        self,
        *,
        grad_dtype: torch.dtype = torch.float32,
        out_dtype: torch.dtype = torch.bfloat16,
        grad_scale: float = 1.0,
        check: bool = True,
        sparse_ratio: float | None = None,
    ) -> list[torch.Tensor]:
        self.step_count += 1
        t = self.step_count
        lr = changing_lr(t)
        outs = []
        for i, (n, ref, opt, (_, _, _, hp_kwargs)) in enumerate(zip(self.sizes, self.refs, self.torch_opts, self.opts)):
            grad: torch.Tensor | SparseGrad = torch.randn(n, generator=self.gen).to(grad_dtype)
            if sparse_ratio is not None:
                k = int(n * sparse_ratio)
                idx = torch.randperm(n, generator=self.gen)[:k].sort().values.to(torch.int32)
                grad = SparseGrad(idx, grad[idx.long()], n)
                dense = grad.to_dense(torch.float32)
            else:
                dense = grad.to(torch.float32, copy=True)  # copy=True so an fp32 grad is not scaled in place
            # Same fp32 arithmetic as the device.
            ref.grad = dense.mul_(grad_scale)
            opt.param_groups[0]["lr"] = lr
            with self.reference_sqrt():
                opt.step()
            out = torch.full((n,), float("nan"), dtype=out_dtype)
            self.backend.submit(i, grad, StepParams(step=t, lr=lr, grad_scale=grad_scale, **hp_kwargs), out)
            outs.append(out)
        self.backend.wait()
        if check:
            for i, (out, ref) in enumerate(zip(outs, self.refs)):
                expected = ref.detach().to(out_dtype)
                assert_close(out, expected, rtol=0, atol=0, msg=lambda m, i=i: f"step {t}, shard {i}: {m}")
        return outs

    def check_masters(self) -> None:
        for i, ref in enumerate(self.refs):
            master = torch.full((self.sizes[i],), float("nan"))
            self.backend.read_master(i, master)
            self.backend.wait()
            assert_close(master, ref.detach(), rtol=0, atol=0, msg=lambda m, i=i: f"master of shard {i}: {m}")

    def file_bytes(self) -> int:
        return sum(ChunkLayout(s.numel, CHUNK, len(s.rule.state_names)).file_bytes for s in self.specs)


def _dirs(root: Path, n: int, name: str = "dev") -> list[Path]:
    return [root / f"{name}{i}" for i in range(n)]


@pytest.fixture(params=BACKENDS)
def backend_kind(request) -> str:
    return request.param


@pytest.fixture
def construct(backend_kind, request, tmp_path_factory) -> Callable[..., Backend]:
    """The backend's constructor (``xrt``: bound to a fresh model xclbin of ``MODEL_DEVICES`` SmartSSDs)."""
    if backend_kind == "cpu":
        return CpuBackend
    library = request.getfixturevalue("csim_library")
    root = tmp_path_factory.mktemp("xrt-model")
    xclbin = write_model_xclbin(root / "smartinf.json", library, devices=MODEL_DEVICES, dram_root=root / "ddr")
    request.addfinalizer(lambda: forget_platform(xclbin))

    def make(dirs: Sequence[Path], **kwargs) -> XrtBackend:
        return XrtBackend(dirs, xclbin=xclbin, **kwargs)

    return make


@pytest.fixture
def make_backend(construct):
    """Creates backends and closes every one at teardown (with a timeout, so a hang fails instead of blocking)."""
    made: list[Backend] = []

    def make(dirs: Sequence[Path], **kwargs) -> Backend:
        kwargs.setdefault("chunk_elems", CHUNK)
        backend = construct(dirs, **kwargs)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        run_with_timeout(backend.close)


# --------------------------------------------------------------------------------------------------- conformance


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("buffer_count", [2, 4])
@pytest.mark.parametrize("num_devices", [1, 3])
def test_matches_torch_optim(tmp_path, make_backend, num_devices, buffer_count, out_dtype) -> None:
    backend = make_backend(_dirs(tmp_path, num_devices), buffer_count=buffer_count)
    model = Model(backend, ODD_SIZES, ODD_OPTS)
    for _ in range(5):
        model.step(out_dtype=out_dtype)
    model.check_masters()


@pytest.mark.parametrize(
    ("grad_dtype", "grad_scale"),
    [
        (torch.bfloat16, 1.0),
        (torch.float16, 1.0),
        (torch.float32, 1 / 3),
        (torch.bfloat16, 2.0**-10),
        (torch.float16, 0.7),
    ],
    ids=["bf16", "fp16", "fp32-scaled", "bf16-scaled", "fp16-scaled"],
)
def test_low_precision_and_scaled_grads(tmp_path, make_backend, grad_dtype, grad_scale) -> None:
    backend = make_backend(_dirs(tmp_path, 2), buffer_count=3)
    model = Model(backend, ODD_SIZES, ODD_OPTS, seed=1, init_dtype=torch.bfloat16)
    for _ in range(5):
        model.step(grad_dtype=grad_dtype, grad_scale=grad_scale, out_dtype=torch.bfloat16)
    model.check_masters()


def test_every_optimizer_on_a_multi_chunk_shard(tmp_path, make_backend) -> None:
    names = list(OPTIMIZERS)
    backend = make_backend(_dirs(tmp_path, 2), buffer_count=2)
    model = Model(backend, [2 * CHUNK + 1000] * len(names), names, seed=2)
    for _ in range(5):
        model.step(out_dtype=torch.float32)
    model.check_masters()


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_sparse_grads_match_torch_optim_on_the_dense_scatter(tmp_path, make_backend, grad_dtype) -> None:
    """Top-k gradients (xrt: the ``*_topk_*`` kernels, pairs rebased per chunk) update as their dense scatter."""
    names = [
        "adamw",
        "sgd_nesterov",
        "adagrad",
        "adam_l2_maximize",
        "sgd_plain",
        "ef_adamw",
        "ef_adam_l2_maximize",
        "ef_adafactor",
    ]
    sizes = [*ODD_SIZES, 1025, 3 * CHUNK + 5, 2 * CHUNK + 7]
    backend = make_backend(_dirs(tmp_path, 2), buffer_count=2)
    model = Model(backend, sizes, names, seed=9)
    before = backend.traffic_snapshot()
    for ratio in (0.3, 0.0, 1.0, 0.01):
        model.step(grad_dtype=grad_dtype, out_dtype=grad_dtype, sparse_ratio=ratio, grad_scale=0.5)
    model.check_masters()
    pairs = sum(int(n * r) for n in sizes for r in (0.3, 0.0, 1.0, 0.01))
    link = (backend.traffic_snapshot() - before).link_write_bytes
    assert link == pairs * (4 + grad_dtype.itemsize)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "topk"])
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_state_formats_are_their_reference_byte_for_byte(tmp_path, make_backend, backend_kind, fmt, sparse) -> None:
    """Each rule's state in bf16 and int8 on the odd sizes, over two devices: the parameters each step returns and
    the saved records are :func:`~lightning_smartinf.core.state_formats.update_chunk`'s over the same records (xrt:
    the kernels' own conversions; cpu: the host's C kernels and torch)."""
    names = ["adamw", "sgd_nesterov", "adagrad", "ef_adamw"]
    specs = [ShardSpec(i, n, OPTIMIZERS[names[i % len(names)]][0], state_format=fmt) for i, n in enumerate(ODD_SIZES)]
    backend = make_backend(_dirs(tmp_path, 2), buffer_count=2)
    with ieee_sqrt() if backend_kind == "xrt" and not TORCH_SQRT_IS_IEEE else contextlib.nullcontext():
        reference = format_reference.train(backend, specs, CHUNK, seed=5, sparse=sparse)
    backend.save(tmp_path / "ckpt")
    for spec in specs:
        saved = (tmp_path / "ckpt" / shard_file_name(spec.index)).read_bytes()
        assert saved == reference.file_bytes(spec.index), f"shard {spec.index} ({spec.rule.name}, {fmt})"


def test_training_changes_parameters(tmp_path, make_backend) -> None:
    """Guards the conformance tests against a backend and a reference that both do nothing."""
    backend = make_backend(_dirs(tmp_path, 1))
    model = Model(backend, [CHUNK + 1], ["adamw"], seed=3)
    before = model.refs[0].detach().clone()
    out = model.step(out_dtype=torch.float32)[0]
    assert not torch.equal(out, before)


def test_initialize_resets_state(tmp_path, make_backend) -> None:
    """Re-initialising a shard restores fresh states (step 1 again must match a fresh torch optimizer)."""
    backend = make_backend(_dirs(tmp_path, 1))
    model = Model(backend, [CHUNK + 7], ["adam_amsgrad"], seed=4)
    for _ in range(3):
        model.step()
    init = torch.randn(CHUNK + 7, generator=model.gen)
    backend.initialize(0, init)
    backend.wait()
    model.refs = [torch.nn.Parameter(init.clone())]
    _, cls, kw, _ = model.opts[0]
    model.torch_opts = [cls(model.refs, lr=changing_lr(1), foreach=False, **kw)]
    model.step_count = 0
    for _ in range(2):
        model.step()


# ------------------------------------------------------------------------------------------ traffic and placement


def _expected_traffic(
    model: Model, steps: int, init: torch.dtype, grad: torch.dtype, out: torch.dtype
) -> dict[str, int]:
    """Cumulative counters after initialize and ``steps`` steps (xrt: true link bytes, see the module docstring)."""
    numel = sum(model.sizes)
    fb = model.file_bytes()
    init_link = fb if model.kind == "xrt" else numel * init.itemsize
    grad_elem, out_elem = grad.itemsize, out.itemsize
    if model.kind == "xrt" and grad != out:
        grad_elem = out_elem = 4  # the fp32 kernel runs
    return {
        "link_write_bytes": init_link + steps * numel * grad_elem,
        "link_read_bytes": steps * numel * out_elem,
        "storage_read_bytes": steps * fb,
        "storage_write_bytes": (steps + 1) * fb,
        "memory_read_bytes": 0,
        "memory_write_bytes": 0,
        "accelerator_read_bytes": 0,
        "accelerator_write_bytes": 0,
        "param_read_bytes": 0,
        "param_write_bytes": 0,
    }


@pytest.mark.parametrize("num_devices", [1, 3])
def test_traffic_exact_aligned_sizes(tmp_path, make_backend, num_devices) -> None:
    sizes = [1024, CHUNK, 3 * CHUNK, 2048]
    opts = ["adamw", "sgd_nesterov", "adam_amsgrad", "sgd_plain"]
    backend = make_backend(_dirs(tmp_path, num_devices), buffer_count=2)
    model = Model(backend, sizes, opts, init_dtype=torch.bfloat16)
    third = 12 if model.kind == "xrt" else 16  # Adam instead of Adam+amsgrad on xrt
    # No padding at multiples of 1024: the file is exactly the fp32 state.
    assert (
        model.file_bytes()
        == sum(s.state_bytes for s in model.specs)
        == 1024 * 12 + CHUNK * 8 + 3 * CHUNK * third + 2048 * 4
    )
    bf16 = torch.bfloat16
    snap = backend.traffic_snapshot().as_dict()
    assert snap == _expected_traffic(model, 0, bf16, bf16, bf16)
    steps = 3
    for _ in range(steps):
        model.step(grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
    assert backend.traffic_snapshot().as_dict() == _expected_traffic(model, steps, bf16, bf16, bf16)
    # Per step: 2 B/param in, 2 B/param out over the link.
    numel = sum(sizes)
    before = backend.traffic_snapshot()
    model.step(grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
    delta = (backend.traffic_snapshot() - before).as_dict()
    assert delta == {
        "link_write_bytes": 2 * numel,
        "link_read_bytes": 2 * numel,
        "storage_read_bytes": model.file_bytes(),
        "storage_write_bytes": model.file_bytes(),
        "memory_read_bytes": 0,
        "memory_write_bytes": 0,
        "accelerator_read_bytes": 0,
        "accelerator_write_bytes": 0,
        "param_read_bytes": 0,
        "param_write_bytes": 0,
    }


def test_traffic_exact_padded_sizes(tmp_path, make_backend) -> None:
    sizes = [1, 1025, 3 * CHUNK + 5]
    opts = ["adamw", "sgd_nesterov", "adam_amsgrad"]  # 2, 1 and 3 states
    backend = make_backend(_dirs(tmp_path, 2), buffer_count=3)
    model = Model(backend, sizes, opts)
    third = 3 if model.kind == "xrt" else 4  # tensors per record: Adam instead of Adam+amsgrad on xrt
    # Hand-computed layout: each state of a record padded to 1024 elements, records at chunk strides.
    expected_files = [1024 * 4 * 3, 2048 * 4 * 2, 3 * CHUNK * 4 * third + 1024 * 4 * third]
    assert model.file_bytes() == sum(expected_files)
    for _ in range(2):
        model.step(grad_dtype=torch.float16, out_dtype=torch.float32)
    expected = _expected_traffic(model, 2, torch.float32, torch.float16, torch.float32)
    assert backend.traffic_snapshot().as_dict() == expected
    for i, size in enumerate(expected_files):
        assert (tmp_path / f"dev{i % 2}" / shard_file_name(i)).stat().st_size == size


@pytest.mark.parametrize("num_devices", [1, 2, 3])
def test_shard_placement_and_private_dirs(tmp_path, make_backend, num_devices) -> None:
    dirs = [tmp_path / f"disk{i}" / "smartinf" for i in range(num_devices)]
    dirs[0].mkdir(parents=True, mode=0o755)
    os.chmod(dirs[0], 0o755)  # an existing, world-readable directory is made private too
    backend = make_backend(dirs)
    sizes = [1025, 1, CHUNK, 2 * CHUNK, 3]
    model = Model(backend, sizes, ["adamw", "sgd_plain", "adagrad", "adam_amsgrad", "sgd_nesterov"])
    for d in dirs:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for i, spec in enumerate(model.specs):
        layout = ChunkLayout(spec.numel, CHUNK, len(spec.rule.state_names))
        for j, d in enumerate(dirs):
            path = d / shard_file_name(i)
            if j == i % num_devices:
                assert path.is_file(), path
                assert path.stat().st_size == layout.file_bytes
            else:
                assert not path.exists(), path
    assert backend.device_of(4).directory == dirs[4 % num_devices]


def test_read_master_exact(tmp_path, make_backend) -> None:
    backend = make_backend(_dirs(tmp_path, 2), buffer_count=2)
    model = Model(backend, ODD_SIZES, ODD_OPTS, seed=5)
    model.check_masters()  # right after initialize
    for _ in range(4):
        model.step(out_dtype=torch.float16)
    model.check_masters()
    # Into a low-precision tensor too.
    out = torch.empty(ODD_SIZES[-1], dtype=torch.bfloat16)
    backend.read_master(len(ODD_SIZES) - 1, out)
    backend.wait()
    assert_close(out, model.refs[-1].detach().bfloat16(), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------- save and load


@pytest.mark.parametrize(("devices_before", "devices_after"), [(1, 3), (3, 2)])
def test_save_load_resume_is_identical(tmp_path, make_backend, devices_before, devices_after) -> None:
    sizes = [1025, 3 * CHUNK + 5, 1, CHUNK]
    opts = ["adamw", "adam_amsgrad", "sgd_nesterov", "adagrad"]
    first = make_backend(_dirs(tmp_path / "run1", devices_before), buffer_count=2)
    model = Model(first, sizes, opts, seed=6)
    for _ in range(3):
        model.step()
    ckpt = tmp_path / "ckpt"
    first.save(ckpt)
    assert (ckpt / MANIFEST).is_file()
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o700
    run_with_timeout(first.close)

    second = make_backend(_dirs(tmp_path / "run2", devices_after), buffer_count=4)
    second.open(model.specs)
    # Garbage that load must overwrite (masters *and* states).
    for i, n in enumerate(sizes):
        second.initialize(i, torch.full((n,), 123.0))
    second.wait()
    second.load(ckpt)
    model.backend = second  # the reference optimizers continue uninterrupted
    for _ in range(3):
        model.step()
    model.check_masters()
    for i in range(len(sizes)):
        assert (tmp_path / "run2" / f"dev{i % devices_after}" / shard_file_name(i)).is_file()


def _saved(tmp_path: Path, make_backend, sizes=(1025, CHUNK), opts=("adamw", "sgd_nesterov")) -> tuple[Model, Path]:
    backend = make_backend(_dirs(tmp_path / "src", 1))
    model = Model(backend, sizes, opts, seed=8)
    model.step()
    ckpt = tmp_path / "ckpt"
    backend.save(ckpt)
    return model, ckpt


def test_load_rejects_other_numel(tmp_path, make_backend) -> None:
    _, ckpt = _saved(tmp_path, make_backend)
    other = make_backend(_dirs(tmp_path / "dst", 1))
    other.open([ShardSpec(0, 1025, OPTIMIZERS["adamw"][0]), ShardSpec(1, CHUNK + 1, OPTIMIZERS["sgd_nesterov"][0])])
    with pytest.raises(ValueError, match="does not match") as info:
        other.load(ckpt)
    assert str(CHUNK + 1) in str(info.value) and str(CHUNK) in str(info.value)


def test_load_rejects_other_rule(tmp_path, make_backend) -> None:
    _, ckpt = _saved(tmp_path, make_backend)
    other = make_backend(_dirs(tmp_path / "dst", 1))
    other.open([ShardSpec(0, 1025, OPTIMIZERS["adamw"][0]), ShardSpec(1, CHUNK, OPTIMIZERS["adagrad"][0])])
    with pytest.raises(ValueError, match="does not match") as info:
        other.load(ckpt)
    assert "adagrad" in str(info.value) and "sgd" in str(info.value)


@pytest.mark.parametrize(("before", "after"), [("adamw", "ef_adamw"), ("ef_adamw", "adamw")])
def test_load_converts_between_adam_and_ef_adam(tmp_path, make_backend, before, after, caplog) -> None:
    """Turning compression's EF-Adam on or off between runs: masters and the second moment carry over, Adam's first
    moment starts at zero (and EF-Adam drops it), so training continues as torch.optim with beta1 switched."""
    sizes = [1025, 3 * CHUNK + 5]
    model = Model(make_backend(_dirs(tmp_path / "run1", 2), buffer_count=2), sizes, [before] * 2, seed=12)
    for _ in range(3):
        model.step()
    ckpt = tmp_path / "ckpt"
    model.backend.save(ckpt)
    second = make_backend(_dirs(tmp_path / "run2", 1), buffer_count=3)
    model.opts = [OPTIMIZERS[after]] * 2
    model.specs = [ShardSpec(i, n, OPTIMIZERS[after][0]) for i, n in enumerate(sizes)]
    second.open(model.specs)
    with caplog.at_level("WARNING", logger="lightning_smartinf.core.format.state_files"):
        second.load(ckpt)
    assert f"saved by update rule {OPTIMIZERS[before][0].name}; converting it to {OPTIMIZERS[after][0].name}" in (
        caplog.text
    )
    model.backend = second
    model.check_masters()
    for opt in model.torch_opts:
        opt.param_groups[0]["betas"] = OPTIMIZERS[after][2]["betas"]
        for state in opt.state.values():
            state["exp_avg"].zero_()  # EF-Adam has none; Adam's starts fresh (EF-Adam overwrites it with g anyway)
    for _ in range(3):
        model.step()
    model.check_masters()


def test_load_rejects_other_state_set(tmp_path, make_backend, backend_kind) -> None:
    """Same rule name, different states must not load: Adam vs Adam+amsgrad, and SGD with momentum vs without (the
    one pair the kernels of xrt can open, which run no amsgrad)."""
    _, ckpt = _saved(tmp_path, make_backend)
    other = make_backend(_dirs(tmp_path / "dst", 1))
    if backend_kind == "xrt":
        other.open([ShardSpec(0, 1025, OPTIMIZERS["adamw"][0]), ShardSpec(1, CHUNK, OPTIMIZERS["sgd_plain"][0])])
        differs = "momentum_buffer"
    else:
        other.open([ShardSpec(0, 1025, Adam(amsgrad=True)), ShardSpec(1, CHUNK, OPTIMIZERS["sgd_nesterov"][0])])
        differs = "max_exp_avg_sq"
    with pytest.raises(ValueError, match=differs):
        other.load(ckpt)


def test_load_rejects_other_chunk_elems(tmp_path, make_backend) -> None:
    model, ckpt = _saved(tmp_path, make_backend)
    other = make_backend(_dirs(tmp_path / "dst", 1), chunk_elems=2 * CHUNK)
    other.open(model.specs)
    with pytest.raises(ValueError, match=rf"saved in chunks of {CHUNK} elements, this run's are {2 * CHUNK}"):
        other.load(ckpt)


def test_load_truncated_file_names_it_and_keeps_state(tmp_path, make_backend) -> None:
    model, ckpt = _saved(tmp_path, make_backend)
    victim = ckpt / shard_file_name(1)
    os.truncate(victim, victim.stat().st_size - 4096)
    with pytest.raises(ValueError, match=str(victim)):
        model.backend.load(ckpt)
    # Nothing was replaced: training continues exactly.
    model.step()
    model.check_masters()


def test_load_missing_shard_file(tmp_path, make_backend) -> None:
    model, ckpt = _saved(tmp_path, make_backend)
    (ckpt / shard_file_name(0)).unlink()
    with pytest.raises(ValueError, match=shard_file_name(0)):
        model.backend.load(ckpt)


def test_load_missing_manifest(tmp_path, make_backend) -> None:
    model, ckpt = _saved(tmp_path, make_backend)
    (ckpt / MANIFEST).unlink()
    with pytest.raises(FileNotFoundError, match=MANIFEST):
        model.backend.load(ckpt)
    with pytest.raises(FileNotFoundError):
        model.backend.load(tmp_path / "nowhere")


# ------------------------------------------------------------------------------------------------------ errors


def test_wrong_sizes_rejected(tmp_path, make_backend) -> None:
    backend = make_backend(_dirs(tmp_path, 1))
    Model(backend, [1025], ["adamw"])
    hp = StepParams(step=1, lr=0.1)
    with pytest.raises(ValueError, match="grad"):
        backend.submit(0, torch.zeros(1024), hp, torch.zeros(1025))
    with pytest.raises(ValueError, match="out"):
        backend.submit(0, torch.zeros(1025), hp, torch.zeros(1026))
    with pytest.raises(ValueError, match="master"):
        backend.initialize(0, torch.zeros(1))
    with pytest.raises(ValueError, match="out"):
        backend.read_master(0, torch.zeros(2050))


@pytest.mark.parametrize("buffer_count", [1, 0, -3])
def test_buffer_count_too_small(tmp_path, construct, buffer_count) -> None:
    with pytest.raises(ValueError, match="buffer_count"):
        construct(_dirs(tmp_path, 1), buffer_count=buffer_count)


@pytest.mark.parametrize("chunk_elems", [1000, 0, -1024, 1536])
def test_chunk_elems_not_multiple_of_1024(tmp_path, construct, chunk_elems) -> None:
    with pytest.raises(ValueError, match="chunk_elems"):
        construct(_dirs(tmp_path, 1), chunk_elems=chunk_elems)


def test_no_device_dirs(construct) -> None:
    with pytest.raises(ValueError, match="device_dirs"):
        construct([])


def test_open_twice(tmp_path, make_backend) -> None:
    backend = make_backend(_dirs(tmp_path, 1))
    backend.open([ShardSpec(0, 10, SGD())])
    with pytest.raises(RuntimeError, match="open"):
        backend.open([ShardSpec(0, 10, SGD())])


def test_open_rejects_index_not_matching_position(tmp_path, make_backend) -> None:
    """`ShardSpec.index` is documented as the shard's position; a mismatch (or a duplicate) must be refused.

    Otherwise two specs with one index share a state file, and ``submit(i)`` borrows the gradient chunk of
    device ``i % N`` while the request runs on device ``spec.index % N`` (two devices racing on one buffer).
    """
    backend = make_backend(_dirs(tmp_path, 2))
    with pytest.raises(ValueError, match="index"):
        backend.open([ShardSpec(1, 1024, SGD()), ShardSpec(0, 1024, SGD())])
    other = make_backend(_dirs(tmp_path / "b", 2))
    with pytest.raises(ValueError, match="index"):
        other.open([ShardSpec(0, 1024, SGD()), ShardSpec(0, 1024, SGD())])


def test_free_space_check(tmp_path) -> None:
    free = shutil.disk_usage(tmp_path).free
    check_free_space(tmp_path, 1 << 20)  # fits
    with pytest.raises(StorageError, match="GiB") as info:
        check_free_space(tmp_path, free + (64 << 30))
    assert str(tmp_path) in str(info.value)


def test_free_space_ignores_unrelated_files(tmp_path) -> None:
    """Only state files the backend will overwrite may count as reclaimable space.

    A (sparse) unrelated file as large as the disk must not make an impossible request pass.
    """
    free = shutil.disk_usage(tmp_path).free
    (tmp_path / "dataset.bin").touch()
    os.truncate(tmp_path / "dataset.bin", 2 * free)  # sparse: takes no blocks
    with pytest.raises(StorageError):
        check_free_space(tmp_path, free + (1 << 30))


def test_open_refuses_when_disk_too_small(tmp_path, make_backend) -> None:
    backend = make_backend(_dirs(tmp_path, 1))
    free = shutil.disk_usage(tmp_path).free
    numel = (free + (64 << 30)) // 12
    with pytest.raises(StorageError, match=str(tmp_path / "dev0")):
        backend.open([ShardSpec(0, numel, Adam())])
    assert not (tmp_path / "dev0" / shard_file_name(0)).exists()


def test_bad_arguments_are_listed_in_one_error_before_any_directory_is_claimed(tmp_path, make_backend) -> None:
    dirs = _dirs(tmp_path, 2)
    bad = {"buffer_count": 1, "device_timeout_s": float("nan"), "device_weights": [1.0, float("inf")]}
    with pytest.raises(ValueError, match=r"got 3 invalid arguments") as refused:
        make_backend(dirs, **bad)
    for line in ("`buffer_count=1` is too small", "`device_timeout_s=nan`", "`device_weights[1]=inf` is not finite"):
        assert line in str(refused.value)
    assert not any(d.exists() for d in dirs)  # nothing was created or claimed


def test_validate_storage_path(tmp_path) -> None:
    assert validate_storage_path(tmp_path) == tmp_path.resolve()
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match="does not exist") as info:
        validate_storage_path(missing)
    assert str(missing) in str(info.value)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="not a directory") as info:
        validate_storage_path(a_file, "storage_paths")
    assert str(a_file) in str(info.value) and "storage_paths" in str(info.value)


def test_validate_storage_path_not_writable(tmp_path) -> None:
    locked = tmp_path / "locked"
    with unwritable_dir(locked), pytest.raises(ValueError, match="not writable") as info:
        validate_storage_path(locked)
    assert str(locked) in str(info.value)


# --------------------------------------------------------------------------------------------- device failures


def test_io_error_surfaces_and_close_is_clean(tmp_path, make_backend) -> None:
    backend = make_backend(_dirs(tmp_path, 2), buffer_count=2)
    model = Model(backend, [3 * CHUNK, CHUNK], ["adamw", "sgd_nesterov"])
    backend.shards[0].file.close()  # the device's next pread gets EBADF
    hp = StepParams(step=1, lr=0.1)
    backend.submit(0, torch.zeros(3 * CHUNK), hp, torch.zeros(3 * CHUNK))
    good = torch.zeros(CHUNK)
    backend.submit(1, torch.ones(CHUNK), StepParams(step=1, lr=0.1, momentum=0.9), good)
    exc = run_with_timeout(backend.wait)
    assert isinstance(exc, OSError) and exc.errno == errno.EBADF, exc
    assert not torch.equal(good, torch.zeros(CHUNK))  # the healthy device still did its work
    assert run_with_timeout(backend.wait) is None  # the error was reported once
    assert run_with_timeout(backend.close) is None
    del model


@pytest.mark.parametrize("buffer_count", [2, 3])
def test_io_errors_do_not_leak_buffers(tmp_path, make_backend, buffer_count) -> None:
    """A failed request must give its chunk buffers back; otherwise the device's pool drains and `close` blocks
    forever. The error stops the backend: the healthy shard on the same device is refused too."""
    backend = make_backend(_dirs(tmp_path, 1), buffer_count=buffer_count)
    n = CHUNK  # one chunk per request, so each failed request costs (at most) one buffer and nothing blocks
    model = Model(backend, [n] * (buffer_count + 1), ["sgd_plain"] * (buffer_count + 1))
    device = backend.devices[0]
    for i in range(buffer_count):
        backend.shards[i].file.close()
        backend.submit(i, torch.ones(n), StepParams(step=1, lr=0.1), torch.zeros(n))
    exc = run_with_timeout(backend.wait)
    assert isinstance(exc, StorageError) and exc.errno == errno.EBADF, exc
    assert device.pool.size - device.pool.in_use == buffer_count, "chunk buffers lost after failed requests"
    with pytest.raises(StorageError, match="refused"):
        backend.submit(buffer_count, torch.ones(n), StepParams(step=1, lr=0.1), torch.zeros(n))
    assert run_with_timeout(backend.close) is None
    del model


# ------------------------------------------------------------------------------------------------- host memory


@pytest.mark.parametrize(("num_devices", "buffer_count"), [(1, 4), (2, 2), (3, 3)])
def test_host_buffer_memory_is_fixed(tmp_path, make_backend, num_devices, buffer_count) -> None:
    chunk = 1 << 16
    sizes = {}
    for numel in (4 << 20, 16 << 20):
        backend = make_backend(_dirs(tmp_path / str(numel), num_devices), chunk_elems=chunk, buffer_count=buffer_count)
        backend.open([ShardSpec(0, numel, Adam())])
        sizes[numel] = backend.buffer_bytes
    # cpu: the pool plus one fp32 gradient chunk; xrt: the P2P pool plus three staging buffers (grad, idx, param).
    extra = 3 if _kind(backend) == "xrt" else 1
    assert sizes[4 << 20] == sizes[16 << 20] == num_devices * ((buffer_count * (1 + 2) + extra) * chunk * 4)


def test_host_buffer_memory_uses_largest_record(tmp_path, make_backend) -> None:
    backend = make_backend(_dirs(tmp_path, 2), buffer_count=2)
    if _kind(backend) == "xrt":  # no amsgrad kernel: Adagrad's 1 state vs Adam's 2
        backend.open([ShardSpec(0, 10, Adagrad()), ShardSpec(1, 10, Adam())])
        assert backend.buffer_bytes == 2 * ((2 * (1 + 2) + 3) * CHUNK * 4)
    else:
        backend.open([ShardSpec(0, 10, SGD(with_momentum=False)), ShardSpec(1, 10, Adam(amsgrad=True))])
        assert backend.buffer_bytes == 2 * ((2 * (1 + 3) + 1) * CHUNK * 4)


class _Gate:
    """A real fence for host threads: ``synchronize`` blocks until :meth:`open`, and records that it was waited on."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.waited = threading.Event()

    def synchronize(self) -> None:
        self.waited.set()
        self._open.wait()

    def open(self) -> None:
        self._open.set()


def test_device_reads_the_gradient_only_after_its_fence(tmp_path, make_backend) -> None:
    """``submit(ready=...)``: the gradient may still be in flight at submission (an accelerator's copy); the device
    waits for the fence on its own thread and reads what the tensor holds then."""
    numel = 2 * CHUNK + 5
    backend = make_backend(_dirs(tmp_path, 1), buffer_count=3)
    backend.open([ShardSpec(index=0, numel=numel, rule=SGD())])
    master = torch.randn(numel, generator=torch.Generator().manual_seed(6))
    backend.initialize(0, master)
    backend.wait()
    grad = torch.zeros(numel)
    out = torch.empty(numel)
    gate = _Gate()
    handle = backend.submit(0, grad, StepParams(step=1, lr=0.5), out, ready=gate)
    assert gate.waited.wait(10), "the device waits for the fence"
    assert not handle.done(), "and computes nothing before it completes"
    final = torch.randn(numel, generator=torch.Generator().manual_seed(7))
    grad.copy_(final)  # what the in-flight copy would deliver
    gate.open()
    backend.result(handle)
    assert_close(out, master - 0.5 * final, rtol=0, atol=0)
