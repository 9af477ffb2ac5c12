"""What only the ``xrt`` backend has: byte counters per path, P2P buffers, device pairing and its bad-input messages.

Everything runs on the software model of pyxrt (``lightning_smartinf.devices.xrt.software_xrt``), which executes the C
simulation of ``hls_kernels/``; the conformance suite (``test_backend_conformance.py``) covers the update results.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.compression import SparseGrad
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.format.state_files import shard_file_name
from lightning_smartinf.core.rules import SGD, Adagrad, Adam, StepParams
from lightning_smartinf.devices.xrt import (
    SMARTSSD_DDR_BYTES,
    XrtBackend,
    check_xrt_settings,
    forget_platform,
    pair_by_pcie,
    platform_for,
    write_model_xclbin,
)
from lightning_smartinf.devices.xrt.abi import padded_elems

CHUNK = 4096


@pytest.fixture
def model_xclbin(tmp_path, csim_library) -> Iterator:
    """``model_xclbin(**manifest kwargs)`` writes a model xclbin; its model machine is dropped at teardown."""
    written: list[Path] = []

    def write(name: str = "smartinf.json", **kwargs) -> Path:
        kwargs.setdefault("devices", 2)
        path = write_model_xclbin(tmp_path / name, csim_library, dram_root=tmp_path / f"ddr-{name}", **kwargs)
        written.append(path)
        return path

    yield write
    for path in written:
        forget_platform(path)


def _backend(backends: list[XrtBackend], dirs: list[Path], xclbin: Path, **kwargs) -> XrtBackend:
    kwargs.setdefault("chunk_elems", CHUNK)
    kwargs.setdefault("buffer_count", 2)
    backend = XrtBackend(dirs, xclbin=xclbin, **kwargs)
    backends.append(backend)
    return backend


# ------------------------------------------------------------------------------------------------ traffic per path


def test_state_moves_only_on_the_device_internal_path(tmp_path, model_xclbin, backends) -> None:
    """Per device and path, the model's DMA counters equal what the backend reports crossing the link (plus the
    64-byte beat padding of each transfer), P2P buffers are never synced by the host, and the state bytes appear
    only on the storage path."""
    xclbin = model_xclbin()
    sizes = [3 * CHUNK + 5, 1025, 2 * CHUNK]
    specs = [
        ShardSpec(0, sizes[0], Adam(decoupled_weight_decay=True)),
        ShardSpec(1, sizes[1], SGD()),
        ShardSpec(2, sizes[2], Adagrad()),
    ]
    backend = _backend(backends, [tmp_path / "a", tmp_path / "b"], xclbin)
    backend.open(specs)
    for i, n in enumerate(sizes):
        backend.initialize(i, torch.randn(n))
    backend.wait()
    platform = platform_for(xclbin)
    before = [platform.counters(d) for d in range(2)]
    link_before = backend.traffic_snapshot()
    gen = torch.Generator().manual_seed(0)
    expected_h2d, expected_d2h, expected_runs = [0, 0], [0, 0], [0, 0]
    expected_link = 0
    for step in (1, 2):
        for i, n in enumerate(sizes):
            dev = i % 2
            layout = ChunkLayout(n, CHUNK, len(specs[i].rule.state_names))
            beats = sum(padded_elems(layout.chunk_range(k)[1], 2) * 2 for k in range(layout.num_chunks))  # bf16
            out = torch.empty(n, dtype=torch.bfloat16)
            if i == 0:  # top-k on the Adam shard: indices and values per chunk
                idx = torch.randperm(n, generator=gen)[: n // 5].sort().values.to(torch.int32)
                grad = SparseGrad(idx, torch.randn(idx.numel(), generator=gen).bfloat16(), n)
                expected_link += idx.numel() * (4 + 2)
                for k in range(layout.num_chunks):
                    lo, hi = grad.chunk_bounds(*layout.chunk_range(k))
                    if hi > lo:
                        expected_h2d[dev] += padded_elems(hi - lo, 4) * 4 + padded_elems(hi - lo, 2) * 2
            else:
                grad = torch.randn(n, generator=gen).bfloat16()
                expected_link += n * 2
                expected_h2d[dev] += beats
            expected_d2h[dev] += beats
            expected_runs[dev] += layout.num_chunks
            backend.submit(i, grad, StepParams(step=step, lr=1e-2, momentum=0.9), out)
        backend.wait()
    after = [platform.counters(d) for d in range(2)]
    for d in range(2):
        assert after[d].host_to_device_bytes - before[d].host_to_device_bytes == expected_h2d[d]
        assert after[d].device_to_host_bytes - before[d].device_to_host_bytes == expected_d2h[d]
        assert after[d].kernel_runs - before[d].kernel_runs == expected_runs[d]
        assert after[d].p2p_host_sync_bytes == 0
    link = backend.traffic_snapshot() - link_before
    file_bytes = sum(ChunkLayout(s.numel, CHUNK, len(s.rule.state_names)).file_bytes for s in specs)
    # The host link carried gradients in and bf16 parameters out (what the CPU backend counts); the state only
    # moved between SSD and device memory.
    assert link.link_write_bytes == expected_link
    assert link.link_read_bytes == 2 * sum(sizes) * 2
    assert link.storage_read_bytes == link.storage_write_bytes == 2 * file_bytes


def test_p2p_buffers_are_file_backed_and_fit_device_memory(tmp_path, model_xclbin, backends) -> None:
    xclbin = model_xclbin(devices=1)
    backend = _backend(backends, [tmp_path / "a"], xclbin, buffer_count=3)
    backend.open([ShardSpec(0, 2 * CHUNK + 3, Adam())])
    backend.initialize(0, torch.randn(2 * CHUNK + 3))
    backend.wait()
    device = backend.devices[0]
    state = platform_for(xclbin).device_state(0)
    records = list(device._records.values())
    assert len(records) == 3
    for bo in records:
        assert bo.is_p2p
        path = bo.backing_file
        assert path.parent == state.dram_dir and path.stat().st_size == bo.size() == CHUNK * 4 * 3
        # What the host (and the SSD's pread/pwrite) see through the mapping is the file's content.
        with open(path, "rb") as f:
            assert f.read() == bytes(bo.map())
    # Device DDR in use is exactly the backend's buffers: P2P records plus three staging buffers.
    assert state.ddr_used == backend.buffer_bytes == (3 * 3 + 3) * CHUNK * 4
    # The last chunk's record came through a P2P buffer and reached the SSD's state file unchanged.
    layout = ChunkLayout(2 * CHUNK + 3, CHUNK, 2)
    with open(tmp_path / "a" / shard_file_name(0), "rb") as f:
        f.seek(layout.record_offset(2))
        on_ssd = f.read(layout.record_bytes(2))
    assert any(bytes(bo.map())[: len(on_ssd)] == on_ssd for bo in records)


# ------------------------------------------------------------------------------------------------ bad input


def test_missing_or_wrong_xclbin(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"`xclbin=None`.*make -C hls_kernels xclbin"):
        check_xrt_settings(None, None, None)
    missing = tmp_path / "nope.xclbin"
    with pytest.raises(FileNotFoundError, match=r"`xclbin=.*nope\.xclbin'` does not exist.*make -C hls_kernels"):
        check_xrt_settings(missing, None, [tmp_path])
    other = tmp_path / "kernels.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=r"neither an `\.xclbin` file nor a model manifest"):
        check_xrt_settings(other, None, None)
    with pytest.raises(FileNotFoundError, match="nope.xclbin"):
        XrtBackend([tmp_path / "a"], xclbin=missing, chunk_elems=CHUNK)


def test_missing_pyxrt_says_how_to_install_xrt(tmp_path, monkeypatch) -> None:
    xclbin = tmp_path / "smartinf.xclbin"
    xclbin.write_bytes(b"xclbin2\0")
    monkeypatch.setitem(sys.modules, "pyxrt", None)  # `import pyxrt` raises ImportError, installed or not
    with pytest.raises(RuntimeError, match=r"cannot import `pyxrt`.*Install XRT.*source /opt/xilinx/xrt/setup\.sh"):
        XrtBackend([tmp_path / "a"], xclbin=xclbin, chunk_elems=CHUNK)


def test_kernel_not_in_xclbin(tmp_path, model_xclbin, backends) -> None:
    xclbin = model_xclbin(kernels=["smartinf_adam_bf16", "smartinf_adam_topk_bf16"], devices=1)
    backend = _backend(backends, [tmp_path / "a"], xclbin)
    with pytest.raises(ValueError, match=r"no `smartinf_sgd_\*` kernel.*KERNELS=\"smartinf_sgd_bf16"):
        backend.open([ShardSpec(0, 100, SGD())])
    backend.open([ShardSpec(0, 100, Adam())])
    backend.initialize(0, torch.zeros(100))
    out = torch.empty(100, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"`smartinf_adam_fp16`.*is not in `xclbin=.*smartinf_adam_bf16.*KERNELS="):
        backend.submit(0, torch.zeros(100, dtype=torch.float16), StepParams(step=1, lr=0.1), out)
    backend.wait()  # nothing was queued by the refused submit


def test_unsupported_rule_and_dtypes(tmp_path, model_xclbin, backends) -> None:
    backend = _backend(backends, [tmp_path / "a"], model_xclbin(devices=1))
    with pytest.raises(ValueError, match=r"`Adam\(amsgrad=True\)`.*max_exp_avg_sq.*amsgrad=False"):
        backend.open([ShardSpec(0, 100, Adam(amsgrad=True))])
    backend.open([ShardSpec(0, 100, SGD())])
    with pytest.raises(ValueError, match=r"float64 has no kernel"):
        backend.submit(0, torch.zeros(100), StepParams(step=1, lr=0.1), torch.zeros(100, dtype=torch.float64))


def test_more_storage_paths_than_devices(tmp_path, model_xclbin) -> None:
    xclbin = model_xclbin(devices=2)
    dirs = [tmp_path / f"ssd{i}" for i in range(3)]
    with pytest.raises(ValueError, match=r"`storage_paths` gives 3 path\(s\).*only 2 device\(s\).*at most 2"):
        XrtBackend(dirs, xclbin=xclbin, chunk_elems=CHUNK)
    with pytest.raises(ValueError, match=r"names 2 device\(s\) for 3 storage path\(s\).*one device per storage path"):
        check_xrt_settings(xclbin, [0, 1], dirs)
    with pytest.raises(ValueError, match=r"names a device twice"):
        check_xrt_settings(xclbin, [0, 0], dirs[:2])
    with pytest.raises(ValueError, match=r"entry 'ssd0' is neither a device index.*PCIe BDF"):
        check_xrt_settings(xclbin, ["ssd0"], dirs[:1])
    with pytest.raises(RuntimeError, match=r"Cannot open XRT device 7 for storage path .*ssd0.*xbutil examine"):
        XrtBackend(dirs[:1], xclbin=xclbin, devices=[7], chunk_elems=CHUNK)


def test_explicit_devices_by_bdf(tmp_path, model_xclbin, backends) -> None:
    xclbin = model_xclbin(devices=["0000:3b:00.1", "0000:5e:00.1"])
    backend = _backend(backends, [tmp_path / "a", tmp_path / "b"], xclbin, devices=["0000:5e:00.1", "0000:3b:00.1"])
    assert [d.bdf for d in backend.devices] == ["0000:5e:00.1", "0000:3b:00.1"]


def test_buffers_larger_than_device_memory(tmp_path, model_xclbin, backends) -> None:
    # A SmartSSD has 4 GiB: 64 Mi-element chunks of Adam records (3 fp32 tensors) fit 4 buffers but not 5.
    xclbin = model_xclbin(devices=1, ddr_bytes=SMARTSSD_DDR_BYTES)
    chunk = 64 << 20
    fits = _backend(backends, [tmp_path / "a"], xclbin, chunk_elems=chunk, buffer_count=4)
    assert fits.devices[0].device_bytes(3) <= SMARTSSD_DDR_BYTES
    big = _backend(backends, [tmp_path / "b"], xclbin, chunk_elems=chunk, buffer_count=5)
    with pytest.raises(
        ValueError,
        match=r"`chunk_elems=67108864` with `buffer_count=5` needs 4608 MiB.*4\.00 GiB.*"
        r"Lower `chunk_size` \(at most 59652096 here\) or `buffer_count`",
    ):
        big.open([ShardSpec(0, 10, Adam())])
    assert platform_for(xclbin).device_state(0).ddr_used == 0  # refused before allocating anything


def test_model_refuses_buffers_too_small_for_the_kernel(tmp_path, model_xclbin) -> None:
    """The model checks every port holds the beats the kernel touches (hardware would corrupt memory)."""
    pyxrt = platform_for(model_xclbin(devices=1))
    device = pyxrt.device(0)
    uuid = device.load_xclbin(pyxrt.xclbin(str(pyxrt.manifest_path)))
    with pytest.raises(RuntimeError, match="No such compute unit 'smartinf_lamb_bf16'"):
        pyxrt.kernel(device, uuid, "smartinf_lamb_bf16", pyxrt.kernel.shared)
    kernel = pyxrt.kernel(device, uuid, "smartinf_sgd_fp32", pyxrt.kernel.shared)
    bos = [pyxrt.bo(device, 64, pyxrt.bo.normal, kernel.group_id(0)) for _ in range(4)]
    with pytest.raises(RuntimeError, match=r"argument 0: buffer of 64 B, the kernel touches 128 B \(n=17"):
        kernel(*bos, 17, 0, 0, 0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="bad_alloc"):
        pyxrt.bo(device, SMARTSSD_DDR_BYTES, pyxrt.bo.p2p, 0)


# ------------------------------------------------------------------------------------------------ PCIe pairing


def _fake_sysfs(root: Path, storage: Path, nvme_chain: list[str]) -> None:
    """A /sys with two SmartSSDs (switch upstream ports 0000:01:00.0 and 0000:05:00.0) and the block device of
    ``storage`` behind the NVMe controller at the end of ``nvme_chain``."""
    pci = root / "devices" / "pci0000:00"
    fpgas = {
        "0000:04:00.1": pci / "0000:00:01.0" / "0000:01:00.0" / "0000:02:01.0" / "0000:04:00.1",
        "0000:08:00.1": pci / "0000:00:02.0" / "0000:05:00.0" / "0000:06:01.0" / "0000:08:00.1",
    }
    (root / "bus" / "pci" / "devices").mkdir(parents=True)
    for bdf, path in fpgas.items():
        path.mkdir(parents=True)
        (root / "bus" / "pci" / "devices" / bdf).symlink_to(path)
    disk = pci.joinpath(*nvme_chain) / "nvme" / "nvme0" / "nvme0n1"
    disk.mkdir(parents=True)
    st = os.stat(storage)
    (root / "dev" / "block").mkdir(parents=True)
    (root / "dev" / "block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}").symlink_to(disk)


def test_pair_storage_path_with_the_fpga_behind_its_switch(tmp_path) -> None:
    storage = tmp_path / "ssd"
    storage.mkdir()
    sysfs = tmp_path / "sys"
    _fake_sysfs(sysfs, storage, ["0000:00:02.0", "0000:05:00.0", "0000:06:00.0", "0000:07:00.0"])
    assert pair_by_pcie([storage], ["0000:04:00.1", "0000:08:00.1"], sysfs=sysfs) == ["0000:08:00.1"]


def test_pairing_fails_clearly_for_a_plain_nvme_disk(tmp_path) -> None:
    storage = tmp_path / "ssd"
    storage.mkdir()
    sysfs = tmp_path / "sys"
    _fake_sysfs(sysfs, storage, ["0000:00:03.0", "0000:09:00.0"])  # an NVMe SSD on a root port, no SmartSSD
    with pytest.raises(ValueError, match=r"Cannot pair storage path .*ssd.*0 of the XRT devices.*`xrt_devices=`"):
        pair_by_pcie([storage], ["0000:04:00.1", "0000:08:00.1"], sysfs=sysfs)


# ------------------------------------------------------------------------------------------------ checkpoints


def test_checkpoints_move_between_cpu_and_xrt(tmp_path, model_xclbin, backends) -> None:
    """Both backends save the same state format: a cpu checkpoint resumes on xrt and back, state for state."""
    from lightning_smartinf.devices.cpu import CpuBackend

    specs = [ShardSpec(0, CHUNK + 5, Adam(decoupled_weight_decay=True)), ShardSpec(1, 1000, SGD())]
    gen = torch.Generator().manual_seed(3)

    def train(backend, steps: range) -> None:
        for step in steps:
            for spec in specs:
                grad = torch.randn(spec.numel, generator=gen)
                hp = StepParams(step=step, lr=1e-2, weight_decay=0.1, momentum=0.9)
                backend.submit(spec.index, grad, hp, torch.empty(spec.numel))
            backend.wait()

    def masters(backend) -> list[torch.Tensor]:
        outs = [torch.empty(s.numel) for s in specs]
        for spec, out in zip(specs, outs):
            backend.read_master(spec.index, out)
        backend.wait()
        return outs

    cpu = CpuBackend([tmp_path / "cpu"], chunk_elems=CHUNK, buffer_count=2)
    try:
        cpu.open(specs)
        for spec in specs:
            cpu.initialize(spec.index, torch.randn(spec.numel, generator=gen))
        train(cpu, range(1, 3))
        cpu.save(tmp_path / "ckpt-cpu")
        on_cpu = masters(cpu)
    finally:
        cpu.close()
    xrt = _backend(backends, [tmp_path / "x0", tmp_path / "x1"], model_xclbin())
    xrt.open(specs)
    xrt.load(tmp_path / "ckpt-cpu")
    for got, want in zip(masters(xrt), on_cpu):
        assert torch.equal(got, want)
    train(xrt, range(3, 5))
    xrt.save(tmp_path / "ckpt-xrt")
    back = CpuBackend([tmp_path / "cpu2"], chunk_elems=CHUNK, buffer_count=2)
    try:
        back.open(specs)
        back.load(tmp_path / "ckpt-xrt")
        for got, want in zip(masters(back), masters(xrt)):
            assert torch.equal(got, want)
    finally:
        back.close()
