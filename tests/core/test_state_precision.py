"""State kept in bf16 and int8 on the ``cpu`` backend and its memory tier: bit for bit the reference of each format
(:func:`~lightning_smartinf.core.state_formats.update_chunk` over the records), saved, loaded and converted."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from helpers.hang_guard import run_with_timeout

from lightning_smartinf.core.backend import Backend, ShardSpec
from lightning_smartinf.core.build import tiers_over
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.format.state_files import MANIFEST, read_manifest, shard_file_name
from lightning_smartinf.core.rules import SGD, Adagrad, Adam, EFAdam, StepParams, UpdateRule
from lightning_smartinf.core.state_formats import reference_format, state_format, update_chunk
from lightning_smartinf.devices.cpu import CpuBackend
from lightning_smartinf.devices.remote.client import RemoteBackend
from lightning_smartinf.devices.remote.tokens import read_token
from lightning_smartinf.devices.xrt import XrtBackend, forget_platform, write_model_xclbin

CHUNK = 4096
SIZES = [1, 1025, 3 * CHUNK + 5]
RULES: list[UpdateRule] = [
    Adam(decoupled_weight_decay=True),
    SGD(),
    Adagrad(initial_accumulator_value=0.1),
    EFAdam(),
]
STEPS = 3


def _hp(step: int) -> StepParams:
    return StepParams(step=step, lr=1e-2 / step, grad_scale=0.5, weight_decay=0.01, momentum=0.9)


class Reference:
    """Each shard as records in memory, stepped by the reference of its format."""

    def __init__(self, specs: list[ShardSpec], masters: list[torch.Tensor]) -> None:
        self.specs = specs
        self.layouts = [ChunkLayout(s.numel, CHUNK, len(s.rule.state_names), s.state_format) for s in specs]
        self.records: list[list[torch.Tensor]] = []
        for spec, layout, master in zip(specs, self.layouts, masters):
            records = []
            for k in range(layout.num_chunks):
                start, n = layout.chunk_range(k)
                padded = layout.padded_len(k)
                tensors = [torch.zeros(padded)]
                tensors[0][:n] = master[start : start + n]
                for name in spec.rule.state_names:
                    tensors.append(torch.zeros(padded))
                    tensors[-1][:n] = spec.rule.initial_state_value(name)
                records.append(layout.pack(tensors, k, spec.rule.state_names).view(torch.float32))
            self.records.append(records)

    def step(self, index: int, grad: torch.Tensor, hp: StepParams) -> None:
        spec, layout = self.specs[index], self.layouts[index]
        for k, record in enumerate(self.records[index]):
            start, n = layout.chunk_range(k)
            g = grad[start : start + n].float() * hp.grad_scale
            states = layout.states_of(record, k, n)
            if spec.state_format == "fp32":  # the states as fp32 views: the rule itself
                spec.rule.apply(record[:n], g, states, hp)
            else:
                # The plain-torch reference, whatever kernels the devices convert with.
                update_chunk(spec.rule, reference_format(spec.state_format), record[:n], g, states, hp)

    def file_bytes(self, index: int) -> bytes:
        layout = self.layouts[index]
        out = bytearray(layout.file_bytes)
        for k, record in enumerate(self.records[index]):
            raw = record.view(torch.uint8).numpy().tobytes()
            out[layout.record_offset(k) : layout.record_offset(k) + len(raw)] = raw
        return bytes(out)


def _specs(fmt: str) -> list[ShardSpec]:
    return [ShardSpec(i, n, rule, state_format=fmt) for i, (n, rule) in enumerate(zip(SIZES + [2048], RULES))]


def _train(backend: Backend, specs: list[ShardSpec], seed: int = 0) -> Reference:
    gen = torch.Generator().manual_seed(seed)
    masters = [torch.randn(s.numel, generator=gen) for s in specs]
    backend.open(specs)
    for i, master in enumerate(masters):
        backend.initialize(i, master)
    backend.wait()
    reference = Reference(specs, masters)
    for step in range(1, STEPS + 1):
        for spec in specs:
            grad = torch.randn(spec.numel, generator=gen).to(torch.bfloat16)
            out = torch.empty(spec.numel, dtype=torch.bfloat16)
            backend.submit(spec.index, grad, _hp(step), out)
            reference.step(spec.index, grad, _hp(step))
        backend.wait()
    return reference


def _cpu(tmp_path: Path, name: str = "run", **kwargs) -> Backend:
    return CpuBackend([tmp_path / name / "d0", tmp_path / name / "d1"], chunk_elems=CHUNK, buffer_count=4, **kwargs)


@pytest.mark.parametrize("tier", ["devices", "memory", "accelerator"])
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_devices_and_each_tier_hold_the_reference_bytes(tmp_path, fmt, tier):
    """The accelerator tier runs here on the host's torch device (CPU tensors where a GPU holds CUDA ones); the GPU
    suite runs it on CUDA."""
    backend = _cpu(tmp_path)
    held = 2 * ChunkLayout(2048, CHUNK, 2, fmt).file_bytes  # some shards in the tier, the others on the devices
    if tier == "memory":
        backend = tiers_over(backend, memory_bytes=held, chunk_elems=CHUNK)
    elif tier == "accelerator":
        backend = tiers_over(backend, accelerator_bytes=held, accelerator_device="cpu", chunk_elems=CHUNK)
    specs = _specs(fmt)
    try:
        reference = _train(backend, specs)
        if tier != "devices":
            assert getattr(backend.traffic_snapshot(), f"{tier}_write_bytes") > 0, f"the {tier} tier held nothing"
        backend.save(tmp_path / "ckpt")
        manifest = read_manifest(tmp_path / "ckpt")
        assert [e["state_format"] for e in manifest["shards"]] == [fmt] * len(specs)
        for spec in specs:
            saved = (tmp_path / "ckpt" / shard_file_name(spec.index)).read_bytes()
            assert saved == reference.file_bytes(spec.index), f"shard {spec.index} ({spec.rule.name})"
            fp32_bytes = ChunkLayout(spec.numel, CHUNK, len(spec.rule.state_names)).file_bytes
            # Each state's bytes are padded to 4 KiB: a shard of less than 2048 elements takes no fewer.
            assert len(saved) < fp32_bytes if spec.numel >= CHUNK else len(saved) <= fp32_bytes
    finally:
        run_with_timeout(backend.close)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_remote_servers_update_as_the_reference(servers, token_file, fmt):
    """The servers hold the state (their checkpoints stay with them): the masters they return after every step are
    the reference's, bit for bit, so their arithmetic on the stored state is."""
    backend = RemoteBackend(
        [s.address for s in servers], read_token(token_file), chunk_elems=CHUNK, buffer_count=4, device_timeout_s=60.0
    )
    specs = _specs(fmt)
    try:
        reference = _train(backend, specs)
        for spec, layout, records in zip(specs, reference.layouts, reference.records):
            master = torch.empty(spec.numel)
            backend.read_master(spec.index, master)
            backend.wait()
            expected = torch.cat([r[: layout.chunk_range(k)[1]] for k, r in enumerate(records)])
            assert torch.equal(master, expected), (fmt, spec.rule.name)
    finally:
        run_with_timeout(backend.close)


def test_fp32_manifests_read_as_before_formats_existed(tmp_path):
    backend = _cpu(tmp_path)
    try:
        _train(backend, _specs("fp32"))
        backend.save(tmp_path / "ckpt")
    finally:
        run_with_timeout(backend.close)
    assert all("state_format" not in e for e in read_manifest(tmp_path / "ckpt")["shards"])


@pytest.mark.parametrize(("saved", "wanted"), [("int8", "int8"), ("fp32", "int8"), ("int8", "fp32"), ("bf16", "int8")])
def test_resume_in_the_same_format_is_bitwise_and_another_converts(tmp_path, caplog, saved, wanted):
    first = _cpu(tmp_path, "first")
    try:
        _train(first, _specs(saved))
        first.save(tmp_path / "ckpt")
    finally:
        run_with_timeout(first.close)
    specs = _specs(wanted)
    second = _cpu(tmp_path, "second")
    try:
        second.open(specs)
        with caplog.at_level(logging.INFO, logger="lightning_smartinf"):
            second.load(tmp_path / "ckpt")
        second.save(tmp_path / "again")
    finally:
        run_with_timeout(second.close)
    converting = [r for r in caplog.records if "converting it to" in r.getMessage()]
    for spec in specs:
        before = (tmp_path / "ckpt" / shard_file_name(spec.index)).read_bytes()
        after = (tmp_path / "again" / shard_file_name(spec.index)).read_bytes()
        if saved == wanted:
            assert after == before
            continue
        names = spec.rule.state_names
        old = ChunkLayout(spec.numel, CHUNK, len(names), saved)
        new = ChunkLayout(spec.numel, CHUNK, len(names), wanted)
        for k in range(new.num_chunks):
            was = old.unpack(_record(before, old, k), k, names)
            now = new.unpack(_record(after, new, k), k, names)
            assert torch.equal(now[0], was[0]), "masters are fp32 in every format"
            for name, a, b in zip(names, was[1:], now[1:]):
                fmt = state_format(wanted)
                expected = torch.empty_like(a)
                raw = torch.empty(fmt.stored_bytes(a.numel()), dtype=torch.uint8)
                fmt.store(a, raw, name)
                fmt.load(raw, expected, name)
                assert torch.equal(b, expected), (spec.rule.name, name, k)  # dequantised exactly, or stored once
    if saved == wanted:
        assert not converting
    else:
        [record] = converting
        smaller = wanted == "int8" or (saved, wanted) == ("fp32", "bf16")
        assert record.levelno == (logging.WARNING if smaller else logging.INFO)
        assert f"saved in {saved}; converting it to {wanted}" in record.getMessage()


def _record(data: bytes, layout: ChunkLayout, k: int) -> torch.Tensor:
    start = layout.record_offset(k)
    return torch.frombuffer(bytearray(data[start : start + layout.record_bytes(k)]), dtype=torch.uint8)


def test_an_unknown_saved_format_is_refused(tmp_path):
    backend = _cpu(tmp_path, "first")
    try:
        _train(backend, _specs("int8"))
        backend.save(tmp_path / "ckpt")
    finally:
        run_with_timeout(backend.close)
    manifest_path = tmp_path / "ckpt" / MANIFEST
    manifest_path.write_text(manifest_path.read_text().replace('"int8"', '"int4"'))
    second = _cpu(tmp_path, "second")
    try:
        second.open(_specs("int8"))
        with pytest.raises(ValueError, match="does not match this model and optimizer"):
            second.load(tmp_path / "ckpt")
    finally:
        run_with_timeout(second.close)


def test_the_pools_shrink_with_the_state():
    """A buffer holds one record: Adam's in bf16 or int8 needs two fp32-chunk-sized tensors of room, not three."""
    for fmt, tensors in (("fp32", 3), ("bf16", 2), ("int8", 2)):
        layout = ChunkLayout(10 * CHUNK, CHUNK, 2, fmt)
        assert layout.pool_tensors == tensors
        assert layout.record_offset(1) <= tensors * 4 * CHUNK  # a full record fits a buffer
    assert ChunkLayout(CHUNK, CHUNK, 1, "int8").pool_tensors == 2  # master + one state: no saving below a tensor


def test_a_devices_pool_is_sized_for_its_format(tmp_path):
    allocated = {}
    for fmt in ("fp32", "int8"):
        backend = _cpu(tmp_path, fmt)
        try:
            backend.open([ShardSpec(0, 4 * CHUNK, Adam(), state_format=fmt)])
            allocated[fmt] = sum(device.allocated_bytes for device in backend.devices)
        finally:
            run_with_timeout(backend.close)
    grad_chunks = 2 * CHUNK * 4  # each device's own fp32 gradient chunk
    assert (allocated["int8"] - grad_chunks) * 3 == (allocated["fp32"] - grad_chunks) * 2


@pytest.fixture(scope="module")
def xclbin(csim_library, tmp_path_factory):
    root = tmp_path_factory.mktemp("xrt-model")
    path = write_model_xclbin(root / "smartinf.json", csim_library, devices=1, dram_root=root / "ddr")
    yield path
    forget_platform(path)


def test_a_backend_that_holds_fp32_only_refuses_other_formats_before_anything_is_written(tmp_path, xclbin):
    """Built directly (the strategy's settings refuse it earlier), an xrt backend is not handed records it would
    update as fp32."""
    xrt = XrtBackend([tmp_path / "ssd0"], xclbin=xclbin, chunk_elems=CHUNK, buffer_count=2)
    try:
        with pytest.raises(ValueError, match=r"`XrtBackend` holds the optimizer state in fp32 only.*\['int8'\]"):
            xrt.open(_specs("int8"))
    finally:
        run_with_timeout(xrt.close)
    assert not list(tmp_path.rglob("*.state"))
