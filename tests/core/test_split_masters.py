"""Split masters: the codec is exact, and a backend that keeps its masters split is, bit for bit, one that keeps them
whole: the same parameters, masters and saved files, through tentative updates, roll-backs, tiers and loads, with the
bytes of state it moves counted exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_smartinf.core import split_masters
from lightning_smartinf.core.backend import Backend, ShardSpec
from lightning_smartinf.core.build import tiers_over
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.format.state_files import MANIFEST, read_manifest, shard_file_name
from lightning_smartinf.core.io.direct import IO_ALIGN, round_up
from lightning_smartinf.core.native import state_format_kernels
from lightning_smartinf.core.native.pieces import PIECE
from lightning_smartinf.core.rules import Adam, StepParams
from lightning_smartinf.devices.cpu import CpuBackend

CHUNK = 1 << 15  # a multiple of 32768 elements: a chunk's split masters fill whole 4 KiB blocks
SIZES = [1, 1029, CHUNK, 2 * CHUNK + 7]


def _masters(n: int, seed: int = 0) -> torch.Tensor:
    """Every kind of finite fp32 master: random bit patterns, both ties of even and odd parameters, the edges
    (zeros, subnormals, the largest finite values, infinities)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    high = torch.randint(-(2**15), 2**15, (n // 4,), generator=g, dtype=torch.int32)
    bits[: n // 4] = (high << 16) | 0x8000  # exact ties
    edges = [0, -(2**31), 1, 0x8000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000, 0x3F808000, 0x3F818000]
    edges = torch.tensor([e - (1 << 32) if e >= 1 << 31 else e for e in edges], dtype=torch.int32)
    count = min(len(edges), n - n // 4)
    bits[n // 4 : n // 4 + count] = edges[:count]
    masters = bits.view(torch.float32)
    return torch.where(torch.isnan(masters), torch.ones(()), masters)


@pytest.mark.parametrize("native", [True, False], ids=["C", "reference"])
@pytest.mark.parametrize(("n", "threads"), [(1, 1), (7, 1), (8, 1), (259, 1), (100_003, 1), (3 * PIECE + 13, 3)])
def test_every_master_is_rebuilt_bit_for_bit_from_its_rounding(n, threads, native, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the kernels' pieces follow torch's threads
    if not native:
        monkeypatch.setattr(split_masters, "state_format_kernels", lambda: None)
    elif state_format_kernels() is None:
        pytest.skip("no C compiler: the reference runs")  # CI installs gcc; the skip is for a machine without one
    masters = _masters(n)
    padded = round_up(n, 1024)
    region = torch.zeros(split_masters.region_bytes(padded), dtype=torch.uint8)
    params = torch.zeros(n, dtype=torch.bfloat16)
    split_masters.encode(masters, region, params)
    assert torch.equal(params.view(torch.int16), masters.to(torch.bfloat16).view(torch.int16))  # the roundings
    rebuilt, aside = torch.full((n,), float("nan")), torch.zeros(n, dtype=torch.bfloat16)
    split_masters.decode(masters.to(torch.bfloat16), region, rebuilt, aside)
    assert torch.equal(rebuilt.view(torch.int32), masters.view(torch.int32))
    assert torch.equal(aside.view(torch.int16), masters.to(torch.bfloat16).view(torch.int16))  # copied on the way
    # The bytes past the masters stay zero, a last carry byte's unused bits too.
    low, carry = region[: 2 * padded], region[2 * padded :]
    assert not low[2 * n :].any() and not carry[-(-n // 8) :].any()
    if n % 8:
        assert int(carry[n // 8]) >> (n % 8) == 0


def test_the_carry_bit_is_what_sixteen_bits_lack():
    """Both ties of an even bf16 value round to it: without the carry bit they would be rebuilt alike."""
    ties = torch.tensor([0x3F808000, 0x3F7F8000], dtype=torch.int32).view(torch.float32)  # both round to 0x3F80
    assert torch.equal(ties.to(torch.bfloat16)[0].view(torch.int16), ties.to(torch.bfloat16)[1].view(torch.int16))
    region = torch.zeros(split_masters.region_bytes(8), dtype=torch.uint8)
    split_masters.encode(ties, region)
    assert int(region[16]) == 0b10  # the second carried into the high half, the first did not
    rebuilt = torch.empty(2)
    split_masters.decode(ties.to(torch.bfloat16), region, rebuilt)
    assert torch.equal(rebuilt.view(torch.int32), ties.view(torch.int32))


def test_the_c_kernels_write_the_references_bytes(monkeypatch):
    if state_format_kernels() is None:
        pytest.skip("no C compiler: the reference runs")
    masters = _masters(50_001, seed=1)
    regions = []
    for kernels in (state_format_kernels, lambda: None):
        monkeypatch.setattr(split_masters, "state_format_kernels", kernels)
        region = torch.full((split_masters.region_bytes(round_up(50_001, 1024)),), 0, dtype=torch.uint8)
        split_masters.encode(masters, region)
        regions.append(region)
    assert torch.equal(*regions)


def test_a_record_holds_2_125_bytes_per_master_and_needs_its_parameters():
    whole = ChunkLayout(3 * CHUNK, CHUNK, 2)
    split = ChunkLayout(3 * CHUNK, CHUNK, 2, master_format="split")
    assert whole.record_bytes(0) == 12 * CHUNK
    assert split.record_bytes(0) == CHUNK * 17 // 8 + 8 * CHUNK
    # A short last chunk: its split masters are padded to the next 4 KiB, its states start there.
    tail = ChunkLayout(CHUNK + 5, CHUNK, 2, master_format="split")
    assert tail.state_extents(1)[0][0] == round_up(split_masters.region_bytes(1024), IO_ALIGN)
    masters = _masters(5)
    tensors = [torch.zeros(1024), torch.zeros(1024), torch.zeros(1024)]
    tensors[0][:5] = masters
    params = torch.zeros(5, dtype=torch.bfloat16)
    record = tail.pack(tensors, 1, ["exp_avg", "exp_avg_sq"], params_out=params)
    assert torch.equal(params, masters.to(torch.bfloat16))  # the other half, set by the pack
    unpacked = tail.unpack(record, 1, ["exp_avg", "exp_avg_sq"], params)
    assert torch.equal(unpacked[0][:5].view(torch.int32), masters.view(torch.int32))
    with pytest.raises(ValueError, match="pass `params`"):
        tail.unpack(record, 1, ["exp_avg", "exp_avg_sq"])
    with pytest.raises(ValueError, match="pass `params_out`"):
        tail.pack(tensors, 1, ["exp_avg", "exp_avg_sq"])
    with pytest.raises(ValueError, match="master_format='half'"):
        ChunkLayout(1, CHUNK, 2, master_format="half")


class Pair:
    """The same shards on a backend that splits its masters and on one that keeps them whole, driven alike."""

    def __init__(self, root: Path, make: callable, sizes=SIZES) -> None:  # type: ignore[valid-type]
        self.sizes = sizes
        rule = Adam(decoupled_weight_decay=True)
        self.backends: list[Backend] = []
        self.params: list[list[torch.Tensor]] = []
        g = torch.Generator().manual_seed(0)
        inits = [torch.randn(n, generator=g).to(torch.bfloat16) for n in sizes]
        for master_format in ("split", "fp32"):
            backend = make(root / master_format)
            backend.open([ShardSpec(i, n, rule, master_format=master_format) for i, n in enumerate(sizes)])
            params = [x.clone() for x in inits]
            if master_format == "split":
                backend.bind_parameters(lambda i, params=params: params[i])
            for i, x in enumerate(inits):
                backend.initialize(i, x)
            backend.wait()
            self.backends.append(backend)
            self.params.append(params)
        self.gen = torch.Generator().manual_seed(1)
        self.t = 0

    def step(self, *, tentative: bool = False) -> list[int]:
        """One update of every shard (tentative where the backends take it); returns the shards updated so."""
        self.t += 1
        grads = [torch.randn(n, generator=self.gen).to(torch.bfloat16) for n in self.sizes]
        hp = StepParams(step=self.t, lr=1e-2 / self.t, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-6)
        held = []
        for backend, params in zip(self.backends, self.params):
            for i, grad in enumerate(grads):
                hand_off = tentative and backend.takes_hand_off(i)
                backend.submit(i, grad, hp, params[i], tentative=hand_off)
                held += [i] if hand_off and backend is self.backends[0] else []
            backend.wait()
        return held

    def masters(self, which: int) -> list[torch.Tensor]:
        out = [torch.full((n,), float("nan")) for n in self.sizes]
        for i, master in enumerate(out):
            self.backends[which].read_master(i, master)
        self.backends[which].wait()
        return out

    def assert_same(self) -> None:
        for split, whole in zip(self.params[0], self.params[1]):
            assert torch.equal(split.view(torch.int16), whole.view(torch.int16))
        for split, whole in zip(self.masters(0), self.masters(1)):
            assert torch.equal(split.view(torch.int32), whole.view(torch.int32))

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


def _cpu(root: Path) -> CpuBackend:
    return CpuBackend([root / "dev0", root / "dev1"], chunk_elems=CHUNK, buffer_count=4, tentative_slots=True)


def test_updates_commits_and_rollbacks_match_whole_masters(tmp_path):
    pair = Pair(tmp_path, _cpu)
    try:
        pair.assert_same()
        pair.step()
        pair.assert_same()
        # Hand-offs kept: the new parameters and records stand together.
        held = pair.step(tentative=True)
        assert held == list(range(len(SIZES)))
        for backend in pair.backends:
            backend.commit(held)
        pair.assert_same()
        # Hand-offs rolled back: split masters put their parameters back (half of the committed state); whole ones
        # leave the discarded parameters, which their masters restore.
        before = [p.clone() for p in pair.params[0]]
        held = pair.step(tentative=True)
        assert not all(torch.equal(p, old) for p, old in zip(pair.params[0], before))
        for backend in pair.backends:
            backend.rollback(held)
        assert all(torch.equal(p, old) for p, old in zip(pair.params[0], before))
        for i, master in enumerate(pair.masters(1)):
            pair.params[1][i].copy_(master)
        pair.assert_same()
        # Rolled back again, then redone with the same shards: the aside copies are reused.
        held = pair.step(tentative=True)
        for backend in pair.backends:
            backend.rollback(held)
        for i, master in enumerate(pair.masters(1)):
            pair.params[1][i].copy_(master)
        pair.assert_same()
        pair.step()
        pair.assert_same()
    finally:
        pair.close()


def test_a_save_writes_whole_masters_byte_for_byte_as_a_whole_run_does(tmp_path):
    pair = Pair(tmp_path, _cpu)
    try:
        pair.step()
        pair.step()
        for backend, name in zip(pair.backends, ("split", "whole")):
            backend.save(tmp_path / "saved" / name)
        split, whole = tmp_path / "saved" / "split", tmp_path / "saved" / "whole"
        assert read_manifest(split) == read_manifest(whole)
        for i in range(len(SIZES)):
            assert (split / shard_file_name(i)).read_bytes() == (whole / shard_file_name(i)).read_bytes()
        assert pair.backends[0].last_save.by_method == {
            "rebuilt": sum(ChunkLayout(n, CHUNK, 2).file_bytes for n in SIZES)
        }
        # Loaded into split masters (from either), the parameters are set and the next steps agree.
        for params in pair.params[0]:
            params.zero_()
        pair.backends[0].load(whole)
        pair.backends[1].load(split)
        pair.assert_same()
        pair.step()
        pair.assert_same()
    finally:
        pair.close()


def test_a_memory_tier_keeps_split_masters_too(tmp_path):
    budget = ChunkLayout(2 * CHUNK + 7, CHUNK, 2, master_format="split").file_bytes
    pair = Pair(tmp_path, lambda root: tiers_over(_cpu(root), memory_bytes=2 * budget, measure_memory_share=False))
    try:
        assert pair.backends[0].local_shards  # some shards live in memory
        for _ in range(3):
            held = pair.step(tentative=True)
            for backend in pair.backends:
                backend.commit(held)
        pair.assert_same()
    finally:
        pair.close()


def test_storage_traffic_is_the_split_records_bytes(tmp_path):
    pair = Pair(tmp_path, _cpu, sizes=[CHUNK, 3 * CHUNK])
    try:
        traffic = [backend.traffic.snapshot for backend in pair.backends]
        before = [(t().storage_read_bytes, t().storage_write_bytes) for t in traffic]
        steps = 3
        for _ in range(steps):
            pair.step()
        moved = [(t().storage_read_bytes - r, t().storage_write_bytes - w) for t, (r, w) in zip(traffic, before)]
        # Every chunk fills its blocks: 2.125 bytes of master and 4 + 4 of Adam's moments per element, each way,
        # against 12 with whole masters.
        assert moved[0] == (steps * 4 * CHUNK * 81 // 8,) * 2
        assert moved[1] == (steps * 4 * CHUNK * 12,) * 2
    finally:
        pair.close()


def test_parameters_that_cannot_hold_half_a_master_are_refused(tmp_path):
    backend = _cpu(tmp_path)
    try:
        backend.open([ShardSpec(0, 1029, Adam(), master_format="split")])
        with pytest.raises(ValueError, match="bf16 host tensor of 1029 elements; got 1029 torch.float32"):
            backend.bind_parameters(lambda i: torch.zeros(1029))
        params = torch.zeros(1029, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="call `bind_parameters`"):
            backend.initialize(0, params)
        backend.bind_parameters(lambda i: params)
        with pytest.raises(ValueError, match="do not round to its parameters"):
            backend.initialize(0, torch.ones(1029))
        params[-1] = float("nan")  # ZeRO pads the last partition with whatever its memory held: NaN rounds to NaN
        backend.initialize(0, params)
        with pytest.raises(ValueError, match="writes its own parameters"):
            backend.submit(0, torch.zeros(1029), StepParams(step=1, lr=0.1), torch.zeros(1029, dtype=torch.bfloat16))
    finally:
        backend.close()
    assert not (tmp_path / "dev0" / MANIFEST).exists()


def test_a_save_whose_live_file_cannot_be_read_leaves_no_descriptor_open(tmp_path) -> None:
    """Rebuilding whole masters opens the live file before creating the copy: a source that will not open (gone,
    EIO) fails the save without leaking the copy's descriptor, run after run."""
    from lightning_smartinf.core.format.state_files import ShardState, save_state

    spec = ShardSpec(0, 1024, Adam(), master_format="split")
    shard = ShardState(spec, spec.layout(1024), tmp_path / "gone.state", params=torch.zeros(1024, dtype=torch.bfloat16))
    before = len(list(Path("/proc/self/fd").iterdir()))
    for _ in range(3):
        with pytest.raises(FileNotFoundError):
            save_state([shard], tmp_path / "ckpt", chunk_elems=1024)
    assert len(list(Path("/proc/self/fd").iterdir())) == before
    assert not (tmp_path / "ckpt").exists()
