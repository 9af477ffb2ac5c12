"""Hugging Face models trained with ``strategy="smart_infinity"``: LightningModules, data modules and export.

- :class:`HFCausalLM` fine-tunes any local ``AutoModelForCausalLM`` directory, or pre-trains one from a config
  (``config={...}`` of e.g. ``GPT2Config`` fields and a ``tokenizer_path``).
- :func:`from_pretrained` loads a pretrained model in any LightningModule's ``configure_model`` straight into ZeRO-3's
  partitions (the whole model is never in host memory); :func:`partitioned_build` does it for models built otherwise.
- :class:`HFSequenceClassifier` fine-tunes any local ``AutoModelForSequenceClassification`` (or encoder) directory.
- :class:`TextDataModule` packs plain text / JSONL into blocks; :class:`SFTDataModule` reads prompt/response JSONL
  (loss on the responses); both tokenise once into a memory-mapped token cache. :class:`ClassificationDataModule`
  reads CSV / JSONL with text and label columns. :func:`train_bpe_tokenizer` trains a byte-level BPE tokenizer.
- :class:`SavePretrained` writes a ``save_pretrained`` directory (sharded safetensors, in the dtype the model was
  loaded in, or ``dtype=``) with the fp32 master weights consolidated from the devices at the end of fit;
  :func:`lightning_smartinf.commands.export.export_pretrained` does it from a checkpoint.

A model or tokenizer is named by a local directory or by a Hugging Face Hub id (``"meta-llama/Llama-3.1-8B"``),
which ``huggingface_hub`` resolves through its cache (:mod:`lightning_smartinf.hf.sources`): only the config,
tokenizer and weight files are fetched, and ``HF_HUB_OFFLINE`` is honoured.
Requires the ``hf`` extra: ``pip install -e '.[hf]'`` in the repository (``scripts/setup.sh`` installs it).
"""

from lightning_utilities.core.imports import RequirementCache

_TRANSFORMERS_AVAILABLE = RequirementCache("transformers>=4.56")  # `from_pretrained(dtype=...)`
if not _TRANSFORMERS_AVAILABLE:
    raise ModuleNotFoundError(
        f"`lightning_smartinf.hf` needs Hugging Face transformers ({_TRANSFORMERS_AVAILABLE.message}). Install it by "
        "running `pip install -e '.[hf]'`."
    )

from lightning_smartinf.hf.data import (  # noqa: E402
    ClassificationDataModule,
    SFTDataModule,
    TextDataModule,
    load_tokenizer,
    train_bpe_tokenizer,
)
from lightning_smartinf.hf.loading import from_pretrained, partitioned_build  # noqa: E402
from lightning_smartinf.hf.modules import HFCausalLM, HFSequenceClassifier  # noqa: E402
from lightning_smartinf.hf.pretrained import SavePretrained, fp32_state_dict, save_pretrained  # noqa: E402

__all__ = [
    "ClassificationDataModule",
    "HFCausalLM",
    "HFSequenceClassifier",
    "SFTDataModule",
    "SavePretrained",
    "TextDataModule",
    "fp32_state_dict",
    "from_pretrained",
    "load_tokenizer",
    "partitioned_build",
    "save_pretrained",
    "train_bpe_tokenizer",
]
