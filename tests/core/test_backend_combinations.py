"""Every device kind alone and inside each tier: ``cpu``, ``xrt`` (its software model) and ``remote`` (two
``smartinf serve`` processes on loopback), bare and wrapped in a host-memory tier or an accelerator tier (the
accelerator's code on the host's torch device here).

Each combination trains bitwise like ``torch.optim``, counts its link bytes exactly and its state bytes whole, takes
tentative updates where it hands off early, reads its masters back, and resumes from its checkpoint. Checkpoints of
backends that stream through this host (``cpu``, ``xrt``, with or without tiers) are one record whatever the split,
so each is also loaded by a different combination.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers.hang_guard import run_with_timeout
from helpers.ieee import TORCH_SQRT_IS_IEEE, ieee_sqrt
from torch.testing import assert_close

from lightning_smartinf.core import registry
from lightning_smartinf.core.backend import Backend, ShardSpec
from lightning_smartinf.core.build import tiers_over
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.rules import StepParams
from lightning_smartinf.core.tiers.tiered import TieredBackend
from lightning_smartinf.devices.cpu import CpuBackend
from lightning_smartinf.devices.remote.client import RemoteBackend
from lightning_smartinf.devices.remote.tokens import read_token
from lightning_smartinf.devices.xrt import XrtBackend, forget_platform, write_model_xclbin
from tests.core.backends import OPTIMIZERS, changing_lr

CHUNK = 4096
KINDS = ("cpu", "xrt", "remote")
TIERS = ("alone", "memory", "accelerator")
COMBINATIONS = [(kind, tier) for kind in KINDS for tier in TIERS]
SIZES = [CHUNK + 5, 2 * CHUNK, 777, 3 * CHUNK - 1, CHUNK // 2, CHUNK]
#: AdamW, SGD with Nesterov momentum and Adagrad, in turn.
RULES = [OPTIMIZERS[("adamw", "sgd_nesterov", "adagrad")[i % 3]] for i in range(len(SIZES))]
SPECS = [ShardSpec(i, n, rule[0]) for i, (n, rule) in enumerate(zip(SIZES, RULES))]
FILE_BYTES = [ChunkLayout(s.numel, CHUNK, len(s.rule.state_names)).file_bytes for s in SPECS]
#: A tier's budget: about half the state, so that each combination with a tier splits its shards.
TIER_BYTES = sum(FILE_BYTES) // 2


@pytest.fixture(scope="module")
def xclbin(csim_library, tmp_path_factory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("xrt-model")
    path = write_model_xclbin(root / "smartinf.json", csim_library, devices=2, dram_root=root / "ddr")
    yield path
    forget_platform(path)


@pytest.fixture
def build(request, tmp_path) -> Iterator[Callable[[str, str, str], Backend]]:
    """``build(kind, tier, name, root=None)``: a backend of that combination over fresh directories (under ``root``,
    default this test's ``tmp_path``), closed at teardown."""
    made: list[Backend] = []

    def make(kind: str, tier: str, name: str, root: Path | None = None) -> Backend:
        options = {"chunk_elems": CHUNK, "buffer_count": 4, "device_timeout_s": 60.0}
        dirs = [(root or tmp_path) / name / f"dev{i}" for i in range(2)]
        if kind == "cpu":
            backend: Backend = CpuBackend(dirs, **options)
        elif kind == "xrt":
            backend = XrtBackend(dirs, xclbin=request.getfixturevalue("xclbin"), **options)
        else:
            servers = request.getfixturevalue("servers")
            token = read_token(request.getfixturevalue("token_file"))
            backend = RemoteBackend([s.address for s in servers], token, **options)
        if tier != "alone":
            budget = {"memory_bytes" if tier == "memory" else "accelerator_bytes": TIER_BYTES}
            computes = registry.kind(kind).devices_compute
            backend = tiers_over(backend, **budget, accelerator_device="cpu", devices_compute=computes, **options)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        run_with_timeout(backend.close)


def _on_kernels(backend: Backend, shard: int) -> bool:
    """Whether ``shard`` is updated by a SmartSSD's kernel (whose sqrt is IEEE) rather than by torch's code."""
    inner = backend.inner if isinstance(backend, TieredBackend) else backend
    return isinstance(inner, XrtBackend) and not inner.device_of(shard).in_memory


class Run:
    """The shards on a backend beside reference parameters stepped by plain ``torch.optim``."""

    def __init__(self, backend: Backend, seed: int = 0) -> None:
        self.backend = backend
        self.generator = torch.Generator().manual_seed(seed)
        backend.open(SPECS)
        masters = [torch.randn(n, generator=self.generator) for n in SIZES]
        self.refs = [torch.nn.Parameter(m.clone()) for m in masters]
        self.optims = [
            cls([ref], lr=changing_lr(1), foreach=False, **kw) for ref, (_, cls, kw, _) in zip(self.refs, RULES)
        ]
        self.steps = 0
        for i, master in enumerate(masters):
            backend.initialize(i, master)
        backend.wait()

    def step(self, *, tentative: bool = False, roll_back: bool = False) -> None:
        """One step of every shard, checked bitwise (bf16 gradients and parameters). With ``tentative``, shards that
        hand off early take it as a tentative update, committed (or, with ``roll_back``, rolled back and the step
        then redone as it would be after a skipped step)."""
        self.steps += 1
        t, lr = self.steps, changing_lr(self.steps)
        grads = [torch.randn(n, generator=self.generator).bfloat16() for n in SIZES]
        self.previous = [ref.detach().clone() for ref in self.refs]
        early = [i for i in range(len(SIZES)) if tentative and self.backend.takes_hand_off(i)]
        # The reference steps first, while no device works: `ieee_sqrt` patches `Tensor.sqrt` for the whole process,
        # and a host-core device updating meanwhile would take the patched one.
        for i, (ref, optim) in enumerate(zip(self.refs, self.optims)):
            ref.grad = grads[i].float()
            optim.param_groups[0]["lr"] = lr
            sqrt = ieee_sqrt() if _on_kernels(self.backend, i) and not TORCH_SQRT_IS_IEEE else contextlib.nullcontext()
            with sqrt:
                optim.step()
        if roll_back:
            scratch = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
            for i in early:
                self.backend.submit(i, grads[i] * 7, self._params(i, t, lr), scratch[i], tentative=True)
            self.backend.rollback(early)
            self.check_masters(before=True)  # a rolled-back update leaves no trace
        outs = [torch.full((n,), float("nan"), dtype=torch.bfloat16) for n in SIZES]
        for i in range(len(SIZES)):
            self.backend.submit(i, grads[i], self._params(i, t, lr), outs[i], tentative=i in early and not roll_back)
        if early and not roll_back:
            self.backend.commit(early)
        self.backend.wait()
        for i, (out, ref) in enumerate(zip(outs, self.refs)):
            assert_close(out, ref.detach().bfloat16(), rtol=0, atol=0, msg=lambda m, i=i: f"step {t}, shard {i}: {m}")

    def _params(self, shard: int, t: int, lr: float) -> StepParams:
        return StepParams(step=t, lr=lr, **RULES[shard][3])

    def check_masters(self, *, before: bool = False) -> None:
        """The devices' masters equal the references' (``before``: as they were before this step's reference)."""
        expected = self.previous if before else [ref.detach().clone() for ref in self.refs]
        for i, want in enumerate(expected):
            master = torch.full((SIZES[i],), float("nan"))
            self.backend.read_master(i, master)
            self.backend.wait()
            assert_close(master, want, rtol=0, atol=0, msg=lambda m, i=i: f"master of shard {i}: {m}")


@pytest.mark.parametrize(("kind", "tier"), COMBINATIONS, ids=[f"{k}-{t}" for k, t in COMBINATIONS])
def test_trains_like_torch_optim_with_exact_link_bytes_and_whole_state_bytes(build, kind, tier) -> None:
    backend = build(kind, tier, "run")
    run = Run(backend)
    devices = set(backend.assignment)
    if tier != "alone":
        assert len(devices) > 1 and max(devices) >= backend.num_devices - 1, backend.assignment  # split into the tier
    run.step()
    before = backend.traffic_snapshot()
    run.step(tentative=True)
    delta = (backend.traffic_snapshot() - before).as_dict()
    numel = sum(SIZES)
    assert (delta["link_write_bytes"], delta["link_read_bytes"]) == (2 * numel, 2 * numel)  # bf16 out, bf16 back
    read = delta["storage_read_bytes"] + delta["memory_read_bytes"] + delta["accelerator_read_bytes"]
    written = delta["storage_write_bytes"] + delta["memory_write_bytes"] + delta["accelerator_write_bytes"]
    assert read == written == sum(FILE_BYTES)  # every record once, in whichever tier it is
    in_tier = delta["memory_read_bytes"] + delta["accelerator_read_bytes"]
    assert (in_tier > 0) == (tier != "alone")
    assert (delta[f"{tier}_read_bytes"] > 0) if tier != "alone" else True
    run.step(tentative=True, roll_back=True)
    run.check_masters()


#: Each streaming combination's checkpoint is loaded by the next one (a different kind or split).
STREAMING = [(kind, tier) for kind in ("cpu", "xrt") for tier in TIERS]
RESUMES = [(STREAMING[i], STREAMING[(i + 1) % len(STREAMING)]) for i in range(len(STREAMING))]
RESUMES += [(("remote", tier), ("remote", tier)) for tier in TIERS]


@pytest.mark.parametrize(("saved", "loaded"), RESUMES, ids=[f"{'-'.join(a)}-to-{'-'.join(b)}" for a, b in RESUMES])
def test_a_checkpoint_resumes_bitwise(build, tmp_path, saved, loaded) -> None:
    first = build(*saved, "first")
    run = Run(first, seed=3)
    for _ in range(2):
        run.step(tentative=True)
    first.save(tmp_path / "checkpoint")
    run_with_timeout(first.close)
    second = build(*loaded, "second")
    second.open(SPECS)
    for i, n in enumerate(SIZES):  # state that loading must replace, masters and moments alike
        second.initialize(i, torch.full((n,), 123.0))
    second.wait()
    second.load(tmp_path / "checkpoint")
    run.backend = second
    run.check_masters()
    for _ in range(2):
        run.step(tentative=True)
    run.check_masters()


@pytest.mark.parametrize(("kind", "tier"), STREAMING, ids=[f"{k}-{t}" for k, t in STREAMING])
def test_a_checkpoint_on_a_reflink_filesystem_clones_the_state_on_storage(reflink_fs, build, kind, tier) -> None:
    """The devices' record checksums make every state file on storage a clone (no byte read back); state in a tier's
    memory is copied. The checkpoint verifies, and another combination resumes from it bitwise."""
    first = build(kind, tier, "first", reflink_fs)
    run = Run(first, seed=5)
    run.step(tentative=True)
    first.save(reflink_fs / "checkpoint")
    streaming = first.inner if isinstance(first, TieredBackend) else first
    on_storage = sum(FILE_BYTES[i] for i, d in enumerate(streaming.assignment) if not streaming.devices[d].in_memory)
    stats = streaming.last_save
    assert on_storage > 0 and stats.cloned_bytes == on_storage
    assert stats.checksummed_bytes == sum(FILE_BYTES) - on_storage
    run_with_timeout(first.close)
    second = build(*STREAMING[(STREAMING.index((kind, tier)) + 1) % len(STREAMING)], "second", reflink_fs)
    second.open(SPECS)
    second.load(reflink_fs / "checkpoint")
    run.backend = second
    run.check_masters()
    run.step(tentative=True)
    run.check_masters()
