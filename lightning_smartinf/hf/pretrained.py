"""Hugging Face ``save_pretrained`` directories with the fp32 master weights consolidated from the devices.

With ``strategy="smart_infinity"`` the fp32 masters never leave the devices during training; ZeRO's parameters
are the low-precision copies. :func:`fp32_state_dict` reads the masters back from every device of every rank
(:meth:`Backend.read_master`) and joins the ranks' partitions; :func:`save_pretrained` writes them as a Hugging Face
model directory; :class:`SavePretrained` does both at the end of fit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from typing_extensions import override

from lightning_smartinf.arguments import Problems

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

#: Task name (``HFCausalLM.task`` / ``HFSequenceClassifier.task``) -> transformers auto class.
AUTO_CLASSES = {"causal-lm": "AutoModelForCausalLM", "sequence-classification": "AutoModelForSequenceClassification"}


def _strip(name: str, prefix: str) -> str:
    return name[len(prefix) :] if name.startswith(prefix) else name


def _live_masters(strategy: Any) -> dict[str, Tensor]:
    """Full fp32 masters of every parameter the devices hold, by module parameter name (all ranks take part)."""
    import torch.distributed as dist

    zero_optimizer = strategy.deepspeed_engine.optimizer
    backend = zero_optimizer.smartinf_backend
    backend.wait()
    layout = zero_optimizer.smartinf_layout()
    buffers = []
    for index, params in enumerate(layout):
        buffer = torch.empty(sum(int(p["partition_numel"]) for p in params), dtype=torch.float32)
        backend.read_master(index, buffer)
        buffers.append(buffer)
    backend.wait()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    state: dict[str, Tensor] = {}
    for params, buffer in zip(layout, buffers):
        offset = 0
        for param in params:
            n, shape = int(param["partition_numel"]), list(param["shape"])
            part = buffer[offset : offset + n]
            offset += n
            if world > 1:  # every rank holds the same parameters in the same order, each its own slice
                part = part.to(strategy.root_device)
                parts = [torch.empty_like(part) for _ in range(world)]
                dist.all_gather(parts, part)
                part = torch.cat(parts).cpu()
            numel = 1
            for size in shape:
                numel *= size
            state[param["name"]] = part[:numel].clone().view(shape)
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
    if isinstance(strategy, SmartInfinityStrategy) and strategy._backend is not None:
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


def build_model(config: PretrainedConfig, task: str) -> PreTrainedModel:
    """An fp32 Hugging Face model of ``task`` (a key of :data:`AUTO_CLASSES`) built from ``config``, on the CPU."""
    import transformers

    if task not in AUTO_CLASSES:
        raise ValueError(f"Unknown task {task!r}; it must be one of: {', '.join(map(repr, AUTO_CLASSES))}.")
    return getattr(transformers, AUTO_CLASSES[task]).from_config(config, dtype=torch.float32)


def save_pretrained(
    state: dict[str, Tensor],
    config: PretrainedConfig,
    task: str,
    out_dir: str | os.PathLike,
    *,
    tokenizer: Any = None,
) -> PreTrainedModel:
    """Write ``state`` (fp32 weights by Hugging Face name) as a ``save_pretrained`` directory; return the model.

    Every parameter of the model must be in ``state`` except weights tied to one that is (GPT-2's ``lm_head``);
    buffers keep the values the config gives them. The tokenizer, if given, is saved beside the model.

    Raises:
        ValueError: ``state`` lacks parameters of the model or has names the model does not know.
    """
    model = build_model(config, task)
    own = {n for n, _ in model.named_parameters()}  # tied weights appear once
    missing, unexpected = sorted(own - state.keys()), sorted(state.keys() - dict(model.state_dict()).keys())
    if missing or unexpected:
        raise ValueError(
            f"The weights do not match a {type(model).__name__} of this config: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}."
        )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.shape != state[name].shape:
                raise ValueError(
                    f"{name}: the weights have shape {list(state[name].shape)}, the model {list(param.shape)}."
                )
            param.copy_(state[name])
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
