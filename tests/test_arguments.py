"""Arguments of the strategy and the callbacks are checked at construction, by type and range, and every problem is
reported in one message: a header, then one ``- `` line per problem naming the argument, the value, what is allowed
and the fix."""

from __future__ import annotations

import json
import math
import re
from collections import namedtuple
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
import psutil
import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.core.arguments import INT64_MAX, MIB, Problems
from lightning_smartinf.core.compression import TopKCompression
from lightning_smartinf.core.format.layout import POOL_TENSORS, pool_bytes
from lightning_smartinf.lightning.activation_offload import ActivationOffload
from lightning_smartinf.lightning.callbacks import BufferPool, CompressionWarmup
from lightning_smartinf.lightning.monitor import TrainingMonitor

HEADER = re.compile(r"^`(\w+)` got (\d+) invalid arguments?:$")


def problems_of(info: pytest.ExceptionInfo) -> list[str]:
    """The problem lines of a raised message, after checking its header counts them."""
    header, *lines = str(info.value).split("\n")
    match = HEADER.match(header)
    assert match, header
    assert all(line.startswith("- ") for line in lines), lines
    assert int(match.group(2)) == len(lines)
    return [line[2:] for line in lines]


def refused(match: str, **kwargs) -> list[str]:
    """Construct the strategy with ``kwargs``; it must refuse them with one problem matching ``match``."""
    with pytest.raises(MisconfigurationException) as info:
        SmartInfinityStrategy(**kwargs)
    lines = problems_of(info)
    assert len(lines) == 1, lines
    assert re.search(match, lines[0]), lines[0]
    return lines


# --------------------------------------------------------------------------------------------- counts and sizes

COUNTS = {  # argument: (smallest valid value, bound of the problem line for a too-small value)
    "sub_group_size": (1, ">= 1"),
    "buffer_count": (2, ">= 2"),
    "io_queue_depth": (1, ">= 1"),
    "io_threads": (1, ">= 1"),
    "allgather_bucket_size": (1, ">= 1"),
    "loss_scale_window": (1, ">= 1"),
    "hysteresis": (1, ">= 1"),
}


@pytest.mark.parametrize("name", list(COUNTS))
@pytest.mark.parametrize(
    ("value", "what"),
    [
        (True, "is a bool, not a count"),
        (False, "is a bool, not a count"),
        (None, "is not allowed"),
        (16.0, "is a float.*Pass the int"),
        (np.int64(16), "is an int64.*Pass the Python int"),
        (2.5, "is a float"),
        ("16", "is a str.*Pass the int `\\w+=16`, without quotes"),
        ([4], "is a list"),
        (-1, "is too small"),
        (0, "is too small"),
        (10**30, "is too large"),
    ],
)
def test_counts_are_ints_in_range(name, value, what):
    _, bound = COUNTS[name]
    lines = refused(rf"^`{name}={re.escape(repr(value))}` {what}", **{name: value})
    assert f"must be an int {bound}" in lines[0]
    assert "Pass" in lines[0]  # the fix


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunk_size": 1000}, r"`chunk_size=1000` is too small: .*a multiple of 1024.*Pass `chunk_size=1024`"),
        ({"chunk_size": 3000}, r"`chunk_size=3000` is not a multiple of 1024.*Pass `chunk_size=2048`"),
        ({"chunk_size": 0}, r"`chunk_size=0` is too small"),
        ({"chunk_size": True}, r"`chunk_size=True` is a bool"),
        ({"chunk_size": 4096.0}, r"`chunk_size=4096.0` is a float.*`chunk_size=4096`"),
        ({"chunk_size": 3000.0}, r"`chunk_size=3000.0` is a float.*Pass e.g. `chunk_size=1048576`"),
        ({"buffer_count": "\u00b2"}, r"`buffer_count='\u00b2'` is a str.*Pass e.g. `buffer_count=16`"),
        ({"io_block_size": 100}, r"`io_block_size=100` is too small.*multiple of 4096"),
        ({"io_block_size": 6000}, r"`io_block_size=6000` is not a multiple of 4096"),
        ({"io_block_size": 2 << 30}, r"`io_block_size=2147483648` is too large.*<= 2\*\*30"),
        ({"io_queue_depth": 4096}, r"`io_queue_depth=4096` is too large.*<= 1024"),
        ({"io_threads": 10**6}, r"`io_threads=1000000` is too large"),
        ({"reduce_bucket_size": 0}, r"`reduce_bucket_size=0` is too small.*or None"),
        ({"reduce_bucket_size": 5e8}, r"`reduce_bucket_size=500000000.0` is a float.*`reduce_bucket_size=500000000`"),
        ({"initial_scale_power": 200}, r"`initial_scale_power=200` is too large.*<= 127"),
        ({"initial_scale_power": -1}, r"`initial_scale_power=-1` is too small"),
        ({"logging_batch_size_per_gpu": 0}, r"`logging_batch_size_per_gpu=0` is too small.*'auto'"),
        ({"logging_batch_size_per_gpu": "big"}, r"`logging_batch_size_per_gpu='big'` is a str"),
        ({"logging_level": "LOUD"}, r"`logging_level='LOUD'` is a str.*`logging` level"),
        ({"logging_level": 1.5}, r"`logging_level=1.5` is a float"),
    ],
)
def test_sizes_and_ranges(kwargs, match):
    refused(match, **kwargs)


@pytest.mark.parametrize(
    ("text", "bytes_"),
    [("1MiB", 1 << 20), ("4KiB", 4096), ("1GB", 10**9), ("8 kib", 8192), ("4096", 4096)],
)
def test_byte_counts_refuse_strings_and_say_which_int_to_write(text, bytes_):
    (line,) = refused(rf"`io_block_size={re.escape(repr(text))}` is a str", io_block_size=text)
    assert f"`io_block_size={bytes_}`" in line
    assert "units are not parsed" in line or text == "4096"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device_timeout_s": 0}, r"`device_timeout_s=0` is out of range: .*> 0"),
        ({"device_timeout_s": -5.0}, r"`device_timeout_s=-5.0` is out of range"),
        ({"device_timeout_s": True}, r"`device_timeout_s=True` is a bool, not a number"),
        ({"device_timeout_s": math.nan}, r"`device_timeout_s=nan` is not finite"),
        ({"device_timeout_s": math.inf}, r"`device_timeout_s=inf` is not finite.*None waits forever"),
        ({"device_timeout_s": "300"}, r"`device_timeout_s='300'` is a str.*`device_timeout_s=300.0`, without quotes"),
        ({"device_timeout_s": timedelta(seconds=5)}, r"`device_timeout_s=datetime.timedelta\(seconds=5\)` is a"),
        ({"loss_scale": -1}, r"`loss_scale=-1` is out of range"),
        ({"loss_scale": "dynamic"}, r"`loss_scale='dynamic'` is a str"),
        ({"loss_scale": 1e300}, r"`loss_scale=1e\+300` is out of range.*<= 2\*\*127"),
        ({"min_loss_scale": 0}, r"`min_loss_scale=0` is out of range.*> 0"),
        ({"device_timeout_s": 10**400}, r"`device_timeout_s=1000.*` is out of range"),
        ({"loss_scale": "nan"}, r"`loss_scale='nan'` is a str: .*Pass e.g. `loss_scale=0`"),
    ],
)
def test_numbers_are_finite_and_in_range(kwargs, match):
    refused(match, **kwargs)


@pytest.mark.parametrize("name", ["overlap_backward", "prefetch_state", "contiguous_gradients", "overlap_comm"])
@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_flags_are_true_or_false(name, value):
    refused(rf"`{name}={re.escape(repr(value))}` .*: it must be True or False. Pass `{name}=True`", **{name: value})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "gpu"}, r"`backend='gpu'` is not supported: it must be one of: 'cpu', 'remote', 'xrt'"),
        ({"backend": None}, r"`backend=None` is not supported"),
        ({"io_engine": "spdk"}, r"`io_engine='spdk'` is not supported: .*'auto', 'aio', 'threads'"),
        ({"io_engine": ["aio"]}, r"`io_engine=\['aio'\]` is not supported"),
        ({"accelerator": "cpu"}, r"`accelerator='cpu'` is a str: it must be an `Accelerator`.*Trainer"),
        ({"timeout": 30}, r"`timeout=30` is an int: it must be a `datetime.timedelta`"),
        ({"timeout": timedelta(seconds=-5)}, r"`timeout=datetime.timedelta\(days=-1, .*\)` is not a wait: it must"),
        ({"timeout": timedelta(0)}, r"`timeout=datetime.timedelta\(0\)` is not a wait"),
        ({"state_memory_budget": "99999999999999GiB"}, r"`state_memory_budget='99999999999999GiB'` is too large"),
        ({"process_group_backend": 1}, r"`process_group_backend=1` is an int"),
        ({"parallel_devices": "cpu"}, r"`parallel_devices='cpu'` is a str"),
        ({"cluster_environment": "slurm"}, r"`cluster_environment='slurm'` is a str"),
        ({"precision_plugin": "bf16-mixed"}, r"`precision_plugin='bf16-mixed'` is a str.*SmartInfinityPrecision"),
        ({"xclbin": "kernels.xclbin"}, r"`backend='xrt'` only, but `backend='cpu'`"),
    ],
)
def test_choices_and_objects(kwargs, match):
    refused(match, **kwargs)


def test_storage_paths_shapes(tmp_path):
    refused(r"`storage_paths=\[\]` is empty", storage_paths=[])
    refused(r"`storage_paths=5` is an int: it must be a directory or a non-empty list", storage_paths=5)
    refused(r"`storage_paths\[1\]=None` is not a path", storage_paths=[tmp_path, None])
    refused(r"`storage_paths\[0\]=''` is not a path", storage_paths=[""])
    refused(r"`storage_paths` entry .*nope/ssd' does not exist and cannot", storage_paths=[tmp_path / "nope" / "ssd"])
    refused(r"same directory", storage_paths=[tmp_path, tmp_path / "."])


# ----------------------------------------------------------------------------------------------------- dicts


@pytest.mark.parametrize(
    ("compression", "match"),
    [
        ({"ratio": "0.01"}, r"`compression\['ratio'\]='0.01'` is a str: .*0 < ratio <= 1.*without quotes"),
        ({"ratio": True}, r"`compression\['ratio'\]=True` is a bool"),
        ({"ratio": 0}, r"`compression\['ratio'\]=0` is out of range"),
        ({"ratio": math.nan}, r"`compression\['ratio'\]=nan` is not finite"),
        ({"ratio": 0.1, "error_feedback": 1}, r"`compression\['error_feedback'\]=1` is an int: it must be True or"),
        ({"ratio": 0.1, "layerwise": None}, r"`compression\['layerwise'\]=None` is not allowed"),
        ({"ratio": 0.1, "feedback": True}, r"`compression` has unknown key 'feedback': the allowed keys are 'ratio'"),
        ({"error_feedback": True}, r"`compression` lacks the key 'ratio'"),
        ({1: 0.1, "ratio": 0.1}, r"`compression` has unknown key 1"),
        (True, r"`compression=True` is a bool"),
        ("0.01", r"`compression='0.01'` is a str: it must be the kept ratio"),
        ([0.01], r"`compression=\[0.01\]` is a list"),
        (2, r"`compression=2` is out of range"),
    ],
)
def test_compression_keys_and_values(compression, match):
    refused(match, compression=compression)


def test_offload_activations_keys_and_values(tmp_path):
    refused(
        r"`offload_activations` has unknown key 'bogus': the allowed keys are 'storage_paths', 'threshold_bytes'",
        offload_activations={"bogus": 1},
    )
    refused(r"`offload_activations='yes'` is a str: it must be True, False, or a dict", offload_activations="yes")
    refused(r"`offload_activations=1` is an int", offload_activations=1)
    with pytest.raises(MisconfigurationException) as info:
        SmartInfinityStrategy(
            offload_activations={"threshold_bytes": "1MiB", "io_threads": 0, "storage_paths": [None], "log_stats": 1}
        )
    lines = problems_of(info)
    assert len(lines) == 4
    assert any("`offload_activations['threshold_bytes']=1048576`" in line for line in lines)
    assert any(line.startswith("`offload_activations['io_threads']=0` is too small") for line in lines)
    assert any(line.startswith("`offload_activations['storage_paths'][0]=None` is not a path") for line in lines)
    assert any(line.startswith("`offload_activations['log_stats']=1` is an int") for line in lines)


# ---------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ([], r"`config=\[\]` is a list: it must be a DeepSpeed config dict, the path of a JSON file, or None"),
        (42, r"`config=42` is an int"),
        (b"{}", r"`config=b'{}'` is a bytes"),
        ({"zero_optimization": None}, r"`config\['zero_optimization'\]=None` is not allowed: it must be a dict"),
        ({"zero_optimization": []}, r"`config\['zero_optimization'\]=\[\]` is a list"),
        ({"zero_optimization": {"stage": 2}}, r"`config\['zero_optimization'\]\['stage'\]=2` is not supported"),
        ({"zero_optimization": {"stage": "3"}}, r"\['stage'\]='3'` is not supported: .*stage 3"),
        ({"zero_optimization": {"stage": True}}, r"\['stage'\]=True` is not supported"),
        ({"zero_optimization": {"offload_optimizer": []}}, r"\['offload_optimizer'\]=\[\]` is a list: .*or None"),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, r"\['device'\]='cpu'`.*storage_paths"),
        ({"zero_optimization": {"offload_param": "cpu"}}, r"\['offload_param'\]='cpu'` is a str"),
        (
            {"zero_optimization": {"offload_param": {"device": "nvme"}}},
            r"\['device'\]='nvme'`: pass `offload_parameters=",
        ),
        ({"zero_optimization": {"offload_param": {"device": "gpu"}}}, r"one of: 'none', 'cpu'"),
        ({"zero_optimization": {"sub_group_size": "auto"}}, r"\['sub_group_size'\]='auto'` is a str"),
        ({"zero_optimization": {"reduce_bucket_size": 0}}, r"\['reduce_bucket_size'\]=0` is too small"),
        ({"zero_optimization": {"allgather_bucket_size": 10**30}}, r"\['allgather_bucket_size'\]=1000.*too large"),
        ({"zero_optimization": {"overlap_comm": "true"}}, r"\['overlap_comm'\]='true'` is a str: .*True or False"),
        ({"fp16": True}, r"`config\['fp16'\]=True` is a bool: it must be a dict"),
        ({"bf16": None}, r"`config\['bf16'\]=None` is not allowed: it must be a dict"),
        ({"train_micro_batch_size_per_gpu": 0}, r"`config\['train_micro_batch_size_per_gpu'\]=0` is too small"),
        ({"gradient_clipping": float("nan")}, r"`config\['gradient_clipping'\]=nan` is not finite"),
        ({"gradient_clipping": -1.0}, r"`config\['gradient_clipping'\]=-1.0` is out of range"),
        ({"gradient_accumulation_steps": 4}, r"accumulate_grad_batches"),
        ({"optimizer": {"type": "Adam"}}, r"`config\['optimizer'\]`.*configure_optimizers"),
        ({"tags": {1, 2}}, r"`config` holds a value JSON cannot represent"),
    ],
)
def test_config_shapes(config, match):
    refused(match, config=config)


def test_config_files(tmp_path, monkeypatch):
    refused(r"`config='.*missing.json'` does not exist", config=str(tmp_path / "missing.json"))
    refused(r"`config='.*'` is a directory", config=tmp_path)
    (tmp_path / "bad.json").write_text('{"zero_optimization": {"stage": 3,}}')
    refused(r"`config='.*bad.json'` is not valid JSON \(.* at line 1, column \d+\)", config=tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    refused(r"`config='.*list.json'` holds a JSON list, not an object", config=str(tmp_path / "list.json"))
    (tmp_path / "stage2.json").write_text('{"zero_optimization": {"stage": 2}}')
    refused(r"\['stage'\]=2` is not supported", config=str(tmp_path / "stage2.json"))
    # With config=None, Lightning's environment variable names the file.
    monkeypatch.setenv(SmartInfinityStrategy.DEEPSPEED_ENV_VAR, str(tmp_path / "gone.json"))
    refused(r"`PL_DEEPSPEED_CONFIG_PATH='.*gone.json'` does not exist")
    (tmp_path / "good.json").write_text(json.dumps({"zero_optimization": {"sub_group_size": 5e6}}))
    monkeypatch.setenv(SmartInfinityStrategy.DEEPSPEED_ENV_VAR, str(tmp_path / "good.json"))
    assert SmartInfinityStrategy().config["zero_optimization"]["sub_group_size"] == 5e6


def test_compression_needs_sub_groups_int32_can_address():
    refused(r"int32 indices.*< 2\*\*31", compression=0.01, sub_group_size=1 << 31)
    refused(r"int32 indices", compression=0.01, config={"zero_optimization": {"sub_group_size": 4e9}})
    SmartInfinityStrategy(compression=0.01, sub_group_size=(1 << 31) - 1)
    SmartInfinityStrategy(sub_group_size=1 << 40)  # dense: any int64 size


# ------------------------------------------------------------------------------------------- memory of the pools


def test_pools_larger_than_available_memory_are_refused_with_the_numbers(tmp_path):
    chunk = 1 << 20
    per_buffer = chunk * 4 * POOL_TENSORS
    available = psutil.virtual_memory().available
    count = 2 * available // per_buffer + 2  # twice what is available: robust to memory freed meanwhile
    (line,) = refused(r"needs \d+ MiB of host memory .*, \d+ MiB available", buffer_count=count, chunk_size=chunk)
    assert line.startswith(f"`buffer_count={count}` with `chunk_size={chunk}` on 1 storage path(s) needs ")
    assert f"needs {count * per_buffer / MIB:.0f} MiB" in line
    shown = int(re.search(r"(\d+) MiB available", line).group(1))
    assert 0.5 * available / MIB <= shown <= 1.5 * available / MIB
    assert line.endswith("Lower `buffer_count` (at least 2) or `chunk_size`.")

    # Each storage path is a device with a pool of its own: half the count on two paths needs as much.
    paths = [tmp_path / "a", tmp_path / "b"]
    for path in paths:
        path.mkdir()
    (line,) = refused(r"on 2 storage path\(s\) needs", storage_paths=paths, buffer_count=count // 2 + 1)
    assert f"needs {pool_bytes(2, count // 2 + 1, chunk) / MIB:.0f} MiB" in line


def test_memory_check_uses_what_is_available(monkeypatch):
    memory = namedtuple("memory", "available")
    monkeypatch.setattr("lightning_smartinf.core.arguments.psutil.virtual_memory", lambda: memory(100 * MIB))
    # Defaults: 1 path x 16 buffers x 1 Mi elements x 12 B = 192 MiB.
    refused(r"`buffer_count=16` with `chunk_size=1048576` on 1 storage path\(s\) needs 192 MiB .*, 100 MiB available")
    assert SmartInfinityStrategy(buffer_count=8).settings.buffer_count == 8  # 96 MiB fits
    refused(r"`chunk_size=2097152`.*needs 192 MiB", buffer_count=8, chunk_size=2 << 20)
    refused(r"`chunk_size=1152921504606846976`.*needs \d+ MiB", chunk_size=1 << 60)
    with pytest.raises(MisconfigurationException, match=r"`memory_budget=209715200` needs 200 MiB"):
        BufferPool(memory_budget=200 * MIB)
    with pytest.raises(MisconfigurationException, match=r"`buffer_count=9` with `chunk_size=1048576` needs 108 MiB"):
        BufferPool(buffer_count=9, chunk_size=1 << 20)
    BufferPool(memory_budget=50 * MIB)


# ------------------------------------------------------------------------------------------- all at once


def test_every_problem_is_listed_in_one_message(tmp_path):
    with pytest.raises(MisconfigurationException) as info:
        SmartInfinityStrategy(
            backend="fpga",
            buffer_count=True,
            chunk_size=1000,
            io_block_size="4KiB",
            io_threads=0,
            device_timeout_s=-1,
            overlap_backward="yes",
            storage_paths=[tmp_path, None],
            compression={"ratio": "0.01", "bogus": 1},
            offload_activations={"bogus": 1},
            config={"zero_optimization": {"stage": 2, "offload_optimizer": None}, "optimizer": {}},
        )
    assert str(info.value).startswith("`SmartInfinityStrategy` got 13 invalid arguments:\n- ")
    lines = problems_of(info)
    for start in (
        "`backend='fpga'`",
        "`buffer_count=True`",
        "`chunk_size=1000`",
        "`io_block_size='4KiB'`",
        "`io_threads=0`",
        "`device_timeout_s=-1`",
        "`overlap_backward='yes'`",
        "`storage_paths[1]=None`",
        "`compression` has unknown key 'bogus'",
        "`compression['ratio']='0.01'`",
        "`offload_activations` has unknown key 'bogus'",
        "`config['zero_optimization']['stage']=2`",
        "`config['optimizer']`",
    ):
        assert sum(line.startswith(start) for line in lines) == 1, (start, lines)
    # The contradictions of the DeepSpeed config come in the same message.
    with pytest.raises(MisconfigurationException) as info:
        SmartInfinityStrategy(sub_group_size=0, config={"zero_optimization": {"stage": 1}, "optimizer": {}})
    assert [line.split("`")[1] for line in problems_of(info)] == [
        "sub_group_size=0",
        "config['zero_optimization']['stage']=1",
        "config['optimizer']",
    ]


# ------------------------------------------------------------------------------------------- what is accepted


@pytest.mark.parametrize(
    "kwargs",
    [
        {"buffer_count": 2, "chunk_size": 1024},
        {"sub_group_size": 1},
        {"sub_group_size": INT64_MAX},
        {"sub_group_size": 1_000_000_000_000},  # Lightning's DeepSpeedStrategy default
        {"io_block_size": 4096, "io_queue_depth": 1, "io_threads": 1},
        {"io_block_size": 1 << 30, "io_queue_depth": 1024, "io_threads": 1024},
        {"device_timeout_s": None},
        {"device_timeout_s": 0.001},
        {"device_timeout_s": 86400},
        {"compression": 1},
        {"compression": 1e-6},
        {"compression": {"ratio": 0.05, "error_feedback": False, "layerwise": False}},
        {"compression": TopKCompression(0.01)},
        {"reduce_bucket_size": None},
        {"reduce_bucket_size": 1},
        {"logging_batch_size_per_gpu": 4},
        {"logging_level": "INFO"},
        {"logging_level": 0},
        {"loss_scale": 0, "initial_scale_power": 0, "min_loss_scale": 1e-4},
        {"loss_scale": 128.0, "initial_scale_power": 127},
        {"offload_activations": True},
        {"offload_activations": {}},
        {"offload_activations": {"threshold_bytes": 0, "keep_last": 0, "io_threads": 1, "log_stats": False}},
        {"timeout": timedelta(minutes=5), "process_group_backend": "gloo", "parallel_devices": None},
        {"config": {}},
        {"config": {"zero_optimization": {"offload_optimizer": None, "offload_param": None}}},
        {"config": {"zero_optimization": {"offload_optimizer": {"device": None}, "offload_param": {"device": "cpu"}}}},
        {"config": {"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "sub_group_size": 1e9}}},
        {"config": {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": False}}},
    ],
)
def test_valid_edge_values_are_accepted(kwargs):
    strategy = SmartInfinityStrategy(**kwargs)
    for name in ("buffer_count", "chunk_size", "io_block_size", "io_queue_depth", "io_threads"):
        if name in kwargs:
            assert getattr(strategy.settings, name) == kwargs[name]


def test_device_timeout_s_is_stored_as_seconds():
    assert SmartInfinityStrategy().settings.device_timeout_s == 300.0
    assert SmartInfinityStrategy(device_timeout_s=None).settings.device_timeout_s is None
    strategy = SmartInfinityStrategy(device_timeout_s=5)
    assert strategy.settings.device_timeout_s == 5.0 and isinstance(strategy.settings.device_timeout_s, float)


def test_storage_paths_as_one_string_or_path(tmp_path):
    assert SmartInfinityStrategy(storage_paths=str(tmp_path)).settings.storage_paths == (tmp_path.resolve(),)
    assert SmartInfinityStrategy(storage_paths=tmp_path).settings.storage_paths == (tmp_path.resolve(),)
    assert SmartInfinityStrategy(storage_paths=(tmp_path,)).settings.storage_paths == (tmp_path.resolve(),)


def test_config_file_and_presets(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 5e8}}))
    assert SmartInfinityStrategy(config=tmp_path / "ds.json").config["zero_optimization"]["stage"] == 3
    for name in ("smart_infinity", "smart_infinity_comp"):
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
        assert isinstance(trainer.strategy, SmartInfinityStrategy)


# ------------------------------------------------------------------------------------------------- callbacks


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunk_size": True}, r"`chunk_size=True` is a bool"),
        ({"chunk_size": 4096.0}, r"`chunk_size=4096.0` is a float"),
        ({"chunk_size": 1 << 70}, r"`chunk_size=1180591620717411303424` is too large"),
        ({"buffer_count": "8"}, r"`buffer_count='8'` is a str.*`buffer_count=8`"),
        ({"buffer_count": 1}, r"`buffer_count=1` is too small.*>= 2"),
        ({"memory_budget": "4GiB"}, r"`memory_budget='4GiB'` is a str.*`memory_budget=4294967296`"),
        ({"memory_budget": 0}, r"`memory_budget=0` is too small"),
        ({"memory_budget": 1.5e9}, r"`memory_budget=1500000000.0` is a float"),
        ({"memory_budget": 10**30}, r"`memory_budget=1000.*is too large"),
        ({"buffer_count": 4, "memory_budget": 1 << 30}, r"both given: give one of them"),
    ],
)
def test_buffer_pool_arguments(kwargs, match):
    with pytest.raises(MisconfigurationException, match=match) as info:
        BufferPool(**kwargs)
    assert len(problems_of(info)) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dense_steps": -1}, r"`dense_steps=-1` is too small"),
        ({"dense_steps": True}, r"`dense_steps=True` is a bool"),
        ({"dense_steps": 2.0}, r"`dense_steps=2.0` is a float.*`dense_steps=2`"),
        ({"dense_steps": None}, r"`dense_steps=None` is not allowed"),
        ({"dense_steps": 10**30}, r"is too large"),
        ({"steps_per_stage": 0}, r"`steps_per_stage=0` is too small.*>= 1"),
        ({"steps_per_stage": "2"}, r"`steps_per_stage='2'` is a str"),
        ({"schedule": "fast"}, r"`schedule='fast'` is not supported: it must be 'dgc', a list of kept ratios"),
        ({"schedule": 0.5}, r"`schedule=0.5` is not supported"),
        ({"schedule": [0.5, 2.0]}, r"`schedule\[1\]=2.0` is out of range: .*0 < ratio <= 1"),
        ({"schedule": ["0.5"]}, r"`schedule\[0\]='0.5'` is a str"),
        ({"schedule": [True]}, r"`schedule\[0\]=True` is a bool"),
    ],
)
def test_compression_warmup_arguments(kwargs, match):
    with pytest.raises(MisconfigurationException, match=match) as info:
        CompressionWarmup(**kwargs)
    assert len(problems_of(info)) == 1


def test_callbacks_list_every_problem():
    with pytest.raises(MisconfigurationException) as info:
        CompressionWarmup(dense_steps=-1, schedule=[0.5, 0, "x"], steps_per_stage=0)
    assert len(problems_of(info)) == 4
    with pytest.raises(MisconfigurationException) as info:
        BufferPool(chunk_size=1000, buffer_count=1)
    assert len(problems_of(info)) == 2
    with pytest.raises(ValueError) as info:
        ActivationOffload(threshold_bytes=-1, keep_last="auto", max_inflight_bytes="64MiB", io_threads=0, log_stats=1)
    assert len(problems_of(info)) == 5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"token_key": None}, r"`token_key=None` is not a key name: it must be a non-empty str"),
        ({"token_key": ""}, r"`token_key=''` is not a key name"),
        ({"token_key": 3}, r"`token_key=3` is not a key name"),
        ({"progress_bar": 1}, r"`progress_bar=1` is an int: it must be True or False"),
        ({"progress_bar": "no"}, r"`progress_bar='no'` is a str"),
    ],
)
def test_training_monitor_arguments(kwargs, match):
    with pytest.raises(MisconfigurationException, match=match):
        TrainingMonitor(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"threshold_bytes": -1}, r"`threshold_bytes=-1` is too small"),
        ({"threshold_bytes": True}, r"`threshold_bytes=True` is a bool, not a number of bytes"),
        ({"threshold_bytes": "1MiB"}, r"`threshold_bytes='1MiB'` is a str.*`threshold_bytes=1048576`"),
        ({"max_inflight_bytes": 0}, r"`max_inflight_bytes=0` is too small.*>= 1"),
        ({"max_inflight_bytes": 10**30}, r"is too large"),
        ({"keep_last": 1.0}, r"`keep_last=1.0` is a float"),
        ({"io_threads": None}, r"`io_threads=None` is not allowed"),
        ({"io_threads": 4096}, r"`io_threads=4096` is too large"),
        ({"log_stats": "yes"}, r"`log_stats='yes'` is a str: it must be True or False"),
        ({"storage_paths": []}, r"`storage_paths=\[\]` is empty"),
        ({"storage_paths": [1]}, r"`storage_paths\[0\]=1` is not a path"),
    ],
)
def test_activation_offload_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ActivationOffload(**kwargs)


def test_valid_callback_arguments(tmp_path):
    BufferPool()
    BufferPool(chunk_size=1024, buffer_count=2)
    BufferPool(memory_budget=1)
    CompressionWarmup(dense_steps=0, schedule="dgc", steps_per_stage=1)
    CompressionWarmup(schedule=(1.0, 0.5), steps_per_stage=10**6)
    CompressionWarmup(schedule=[])
    TrainingMonitor(token_key="tokens", progress_bar=False)
    ActivationOffload(storage_paths=tmp_path, threshold_bytes=0, keep_last=0, max_inflight_bytes=1, io_threads=1)
    ActivationOffload(storage_paths=[str(tmp_path)], log_stats=False)


def test_save_pretrained_arguments(tmp_path):
    from lightning_smartinf.hf import SavePretrained  # transformers: installed with the test extras

    (tmp_path / "file").write_text("x")
    with pytest.raises(MisconfigurationException, match=r"`dirpath='.*file'` is a file, not a directory"):
        SavePretrained(str(tmp_path / "file"))
    for bad, match in ((None, r"`dirpath=None` is not a path"), ("", r"`dirpath=''`"), (3, r"`dirpath=3`")):
        with pytest.raises(MisconfigurationException, match=match):
            SavePretrained(bad)
    assert SavePretrained(str(tmp_path / "new")).dirpath == str(tmp_path / "new")
    SavePretrained(tmp_path)
    SavePretrained(tmp_path, dtype="bfloat16", max_shard_size="2GiB")
    with pytest.raises(MisconfigurationException, match=r"2 invalid arguments:\n- `dtype='int8'` is not a dtype .*"
                       r"'bf16'.*\n- `max_shard_size='5 parsecs'` is not a size"):  # fmt: skip
        SavePretrained(tmp_path, dtype="int8", max_shard_size="5 parsecs")

    class OwnSaver:  # a module of the user's own with `save_pretrained(out_dir)`: checked before training
        def save_pretrained(self, out_dir: str) -> None: ...

    SavePretrained(tmp_path).setup(None, OwnSaver(), "fit")  # it writes as it does
    with pytest.raises(MisconfigurationException, match=r"`OwnSaver.save_pretrained` takes no `dtype`.*Add them"):
        SavePretrained(tmp_path, dtype="bf16").setup(None, OwnSaver(), "fit")
    with pytest.raises(MisconfigurationException, match=r"needs a module with `save_pretrained\(out_dir, \*, dtype"):
        SavePretrained(tmp_path).setup(None, object(), "fit")


# ------------------------------------------------------------------------------------------------ Problems


def test_problems_collects_and_names_dict_keys():
    problems = Problems("Thing", TypeError)
    assert problems.integer("n", 3, low=1) and problems.flag("f", False) and not problems
    problems.within("opts").integer("depth", 0, low=1, example=4)
    problems.within("opts").within("inner").flag("on", "x")
    with pytest.raises(TypeError) as info:
        problems.raise_if_any()
    assert problems_of(info) == [
        "`opts['depth']=0` is too small: it must be an int >= 1. Pass `opts['depth']=1` or more.",
        "`opts['inner']['on']='x'` is a str: it must be True or False. Pass `opts['inner']['on']=True` or "
        "`opts['inner']['on']=False`.",
    ]
    assert str(info.value).startswith("`Thing` got 2 invalid arguments:")


def test_argument_module_is_lightning_free():
    import subprocess
    import sys

    # Importing the package loads Lightning; the module on its own must not need it (nor torch).
    spec = Path(__file__).resolve().parents[1] / "lightning_smartinf" / "core" / "arguments.py"
    code = (
        "import importlib.util, sys; "
        f"s = importlib.util.spec_from_file_location('arguments', {str(spec)!r}); "
        "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
        "sys.exit('lightning' in sys.modules or 'torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
