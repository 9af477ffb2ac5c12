"""The weight files of a ``save_pretrained`` directory, written one at a time, in the dtype asked for.

The layout is transformers' own: ``model.safetensors`` when the weights fit one file of ``max_shard_size``, else
``model-00001-of-0000N.safetensors`` ... with ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes,
"total_parameters": count}, "weight_map": {name: file}}``). Tensors go into files in order, a file closed when the
next tensor would take it past ``max_shard_size`` (a larger tensor gets a file of its own): huggingface_hub's
``split_state_dict_into_shards_factory``, the split transformers' ``save_pretrained`` makes.

Each file's tensors are read (fp32), cast, written and dropped before the next file's are read, so memory holds one
file's worth and one parameter in fp32, never the model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_smartinf.core.arguments import Problems
from lightning_smartinf.core.format.safetensors_stream import safetensors_blocks
from lightning_smartinf.core.io.leftovers import remove_leftovers, temporary_path
from lightning_smartinf.core.io.storage import (
    disk_full_error,
    free_bytes,
    fsync_dir,
    fsync_file,
    is_disk_full,
    write_file_atomic,
)
from lightning_smartinf.core.progress import Progress

#: Room a save counts beyond its tensors' bytes (safetensors headers, config, index).
HEADROOM = 1 << 20

#: The largest weight file by default, as transformers 4 wrote them (transformers 5 writes up to 50GB).
MAX_SHARD_SIZE = "5GB"
#: The dtypes written, by the names they are given as.
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: The name of each file of a sharded save: ``model-00001-of-00003.safetensors``.
SHARD_PATTERN = "model{suffix}.safetensors"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def export_dtype(value: Any, argument: str = "dtype") -> torch.dtype:
    """The dtype ``value`` names: ``"bf16"``/``"bfloat16"``/``torch.bfloat16``, the same for fp16 and fp32.

    Raises:
        ValueError: ``value`` is none of them; the message names ``argument``.
    """
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value.strip().lower().removeprefix("torch.") in DTYPES:
        return DTYPES[value.strip().lower().removeprefix("torch.")]
    raise ValueError(
        f"`{argument}={value!r}` is not a dtype the weights can be written in. Give 'bf16' ('bfloat16', "
        "torch.bfloat16), 'fp16' ('float16', torch.float16) or 'fp32' ('float32', torch.float32)."
    )


def dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``: the name config.json gives a dtype."""
    return str(dtype).removeprefix("torch.")


def config_dtype(config: Any) -> torch.dtype:
    """The dtype the model was saved in, as its config says (``dtype``, or ``torch_dtype`` before transformers 5);
    fp32 when it says none.

    Raises:
        ValueError: the config names a dtype the weights cannot be written in (``float64``).
    """
    fields = config.to_dict()
    value = fields.get("dtype") or fields.get("torch_dtype")
    if value is None:
        return torch.float32
    try:
        return export_dtype(value)
    except ValueError:
        raise ValueError(
            f"The model's config says `dtype={value!r}`, which the weights cannot be written in. Give `dtype` "
            "(`--dtype`): 'bf16', 'fp16' or 'fp32'."
        ) from None


def shard_bytes(value: Any, argument: str = "max_shard_size") -> int:
    """The bytes ``value`` stands for: an int, or a string of a number and a unit (``"500MB"``, ``"2GiB"``,
    ``"1000000"``) as :meth:`~lightning_smartinf.core.arguments.Problems.size` reads it: KB, MB, GB, TB count in
    powers of 1000, KiB, MiB, GiB, TiB in powers of 1024.

    Raises:
        ValueError: ``value`` is not a size of at least one byte; the message is the one line of a ``Problems``
            naming ``argument``, so that callers collecting problems (``SavePretrained``) list it as their own.
    """
    problems = Problems(argument)  # one value: one line at most, raised without the header
    size = problems.size(argument, value, low=1, example=MAX_SHARD_SIZE, optional=False)
    if size is None:
        raise ValueError(problems.lines[0])
    return size


@dataclass(frozen=True)
class WrittenWeights:
    """What :func:`write_weight_files` wrote."""

    #: The weight files, in order (one: ``model.safetensors``).
    files: list[str]
    #: The file each tensor is in.
    weight_map: dict[str, str]
    #: Bytes of tensor data.
    total_size: int
    #: Elements of the model's parameters (tied ones once).
    parameters: int
    dtype: torch.dtype


def write_weight_files(
    out_dir: str | os.PathLike,
    tensors: Mapping[str, Tensor],
    read: Callable[[Sequence[str]], Iterator[tuple[str, Tensor]]],
    *,
    max_bytes: int,
    parameters: int,
    dtype: torch.dtype,
    convert: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None,
    write: bool = True,
) -> WrittenWeights:
    """Write the weights named by ``tensors`` into ``out_dir`` as transformers lays them out, a file at a time.

    Args:
        out_dir: the directory (created). Weight files of an earlier save there that this one does not write
            (``model.safetensors``, the index, ``model-*-of-*.safetensors``) are removed, so none is left over.
        tensors: the tensors to write, by name, in order: their shapes and dtypes (meta tensors will do).
        read: yields ``(name, tensor)`` for each name asked for; each is cast to its dtype in ``tensors``.
        max_bytes: the largest file (a tensor larger than that gets a file of its own).
        parameters: the model's parameter count, for the index.
        dtype: the dtype written, for the record.
        convert: renames (and splits) a file's tensors as they are saved (transformers' ``revert_weight_conversion``).
        write: ``False`` reads everything (collectives on every rank) but writes nothing.
    """
    from huggingface_hub import split_state_dict_into_shards_factory

    sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in tensors.items()}
    split = split_state_dict_into_shards_factory(
        sizes, get_storage_size=int, filename_pattern=SHARD_PATTERN, max_shard_size=max_bytes
    )
    out = Path(out_dir)
    total = int(split.metadata["total_size"])
    what = f"the exported weights ({len(split.filename_to_tensors)} safetensors file(s))"
    fix = "Free space there, or export to another directory."
    stage = temporary_path(out / "weights")
    if write:
        require_room(out, what, total, fix)  # an earlier export there stays until this one is whole
        out.mkdir(parents=True, exist_ok=True)
        remove_leftovers(out, "weights")  # left by an export that was killed
        stage.mkdir(mode=0o700)
    weight_map: dict[str, str] = {}
    progress = Progress(f"writing the weights to {out}", total) if write else None
    try:
        for file, names in split.filename_to_tensors.items():
            shard: dict[str, Tensor] = {}
            for name, value in read(names):
                shard[name] = value.to(tensors[name].dtype).contiguous()
                del value  # the fp32 copy, before the next one is made
            if convert is not None:
                shard = convert(shard)
            weight_map.update(dict.fromkeys(shard, file))
            if write:
                write_file_atomic(stage / file, safetensors_blocks(shard, metadata={"format": "pt"}))
                assert progress is not None
                progress.update(sum(sizes[name] for name in names))
            del shard
        if write and split.is_sharded:
            index = {"metadata": {"total_parameters": parameters, **split.metadata}, "weight_map": weight_map}
            (stage / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            fsync_file(stage / INDEX_NAME)
    except BaseException as exc:
        if progress is not None:
            progress.close(failed=True)
        shutil.rmtree(stage, ignore_errors=True)
        if write and is_disk_full(exc):
            raise disk_full_error(
                out, what, total, f"Nothing was kept; an earlier export there is untouched. {fix}"
            ) from None
        raise
    if write:
        assert progress is not None
        progress.close()
        _install(stage, out, set(split.filename_to_tensors))
    return WrittenWeights(
        files=list(split.filename_to_tensors),
        weight_map=weight_map,
        total_size=total,
        parameters=parameters,
        dtype=dtype,
    )


def require_room(directory: Path, what: str, nbytes: int, fix: str) -> None:
    """Refuse, before anything is written, a save of ``nbytes`` into ``directory`` its filesystem has no room for."""
    free = free_bytes(directory)
    if free is not None and free < nbytes + HEADROOM:
        raise disk_full_error(directory, what, nbytes + HEADROOM, f"Nothing was written. {fix}")


def _install(stage: Path, out: Path, files: set[str]) -> None:
    """Move a whole export from ``stage`` into ``out``: the earlier export's weight files go first, the index (which
    names the shards to load) last, so a crash between leaves no index over a mix of old and new shards."""
    # An earlier save's weight files not among `files`: `from_pretrained` would read a left-over `model.safetensors`
    # before the index.
    for path in out.iterdir():
        stale = path.name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_NAME.fullmatch(path.name) is not None
        if stale and path.name not in files and path.is_file():
            path.unlink()
    (out / INDEX_NAME).unlink(missing_ok=True)
    for name in sorted(files):
        os.replace(stage / name, out / name)
    if (stage / INDEX_NAME).exists():
        os.replace(stage / INDEX_NAME, out / INDEX_NAME)
    stage.rmdir()
    fsync_dir(out)
