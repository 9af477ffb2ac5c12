"""Hugging Face ``save_pretrained`` directories with the fp32 master weights consolidated from the devices.

With ``strategy="smart_infinity"`` the fp32 masters never leave the devices during training; ZeRO's parameters
are the low-precision copies. :func:`trained_weights` reads the masters back from every device of every rank
(:meth:`Backend.read_master`) a device shard at a time and joins the ranks' partitions; :func:`save_pretrained`
writes them as a Hugging Face model directory in the dtype asked for, one weight file of at most ``max_shard_size``
at a time (:mod:`.weight_files`), so neither holds the whole model; :class:`SavePretrained` does both at the end of
fit. The model written is built with its parameters on the meta device: its names, shapes and dtypes, no memory.

For a checkpoint of any module holding a transformers model (``self.model = AutoModelFor...from_pretrained(...)``),
:func:`find_attribute` tells from the parameter names and the config which attribute holds it, and
:func:`find_head` which ``AutoModelFor*`` class its weights fill (``num_labels`` read from the weights).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from typing_extensions import override

from lightning_smartinf.core.arguments import Problems
from lightning_smartinf.core.format.masters import Weights
from lightning_smartinf.core.format.rank_state import PartitionIndex, full_parameter
from lightning_smartinf.hf.weight_files import (
    MAX_SHARD_SIZE,
    WrittenWeights,
    config_dtype,
    dtype_name,
    export_dtype,
    shard_bytes,
    write_weight_files,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

#: Task name (``HFCausalLM.task`` / ``HFSequenceClassifier.task``) -> transformers auto class.
AUTO_CLASSES = {"causal-lm": "AutoModelForCausalLM", "sequence-classification": "AutoModelForSequenceClassification"}
#: The heads :func:`find_head` tries; other ``transformers.AutoModelFor*`` classes can be named explicitly.
HEAD_CLASSES = (
    "AutoModelForCausalLM",
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "AutoModelForQuestionAnswering",
    "AutoModelForMaskedLM",
    "AutoModel",
)
#: Weight shapes by Hugging Face parameter name: all that head and attribute matching look at.
Shapes = Mapping[str, Iterable[int]]


def _device_masters(strategy: Any, prefix: str) -> Weights:
    """The fp32 masters the devices hold of the parameters named ``prefix...`` (named without it), read a device
    shard at a time and joined over the ranks. Every rank must read the same names in the same order."""
    import torch.distributed as dist

    smart_update = strategy.smart_update
    backend = smart_update.backend
    backend.wait()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    partitions = PartitionIndex.of(smart_update.layout(), prefix)
    where, shapes, numels = partitions.where, partitions.shapes, partitions.numels

    def gathered(part: Tensor) -> list[Tensor]:
        if world == 1:
            return [part]
        part = part.to(strategy.root_device)  # every rank holds its own slice of the same parameter
        parts = [torch.empty_like(part) for _ in range(world)]
        dist.all_gather(parts, part)
        return [p.cpu() for p in parts]

    def read(names: Sequence[str]) -> Iterator[tuple[str, Tensor]]:
        by_shard: dict[int, list[str]] = {}
        for name in names:
            by_shard.setdefault(where[name][0], []).append(name)
        for index in sorted(by_shard):
            buffer = torch.empty(numels[index], dtype=torch.float32)
            backend.read_master(index, buffer)
            backend.wait()
            for name in by_shard[index]:
                _, offset, numel = where[name]
                yield name, full_parameter(name, gathered(buffer[offset : offset + numel]), shapes[name])
            del buffer

    return Weights(shapes, read)


def trained_weights(module: L.LightningModule, attribute: str = "model") -> Weights:
    """The fp32 weights of ``module.<attribute>`` by its own (Hugging Face) parameter names, during training, read a
    few at a time.

    With ``smart_infinity``: the fp32 master weights read back from the devices, a device shard at a time;
    parameters the devices do not hold (frozen ones) are gathered from ZeRO. Otherwise: the (gathered) parameters,
    upcast. Every rank must read the same names in the same order (each parameter is gathered from all of them).
    """
    from lightning_smartinf.lightning.contract import SmartUpdateStrategy

    strategy = module.trainer.strategy
    prefix = f"{attribute}."
    params = {n[len(prefix) :]: p for n, p in module.named_parameters() if n.startswith(prefix)}
    masters = Weights.of({})
    if isinstance(strategy, SmartUpdateStrategy) and strategy.has_smart_update:
        masters = _device_masters(strategy, prefix)
    rest = {name: param for name, param in params.items() if name not in masters.shapes}

    def read_rest(names: Sequence[str]) -> Iterator[tuple[str, Tensor]]:
        chosen = [rest[name] for name in names]
        gather: Any = contextlib.nullcontext()
        if any(hasattr(p, "ds_id") for p in chosen):
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(chosen)
        with gather:
            for name in names:
                yield name, rest[name].detach().to("cpu", torch.float32, copy=True)

    shapes = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in rest.items()}
    joined = masters.joined(Weights(shapes, read_rest))
    return Weights({name: joined.shapes[name] for name in params}, joined.read)


def fp32_state_dict(module: L.LightningModule, attribute: str = "model") -> dict[str, Tensor]:
    """Full fp32 weights of ``module.<attribute>`` by its own (Hugging Face) parameter names, during training: all of
    :func:`trained_weights` at once (the whole model in memory). Call it on every rank."""
    return trained_weights(module, attribute).all()


def auto_class(name: str, argument: str = "auto_class") -> Any:
    """The transformers auto class called ``name`` (``"AutoModelForTokenClassification"``) or of the task ``name``
    (a key of :data:`AUTO_CLASSES`).

    Raises:
        ValueError: ``name`` is neither; the message names ``argument``.
    """
    import transformers

    name = AUTO_CLASSES.get(name, name)
    cls = getattr(transformers, name, None) if name == "AutoModel" or name.startswith("AutoModelFor") else None
    if cls is None:
        raise ValueError(
            f"`{argument}={name!r}` is not a transformers auto model class. It must be one of: "
            f"{', '.join(HEAD_CLASSES)} (or another `transformers.AutoModelFor*` class)."
        )
    return cls


def build_model(
    config: PretrainedConfig, task: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """A Hugging Face model of ``task`` (an auto class name or a key of :data:`AUTO_CLASSES`) from ``config``, in
    ``dtype`` (fp32 by default).

    ``device="meta"`` builds it without allocating or initializing weights: names and shapes only. ``config`` is
    left as it is (transformers would set its ``dtype`` to the model's).
    """
    cls = auto_class(task, "task")
    with torch.device(device):
        return cls.from_config(copy.deepcopy(config), dtype=dtype)


def _alias_groups(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter of ``model``; tied ones share a group, led by the name ``named_parameters`` keeps."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return list(groups.values())


def _few(names: list[str]) -> str:
    return f"{names[:4]}{' ...' if len(names) > 4 else ''}"


def _mismatch(shapes: Shapes, model: torch.nn.Module) -> str:
    """Why weights of ``shapes`` cannot fill ``model``'s parameters, or ``""`` when they can.

    They can when every parameter is there under one of its names (tied weights once), every name is one the model
    knows, and every shape is the model's.
    """
    groups = _alias_groups(model)
    known = set(model.state_dict().keys()) | {n for group in groups for n in group}
    missing = [group[0] for group in groups if not any(n in shapes for n in group)]
    unexpected = sorted(set(shapes) - known)
    if missing or unexpected:
        return f"missing {len(missing)} {_few(missing)}, unexpected {len(unexpected)} {_few(unexpected)}"
    params = dict(model.named_parameters(remove_duplicate=False))
    wrong = [
        f"{n} is {list(shapes[n])}, the model's {list(params[n].shape)}"
        for n in params
        if n in shapes and list(shapes[n]) != list(params[n].shape)
    ]
    return f"shapes differ: {'; '.join(wrong[:4])}" if wrong else ""


def _fit_head(shapes: Shapes, config: PretrainedConfig, head: str) -> tuple[PretrainedConfig | None, str]:
    """``(config, "")`` with ``config.num_labels`` as the weights have it when they fill a ``head`` model of
    ``config``; ``(None, why not)`` otherwise."""
    try:
        model = build_model(config, head, device="meta")
    except (ValueError, KeyError, TypeError) as exc:  # transformers has no such head for this model type
        return None, f"none for `{config.model_type}` ({str(exc).splitlines()[0][:100]})"
    problem = _mismatch(shapes, model)
    if problem.startswith("shapes differ"):
        # A head sized by `num_labels`: only its parameters' first dimension differs, by the same count for all.
        params = dict(model.named_parameters(remove_duplicate=False))
        differ = [n for n in params if n in shapes and list(shapes[n]) != list(params[n].shape)]
        labels = {list(shapes[n])[0] for n in differ}
        sized_by_labels = all(
            params[n].shape[0] == config.num_labels and list(shapes[n])[1:] == list(params[n].shape)[1:] for n in differ
        )
        if sized_by_labels and len(labels) == 1:
            config = copy.deepcopy(config)
            config.num_labels = labels.pop()
            model = build_model(config, head, device="meta")
            problem = _mismatch(shapes, model)
    return (None, f"{type(model).__name__}: {problem}") if problem else (config, "")


def find_head(shapes: Shapes, config: PretrainedConfig, head: str | None = None) -> tuple[str, PretrainedConfig]:
    """The auto class whose model the weights (shapes by HF name) fill exactly, and the config to build it from.

    ``head`` (an auto class name or a task of :data:`AUTO_CLASSES`): that one or an error. Otherwise every one of
    :data:`HEAD_CLASSES` is tried, on the meta device; a head sized by ``num_labels`` takes it from the weights.
    When several fit (BERT's masked and causal LM heads have the same weights), the one ``config.architectures``
    names wins, else the masked LM unless ``config.is_decoder``.

    Raises:
        ValueError: no head (or not ``head``) fits, or several fit and nothing tells them apart.
    """
    tried = [auto_class(head).__name__] if head is not None else list(HEAD_CLASSES)
    with _transformers_errors_only():  # each build warns about weights it did not initialize
        fits = {name: _fit_head(shapes, config, name) for name in tried}
        matches = [name for name, (fitted, _) in fits.items() if fitted is not None]
        if len(matches) > 1:
            architectures = set(getattr(config, "architectures", None) or ())
            named = [m for m in matches if type(build_model(fits[m][0], m, device="meta")).__name__ in architectures]
            if len(named) == 1:
                matches = named
            elif set(matches) == {"AutoModelForCausalLM", "AutoModelForMaskedLM"}:
                matches = ["AutoModelForCausalLM" if getattr(config, "is_decoder", False) else "AutoModelForMaskedLM"]
    if not matches:
        reasons = "".join(f"\n  {name}: {fits[name][1]}" for name in tried)
        raise ValueError(
            f"The weights ({len(shapes)} tensors) fit no {' or '.join(tried)} of this `{config.model_type}` config:"
            f"{reasons}\nGive the auto class the module built (`--auto-class`), the attribute holding the model "
            "(`--hf-attribute`), or the model directory it was fine-tuned from (`--hf-model-dir`)."
        )
    if len(matches) > 1:
        raise ValueError(
            f"The weights fit several heads: {', '.join(matches)}. Name the one the module built with `--auto-class` "
            f"(e.g. `--auto-class {matches[0]}`)."
        )
    fitted = fits[matches[0]][0]
    assert fitted is not None
    return matches[0], fitted


@contextlib.contextmanager
def _transformers_errors_only() -> Iterator[None]:
    """transformers logs errors only in the block (its model builds warn about every weight they leave)."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def find_attribute(names: Iterable[str], config: PretrainedConfig) -> str:
    """The module attribute (a dotted path) holding the Hugging Face model, from the module's parameter names.

    A transformers model's parameters are ``<base_model_prefix>.<base name>`` (a model with a head) or
    ``<base name>`` (a bare base model), the base names those of ``AutoModel.from_config(config)``. Every parameter
    name ending so votes for what precedes it, the longest such ending first (``model.bert.embeddings...`` votes
    for ``model``, not ``model.bert``). An attribute needs the votes of at least half of the base model's weights,
    so other parameters of the module (a ``LayerNorm`` of its own) never make one.

    Raises:
        ValueError: no attribute, or more than one (a teacher and a student), holds a model of this config.
    """
    with _transformers_errors_only():
        base = build_model(config, "AutoModel", device="meta")
    groups = _alias_groups(base)
    base_names = {n for group in groups for n in group}
    headed = {f"{base.base_model_prefix}.{n}" for n in base_names}
    names = list(names)
    votes: Counter[str] = Counter()
    for name in names:
        parts = name.split(".")
        for k in range(1, len(parts)):
            ending = ".".join(parts[k:])
            if ending in headed or ending in base_names:
                votes[".".join(parts[:k])] += 1
                break
    found = sorted(prefix for prefix, count in votes.items() if 2 * count >= len(groups))
    if len(found) == 1:
        return found[0]
    kind = f"`{config.model_type}` model ({type(base).__name__}, with or without a head)"
    if not found:
        attributes = sorted({n.split(".")[0] for n in names})
        raise ValueError(
            f"No attribute of the module holds a {kind}: its parameters are under {_few(attributes)}. Give the "
            "model directory it was fine-tuned from (`--hf-model-dir`) or the attribute (`--hf-attribute`)."
        )
    raise ValueError(
        f"Several attributes of the module hold a {kind}: {found}. Choose one with `--hf-attribute` "
        f"(e.g. `--hf-attribute {found[0]}`)."
    )


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside go to the meta device (names, shapes and dtypes, no memory); buffers stay real.

    A module allocates a parameter, then registers it; it is swapped for a meta one right there (as ``accelerate``'s
    ``init_empty_weights(include_buffers=False)`` does), before its initialization would touch its memory.
    """
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _written_tensors(model: torch.nn.Module, shapes: Shapes) -> tuple[dict[str, Tensor], dict[str, str]]:
    """What ``save_pretrained`` writes of ``model``: each tensor of its state dict once, in order (of tied weights,
    the name ``named_parameters`` keeps); and for each parameter written, the name it has in ``shapes``."""
    aliases = {name: group for group in _alias_groups(model) for name in group}
    tensors: dict[str, Tensor] = {}
    sources: dict[str, str] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # a tied weight, under its second name
            continue
        seen.add(id(tensor))
        tensors[name] = tensor.detach()
        if name in aliases:
            sources[name] = next(alias for alias in aliases[name] if alias in shapes)
    return tensors, sources


def _original_format(model: PreTrainedModel) -> Callable[[dict[str, Tensor]], dict[str, Tensor]] | None:
    """transformers' renaming of a file's tensors to the names its checkpoints use (models whose weights it converts
    on loading, such as fused experts); ``None`` before transformers 5, which saved the names in memory."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    return lambda tensors: revert_weight_conversion(model, tensors)


def save_pretrained(
    weights: Weights | Mapping[str, Tensor],
    config: PretrainedConfig,
    task: str,
    out_dir: str | os.PathLike,
    *,
    tokenizer: Any = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = MAX_SHARD_SIZE,
    is_main_process: bool = True,
) -> WrittenWeights:
    """Write ``weights`` (fp32, by Hugging Face name) as a ``save_pretrained`` directory, one weight file at a time.

    Every parameter of the model must be in ``weights`` under one of its names, tied weights (GPT-2's ``lm_head``)
    once: they are written once and stay tied. Buffers keep the values the config gives them. The files are those
    transformers' ``save_pretrained`` writes: ``config.json`` (naming the model's class in ``architectures`` and the
    dtype written in ``dtype``), ``generation_config.json`` for a generative model, and the weights
    (:mod:`.weight_files`). Each file's weights are read, cast and written before the next file's are read. The
    tokenizer, if given, is saved beside the model.

    Args:
        weights: the fp32 weights, a state dict or read a few at a time (:func:`trained_weights`, or a checkpoint's
            through :func:`lightning_smartinf.commands.export.checkpoint_weights`).
        config: the model's config.
        task: an auto class name (``"AutoModelForTokenClassification"``) or a key of :data:`AUTO_CLASSES`.
        out_dir: the output directory (created; files in it are overwritten, weight files of an earlier save that
            this one does not write are removed).
        tokenizer: saved beside the model.
        dtype: the dtype written: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (or ``"bfloat16"``, ``torch.bfloat16`` ...).
            ``None``: the one the model was saved in, as ``config`` says (``dtype``, or ``torch_dtype``), else fp32.
        max_shard_size: the largest weight file, in bytes or as ``"500MB"``, ``"2GiB"``. A model larger than that is
            split over ``model-00001-of-0000N.safetensors`` ... with ``model.safetensors.index.json``.
        is_main_process: whether this process writes; the others only read alongside it (each read of
            :func:`trained_weights` gathers over the ranks).

    Returns:
        What was written, and where.

    Raises:
        ValueError: ``dtype`` or ``max_shard_size`` is not one (before anything is read or written); ``weights``
            lacks parameters of the model, has names it does not know, or other shapes.
    """
    max_bytes = shard_bytes(max_shard_size)
    dtype = config_dtype(config) if dtype is None else export_dtype(dtype)
    if not isinstance(weights, Weights):
        weights = Weights.of(weights)
    # Parameters on the meta device and buffers real: the names, shapes and dtypes to write, the buffers' values.
    with _parameters_on_meta():
        model = build_model(config, task, dtype=dtype)
    problem = _mismatch(weights.shapes, model)
    if problem:
        raise ValueError(f"The weights do not match a {type(model).__name__} of this config: {problem}.")
    tensors, sources = _written_tensors(model, weights.shapes)

    def read(names: Sequence[str]) -> Iterator[tuple[str, Tensor]]:
        written = {sources[name]: name for name in names if name in sources}
        for source, value in weights.read(list(written)):
            yield written[source], value
        yield from ((name, tensors[name]) for name in names if name not in sources)  # buffers

    out = Path(out_dir)
    done = write_weight_files(
        out,
        tensors,
        read,
        max_bytes=max_bytes,
        parameters=model.num_parameters(),
        dtype=dtype,
        convert=_original_format(model),
        write=is_main_process,
    )
    if is_main_process:
        model.config.dtype = dtype_name(dtype)
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(str(out))
        if model.can_generate():
            model.generation_config.save_pretrained(str(out))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
    return done


class SavePretrained(Callback):
    """At the end of fit, write the trained Hugging Face model as a ``save_pretrained`` directory.

    The weights are the fp32 master weights consolidated from the devices (not the bf16/fp16 copies ZeRO trains
    with), cast to ``dtype`` and written a file at a time (:func:`save_pretrained`); the config and tokenizer come
    from the module. Works with :class:`~lightning_smartinf.hf.HFCausalLM`,
    :class:`~lightning_smartinf.hf.HFSequenceClassifier` or any module with a
    ``save_pretrained(out_dir, *, dtype, max_shard_size)`` method.

    Args:
        dirpath: the output directory (created; files in it are overwritten).
        dtype: the dtype written: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (or ``"bfloat16"``, ``torch.bfloat16`` ...).
            ``None``: the one the model was loaded in (its config's ``dtype``), else fp32.
        max_shard_size: the largest weight file, in bytes or as ``"500MB"``, ``"2GiB"``; a larger model is split over
            several files with an index, as transformers' ``save_pretrained`` does.
    """

    def __init__(
        self, dirpath: str, *, dtype: str | torch.dtype | None = None, max_shard_size: int | str = MAX_SHARD_SIZE
    ) -> None:
        problems = Problems("SavePretrained", MisconfigurationException)
        if problems.path("dirpath", dirpath) and os.path.exists(dirpath) and not os.path.isdir(dirpath):
            problems.add(
                f"`dirpath={str(dirpath)!r}` is a file, not a directory: the model is written into a directory. "
                "Choose another path or move the file away."
            )
        checks: list[tuple[Callable[[Any, str], Any], str, Any]] = [(shard_bytes, "max_shard_size", max_shard_size)]
        if dtype is not None:
            checks.insert(0, (export_dtype, "dtype", dtype))
        for check, argument, value in checks:
            try:
                check(value, argument)
            except ValueError as exc:
                problems.add(str(exc))
        problems.raise_if_any()
        self.dirpath = dirpath
        self.dtype = dtype
        self.max_shard_size = max_shard_size
        #: What the end of fit wrote (``None`` before, or when the module's own ``save_pretrained`` says nothing).
        self.written: WrittenWeights | None = None

    def _saver_arguments(self, pl_module: L.LightningModule) -> dict[str, Any]:
        """The keyword arguments ``pl_module.save_pretrained`` gets, or a clear error when it cannot take them."""
        name = type(pl_module).__name__
        saver = getattr(pl_module, "save_pretrained", None)
        if saver is None:
            raise MisconfigurationException(
                "`SavePretrained` needs a module with `save_pretrained(out_dir, *, dtype, max_shard_size)` "
                f"(`HFCausalLM`, `HFSequenceClassifier`); {name} has none."
            )
        wanted = {"dtype": self.dtype, "max_shard_size": self.max_shard_size}
        parameters = inspect.signature(saver).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return wanted
        lacking = [key for key in wanted if key not in parameters]
        if not lacking:
            return wanted
        if self.dtype is None and self.max_shard_size == MAX_SHARD_SIZE:
            return {}  # a module's own `save_pretrained(out_dir)`: it writes as it does
        raise MisconfigurationException(
            f"`SavePretrained(dtype={self.dtype!r}, max_shard_size={self.max_shard_size!r})`: `{name}.save_pretrained` "
            f"takes no {' or '.join(f'`{key}`' for key in lacking)}. Add them to it (and pass them on to "
            "`lightning_smartinf.hf.save_pretrained`), or leave them out of `SavePretrained`."
        )

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._saver_arguments(pl_module)  # before training, not after it

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        written = pl_module.save_pretrained(self.dirpath, **self._saver_arguments(pl_module))
        self.written = written if isinstance(written, WrittenWeights) else None
