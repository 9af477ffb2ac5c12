"""``SmartUpdateSettings`` on its own: the shapes users write are checked, normalised and reported all at once, the
object is frozen, and the derived figures (pool memory, overlap, default bucket) come from it alone. Also the
placement of storage paths and XRT devices on ranks, which reads nothing but the settings."""

from __future__ import annotations

import ast
import dataclasses
import math
import re
import shutil
from pathlib import Path

import numpy as np
import psutil
import pytest

from lightning_smartinf.core.arguments import INT64_MAX, MIB, Problems
from lightning_smartinf.core.compression import TopKCompression
from lightning_smartinf.core.format.layout import POOL_TENSORS
from lightning_smartinf.core.placement import STATE_DIR, rank_device_dirs, rank_share
from lightning_smartinf.core.settings import SettingsError, SmartUpdateSettings

HEADER = re.compile(r"^`SmartUpdateSettings` got (\d+) invalid arguments?:$")


def refused(**kwargs) -> list[str]:
    """The problems ``SmartUpdateSettings(**kwargs)`` reports; the message lists the same lines under its header."""
    with pytest.raises(SettingsError) as info:
        SmartUpdateSettings(**kwargs)
    header, *lines = str(info.value).split("\n")
    match = HEADER.match(header)
    assert match and int(match.group(1)) == len(info.value.problems), header
    assert lines == [f"- {line}" for line in info.value.problems]
    assert isinstance(info.value, ValueError)
    return info.value.problems


def refused_once(match: str, **kwargs) -> str:
    """``kwargs`` are refused with exactly one problem, matching ``match``."""
    (line,) = refused(**kwargs)
    assert re.search(match, line), line
    return line


@pytest.fixture
def xclbin(tmp_path: Path) -> Path:
    """A file the xrt checks take for a device binary (they look at its name only, not at XRT)."""
    path = tmp_path / "smartinf.xclbin"
    path.write_bytes(b"xclbin")
    return path


# ------------------------------------------------------------------------------------------ defaults and shape


def test_defaults_are_the_strategy_defaults_and_the_object_is_frozen_and_keyword_only():
    settings = SmartUpdateSettings()
    assert dataclasses.asdict(settings) == {
        "backend": "cpu",
        "device": {},
        "storage_paths": None,
        "compression": None,
        "sub_group_size": 40_000_000,
        "chunk_size": 1 << 20,
        "buffer_count": 16,
        "io_engine": "auto",
        "io_block_size": 1 << 20,
        "io_queue_depth": 8,
        "io_threads": 3,
        "device_timeout_s": 300.0,
        "overlap_backward": True,
        "prefetch_state": True,
        "state_precision": "fp32",
        "split_masters": False,
        "gradient_buffer": "auto",
        "state_memory_budget": None,
        "device_weights": None,
        "state_accelerator_budget": None,
        "state_memory_share": "auto",
        "saved_state_from": None,
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.buffer_count = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        SmartUpdateSettings("cpu")  # type: ignore[misc]
    with pytest.raises(TypeError, match="offload_activations"):
        SmartUpdateSettings(offload_activations=True)  # type: ignore[call-arg]  # the strategy's, not the core's
    assert hash(settings) == hash(SmartUpdateSettings()) and settings == SmartUpdateSettings()


def test_every_field_has_an_attribute_docstring():
    source = Path(__import__("lightning_smartinf.core.settings", fromlist=["x"]).__file__).read_text()
    (cls,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "SmartUpdateSettings"]
    documented = {
        a.target.id
        for a, doc in zip(cls.body, cls.body[1:])
        if isinstance(a, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
    }
    assert documented == {f.name for f in dataclasses.fields(SmartUpdateSettings)}


def test_core_modules_import_neither_lightning_nor_deepspeed():
    for module in ("settings", "placement"):
        path = Path(__file__).resolve().parents[2] / "lightning_smartinf" / "core" / f"{module}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.split(".")[0] in ("lightning", "deepspeed")], (module, names)


# -------------------------------------------------------------------------------------------- normalisation


def test_raw_values_are_normalised(tmp_path: Path):
    (tmp_path / "b").mkdir()
    for given in (str(tmp_path), tmp_path, [tmp_path], (str(tmp_path),)):
        assert SmartUpdateSettings(storage_paths=given).storage_paths == (tmp_path.resolve(),)
    both = SmartUpdateSettings(storage_paths=[tmp_path / "b", tmp_path / "new"])
    assert both.storage_paths == ((tmp_path / "b").resolve(), (tmp_path / "new").resolve())
    assert not (tmp_path / "new").exists(), "checked only; each rank creates its own share"
    for given in (0.01, {"ratio": 0.01}, TopKCompression(0.01)):
        assert SmartUpdateSettings(compression=given).compression == TopKCompression(0.01)
    assert SmartUpdateSettings(compression=1).compression == TopKCompression(1)
    assert SmartUpdateSettings(compression={"ratio": 0.5, "error_feedback": False}).compression == TopKCompression(
        0.5, error_feedback=False
    )
    timeout = SmartUpdateSettings(device_timeout_s=5).device_timeout_s
    assert timeout == 5.0 and isinstance(timeout, float)
    assert SmartUpdateSettings(device_timeout_s=None).device_timeout_s is None


def test_xrt_settings_are_normalised(tmp_path: Path, xclbin: Path):
    (tmp_path / "a").mkdir()
    settings = SmartUpdateSettings(
        backend="xrt",
        device={"xclbin": str(xclbin), "xrt_devices": [0, "0000:3b:00.1"]},
        storage_paths=[tmp_path, tmp_path / "a"],
    )
    assert settings.option("xclbin") == xclbin and isinstance(settings.option("xclbin"), Path)
    assert settings.option("xrt_devices") == (0, "0000:3b:00.1")
    assert settings.replace() == settings, "normalised values pass the checks again unchanged"


# ---------------------------------------------------------------------------------------------- bad values

COUNTS = {"sub_group_size": 1, "buffer_count": 2, "io_queue_depth": 1, "io_threads": 1}


@pytest.mark.parametrize("name", list(COUNTS))
@pytest.mark.parametrize(
    ("value", "what"),
    [
        (True, "is a bool, not a count"),
        (None, "is not allowed"),
        (16.0, "is a float.*Pass the int"),
        (np.int64(16), "is an int64.*Pass the Python int"),
        ("16", "is a str.*without quotes"),
        ([4], "is a list"),
        (0, "is too small"),
        (10**30, "is too large"),
    ],
)
def test_counts_are_ints_in_range(name: str, value, what: str):
    line = refused_once(rf"^`{name}={re.escape(repr(value))}` {what}", **{name: value})
    assert f"must be an int >= {COUNTS[name]}" in line


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunk_size": 3000}, r"`chunk_size=3000` is not a multiple of 1024.*Pass `chunk_size=2048`"),
        ({"chunk_size": 1 << 70}, r"`chunk_size=1180591620717411303424` is too large"),
        ({"io_block_size": "1MiB"}, r"`io_block_size='1MiB'` is a str.*`io_block_size=1048576` for '1MiB'"),
        ({"io_block_size": 2 << 30}, r"`io_block_size=2147483648` is too large.*<= 2\*\*30"),
        ({"device_timeout_s": 0}, r"`device_timeout_s=0` is out of range: .*> 0"),
        ({"device_timeout_s": math.inf}, r"`device_timeout_s=inf` is not finite.*None waits forever"),
        ({"device_timeout_s": 10**400}, r"`device_timeout_s=1000.*` is out of range"),
        ({"device_timeout_s": "300"}, r"`device_timeout_s='300'` is a str.*`device_timeout_s=300.0`, without quotes"),
        ({"overlap_backward": 1}, r"`overlap_backward=1` is an int: it must be True or False"),
        ({"prefetch_state": None}, r"`prefetch_state=None` is not allowed: it must be True or False"),
        ({"backend": "gpu"}, r"`backend='gpu'` is not supported: it must be one of: 'cpu', 'remote', 'xrt'"),
        ({"io_engine": None}, r"`io_engine=None` is not supported: .*'auto', 'aio', 'threads'"),
        ({"gradient_buffer": "gpu"}, r"`gradient_buffer='gpu'` is not supported: .*'auto', 'accelerator', 'host'"),
        ({"device": {"xclbin": "k.xclbin"}}, r"`xclbin=...` applies to `backend='xrt'` only, but `backend='cpu'`"),
        ({"device": {"xrt_devices": 5}}, r"`backend='xrt'` only, but `backend='cpu'`"),
        ({"device": {"bogus": 1}}, r"`bogus=...`: no device kind takes it"),
        ({"device": "xrt"}, r"`device='xrt'` must be a mapping of the device kind's settings"),
        ({"backend": "xrt"}, r"^`backend='xrt'`: `xclbin=None`: `backend='xrt'` needs the device binary"),
        ({"compression": 0}, r"`compression=0` is out of range"),
        ({"compression": True}, r"`compression=True` is a bool"),
        ({"compression": "0.01"}, r"`compression='0.01'` is a str: it must be the kept ratio"),
        ({"compression": {"ratio": 0.1, "bogus": 1}}, r"`compression` has unknown key 'bogus'"),
        ({"compression": {"error_feedback": False}}, r"`compression` lacks the key 'ratio'"),
        ({"compression": {"ratio": 0.1, "layerwise": 1}}, r"`compression\['layerwise'\]=1` is an int"),
        ({"storage_paths": []}, r"`storage_paths=\[\]` is empty"),
        ({"storage_paths": 5}, r"`storage_paths=5` is an int: it must be a directory or a non-empty list"),
        ({"storage_paths": [""]}, r"`storage_paths\[0\]=''` is not a path"),
    ],
)
def test_bad_values_are_refused_with_the_fix(kwargs, match):
    refused_once(match, **kwargs)


def test_storage_paths_on_disk(tmp_path: Path, xclbin: Path):
    refused_once(
        r"`storage_paths` entry .*nope/ssd' does not exist and cannot", storage_paths=[tmp_path / "nope" / "ssd"]
    )
    refused_once(r"same directory; two devices cannot share", storage_paths=[tmp_path, tmp_path / "."])
    refused_once(r"`storage_paths` entry .*smartinf.xclbin' is not a directory", storage_paths=[xclbin])


def test_xrt_devices_pair_with_storage_paths(tmp_path: Path, xclbin: Path):
    (tmp_path / "a").mkdir()
    two = [tmp_path, tmp_path / "a"]
    refused_once(
        r"names 1 device\(s\) for 2 storage path\(s\)",
        backend="xrt",
        device={"xclbin": xclbin, "xrt_devices": [0]},
        storage_paths=two,
    )
    refused_once(
        r"names a device twice", backend="xrt", device={"xclbin": xclbin, "xrt_devices": [1, 1]}, storage_paths=two
    )
    refused_once(r"missing.xclbin.*does not exist", backend="xrt", device={"xclbin": tmp_path / "missing.xclbin"})


def test_every_problem_is_listed_in_one_error(tmp_path: Path):
    lines = refused(
        backend="fpga",
        storage_paths=[tmp_path, None],
        compression={"ratio": "0.01", "bogus": 1},
        chunk_size=1000,
        buffer_count=True,
        io_engine="spdk",
        io_block_size="4KiB",
        io_queue_depth=0,
        io_threads=None,
        device_timeout_s=-1,
        overlap_backward="yes",
        prefetch_state=0,
        device={"xclbin": "k.xclbin"},
    )
    starts = [
        "`backend='fpga'`",
        "`io_engine='spdk'`",
        "`chunk_size=1000`",
        "`buffer_count=True`",
        "`io_block_size='4KiB'`",
        "`io_queue_depth=0`",
        "`io_threads=None`",
        "`device_timeout_s=-1`",
        "`overlap_backward='yes'`",
        "`prefetch_state=0`",
        "`storage_paths[1]=None`",
        "`xclbin=...` applies",
        "`compression` has unknown key 'bogus'",
        "`compression['ratio']='0.01'`",
    ]
    assert [next(s for s in starts if line.startswith(s)) for line in lines] == starts


def test_collect_adds_the_same_lines_to_a_callers_problems():
    problems = Problems("SmartInfinityStrategy", RuntimeError)
    problems.flag("offload_parameters", "no")
    assert SmartUpdateSettings.collect(problems, buffer_count=1, io_threads=0) is None
    with pytest.raises(SettingsError) as info:
        SmartUpdateSettings(buffer_count=1, io_threads=0)
    assert problems.lines[1:] == info.value.problems and len(problems) == 3
    with pytest.raises(RuntimeError, match=r"^`SmartInfinityStrategy` got 3 invalid arguments:\n- `offload_param"):
        problems.raise_if_any()
    fine = Problems("SmartInfinityStrategy")
    assert SmartUpdateSettings.collect(fine, buffer_count=4, compression=0.1) == SmartUpdateSettings(
        buffer_count=4, compression=TopKCompression(0.1)
    )
    assert not fine


def test_replace_checks_again_and_leaves_the_original():
    settings = SmartUpdateSettings(chunk_size=4096, buffer_count=4)
    with pytest.raises(SettingsError, match=r"`buffer_count=1` is too small"):
        settings.replace(buffer_count=1)
    with pytest.raises(SettingsError, match=r"`compression=2` is out of range"):
        settings.replace(compression=2)
    compressed = settings.replace(compression=0.05)
    assert compressed.compression == TopKCompression(0.05) and compressed.chunk_size == 4096
    assert settings.compression is None and settings.buffer_count == 4


# ---------------------------------------------------------------------------------------------- host memory


def test_pools_larger_than_available_memory_are_refused_with_the_numbers(tmp_path: Path, xclbin: Path):
    chunk = 1 << 20
    per_buffer = chunk * 4 * POOL_TENSORS
    count = 2 * psutil.virtual_memory().available // per_buffer + 2
    line = refused_once(r"needs \d+ MiB of host memory .*, \d+ MiB available", buffer_count=count, chunk_size=chunk)
    assert line.startswith(f"`buffer_count={count}` with `chunk_size={chunk}` on 1 storage path(s) needs ")
    assert f"needs {count * per_buffer / MIB:.0f} MiB" in line
    assert line.endswith("Lower `buffer_count` (at least 2) or `chunk_size`.")
    (tmp_path / "b").mkdir()
    line = refused_once(r"on 2 storage path\(s\)", buffer_count=count, storage_paths=[tmp_path, tmp_path / "b"])
    assert f"needs {2 * count * per_buffer / MIB:.0f} MiB" in line
    # The xrt backend's buffers are in the SmartSSDs' DDR, not here.
    assert SmartUpdateSettings(backend="xrt", device={"xclbin": xclbin}, buffer_count=count).buffer_count == count
    # A huge count that is itself wrong is reported once, as a count.
    refused_once(r"`buffer_count=1000.*` is too large", buffer_count=10**30)


# ----------------------------------------------------------------------------------------- derived figures


def test_pool_bytes_is_the_pool_formula():
    settings = SmartUpdateSettings(chunk_size=4096, buffer_count=4)
    assert settings.pool_bytes(2) == 2 * 4 * 4096 * 4 * 3 == 393_216
    assert settings.pool_bytes(1, tensors_per_record=4) == 4 * 4096 * 4 * 4
    assert SmartUpdateSettings().pool_bytes(1) == 192 * MIB  # the documented default: 192 MiB per device for Adam


def test_overlap_and_the_default_bucket(xclbin: Path):
    assert SmartUpdateSettings().overlap
    assert not SmartUpdateSettings(overlap_backward=False).overlap
    assert not SmartUpdateSettings(compression=0.01).overlap, "compressed gradients are sent after backward"
    assert not SmartUpdateSettings(backend="xrt", device={"xclbin": xclbin}).overlap
    # With overlap, one sub-group per bucket, within 1M..200M elements; otherwise Lightning's 200M.
    for sub_group, bucket in ((1, 1 << 20), (3000, 1 << 20), (40_000_000, 40_000_000), (INT64_MAX, 200_000_000)):
        assert SmartUpdateSettings(sub_group_size=sub_group).default_reduce_bucket_size() == bucket
    assert SmartUpdateSettings(sub_group_size=3000, overlap_backward=False).default_reduce_bucket_size() == 200_000_000
    assert SmartUpdateSettings(sub_group_size=3000, compression=0.5).default_reduce_bucket_size() == 200_000_000


def test_kept_ratio_and_int32_indices():
    assert SmartUpdateSettings().kept_ratio is None
    assert SmartUpdateSettings(compression={"ratio": 0.25}).kept_ratio == 0.25
    refused_once(r"^`compression` with a ZeRO `sub_group_size` of 2147483648: .*int32 indices.*< 2\*\*31",
                 compression=0.01, sub_group_size=1 << 31)  # fmt: skip
    SmartUpdateSettings(compression=0.01, sub_group_size=(1 << 31) - 1)
    SmartUpdateSettings(sub_group_size=1 << 40)  # dense: any int64 size


# ------------------------------------------------------------------------------------------------ placement


def test_rank_share_takes_every_nth_item_from_the_local_rank():
    items = ["a", "b", "c", "d", "e"]
    assert rank_share(items, 0, 2) == ["a", "c", "e"] and rank_share(items, 1, 2) == ["b", "d"]
    assert rank_share(items, 0, 1) == items == rank_share(items, 0, 0), "no devices known yet: one rank"
    assert rank_share(("x",), 1, 2) == []
    assert rank_share((0, "0000:3b:00.1"), 1, 2) == ["0000:3b:00.1"]
    with pytest.raises(ValueError, match="local_rank=-1"):
        rank_share(items, -1, 2)


def test_rank_device_dirs_creates_this_ranks_share_named_by_global_rank(tmp_path: Path):
    storage = [tmp_path / f"nvme{i}" for i in range(4)]
    settings = SmartUpdateSettings(storage_paths=storage, chunk_size=4096)
    directories, owned = rank_device_dirs(settings, global_rank=3, local_rank=1, ranks_per_node=2)
    assert directories == [storage[i].resolve() / STATE_DIR / "rank003" for i in (1, 3)] and owned == []
    assert all(d.is_dir() and (d.stat().st_mode & 0o777) == 0o700 for d in directories)
    assert not storage[0].exists() and not storage[2].exists(), "local rank 0's paths are its own to create"
    with pytest.raises(ValueError, match=r"gives 4 path\(s\) to 8 ranks per node, so ranks would share"):
        rank_device_dirs(settings, global_rank=5, local_rank=5, ranks_per_node=8)


def test_rank_device_dirs_without_storage_paths_is_one_owned_temporary_directory():
    directories, owned = rank_device_dirs(SmartUpdateSettings(), global_rank=7, local_rank=0, ranks_per_node=1)
    try:
        assert directories == owned and len(owned) == 1
        assert owned[0].is_dir() and "rank7" in owned[0].name
    finally:
        shutil.rmtree(owned[0])
