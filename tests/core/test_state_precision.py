"""State kept in bf16 and int8 on the ``cpu`` backend, its memory and accelerator tiers, remote servers and the
SmartSSD kernels (``xrt``): bit for bit the reference of each format
(:func:`~lightning_smartinf.core.state_formats.update_chunk` over the records), saved, loaded and converted."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import pytest
import torch
from helpers.format_reference import train
from helpers.hang_guard import run_with_timeout
from helpers.ieee import TORCH_SQRT_IS_IEEE, ieee_sqrt

from lightning_smartinf.core.backend import Backend, ShardSpec
from lightning_smartinf.core.build import tiers_over
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.format.state_files import FORMAT, MANIFEST, read_manifest, shard_file_name
from lightning_smartinf.core.rules import SGD, Adagrad, Adam, EFAdam, UpdateRule
from lightning_smartinf.core.state_formats import state_format
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


def _specs(fmt: str) -> list[ShardSpec]:
    return [ShardSpec(i, n, rule, state_format=fmt) for i, (n, rule) in enumerate(zip(SIZES + [2048], RULES))]


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
        reference = train(backend, specs, CHUNK)
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
def test_the_devices_take_the_link_gradient_and_write_the_parameters_in_the_formats_pass(tmp_path, fmt, monkeypatch):
    """Adam over a bf16 gradient into bf16 parameters in host memory (bf16 training): the device hands the format's
    native pass the gradient as it crossed the link and the parameters to write, so neither takes a pass of its own;
    the bytes are the reference's (``train`` checks the parameters and the saved state)."""
    seen = []
    kind = type(state_format(fmt))
    fused_update = kind.fused_update

    def spy(self, rule, master, grad, stored, hp, split=None, **kwargs):  # noqa: ANN001, ANN202 - passes through
        ran = fused_update(self, rule, master, grad, stored, hp, split, **kwargs)
        if self.native:  # the device's format (the reference's runs its plain-torch update)
            seen.append((grad.dtype, kwargs.get("params") is not None, kwargs.get("grad_scale"), ran))
        return ran

    monkeypatch.setattr(kind, "fused_update", spy)
    backend = _cpu(tmp_path)
    try:
        train(backend, [ShardSpec(0, 3 * CHUNK + 5, Adam(decoupled_weight_decay=True), state_format=fmt)], CHUNK)
    finally:
        run_with_timeout(backend.close)
    assert seen and set(seen) == {(torch.bfloat16, True, 0.5, True)}


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_remote_servers_update_as_the_reference(servers, token_file, fmt):
    """The servers hold the state (their checkpoints stay with them): the masters they return after every step are
    the reference's, bit for bit, so their arithmetic on the stored state is."""
    backend = RemoteBackend(
        [s.address for s in servers], read_token(token_file), chunk_elems=CHUNK, buffer_count=4, device_timeout_s=60.0
    )
    specs = _specs(fmt)
    try:
        reference = train(backend, specs, CHUNK)
        for spec in specs:
            master = torch.empty(spec.numel)
            backend.read_master(spec.index, master)
            backend.wait()
            assert torch.equal(master, reference.master(spec.index)), (fmt, spec.rule.name)
    finally:
        run_with_timeout(backend.close)


def test_fp32_manifests_read_as_before_formats_existed(tmp_path):
    backend = _cpu(tmp_path)
    try:
        train(backend, _specs("fp32"), CHUNK)
        backend.save(tmp_path / "ckpt")
    finally:
        run_with_timeout(backend.close)
    assert all("state_format" not in e for e in read_manifest(tmp_path / "ckpt")["shards"])


def _train_and_save(tmp_path: Path, fmt: str) -> None:
    """Train a first ``cpu`` backend in format ``fmt`` and save its state to ``tmp_path / "ckpt"``."""
    first = _cpu(tmp_path, "first")
    try:
        train(first, _specs(fmt), CHUNK)
        first.save(tmp_path / "ckpt")
    finally:
        run_with_timeout(first.close)


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_int8_state_saved_in_the_earlier_code_is_refused_and_other_formats_still_load(tmp_path, fmt):
    """Manifests before ``state/4`` coded int8's second moment in E4M3: read as today's codes it would be wrong, so
    such a checkpoint is refused, naming the way over; its fp32 and bf16 state loads as it did."""
    _train_and_save(tmp_path, fmt)
    manifest_path = tmp_path / "ckpt" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    assert manifest["format"] == FORMAT == "lightning_smartinf.state/4"
    manifest["format"] = "lightning_smartinf.state/3"
    manifest_path.write_text(json.dumps(manifest))
    second = _cpu(tmp_path, "second")
    try:
        second.open(_specs(fmt))
        if fmt == "int8":
            with pytest.raises(ValueError, match=r"saved by an earlier version .*'lightning_smartinf.state/3'.*E4M3"):
                second.load(tmp_path / "ckpt")
        else:
            second.load(tmp_path / "ckpt")
    finally:
        run_with_timeout(second.close)


@pytest.mark.parametrize(
    ("saved", "wanted"), [("int8", "int8"), ("fp32", "int8"), ("int8", "fp32"), ("bf16", "int8"), ("int8", "bf16")]
)
def test_resume_in_the_same_format_is_bitwise_and_another_converts(tmp_path, caplog, monkeypatch, saved, wanted):
    from lightning_smartinf.core import progress
    from lightning_smartinf.core.io.storage import readable_size

    _train_and_save(tmp_path, saved)
    specs = _specs(wanted)
    second = _cpu(tmp_path, "second")
    monkeypatch.setattr(progress._settings, "min_seconds", 0.0)  # each operation's line, however short
    try:
        second.open(specs)
        with caplog.at_level(logging.INFO, logger="lightning_smartinf"):
            second.load(tmp_path / "ckpt")
        second.save(tmp_path / "again")
    finally:
        run_with_timeout(second.close)
    # The load's progress counts the bytes it read: the saved files, in the format they were saved in.
    read = sum((tmp_path / "ckpt" / shard_file_name(spec.index)).stat().st_size for spec in specs)
    assert f"Loading the optimizer state: {readable_size(read, decimal=True)} in" in caplog.text
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
                if wanted == "fp32":
                    assert torch.equal(b, a), (spec.rule.name, name, k)
    if saved == wanted:
        assert not converting
    else:
        [record] = converting
        # Only fp32 holds every value of another format as it decodes (an int8 element is a code times an fp32
        # scale: more bits than bf16's 8); into any other format the state is rounded, and the user told so.
        rounded = wanted != "fp32"
        assert record.levelno == (logging.WARNING if rounded else logging.INFO)
        assert ("rounded" if rounded else "exactly") in record.getMessage()
        assert f"saved in {saved}; converting it to {wanted}" in record.getMessage()


def _record(data: bytes, layout: ChunkLayout, k: int) -> torch.Tensor:
    start = layout.record_offset(k)
    return torch.frombuffer(bytearray(data[start : start + layout.record_bytes(k)]), dtype=torch.uint8)


def test_an_unknown_saved_format_is_refused(tmp_path):
    backend = _cpu(tmp_path, "first")
    try:
        train(backend, _specs("int8"), CHUNK)
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


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "topk"])
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_the_smartssd_kernels_hold_the_reference_bytes(tmp_path, xclbin, fmt, sparse, grad_dtype):
    """The ``xrt`` backend on the software model of pyxrt runs the C simulation of the HLS kernels: their records
    (saved, and read back through the P2P buffers every step) are the reference's, byte for byte, and so are the
    parameters they return."""
    xrt = XrtBackend([tmp_path / "ssd0"], xclbin=xclbin, chunk_elems=CHUNK, buffer_count=2)
    specs = _specs(fmt)
    try:
        with contextlib.nullcontext() if TORCH_SQRT_IS_IEEE else ieee_sqrt():  # the kernels' sqrt is IEEE's
            reference = train(xrt, specs, CHUNK, grad_dtype=grad_dtype, sparse=sparse)
        xrt.save(tmp_path / "ckpt")
        for spec in specs:
            saved = (tmp_path / "ckpt" / shard_file_name(spec.index)).read_bytes()
            assert saved == reference.file_bytes(spec.index), f"shard {spec.index} ({spec.rule.name})"
    finally:
        run_with_timeout(xrt.close)


def test_an_xclbin_without_the_formats_kernels_is_refused_before_anything_is_written(tmp_path, csim_library):
    path = write_model_xclbin(
        tmp_path / "fp32-only.json",
        csim_library,
        kernels=["smartinf_adam_bf16", "smartinf_adam_topk_bf16"],
        devices=1,
        dram_root=tmp_path / "ddr",
    )
    xrt = XrtBackend([tmp_path / "ssd0"], xclbin=path, chunk_elems=CHUNK, buffer_count=2)
    try:
        with pytest.raises(
            ValueError,
            match=r"no `smartinf_adam_\*` kernel with the state in int8.*"
            r'KERNELS="smartinf_adam_bf16_state_int8 smartinf_adam_topk_bf16_state_int8"',
        ):
            xrt.open([ShardSpec(0, CHUNK, Adam(), state_format="int8")])
    finally:
        run_with_timeout(xrt.close)
        forget_platform(path)
    assert not list(tmp_path.rglob("*.state"))
