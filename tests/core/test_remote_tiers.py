"""Host and accelerator memory tiers beside remote device servers (``TieredBackend``), against two ``smartinf serve``
processes on loopback.

The servers run the ``cpu`` backend's devices and the local tiers the same rule code, so every comparison with the
in-process ``cpu`` backend is bitwise.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

from lightning_smartinf.core import registry
from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.build import tiers_over
from lightning_smartinf.core.compression import compress_topk
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.format.state_files import CheckpointError
from lightning_smartinf.core.placement import TieredPlacement
from lightning_smartinf.core.rules import SGD, Adagrad, Adam, StepParams
from lightning_smartinf.core.tiers.tiered import LOCAL_TIERS_MANIFEST, TieredBackend, masters_with_tiers
from lightning_smartinf.devices.cpu import CpuBackend
from lightning_smartinf.devices.remote.client import RemoteBackend, checkpoint_masters
from lightning_smartinf.devices.remote.tokens import read_token

CHUNK = 4096
SIZES = [CHUNK + 5, CHUNK, 2 * CHUNK - 1, 777, 3 * CHUNK, CHUNK // 2]
RULES = [Adam(decoupled_weight_decay=True), SGD(with_momentum=True), Adagrad(initial_accumulator_value=0.1), Adam()]
RULES = [RULES[i % len(RULES)] for i in range(len(SIZES))]


def _specs() -> list[ShardSpec]:
    return [ShardSpec(index=i, numel=n, rule=r) for i, (n, r) in enumerate(zip(SIZES, RULES))]


def _record_bytes(i: int) -> int:
    return ChunkLayout(SIZES[i], CHUNK, len(RULES[i].state_names)).file_bytes


STATE = sum(_record_bytes(i) for i in range(len(SIZES)))


def _tiers(servers, token_file, *, memory: int = STATE, accelerator: int = 0, weights=None, **kwargs) -> TieredBackend:
    placement = TieredPlacement(tuple(weights), 0, CHUNK) if weights else None
    remote = RemoteBackend(
        [s.address for s in servers],
        read_token(token_file),
        chunk_elems=CHUNK,
        buffer_count=4,
        device_timeout_s=60.0,
        **({"placement": placement} if placement else {}),
        **kwargs,
    )
    return tiers_over(
        remote,
        memory_bytes=memory,
        accelerator_bytes=accelerator,
        chunk_elems=CHUNK,
        buffer_count=4,
        device_timeout_s=60.0,
        accelerator_device="cpu",  # the accelerator tier's code on the host's torch device (no GPU here)
        devices_compute=registry.kind("remote").devices_compute,
    )


def _initialize(backends, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    masters = [torch.randn(n, generator=generator) for n in SIZES]
    for backend in backends:
        backend.open(_specs())
        for i, master in enumerate(masters):
            backend.initialize(i, master)
        backend.wait()


def _step(backend, step: int, *, ratio: float | None = None, link=torch.bfloat16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    handles = []
    for i, n in enumerate(SIZES):
        grad = torch.randn(n, generator=generator)
        sent = grad if ratio is None else compress_topk(grad, ratio, value_dtype=link)
        hp = StepParams(step=step, lr=1e-2, weight_decay=0.01, momentum=0.9, betas=(0.9, 0.95))
        handles.append(backend.submit(i, sent, hp, outs[i], link_dtype=link))
    for handle in handles:
        backend.result(handle)
    return outs


def _masters(backend) -> list[torch.Tensor]:
    out = []
    for i, n in enumerate(SIZES):
        master = torch.empty(n)
        backend.result(backend.read_master(i, master))
        out.append(master)
    return out


@pytest.mark.parametrize("accelerator", [0, 2 * CHUNK * 4 * 3], ids=["memory", "accelerator+memory"])
def test_local_tiers_beside_servers_are_bitwise_the_cpu_backend(tmp_path, servers, token_file, accelerator) -> None:
    tiers = _tiers(servers, token_file, accelerator=accelerator)
    reference = CpuBackend([tmp_path / "local"], chunk_elems=CHUNK, buffer_count=4)
    _initialize([tiers, reference])
    # Memory holds what one more server would: a third of the state beside two servers (the accelerator fills first).
    local = tiers.local_shards
    assert local and len(local) < len(SIZES)
    in_memory = [i for i, d in zip(range(len(SIZES)), tiers.assignment) if d == 2]
    held = sum(_record_bytes(i) for i in in_memory)
    assert 0 < held <= (STATE - accelerator) / 3
    if accelerator:
        assert 3 in tiers.assignment  # memory is device 2, the accelerator 3
    assert set(tiers.assignment[i] for i in range(len(SIZES)) if i not in local) == {0, 1}
    for step, ratio in enumerate([None, 0.05, None], start=1):
        for a, b in zip(_step(tiers, step, ratio=ratio), _step(reference, step, ratio=ratio)):
            assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(_masters(tiers), _masters(reference)):
        assert_close(a, b, rtol=0, atol=0)
    tiers.wait()
    reference.wait()
    ours, theirs = tiers.traffic_snapshot(), reference.traffic_snapshot()
    # Link bytes are the same; the local shards' state bytes moved from the storage counters to their tiers'.
    assert (ours.link_write_bytes, ours.link_read_bytes) == (theirs.link_write_bytes, theirs.link_read_bytes)
    here = ours.memory_read_bytes + ours.accelerator_read_bytes
    assert here > 0 and ours.memory_read_bytes > 0
    assert ours.storage_read_bytes + here == theirs.storage_read_bytes
    assert ours.storage_write_bytes + ours.memory_write_bytes + ours.accelerator_write_bytes == (
        theirs.storage_write_bytes
    )
    assert bool(accelerator) == (ours.accelerator_read_bytes > 0)
    stats = tiers.stats()
    assert [d.index for d in stats.devices] == list(range(2, tiers.num_devices))
    tiers.close()
    reference.close()


def test_checkpoint_round_trip_and_export_with_a_split(tmp_path, servers, token_file) -> None:
    tiers = _tiers(servers, token_file)
    _initialize([tiers])
    _step(tiers, 1)
    tiers.save(tmp_path / "ckpt")
    split = json.loads((tmp_path / "ckpt" / LOCAL_TIERS_MANIFEST).read_text())
    assert split["local"] == list(tiers.local_shards) and sorted(split["local"] + split["inner"]) == list(range(6))
    saved = _masters(tiers)
    # Export reads the local shards from the checkpoint and the others from the servers' copy, in shard order.
    reader = masters_with_tiers(checkpoint_masters([s.address for s in servers], read_token(token_file)))
    for a, b in zip(reader(tmp_path / "ckpt"), saved):
        assert torch.equal(a, b)
    after_two = _step(tiers, 2)
    _step(tiers, 3)
    tiers.load(tmp_path / "ckpt")
    for a, b in zip(_masters(tiers), saved):
        assert torch.equal(a, b)
    for a, b in zip(_step(tiers, 2), after_two):
        assert torch.equal(a, b)
    tiers.close()
    # A new run with the same settings (new sessions) resumes the checkpoint bit for bit.
    again = _tiers(servers, token_file)
    _initialize([again], seed=5)
    again.load(tmp_path / "ckpt")
    for a, b in zip(_step(again, 2), after_two):
        assert torch.equal(a, b)
    again.close()


def test_loading_under_another_split_is_refused_naming_the_budgets(tmp_path, servers, token_file) -> None:
    split = _tiers(servers, token_file)
    _initialize([split])
    split.save(tmp_path / "split")
    split.close()
    plain = _tiers(servers, token_file, memory=0)
    _initialize([plain])
    assert plain.local is None and plain.local_shards == ()
    plain.save(tmp_path / "plain")
    before = _masters(plain)
    with pytest.raises(
        CheckpointError,
        match=r"kept sub-groups \[.*\] of this rank in host or accelerator memory.*"
        r"this run keeps none there\. Resume with the `state_memory_budget`",
    ):
        plain.load(tmp_path / "split")
    for a, b in zip(_masters(plain), before):  # refused before anything was replaced
        assert torch.equal(a, b)
    plain.close()
    other = _tiers(servers, token_file)
    _initialize([other])
    with pytest.raises(CheckpointError, match=r"kept sub-groups none of this rank .* this run keeps \["):
        other.load(tmp_path / "plain")
    other.close()


def test_local_shards_take_no_tentative_updates(servers, token_file) -> None:
    tiers = _tiers(servers, token_file, tentative_slots=True)
    _initialize([tiers])
    local = tiers.local_shards
    assert tiers.supports_tentative
    assert [tiers.takes_hand_off(i) for i in range(len(SIZES))] == [i not in local for i in range(len(SIZES))]
    hp = StepParams(step=1, lr=1e-2)
    with pytest.raises(ValueError, match=rf"Shard {local[0]} is in a memory tier"):
        tiers.submit(local[0], torch.zeros(SIZES[local[0]]), hp, torch.empty(SIZES[local[0]]), tentative=True)
    remote = next(i for i in range(len(SIZES)) if i not in local)
    before = _masters(tiers)[remote]
    tiers.result(tiers.submit(remote, torch.ones(SIZES[remote]), hp, torch.empty(SIZES[remote]), tentative=True))
    tiers.rollback([remote])
    assert torch.equal(_masters(tiers)[remote], before)
    tiers.close()


def test_server_weights_share_out_the_shards(servers, token_file) -> None:
    tiers = _tiers(servers, token_file, memory=0, weights=[3.0, 1.0])
    _initialize([tiers])
    on = [sum(_record_bytes(i) for i, d in enumerate(tiers.assignment) if d == s) for s in (0, 1)]
    assert on[0] > 2 * on[1] > 0
    tiers.close()
