"""Hugging Face ``save_pretrained`` directories with the fp32 master weights consolidated from the devices.

With ``strategy="smart_infinity"`` the fp32 masters never leave the devices during training; ZeRO's parameters
are the low-precision copies. :func:`fp32_state_dict` reads the masters back from every device of every rank
(:meth:`Backend.read_master`) and joins the ranks' partitions; :func:`save_pretrained` writes them as a Hugging Face
model directory; :class:`SavePretrained` does both at the end of fit.

For a checkpoint of any module holding a transformers model (``self.model = AutoModelFor...from_pretrained(...)``),
:func:`find_attribute` tells from the parameter names and the config which attribute holds it, and
:func:`find_head` which ``AutoModelFor*`` class its weights fill (``num_labels`` read from the weights).
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from typing_extensions import override

from lightning_smartinf.core.arguments import Problems
from lightning_smartinf.core.format.rank_state import full_parameter, param_partitions

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


def _strip(name: str, prefix: str) -> str:
    return name[len(prefix) :] if name.startswith(prefix) else name


def _live_masters(strategy: Any) -> dict[str, Tensor]:
    """Full fp32 masters of every parameter the devices hold, by module parameter name (all ranks take part)."""
    import torch.distributed as dist

    smart_update = strategy.smart_update
    backend = smart_update.backend
    backend.wait()
    layout = smart_update.layout()
    buffers = []
    for index, params in enumerate(layout):
        buffer = torch.empty(sum(int(p["partition_numel"]) for p in params), dtype=torch.float32)
        backend.read_master(index, buffer)
        buffers.append(buffer)
    backend.wait()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    state: dict[str, Tensor] = {}
    for params, buffer in zip(layout, buffers):
        for param, part in param_partitions(params, buffer):
            parts = [part]
            if world > 1:  # every rank holds the same parameters in the same order, each its own slice
                part = part.to(strategy.root_device)
                parts = [torch.empty_like(part) for _ in range(world)]
                dist.all_gather(parts, part)
                parts = [p.cpu() for p in parts]
            state[param["name"]] = full_parameter(param["name"], parts, param["shape"])
    return state


def fp32_state_dict(module: L.LightningModule, attribute: str = "model") -> dict[str, Tensor]:
    """Full fp32 weights of ``module.<attribute>`` by its own (Hugging Face) parameter names, during training.

    With ``smart_infinity``: the fp32 master weights read back from the devices; parameters the devices do not
    hold (frozen ones) are gathered from ZeRO. Otherwise: the (gathered) parameters, upcast. Call it on every rank.
    """
    from lightning_smartinf.strategy import SmartInfinityStrategy

    strategy = module.trainer.strategy
    prefix = f"{attribute}."
    masters: dict[str, Tensor] = {}
    if isinstance(strategy, SmartInfinityStrategy) and strategy.has_smart_update:
        masters = {_strip(k, prefix): v for k, v in _live_masters(strategy).items()}
    named = [(_strip(n, prefix), p) for n, p in module.named_parameters() if n.startswith(prefix)]
    rest = [(n, p) for n, p in named if n not in masters]
    if any(hasattr(p, "ds_id") for _, p in rest):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in rest]):
            gathered = {n: p.detach().float().cpu().clone() for n, p in rest}
    else:
        gathered = {n: p.detach().float().cpu().clone() for n, p in rest}
    return {n: masters[n] if n in masters else gathered[n] for n, _ in named}


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


def build_model(config: PretrainedConfig, task: str, *, device: str | torch.device = "cpu") -> PreTrainedModel:
    """An fp32 Hugging Face model of ``task`` (an auto class name or a key of :data:`AUTO_CLASSES`) from ``config``.

    ``device="meta"`` builds it without allocating or initializing weights: names and shapes only.
    """
    cls = auto_class(task, "task")
    with torch.device(device):
        return cls.from_config(config, dtype=torch.float32)


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
    import transformers

    tried = [auto_class(head).__name__] if head is not None else list(HEAD_CLASSES)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # each build warns about weights it did not initialize
    try:
        fits = {name: _fit_head(shapes, config, name) for name in tried}
        matches = [name for name, (fitted, _) in fits.items() if fitted is not None]
        if len(matches) > 1:
            architectures = set(getattr(config, "architectures", None) or ())
            named = [m for m in matches if type(build_model(fits[m][0], m, device="meta")).__name__ in architectures]
            if len(named) == 1:
                matches = named
            elif set(matches) == {"AutoModelForCausalLM", "AutoModelForMaskedLM"}:
                matches = ["AutoModelForCausalLM" if getattr(config, "is_decoder", False) else "AutoModelForMaskedLM"]
    finally:
        transformers.logging.set_verbosity(verbosity)
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
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        base = build_model(config, "AutoModel", device="meta")
    finally:
        transformers.logging.set_verbosity(verbosity)
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


def save_pretrained(
    state: dict[str, Tensor],
    config: PretrainedConfig,
    task: str,
    out_dir: str | os.PathLike,
    *,
    tokenizer: Any = None,
) -> PreTrainedModel:
    """Write ``state`` (fp32 weights by Hugging Face name) as a ``save_pretrained`` directory; return the model.

    ``task``: an auto class name (``"AutoModelForTokenClassification"``) or a key of :data:`AUTO_CLASSES`. Every
    parameter of the model must be in ``state`` under one of its names, tied weights (GPT-2's ``lm_head``) once:
    they stay tied. Buffers keep the values the config gives them. ``config.json`` names the model's class in
    ``architectures``. The tokenizer, if given, is saved beside the model.

    Raises:
        ValueError: ``state`` lacks parameters of the model, has names it does not know, or other shapes.
    """
    model = build_model(config, task)
    problem = _mismatch({n: t.shape for n, t in state.items()}, model)
    if problem:
        raise ValueError(f"The weights do not match a {type(model).__name__} of this config: {problem}.")
    with torch.no_grad():
        for group in _alias_groups(model):
            source = next(n for n in group if n in state)
            model.get_parameter(group[0]).copy_(state[source])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return model


class SavePretrained(Callback):
    """At the end of fit, write the trained Hugging Face model as a ``save_pretrained`` directory.

    The weights are the fp32 master weights consolidated from the devices (not the bf16/fp16 copies ZeRO trains
    with); the config and tokenizer come from the module. Works with :class:`~lightning_smartinf.hf.HFCausalLM`,
    :class:`~lightning_smartinf.hf.HFSequenceClassifier` or any module with a ``save_pretrained(out_dir)`` method.

    Args:
        dirpath: the output directory (created; files in it are overwritten).
    """

    def __init__(self, dirpath: str) -> None:
        problems = Problems("SavePretrained", MisconfigurationException)
        if problems.path("dirpath", dirpath) and os.path.exists(dirpath) and not os.path.isdir(dirpath):
            problems.add(
                f"`dirpath={str(dirpath)!r}` is a file, not a directory: the model is written into a directory. "
                "Choose another path or move the file away."
            )
        problems.raise_if_any()
        self.dirpath = dirpath
        self.state: dict[str, Tensor] = {}

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        saver = getattr(pl_module, "save_pretrained", None)
        if saver is None:
            raise MisconfigurationException(
                f"`SavePretrained` needs a module with `save_pretrained(out_dir)` (`HFCausalLM`, "
                f"`HFSequenceClassifier`); {type(pl_module).__name__} has none."
            )
        self.state = saver(self.dirpath)
