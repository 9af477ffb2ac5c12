"""Pretrained Hugging Face weights loaded straight into ZeRO-3's partitions, in any LightningModule.

Under ``strategy="smart_infinity"`` (ZeRO stage 3) every parameter is partitioned across ranks the moment it is
created, and with ``offload_parameters="storage"`` its partition lives in a file. A model loaded with a plain
``from_pretrained`` in a module's ``__init__`` is whole in host memory first (28 GB in fp32 at 7B): the strategy
exists to train models that do not fit there. :func:`from_pretrained`, called in ``configure_model``, builds the
model partitioned (transformers' own ZeRO-3 construction, without its random initialisation of weights the
checkpoint fills) and copies the weights from the safetensors files into the partitions one tensor at a time, read
with plain reads (:func:`tensor_file`): host memory grows by the largest tensor, not by a shard or the model.
Checkpoints whose names or shapes transformers must convert, and ``pytorch_model.bin`` weights, take transformers'
own ZeRO-3 loading, which maps every file at once. :class:`~lightning_smartinf.hf.HFCausalLM` and
:class:`~lightning_smartinf.hf.HFSequenceClassifier` load through the same call.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_smartinf.core.format.safetensors_stream import SavedTensor, read_safetensors_header
from lightning_smartinf.core.progress import Progress
from lightning_smartinf.hf.pretrained import auto_class as find_auto_class
from lightning_smartinf.hf.sources import model_files

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: A model directory must hold one of these.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_model_dir(
    path: str | os.PathLike,
    argument: str = "model_path",
    *,
    revision: str | None = None,
    token: str | bool | None = None,
) -> Path:
    """The local directory of a Hugging Face model with a config and weights: ``path`` itself, or the snapshot of the
    Hub id ``path`` in the Hub's cache (:mod:`lightning_smartinf.hf.sources`); or a clear error."""
    directory = model_files(path, argument, revision=revision, token=token)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"`{argument}={str(path)!r}` is neither a directory nor a Hugging Face Hub id. Give a local directory "
            "written by `save_pretrained` (config.json + weights + tokenizer), or a Hub id such as 'gpt2' or "
            "'meta-llama/Llama-3.1-8B'."
        )
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"`{argument}={str(path)!r}` has no config.json: it is not a `save_pretrained` directory."
        )
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        raise FileNotFoundError(
            f"`{argument}={str(path)!r}` has no weights: none of {', '.join(WEIGHT_FILES)} is there. Copy the "
            "model's weight files into it, or train from scratch with `config={...}` and no `model_path`."
        )
    return directory


def attached_trainer(module: L.LightningModule) -> L.Trainer | None:
    """The trainer ``module`` is attached to, or ``None`` before ``fit`` (and the like) attaches it."""
    try:
        return module.trainer
    except RuntimeError:  # Lightning's "is not attached to a `Trainer`"
        return None


class _ZeRO3Config:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def is_zero3(self) -> bool:
        return True


@contextmanager
def partitioned_build(module: L.LightningModule) -> Iterator[None]:
    """Build Hugging Face models inside this block partitioned, as ``module``'s strategy trains them: transformers'
    ZeRO-3 model construction is switched on while the strategy partitions parameters at init.

    For models :func:`from_pretrained` does not build: ``AutoModelForCausalLM.from_config(config)``, a model class
    called directly, several models in one module. Use it in ``configure_model``; outside a ZeRO-3 strategy (or
    before a trainer is attached) it changes nothing.
    """
    trainer = attached_trainer(module)
    if trainer is None or not is_zero3(trainer.strategy):
        yield
        return
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    # transformers' `HfDeepSpeedConfig` needs `accelerate`; its ZeRO-3 paths read only `.config` and `.is_zero3()`.
    holder = _ZeRO3Config(trainer.strategy.config)
    set_hf_deepspeed_config(holder)  # a weak reference: `holder` must outlive the build
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del holder


def from_pretrained(
    module: L.LightningModule,
    model_path: str | os.PathLike,
    *,
    auto_class: str | type = "AutoModelForCausalLM",
    dtype: torch.dtype = torch.float32,
    revision: str | None = None,
    token: str | bool | None = None,
    **kwargs: Any,
) -> PreTrainedModel:
    """Load the pretrained model in ``model_path`` for ``module``, partitioned while it loads; call it in
    ``configure_model``.

    .. code-block:: python

        class MyLM(L.LightningModule):
            def configure_model(self):
                if self.model is None:
                    self.model = from_pretrained(self, "meta-llama/Llama-3.1-8B")  # or a local directory

    Under ``strategy="smart_infinity"`` the weights go from the checkpoint's files into each rank's partitions (and
    into the parameter files with ``offload_parameters="storage"``): the whole model is never in host memory, and
    peak memory grows by the largest tensor, whatever the model's size. Under any other strategy, or in a module not yet
    attached to a trainer, it is a plain ``from_pretrained`` (and warns in the second case, where the whole model
    ends up in memory).

    Args:
        module: the LightningModule the model is for (its trainer's strategy decides how the model is built).
        model_path: a local directory written by ``save_pretrained`` (config, weights: ``model.safetensors``, or
            shards with an index), or a Hugging Face Hub id, resolved as transformers does through the Hub's cache
            (only the config, tokenizer and weight files are fetched; ``HF_HUB_OFFLINE`` is honoured).
        revision: with a Hub id: the branch, tag or commit to load (default: the main branch).
        token: with a Hub id: the Hub token (default: the one ``hf auth login`` saved, or ``HF_TOKEN``).
        auto_class: the transformers class to load with, or its name (``"AutoModelForSequenceClassification"``).
        dtype: the dtype of the parameters built; fp32 (the default) keeps the masters exact, and the strategy's
            precision decides what the forward pass computes in.
        **kwargs: passed on to ``from_pretrained`` (``config=``, ``num_labels=``, ``attn_implementation=``, ...).

    Returns:
        The model, in training mode (``from_pretrained`` returns it in eval mode, and Lightning keeps submodules'
        modes).
    """
    if not isinstance(module, L.LightningModule):
        raise TypeError(
            f"`from_pretrained(module={type(module).__name__})`: `module` must be the LightningModule the model is "
            "for (call `from_pretrained(self, path)` in its `configure_model`)."
        )
    directory = check_model_dir(model_path, revision=revision, token=token)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"`from_pretrained(dtype={dtype!r})`: `dtype` must be a floating-point torch.dtype "
            "(torch.float32, torch.bfloat16 or torch.float16)."
        )
    cls = find_auto_class(auto_class) if isinstance(auto_class, str) else auto_class
    if not hasattr(cls, "from_pretrained"):
        raise TypeError(
            f"`from_pretrained(auto_class={auto_class!r})`: `auto_class` must be a transformers class with a "
            "`from_pretrained` (e.g. `AutoModelForCausalLM`) or its name."
        )
    trainer = attached_trainer(module)
    if trainer is None:
        rank_zero_warn(
            f"`from_pretrained(..., {str(model_path)!r})` ran in a module not attached to a Trainer: the whole model "
            "is loaded in host memory. Call it in the module's `configure_model`, where `smart_infinity` "
            "partitions it while it loads."
        )

    def transformers_loading() -> PreTrainedModel:  # maps every weight file at once: memory, the 16-bit model
        kwargs.setdefault("local_files_only", True)
        with partitioned_build(module):
            return cls.from_pretrained(directory, dtype=dtype, **kwargs).train()

    plan = _weight_plan(directory) if trainer is not None and is_zero3(trainer.strategy) else None
    if plan is None:  # not ZeRO-3, or `.bin` weights
        return transformers_loading()
    config, model_kwargs = _config(directory, kwargs)
    with partitioned_build(module), _initialization_deferred() as initialize:
        build = getattr(cls, "from_config", None) or cls._from_config
        model = build(config, dtype=dtype, **model_kwargs)
    targets = _targets(model, plan)
    if targets is None:  # names or shapes transformers must convert (the model built here is dropped)
        del model
        return transformers_loading()
    _stream_weights(directory, plan, targets)
    loaded = {id(target) for target, _ in targets.values()}
    missing = [n for n, p in model.named_parameters() if id(p) not in loaded]
    if missing:  # a new head: initialised as transformers would, every loaded weight left as it is
        for target, _ in targets.values():
            target._is_hf_initialized = True  # transformers' init functions skip such tensors
        for submodule in model.modules():
            own = list(submodule.parameters(recurse=False))
            if own and all(id(p) in loaded for p in own):
                submodule._is_hf_initialized = True
        initialize(model)
        rank_zero_warn(
            f"`from_pretrained({str(model_path)!r})`: {len(missing)} parameter(s) are not in the checkpoint and were "
            f"newly initialized: {', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}. Train them before "
            "using the model."
        )
    model.tie_weights()
    return model.train()


@contextmanager
def _initialization_deferred() -> Iterator[Any]:
    """While a model is built under ZeRO-3, skip transformers' random initialization of every weight (it gathers
    each module in turn: most of a large model's build time); yields the initializer, to run on what the checkpoint
    did not fill. Transformers versions without a separate ZeRO-3 initializer initialize at construction."""
    from transformers.integrations import deepspeed as hf_deepspeed

    initialize = getattr(hf_deepspeed, "initialize_weights_zero3", None)
    if initialize is None:
        yield lambda model: None
        return
    hf_deepspeed.initialize_weights_zero3 = lambda model: None
    try:
        yield initialize
    finally:
        hf_deepspeed.initialize_weights_zero3 = initialize


def is_zero3(strategy: Any) -> bool:
    """Whether ``strategy`` partitions parameters as it builds them (DeepSpeed ZeRO stage 3)."""
    config = getattr(strategy, "config", None)
    return isinstance(config, dict) and config.get("zero_optimization", {}).get("stage") == 3


def tensor_file(path: Path) -> dict[str, SavedTensor]:
    """The tensors of the safetensors weight file at ``path``, by name, each read when asked with plain reads.

    Raises:
        ValueError: ``path`` is not a safetensors file this loader reads (the reason in the message).
    """
    try:
        return read_safetensors_header(path)
    except ValueError as exc:
        raise ValueError(f"{str(path)!r} is not a safetensors file this loader reads ({exc}).") from None


def _weight_plan(directory: Path) -> dict[str, SavedTensor] | None:
    """The tensors of ``directory``'s safetensors files, file by file; ``None`` for ``pytorch_model.bin`` weights."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    return {name: tensor for file in files for name, tensor in tensor_file(directory / file).items()}


def _config(directory: Path, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The model's config with ``kwargs``' config fields applied, and the kwargs left for the model's constructor."""
    from transformers import AutoConfig

    kwargs = dict(kwargs)
    kwargs.pop("local_files_only", None)
    config = kwargs.pop("config", None)
    if config is None:
        return AutoConfig.from_pretrained(directory, local_files_only=True, return_unused_kwargs=True, **kwargs)
    config = copy.deepcopy(config)
    for key in [k for k in kwargs if hasattr(config, k)]:
        setattr(config, key, kwargs.pop(key))
    return config, kwargs


#: Where each checkpoint tensor goes: a parameter (partitioned) or a buffer (whole on every rank).
Targets = dict[str, tuple[torch.nn.Parameter | torch.Tensor, bool]]


def _targets(model: torch.nn.Module, plan: dict[str, SavedTensor]) -> Targets | None:
    """Each checkpoint tensor's parameter or buffer in ``model``, or ``None`` when one has no place of its shape.

    Names match as transformers writes them, with or without the base model's prefix (``model.`` in Llama); tied
    weights answer to each of their names.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    prefix = getattr(model, "base_model_prefix", "")
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    targets: Targets = {}
    for key, saved in plan.items():
        candidates = [key, f"{prefix}.{key}", key.removeprefix(f"{prefix}.")] if prefix else [key]
        name = next((c for c in candidates if c in params or c in buffers), None)
        if name is None and any(p.search(key) for p in ignored):  # e.g. masks older checkpoints saved
            continue
        if name is None:
            return None
        target = params.get(name, buffers.get(name))
        if saved.shape != tuple(getattr(target, "ds_shape", target.shape)):
            return None
        targets[key] = (target, name in params)
    return targets


def _stream_weights(directory: Path, plan: dict[str, SavedTensor], targets: Targets) -> None:
    """Copy every tensor of the checkpoint into its partitioned parameter, one parameter at a time.

    Invariant: one tensor is read and one parameter gathered at once, so host memory grows by the largest parameter
    (read and gathered), whatever the model's size. Only rank 0 reads values; ``GatheredParameters`` scatters what
    it wrote into every rank's partition (and parameter file) when the block ends. Buffers are read on every rank.
    """
    import deepspeed

    reads = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    total = sum(saved.nbytes for key, saved in plan.items() if key in targets)
    with Progress(f"loading the pretrained weights of {directory}", total) as progress, torch.no_grad():
        for key, (target, is_param) in targets.items():
            if not is_param:
                target.copy_(plan[key].load())
            else:
                with deepspeed.zero.GatheredParameters([target], modifier_rank=0):
                    if reads:
                        target.data.copy_(plan[key].load())
            progress.update(plan[key].nbytes)
