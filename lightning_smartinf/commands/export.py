"""Consolidate the fp32 master weights of a SmartUpdate checkpoint (like ``zero_to_fp32``), or write them as a
Hugging Face ``save_pretrained`` directory in the model's dtype, a weight file at a time.

A checkpoint saved with ``strategy="smart_infinity"`` keeps the fp32 masters on the devices, so DeepSpeed's
``zero_to_fp32.py`` cannot rebuild them. This module reads, for every rank,
``<ckpt>/checkpoint/smartinf/rankNNN/host_state.json`` (which parameter partitions each shard holds, in order)
and the master part of every chunk record of the shard files, checks sizes and checksums against the
manifest, and joins the ranks' partitions of each parameter (rank ``r`` holds elements
``[r * partition_numel, (r + 1) * partition_numel)`` of the flattened parameter, the last one padded). Frozen
parameters (no optimizer state, so nothing on the devices) come from the partitions DeepSpeed saved of them.

When the checkpoint's module holds a Hugging Face model, :func:`export_pretrained` writes that model's consolidated
weights as a ``save_pretrained`` directory: cast to ``dtype`` (default: the dtype the model was loaded in) and split
over files of at most ``max_shard_size`` with an index, as transformers lays them out. It reads the masters of one
file's parameters at a time (only their elements of the shard files, :func:`checkpoint_weights`), so memory holds one
weight file and one fp32 parameter, not the model. :class:`lightning_smartinf.hf.HFCausalLM` and
:class:`~lightning_smartinf.hf.HFSequenceClassifier` record the config, task and tokenizer in the checkpoint; for
any other module (``self.model = AutoModelForTokenClassification.from_pretrained(path)``) they come from the model
directory it was fine-tuned from, the attribute holding the model from the parameter names and the head from the
weights (:func:`.hf.pretrained.find_attribute`, :func:`.hf.pretrained.find_head`).
Nothing is unpickled: the client state is read with ``weights_only=True``, the weights from the raw shard files.

Command line::

    smartinf export <checkpoint dir> <out.safetensors>
    smartinf export <checkpoint dir> --save-pretrained <out dir> [--hf-model-dir <model dir>]
        [--hf-attribute <name>] [--auto-class <AutoModelFor...>] [--dtype bf16|fp16|fp32] [--max-shard-size 5GB]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_smartinf.core.format import checkpoint_folder
from lightning_smartinf.core.format.masters import MastersReader, Weights, saved_masters
from lightning_smartinf.core.format.rank_state import full_parameter
from lightning_smartinf.core.io.storage import nearest_existing
from lightning_smartinf.core.progress import Progress

if TYPE_CHECKING:
    from lightning_smartinf.hf.weight_files import WrittenWeights


def is_complete(checkpoint_path: str | os.PathLike) -> bool:
    """Whether the checkpoint's save ran to the end: its seal is there (cheap, no checksums).

    It tells a checkpoint interrupted by a crash from a finished one. Loading and export verify every file.
    """
    return checkpoint_folder.is_sealed(checkpoint_path)


def _inside_checkpoint(out: str | os.PathLike, named: str, suffix: str) -> str | None:
    """Why ``out`` may not be written, or ``None``: it is at or under a checkpoint directory, which any file added
    makes unloadable (its seal lists every file: resume and export refuse it). ``named`` is how the message names
    ``out`` (``"the output 'x'"``); ``suffix`` makes the path suggested beside the checkpoint (``".safetensors"``)."""
    checkpoint = checkpoint_folder.enclosing(out)
    if checkpoint is None:
        return None
    where = "is" if Path(out).resolve() == checkpoint else "is inside"
    beside = checkpoint.with_name(checkpoint.stem + suffix)
    return (
        f"{named} {where} the smart_infinity checkpoint {str(checkpoint)!r}: a file written there makes the checkpoint "
        f"unloadable (its seal lists every file, so resume and export would refuse it). Write beside it, e.g. "
        f"{str(beside)!r}."
    )


#: Reads the fp32 masters of every shard of one rank's device state kept on remote servers (by shard index).
RemoteMasters = MastersReader


def checkpoint_weights(
    checkpoint_path: str | os.PathLike, *, verify: bool = True, remote: RemoteMasters | None = None
) -> Weights:
    """The full fp32 weights of every parameter of a SmartUpdate checkpoint, by name, read a few at a time: the
    masters the devices held (:func:`~lightning_smartinf.core.format.masters.saved_masters`, only the elements of the
    parameters asked for) and the frozen parameters (:func:`frozen_weights`).

    ``verify``: check every shard file's size and CRC-32 against its manifest first (reads each file once more).
    ``remote``: reads the masters of a rank whose device state is on remote device servers (``remote.json``); the
    servers send a rank's masters whole, so those are held.

    The checks show their progress (:class:`~lightning_smartinf.core.progress.Progress`, over the shard files' bytes).
    """
    seal = checkpoint_folder.verify(checkpoint_path, checksum_shards=False)  # shards: CRC-checked below if `verify`
    size = seal["world_size"]
    directories = [checkpoint_folder.rank_state_dir(checkpoint_path, rank) for rank in range(size)]
    # The checks read every shard file whole (none where the devices kept the state): the bulk of the reading.
    state_bytes = sum(
        entry["bytes"]
        for name, entry in seal["files"].items()
        if verify and name.startswith(f"{checkpoint_folder.STATE_DIR}/") and name.endswith(".state")
    )
    if not state_bytes:
        return saved_masters(directories, verify=verify, elsewhere=remote).joined(frozen_weights(checkpoint_path, size))
    with Progress(f"reading the optimizer state of {checkpoint_path}", state_bytes) as progress:
        masters = saved_masters(directories, verify=verify, elsewhere=remote, checked=progress.update)
    return masters.joined(frozen_weights(checkpoint_path, size))


def consolidate_fp32_state_dict(
    checkpoint_path: str | os.PathLike, *, verify: bool = True, remote: RemoteMasters | None = None
) -> dict[str, Tensor]:
    """Full fp32 weights of every parameter, by name, from a SmartUpdate checkpoint directory: all of
    :func:`checkpoint_weights` at once (the whole model in memory)."""
    return checkpoint_weights(checkpoint_path, verify=verify, remote=remote).all()


def frozen_weights(checkpoint_path: str | os.PathLike, size: int) -> Weights:
    """Parameters the devices never held (``requires_grad=False``: no optimizer state), by name, in fp32.

    DeepSpeed saves each rank's partition of them in its model-state file (``frozen_param_fragments``, in the training
    dtype); they are joined as the masters are. Each read maps the files (``weights_only=True``, never code) and
    copies out the fragments of the parameters asked for only.
    """
    from lightning_smartinf.zero.safe_load import load_deepspeed_file

    paths = [
        Path(checkpoint_path) / checkpoint_folder.TAG / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        for rank in range(size)
    ]
    if not paths[0].is_file():
        return Weights.of({})  # not ZeRO-3's layout of model states: nothing to add
    shapes: dict[str, tuple[int, ...]] = {}
    held: Counter[str] = Counter()
    for rank, path in enumerate(paths):
        if not path.is_file():
            raise ValueError(f"{path} is missing: the checkpoint holds the model states of {rank} of {size} ranks.")
        states = load_deepspeed_file(path, mmap=True)
        shapes.update({name: tuple(shape) for name, shape in (states.get("frozen_param_shapes") or {}).items()})
        held.update(list(states.get("frozen_param_fragments") or ()))  # the names: a dict would add its values
        del states
    for name in shapes:
        if held[name] != size:
            raise ValueError(
                f"Frozen parameter {name!r} has {held[name]} of {size} ranks' partitions in the checkpoint."
            )

    def read(names: Sequence[str]) -> Iterator[tuple[str, Tensor]]:
        fragments: dict[str, list[Tensor]] = {name: [] for name in names}
        for path in paths if names else ():
            states = load_deepspeed_file(path, mmap=True)
            for name in names:  # copied out of the mapping, which closes with `states`
                fragments[name].append(states["frozen_param_fragments"][name].reshape(-1).clone())
            del states
        for name in names:
            yield name, full_parameter(name, fragments.pop(name), shapes[name]).float()

    return Weights(shapes, read)


def save_fp32(
    checkpoint_path: str | os.PathLike, out_file: str | os.PathLike, *, remote: RemoteMasters | None = None
) -> dict[str, Tensor]:
    """Write the consolidated fp32 weights of ``checkpoint_path`` to ``out_file`` (safetensors); return them.
    ``remote`` reads device state kept on remote servers (see :func:`consolidate_fp32_state_dict`)."""
    from lightning_smartinf.core.format.safetensors_stream import safetensors_blocks
    from lightning_smartinf.core.io.storage import disk_full_error, is_disk_full, write_file_atomic
    from lightning_smartinf.hf.weight_files import require_room

    if refused := _inside_checkpoint(out_file, f"`out_file={str(out_file)!r}`", ".safetensors"):
        raise ValueError(refused)
    state = consolidate_fp32_state_dict(checkpoint_path, remote=remote)
    out_file = Path(out_file)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    what, fix = "the fp32 weights", "Free space there, or write them elsewhere."
    require_room(out_file.parent, what, nbytes, fix)
    metadata = {"format": "pt", "source": str(checkpoint_path)}

    def counted(blocks: Iterable[bytes | memoryview], progress: Progress) -> Iterator[bytes | memoryview]:
        """``blocks``, each counted once written (the writer asks for the next one then); the header, first, is not
        counted: the total is the weights'."""
        for index, block in enumerate(blocks):
            yield block
            if index:
                progress.update(memoryview(block).nbytes)

    try:
        with Progress(f"writing the weights to {out_file}", nbytes) as progress:
            # Through a temporary renamed into place once on disk: a full disk leaves no truncated file to load.
            write_file_atomic(out_file, counted(safetensors_blocks(state, metadata=metadata), progress))
    except OSError as exc:
        if is_disk_full(exc):
            raise disk_full_error(out_file.parent, what, nbytes, f"Nothing was kept. {fix}") from None
        raise
    return state


#: DeepSpeed's files holding Lightning's client state (hyper-parameters, ``smartinf_hf``, ...), ZeRO-3's first.
CLIENT_STATE = (checkpoint_folder.MODEL_STATES, "mp_rank_00_model_states.pt")
#: Attribute of the HF modules holding the Hugging Face model; its parameters are named ``model.<HF name>``.
HF_ATTRIBUTE = "model"


def hf_metadata(checkpoint_path: str | os.PathLike) -> dict | None:
    """What an HF module recorded in the checkpoint (``task``, ``config``, ``tokenizer_path``), or ``None``."""
    paths = [Path(checkpoint_path) / checkpoint_folder.TAG / name for name in CLIENT_STATE]
    path = next((p for p in paths if p.is_file()), None)
    if path is None:
        raise FileNotFoundError(f"{paths[0]} is missing: {checkpoint_path} is not a DeepSpeed checkpoint directory.")
    checkpoint_folder.verify(checkpoint_path)
    # Lightning's client state, read as `Trainer.fit(ckpt_path=...)` reads it: weights only, never code.
    from lightning_smartinf.zero.safe_load import load_deepspeed_file

    client_state = load_deepspeed_file(path)
    return client_state.get("smartinf_hf")


def export_pretrained(
    checkpoint_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    model_dir: str | os.PathLike | None = None,
    attribute: str | None = None,
    auto_class: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    remote: RemoteMasters | None = None,
) -> WrittenWeights:
    """Write the consolidated weights of the checkpoint's Hugging Face model as a ``save_pretrained`` directory, a
    weight file at a time (:func:`~lightning_smartinf.hf.pretrained.save_pretrained`).

    Args:
        checkpoint_path: a checkpoint directory saved with ``strategy="smart_infinity"``.
        out_dir: the output directory (created; files in it are overwritten).
        model_dir: the Hugging Face directory (or Hub id) the run started from: the tokenizer, and the config when the
            checkpoint records none (it does for :class:`~lightning_smartinf.hf.HFCausalLM` /
            :class:`~lightning_smartinf.hf.HFSequenceClassifier`).
        attribute: the module attribute holding the model (``"model"``, ``"net.backbone"``). ``None``: the one
            recorded in the checkpoint, else the one whose parameter names are the config's model's
            (:func:`~lightning_smartinf.hf.pretrained.find_attribute`).
        auto_class: the transformers auto class to write (``"AutoModelForTokenClassification"``). ``None``: the
            task recorded in the checkpoint, else the head whose weights the checkpoint holds
            (:func:`~lightning_smartinf.hf.pretrained.find_head`; ``num_labels`` from the weights).
        dtype: the dtype written: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (or ``"bfloat16"``, ``torch.bfloat16`` ...).
            ``None``: the one the model was loaded in (the ``dtype`` of the config the checkpoint records, or of
            ``model_dir``'s config.json), else fp32.
        max_shard_size: the largest weight file, in bytes or as ``"500MB"``, ``"2GiB"``. A larger model is split
            over ``model-00001-of-0000N.safetensors`` ... with ``model.safetensors.index.json``.

    Returns:
        What was written, and where.

    Raises:
        ValueError: ``out_dir`` at or under a checkpoint directory, a bad ``dtype`` or ``max_shard_size`` (before
            anything is read or written), no config to build
            the model from, or the weights fit no model of it (or several).
    """
    from lightning_smartinf.hf.data import TOKENIZER_FILES, load_tokenizer
    from lightning_smartinf.hf.pretrained import find_attribute, find_head, save_pretrained
    from lightning_smartinf.hf.sources import tokenizer_files
    from lightning_smartinf.hf.weight_files import export_dtype, shard_bytes

    if refused := _inside_checkpoint(out_dir, f"`out_dir={str(out_dir)!r}`", "-hf"):
        raise ValueError(refused)
    if dtype is not None:
        export_dtype(dtype)
    shard_bytes(max_shard_size)
    if model_dir is not None:  # a Hub id: its config and tokenizer files, through the Hub's cache
        model_dir = tokenizer_files(model_dir, "model_dir")
    meta = hf_metadata(checkpoint_path)
    if meta is None and model_dir is None:
        raise ValueError(
            f"{checkpoint_path} records no Hugging Face model (it was not trained with `HFCausalLM` or "
            "`HFSequenceClassifier`). Give `model_dir` (`--hf-model-dir`): the model directory or Hub id it was "
            "fine-tuned from, for its config and tokenizer."
        )
    config = _hf_config(meta, model_dir)
    tokenizer_dir = model_dir if model_dir is not None else (meta or {}).get("tokenizer_path")
    tokenizer = None
    if tokenizer_dir is not None and any((Path(tokenizer_dir) / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = load_tokenizer(tokenizer_dir, argument="model_dir")
    weights = checkpoint_weights(checkpoint_path, remote=remote)
    if attribute is None:
        attribute = meta.get("attribute", HF_ATTRIBUTE) if meta is not None else find_attribute(weights.shapes, config)
    prefix = f"{attribute}."
    state = weights.under(prefix)
    if not state.shapes:
        attributes = sorted({k.split(".")[0] for k in weights.shapes})
        raise ValueError(
            f"`attribute={attribute!r}` (`--hf-attribute`): the checkpoint's module has no parameters under it; they "
            f"are under {attributes[:8]}. Give the attribute holding the Hugging Face model, or leave it out."
        )
    if auto_class is None and meta is not None:
        auto_class = meta["task"]
    head, config = find_head(state.shapes, config, auto_class)
    written = save_pretrained(
        state, config, head, out_dir, tokenizer=tokenizer, dtype=dtype, max_shard_size=max_shard_size
    )
    others = sorted(k for k in weights.shapes if not k.startswith(prefix))
    if others:
        print(
            f"note: {len(others)} parameters of the module are outside `{attribute}` and not in {out_dir}: "
            f"{others[:4]}{' ...' if len(others) > 4 else ''}",
            file=sys.stderr,
        )
    if tokenizer is None:
        print(
            f"warning: no tokenizer found at {tokenizer_dir}; {out_dir} has the model only. Copy the tokenizer "
            "files in, or pass `--hf-model-dir`.",
            file=sys.stderr,
        )
    return written


def _hf_config(meta: dict | None, model_dir: str | os.PathLike | None) -> Any:
    """The model config the checkpoint records, else the one in ``model_dir``."""
    from transformers import AutoConfig, PretrainedConfig

    if meta is not None:
        fields = dict(meta["config"])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    assert isinstance(config, PretrainedConfig)
    return config


def _remote_masters(
    devices: list[str] | None, token_file: str | None, tls_dir: str | None, allow_plaintext: bool = False
) -> RemoteMasters | None:
    """``--remote-devices``' reader of device state kept on servers (``None`` without it)."""
    if not devices:
        return None
    from lightning_smartinf.core.settings import SettingsError, SmartUpdateSettings

    options = {
        "remote_devices": devices,
        "remote_token_file": token_file,
        "remote_tls_dir": tls_dir,
        "remote_allow_plaintext": allow_plaintext,
    }
    try:
        settings = SmartUpdateSettings(backend="remote", device=options)
    except SettingsError as exc:
        raise ValueError(str(exc)) from None
    return settings.checkpoint_masters()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smartinf export",
        description="Consolidate the fp32 master weights of a SmartUpdate checkpoint into one safetensors file "
        "and/or a Hugging Face save_pretrained directory.",
    )
    parser.add_argument("checkpoint", help="checkpoint directory saved with strategy='smart_infinity'")
    parser.add_argument("output", nargs="?", help="output .safetensors file")
    parser.add_argument(
        "--save-pretrained",
        metavar="DIR",
        help="also (or only) write a Hugging Face `save_pretrained` directory of the module's HF model (checkpoints "
        "of HFCausalLM / HFSequenceClassifier, or of any module holding a transformers model, with --hf-model-dir)",
    )
    parser.add_argument(
        "--hf-model-dir",
        metavar="DIR",
        help="Hugging Face model directory (or Hub id) the run started from: tokenizer (and config if the checkpoint "
        "has none) for --save-pretrained",
    )
    parser.add_argument(
        "--hf-attribute",
        metavar="NAME",
        help="module attribute holding the HF model (e.g. `model`, `net.backbone`); default: the one whose "
        "parameter names are those of the config's model",
    )
    parser.add_argument(
        "--auto-class",
        metavar="CLASS",
        help="transformers auto class to export as (e.g. AutoModelForTokenClassification); default: the head "
        "whose weights the checkpoint holds (causal LM, sequence/token classification, question answering, "
        "masked LM or the bare model)",
    )
    parser.add_argument(
        "--dtype",
        metavar="DTYPE",
        help="with --save-pretrained: the dtype of the weights written, bf16, fp16 or fp32 (or bfloat16, float16, "
        "float32); default: the one the model was loaded in (its config's `dtype`), else fp32",
    )
    parser.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="with --save-pretrained: the largest weight file, in bytes or e.g. 500MB, 5GB, 2GiB (default: 5GB); a "
        "larger model is split over model-00001-of-0000N.safetensors ... with model.safetensors.index.json, as "
        "transformers' save_pretrained writes it",
    )
    parser.add_argument(
        "--remote-devices",
        nargs="+",
        metavar="HOST:PORT",
        help="the `smartinf serve` servers holding the checkpoint's device state (backend='remote')",
    )
    parser.add_argument("--remote-token-file", metavar="FILE", help="with --remote-devices: the servers' token file")
    parser.add_argument("--remote-tls-dir", metavar="DIR", help="with --remote-devices: ca.pem (+ client.pem/.key)")
    parser.add_argument(
        "--remote-allow-plaintext",
        action="store_true",
        help="with --remote-devices: reach servers on other machines in plain gRPC (the token in clear)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.output is None and args.save_pretrained is None:
        parser.error("give an output .safetensors file, `--save-pretrained DIR`, or both")
    hf_flags = {"--hf-model-dir": args.hf_model_dir, "--hf-attribute": args.hf_attribute, "--dtype": args.dtype}
    for flag, value in {**hf_flags, "--auto-class": args.auto_class, "--max-shard-size": args.max_shard_size}.items():
        if value is not None and args.save_pretrained is None:
            parser.error(f"`{flag}` goes with `--save-pretrained DIR`")
    if (args.remote_token_file or args.remote_tls_dir) and not args.remote_devices:
        parser.error("`--remote-token-file` and `--remote-tls-dir` go with `--remote-devices HOST:PORT ...`")
    for named, path, suffix in (
        (f"the output {args.output!r}", args.output, ".safetensors"),
        (f"`--save-pretrained {args.save_pretrained}`", args.save_pretrained, "-hf"),
    ):
        if path is not None and (refused := _inside_checkpoint(path, named, suffix)):
            parser.error(refused)
    if args.output is not None:  # refused before the checkpoint is read, which can take minutes
        out = Path(args.output)
        if out.is_dir():
            parser.error(
                f"the output {args.output!r} is a directory: name the file, e.g. {str(out / 'model.safetensors')!r}"
            )
        if not out.parent.is_dir():
            parser.error(f"the output's folder {str(out.parent)!r} does not exist: create it, or write elsewhere")
    if args.save_pretrained is not None:  # a directory, created with its missing folders once the weights are read
        pretrained = Path(args.save_pretrained)
        # The nearest existing path at or above it is where the rest is created: a folder (`.` or `/` at worst).
        existing = nearest_existing(pretrained)
        if existing == pretrained and not existing.is_dir():
            parser.error(
                f"`--save-pretrained {args.save_pretrained}` is a file: it must be a directory (created if missing; "
                "the files in it are overwritten). Name a new or existing directory."
            )
        if not existing.is_dir():
            parser.error(
                f"`--save-pretrained {args.save_pretrained}` cannot be created: {str(existing)!r} is a file, not a "
                "folder. Name a directory elsewhere."
            )
        resolved = pretrained.resolve()
        if args.output is not None and Path(args.output).resolve() in (resolved, *resolved.parents):
            parser.error(
                f"`--save-pretrained {args.save_pretrained}` is at or under the output file {args.output!r}, which "
                "is written first: name different places."
            )
    try:
        remote = _remote_masters(
            args.remote_devices, args.remote_token_file, args.remote_tls_dir, args.remote_allow_plaintext
        )
        if args.save_pretrained is not None:  # refused before anything is read or written
            from lightning_smartinf.hf.weight_files import MAX_SHARD_SIZE, export_dtype, shard_bytes

            if args.dtype is not None:
                export_dtype(args.dtype, "--dtype")
            shard_bytes(args.max_shard_size or MAX_SHARD_SIZE, "--max-shard-size")
        if args.output is not None:
            state = save_fp32(args.checkpoint, args.output, remote=remote)
            total = sum(t.numel() for t in state.values())
            print(f"wrote {len(state)} tensors ({total} parameters, fp32) to {args.output}")
        if args.save_pretrained is not None:
            written = export_pretrained(
                args.checkpoint,
                args.save_pretrained,
                model_dir=args.hf_model_dir,
                attribute=args.hf_attribute,
                auto_class=args.auto_class,
                dtype=args.dtype,
                max_shard_size=args.max_shard_size or MAX_SHARD_SIZE,
                remote=remote,
            )
            config = json.loads((Path(args.save_pretrained) / "config.json").read_text())
            architecture = ", ".join(config.get("architectures") or ["?"])
            files = f"{len(written.files)} weight file{'s' if len(written.files) > 1 else ''}"
            print(
                f"wrote {architecture} ({written.parameters} parameters, {config.get('dtype')}, {files}) as "
                f"save_pretrained to {args.save_pretrained}"
            )
    except (OSError, ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
