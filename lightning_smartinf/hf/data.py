"""Data modules for Hugging Face models on local files, and a locally trained byte-level BPE tokenizer.

- :class:`TextDataModule`: plain text (``.txt``) or JSON lines (``.jsonl``, one ``{"text": ...}`` per line) →
  one token stream (documents joined by the tokenizer's end-of-text token) → packed blocks of ``block_size``.
- :class:`SFTDataModule`: JSON lines of prompt/response pairs → one example each, ``[BOS] prompt response EOS``,
  the loss on the response only (``labels`` -100 on the prompt), padded per batch.
- :class:`ClassificationDataModule`: CSV (``.csv``, with a header) or JSON lines with a text and a label column →
  tokenized, truncated to ``max_length``, padded per batch.

All take the tokenizer from their own ``tokenizer_path`` or, when it is ``None``, from the LightningModule they
train (its ``tokenizer``, loaded from its ``model_path`` / ``tokenizer_path``), and check their sequence length
against the model's maximum (its ``max_positions``). The first two tokenise their files once, streaming, into a
token cache on disk (:mod:`lightning_smartinf.hf.token_cache`) that later runs reuse, and read the tokens through
memory maps: a corpus larger than memory trains as it is. After ``setup``, each holds its training and validation
datasets in ``train_data`` and ``val_data``.
"""

from __future__ import annotations

import csv
import functools
import json
import os
import shutil
import warnings
from abc import ABCMeta, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

from lightning_smartinf.core.arguments import Problems, show
from lightning_smartinf.core.io.leftovers import remove_leftovers, temporary_path
from lightning_smartinf.hf.sources import tokenizer_files
from lightning_smartinf.hf.token_cache import (
    Batch,
    TokenCache,
    cached_tokens,
    default_cache_dir,
    make_cache_dir,
    tokenizer_fingerprint,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Files a tokenizer directory may hold; one of them must be there.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model")
END_OF_TEXT = "<|endoftext|>"
#: The smallest vocabulary a byte-level BPE tokenizer has: the 256 bytes and :data:`END_OF_TEXT`, before any merge.
MIN_VOCAB_SIZE = 257
VOCAB_WHY = "the 256 bytes and <|endoftext|> come first, then the merges"
TEXT_SUFFIXES = (".txt", ".jsonl")
TABLE_SUFFIXES = (".csv", ".jsonl")
#: A ``.txt`` file is read and tokenised in pieces of about this many characters (see :func:`_text_pieces`): a
#: fast tokenizer takes about 0.5 KB of memory per character of one string while it encodes it.
TEXT_PIECE_CHARS = 1 << 18
#: Characters of text per tokenizer call: several pieces or records, which a fast tokenizer encodes in parallel.
BATCH_CHARS = 1 << 20
#: Records per tokenizer call at most.
BATCH_RECORDS = 4096
#: The label of a token the loss skips (``torch.nn.functional.cross_entropy``'s ``ignore_index``).
IGNORE_INDEX = -100
T = TypeVar("T")
#: The datasets of a data module (:class:`_FileData`).
D = TypeVar("D", bound=Sized)


def load_tokenizer(
    path: str | os.PathLike,
    *,
    argument: str = "tokenizer_path",
    revision: str | None = None,
    token: str | bool | None = None,
) -> PreTrainedTokenizerBase:
    """The tokenizer in the local directory ``path``, or of the Hugging Face Hub id ``path`` (its tokenizer files
    only, through the Hub's cache: :mod:`lightning_smartinf.hf.sources`).

    Raises:
        FileNotFoundError: ``path`` is not a directory or holds no tokenizer files, or a Hub id cannot be had; the
            message names ``argument``.
    """
    from transformers import AutoTokenizer

    directory = tokenizer_files(path, argument, revision=revision, token=token)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"`{argument}={str(path)!r}` is neither a directory nor a Hugging Face Hub id. Give a local directory "
            "written by `tokenizer.save_pretrained(...)`, or a Hub id such as 'gpt2' or 'meta-llama/Llama-3.1-8B'."
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

    problems = Problems("train_bpe_tokenizer")
    problems.integer("vocab_size", vocab_size, low=MIN_VOCAB_SIZE, why=VOCAB_WHY, example=8192)
    problems.integer("min_frequency", min_frequency, low=1, example=2)
    problems.integer("model_max_length", model_max_length, low=1, example=1024)
    if isinstance(files, (str, os.PathLike)):
        problems.add(f"`files={show(files)}` is one path: pass a list of text files, e.g. `files=[{str(files)!r}]`.")
    problems.raise_if_any()
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
    remove_leftovers(out.parent, out.name)  # staged by a run that was killed
    staging = temporary_path(out)
    staging.mkdir(mode=0o700)
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


def _lines(path: Path, where: str) -> Iterator[str]:
    """The lines of the UTF-8 text file ``path`` (newlines kept, ``\\r\\n`` read as ``\\n``), one at a time."""
    number = 0
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                number += 1
                yield line
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{where}: not UTF-8 text after line {number} ({exc.reason}). Save the file as UTF-8."
        ) from None


def _jsonl_rows(path: Path, fields: dict[str, str], argument: str, owner: str) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` of each non-blank line of the JSON-lines file ``path``, read one at a time.

    ``fields`` maps each field-name argument (``"text_field"``) to the field it names, which every line must have.
    """
    where = f"`{owner}({argument}={str(path)!r})`"
    wanted = " and ".join(map(repr, fields.values()))
    for number, line in enumerate(_lines(path, where), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{where}: line {number} is not JSON ({exc}).") from None
        if not isinstance(row, dict):
            raise ValueError(
                f"{where}: line {number} is not a JSON object ({line.strip()[:40]!r}). Each line must be an object "
                f"with {wanted}."
            )
        for option, field in fields.items():
            if field not in row:
                raise ValueError(
                    f"{where}: line {number} has no {field!r} field (its fields: "
                    f"{', '.join(map(repr, row)) or 'none'}). Each line must be an object with {wanted}; set "
                    f"`{option}` to the name of the field that holds it."
                )
        yield number, row


def _iter_texts(paths: Iterable[str], text_field: str = "text") -> Iterable[str]:
    for path in paths:
        if path.endswith(".jsonl"):
            rows = _jsonl_rows(Path(path), {"text_field": text_field}, "files", "train_bpe_tokenizer")
            yield from (str(row[text_field]) for _, row in rows)
        else:
            yield Path(path).read_text(encoding="utf-8")


def _text_pieces(path: Path, where: str) -> Iterator[str]:
    """The text of ``path`` in pieces of about :data:`TEXT_PIECE_CHARS` characters, cut only after a newline with a
    non-space character on each side. Byte-level BPE pre-tokenisers (GPT-2, Llama 3, Qwen) and WordPiece's split
    there anyway, so the pieces give the ids of the whole text; a SentencePiece tokenizer that puts a space before
    its input gives the first word of each piece after the first that space (about one token in 60K)."""
    piece: list[str] = []
    size = 0
    for line in _lines(path, where):
        if size >= TEXT_PIECE_CHARS and not line[0].isspace() and len(piece[-1]) > 1 and not piece[-1][-2].isspace():
            yield "".join(piece)
            piece, size = [], 0
        piece.append(line)
        size += len(line)
    if piece:
        yield "".join(piece)


def _batched(items: Iterable[T], chars: Callable[[T], int]) -> Iterator[list[T]]:
    """``items`` in lists of :data:`BATCH_CHARS` characters (by ``chars``) or :data:`BATCH_RECORDS` items."""
    batch: list[T] = []
    size = 0
    for item in items:
        batch.append(item)
        size += chars(item)
        if size >= BATCH_CHARS or len(batch) >= BATCH_RECORDS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def _document_batches(
    tokenizer: PreTrainedTokenizerBase, file: Path, text_field: str | None, argument: str
) -> Iterator[Batch]:
    """Token batches of a text file: one document per JSONL line (``text_field``), or the whole ``.txt`` file
    (``text_field=None``), each followed by the end-of-text token."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if text_field is None:
        where = f"`TextDataModule({argument}={str(file)!r})`"
        for pieces in _batched(_text_pieces(file, where), len):
            yield _encode(tokenizer, pieces), None
        yield [eos], None
        return
    rows = _jsonl_rows(file, {"text_field": text_field}, argument, "TextDataModule")
    for texts in _batched((str(row[text_field]) for _, row in rows), len):
        yield [ids + eos for ids in _encode(tokenizer, texts)], None


# ------------------------------------------------------------------------------------------------ the base


def _check_field(problems: Problems, key: str, value: Any) -> bool:
    """``value`` names a field (a JSON key or a CSV column): a non-empty str."""
    if isinstance(value, str) and value:
        return True
    example = key.removesuffix("_field")  # each field argument's default: text_field="text", prompt_field="prompt"
    problems.add(
        f"`{key}={show(value)}` is not a field name: it must be a non-empty str. Pass e.g. `{key}={example!r}`."
    )
    return False


def _check_two_fields(problems: Problems, first: tuple[str, Any], second: tuple[str, Any], noun: str) -> None:
    """Two ``(argument, value)`` pairs that each name a field (a ``noun``: JSON field or CSV column), not the same."""
    both = [_check_field(problems, *first), _check_field(problems, *second)]  # a list: each is checked
    if all(both) and first[1] == second[1]:
        (a, value_a), (b, value_b) = first, second
        problems.add(
            f"`{a}={value_a!r}` and `{b}={value_b!r}` name the same {noun}. Give the {noun} of the "
            f"{a.removesuffix('_field')} and the {noun} of the {b.removesuffix('_field')}."
        )


class _FileData(L.LightningDataModule, Generic[D], metaclass=ABCMeta):
    """What the three data modules share: a training file and a validation file or a share held out of the training
    data, the tokenizer, and the two loaders. :meth:`setup` builds the datasets (``D``) ``train_data`` and
    ``val_data`` once, through a subclass's hooks: the dataset of one file (:meth:`_dataset`), what it takes from the
    tokenizer first (:meth:`_prepare`), how a share is held out (:meth:`_split`)."""

    #: The sequence-length argument, checked against the model's maximum (:meth:`_check_length`).
    _LENGTH: ClassVar[str] = "max_length"
    #: What an item of the datasets is, as the too-few error counts them; and a fix for it besides the common ones.
    _UNIT: ClassVar[str]
    _ALSO_FIX: ClassVar[str] = ""
    #: Whether the training loader drops a short last batch (only ever when there is a full one: never every batch).
    _DROP_LAST: ClassVar[bool] = False
    #: Old attribute names that still work, with a DeprecationWarning: old name → ``train_data`` / ``val_data``.
    _RENAMED: ClassVar[dict[str, str]] = {}
    #: The loaders' collate function, the class's or set by :meth:`_prepare`: a module-level function or a partial of
    #: one, which a worker process started by spawn unpickles without the data module.
    _collate: Callable[[list[Any]], dict[str, torch.Tensor]]
    #: The default of those that take a ``shuffle`` argument: Classification always shuffles.
    shuffle: bool = True

    def __init__(  # subclasses pass their arguments of these names, in this order, and the problems of their own
        self,
        train_file: str,
        val_file: str | None,
        batch_size: int,
        val_fraction: float,
        tokenizer_path: str | None,
        seed: int,
        num_workers: int,
        *,
        problems: Problems,
    ) -> None:
        super().__init__()
        problems.path("train_file", train_file)
        problems.path("val_file", val_file, optional=True)
        problems.path("tokenizer_path", tokenizer_path, optional=True)
        problems.integer("batch_size", batch_size, low=1, example=8)
        share = isinstance(val_fraction, (int, float)) and not isinstance(val_fraction, bool)
        if not (share and 0.0 <= val_fraction < 1.0):  # also NaN
            problems.add(
                f"`val_fraction={show(val_fraction)}` is not a share to hold out: it must be a number in [0, 1) (0: "
                "none). Pass e.g. `val_fraction=0.05`."
            )
        problems.integer("seed", seed, example=42)
        problems.integer("num_workers", num_workers, example=0)
        problems.raise_if_any()
        self.train_file, self.val_file, self.tokenizer_path = train_file, val_file, tokenizer_path
        self.batch_size, self.val_fraction, self.seed, self.num_workers = batch_size, val_fraction, seed, num_workers
        # Both None before setup, both set by it (val_data empty with val_fraction=0 and no val_file).
        self.train_data: D | None = None
        self.val_data: D | None = None

    def _renamed(self, name: str) -> str:
        """The attribute that ``name`` names: itself, or the new name of an old one (with a DeprecationWarning)."""
        if (new := type(self)._RENAMED.get(name)) is not None:
            warnings.warn(f"`{type(self).__name__}.{name}` is deprecated: use `{new}`.", DeprecationWarning, 3)
        return new or name

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(self._renamed(name), value)

    if not TYPE_CHECKING:  # hidden from type checkers, for which any other unknown attribute stays an error

        def __getattr__(self, name: str) -> Any:  # called only for a name not found the usual way
            if name not in type(self)._RENAMED:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            return getattr(self, self._renamed(name))

    def _module_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer of ``tokenizer_path``, else of the LightningModule being trained."""
        if self.tokenizer_path is not None:
            return load_tokenizer(self.tokenizer_path)
        module = self.trainer.lightning_module if self.trainer is not None else None
        tokenizer = getattr(module, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(
                f"`{type(self).__name__}(tokenizer_path=None)` takes the tokenizer of the model it trains, but "
                f"{type(module).__name__} has none. Give `tokenizer_path`, or train an `HFCausalLM` / "
                "`HFSequenceClassifier`."
            )
        return tokenizer

    def _check_length(self) -> None:
        """The sequence length (the argument ``_LENGTH``) is an integer >= 2, at most the model's maximum."""
        argument, value = self._LENGTH, getattr(self, self._LENGTH)
        if not isinstance(value, int) or value < 2:
            raise ValueError(f"`{type(self).__name__}({argument}={value!r})` must be an integer >= 2.")
        module = self.trainer.lightning_module if self.trainer is not None else None
        limit = getattr(module, "max_positions", None)
        if limit is not None and value > limit:
            raise ValueError(
                f"`{type(self).__name__}({argument}={value})` is longer than the model can take: "
                f"{type(module).__name__} has `max_position_embeddings={limit}`. Set `{argument}` to at most {limit}."
            )

    def _prepare(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Take what the datasets and the collate function need from the tokenizer, before any dataset is built."""

    @abstractmethod
    def _dataset(self, tokenizer: PreTrainedTokenizerBase, argument: str, path: str) -> D:
        """The dataset of the data file ``path`` (given as ``argument``)."""

    @abstractmethod
    def _split(self, data: D, held_out: int) -> tuple[D, D]:
        """(training, validation) data, ``held_out`` items of ``data`` in the validation data."""

    def _random_split(self, count: int, held_out: int) -> tuple[np.ndarray, np.ndarray]:
        """(training, validation) positions among ``count`` items, ``held_out`` of them chosen at random with
        ``seed``."""
        order = torch.randperm(count, generator=torch.Generator().manual_seed(self.seed)).numpy()
        return order[held_out:], order[:held_out]

    def setup(self, stage: str | None = None) -> None:
        if self.train_data is not None:
            return
        self._check_length()
        tokenizer = self._module_tokenizer()
        self._prepare(tokenizer)
        data = self._dataset(tokenizer, "train_file", self.train_file)
        if self.val_file is not None:
            self.train_data, self.val_data = data, self._dataset(tokenizer, "val_file", self.val_file)
            return
        # At least one item held out when val_fraction > 0, and at least one left to train on.
        held_out = max(1, round(len(data) * self.val_fraction)) if self.val_fraction > 0 else 0
        if held_out >= len(data):
            raise ValueError(
                f"`{type(self).__name__}(train_file={self.train_file!r})` has {len(data)} {self._UNIT}(s): too few to "
                f"hold out `val_fraction={self.val_fraction}` for validation. Give more data{self._ALSO_FIX}, a "
                "`val_file`, or `val_fraction=0`."
            )
        self.train_data, self.val_data = self._split(data, held_out)

    def train_dataloader(self) -> DataLoader:
        assert self.train_data is not None, "call setup() first"
        return DataLoader(
            self.train_data,  # map-style: len() and [i] (a list is one too)
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            generator=torch.Generator().manual_seed(self.seed),
            collate_fn=self._collate,
            num_workers=self.num_workers,
            drop_last=self._DROP_LAST and len(self.train_data) >= self.batch_size,
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val_data is None or len(self.val_data) == 0:
            return []
        return DataLoader(
            self.val_data, batch_size=self.batch_size, collate_fn=self._collate, num_workers=self.num_workers
        )


class _TokenCachedData(_FileData[D]):
    """A data module that tokenises its files once into a :class:`TokenCache` (:meth:`_cache`), built in
    :meth:`prepare_data` and read through memory maps by its datasets."""

    cache_dir: str | None = None

    def _token_cache(
        self,
        tokenizer: PreTrainedTokenizerBase,
        file: Path,
        settings: dict[str, Any],
        batches: Callable[[], Iterable[Batch]],
    ) -> TokenCache:
        owner = type(self).__name__
        directory = Path(self.cache_dir).expanduser() if self.cache_dir is not None else default_cache_dir()
        return cached_tokens(
            file,
            cache_dir=make_cache_dir(directory, "cache_dir", owner),
            fingerprint=tokenizer_fingerprint(tokenizer),
            vocab_size=len(tokenizer),
            settings={"reader": owner, **settings},
            batches=batches,
        )

    @abstractmethod
    def _cache(self, tokenizer: PreTrainedTokenizerBase, argument: str, path: str) -> TokenCache:
        """The token-cache entry of the data file ``path`` (given as ``argument``), built if it is not there."""

    def prepare_data(self) -> None:
        """Tokenise the files into the cache unless it has them (Lightning calls this before ``setup``, on one rank
        per node, the others waiting)."""
        tokenizer = self._module_tokenizer()
        for argument, path in {"train_file": self.train_file, "val_file": self.val_file}.items():
            if path:
                self._cache(tokenizer, argument, path)


# ------------------------------------------------------------------------------------------------ text


class _Blocks(Dataset):
    """Blocks ``first … first + count - 1`` of ``block_size`` tokens of a cached token stream, each read from the
    memory map as an int64 tensor when asked for."""

    def __init__(self, cache: TokenCache, block_size: int, first: int, count: int) -> None:
        self.cache, self.block_size, self.first, self.count = cache, block_size, first, count

    @property
    def array(self) -> np.ndarray:
        """The blocks as a ``(count, block_size)`` view of the memory map (nothing is read or copied)."""
        start = self.first * self.block_size
        return self.cache.tokens[start : start + self.count * self.block_size].reshape(self.count, self.block_size)

    def split(self, count: int) -> tuple[_Blocks, _Blocks]:
        """The first ``count`` blocks and the others."""
        return (
            _Blocks(self.cache, self.block_size, self.first, count),
            _Blocks(self.cache, self.block_size, self.first + count, self.count - count),
        )

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.count:
            raise IndexError(f"block {index} of {self.count}")
        start = (self.first + index) * self.block_size
        return torch.from_numpy(self.cache.tokens[start : start + self.block_size].astype(np.int64))


def _stack_blocks(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch of blocks, with the attention mask transformers' models expect: all ones, as documents are packed
    (joined by EOS), never padded. Without it a model warns that its ids may be padded, EOS being the pad token."""
    ids = torch.stack(rows)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class TextDataModule(_TokenCachedData[_Blocks]):
    """Causal language-modelling data: a text file packed into blocks of ``block_size`` tokens.

    The file is tokenised once into the token cache (``cache_dir``), streaming, and the blocks are views of its
    memory map: the corpus is never held in memory. A ``.txt`` file is one document, read in pieces of about 256K
    characters cut at line breaks (:func:`_text_pieces`); a ``.jsonl`` file one document per line. With
    several ranks, Lightning's ``prepare_data`` builds the cache on each node's local rank 0 while the others wait.

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
        cache_dir: directory of the token cache; ``None``: ``$XDG_CACHE_HOME/lightning_smartinf/tokens`` (by default
            under ``~/.cache``). An entry is reused while the file (path, size, modification time), the tokenizer
            and ``text_field`` stay the same; ``block_size`` and the split can change without tokenising again.
    """

    _LENGTH, _UNIT, _ALSO_FIX = "block_size", "block", ", a smaller `block_size`"
    _DROP_LAST = True  # every training batch holds batch_size blocks, unless there are fewer blocks than that
    _RENAMED: ClassVar[dict[str, str]] = {"train_blocks": "train_data", "val_blocks": "val_data"}
    _collate = staticmethod(_stack_blocks)

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
        cache_dir: str | None = None,
    ) -> None:
        problems = Problems("TextDataModule")
        _check_field(problems, "text_field", text_field)
        problems.flag("shuffle", shuffle)
        problems.path("cache_dir", cache_dir, optional=True)
        super().__init__(
            train_file, val_file, batch_size, val_fraction, tokenizer_path, seed, num_workers, problems=problems
        )
        self.block_size, self.text_field, self.shuffle, self.cache_dir = block_size, text_field, shuffle, cache_dir

    def _cache(self, tokenizer: PreTrainedTokenizerBase, argument: str, path: str) -> TokenCache:
        file = _check_file(path, argument, TEXT_SUFFIXES, "TextDataModule")
        if file.suffix.lower() == ".jsonl":
            settings: dict[str, Any] = {"text_field": self.text_field}
            field: str | None = self.text_field
        else:
            settings, field = {"piece_chars": TEXT_PIECE_CHARS}, None
        return self._token_cache(tokenizer, file, settings, lambda: _document_batches(tokenizer, file, field, argument))

    def _dataset(self, tokenizer: PreTrainedTokenizerBase, argument: str, path: str) -> _Blocks:
        cache = self._cache(tokenizer, argument, path)
        tokens = len(cache.tokens)
        count = tokens // self.block_size
        if count == 0:
            raise ValueError(
                f"`TextDataModule({argument}={path!r})` has {tokens} tokens, fewer than one block of "
                f"`block_size={self.block_size}`. Give more text or a smaller `block_size`."
            )
        return _Blocks(cache, self.block_size, 0, count)

    def _split(self, blocks: _Blocks, held_out: int) -> tuple[_Blocks, _Blocks]:
        return blocks.split(len(blocks) - held_out)  # the tail of the text, never seen in training


# ------------------------------------------------------------------------------------------------ fine-tuning


def _example_batches(
    tokenizer: PreTrainedTokenizerBase, file: Path, prompt_field: str, response_field: str, argument: str
) -> Iterator[Batch]:
    """Token batches of a prompt/response file: per line ``[BOS] prompt response EOS``, with ``(prompt tokens,
    line)``; BOS where the tokenizer has one of its own (not its EOS, as GPT-2's)."""
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    start = [bos] if bos is not None and bos != eos else []
    fields = {"prompt_field": prompt_field, "response_field": response_field}
    where = f"`SFTDataModule({argument}={str(file)!r})`"

    def texts(number: int, row: dict[str, Any]) -> tuple[int, str, str]:
        for option, field in fields.items():
            if not isinstance(row[field], str):
                raise ValueError(
                    f"{where}: line {number} field {field!r} is {type(row[field]).__name__} {row[field]!r:.40}, not a "
                    f"string. Make it a string, or set `{option}` to the field that holds the text."
                )
        return number, row[prompt_field], row[response_field]

    rows = (texts(number, row) for number, row in _jsonl_rows(file, fields, argument, "SFTDataModule"))
    for batch in _batched(rows, lambda r: len(r[1]) + len(r[2])):
        prompts = _encode(tokenizer, [prompt for _, prompt, _ in batch])
        responses = _encode(tokenizer, [response for _, _, response in batch])
        records = [start + prompt + response + [eos] for prompt, response in zip(prompts, responses)]
        yield records, [(len(start) + len(prompt), number) for (number, _, _), prompt in zip(batch, prompts)]


class _Examples(Dataset):
    """Examples ``indices`` of a cached prompt/response file, cut to ``max_length`` tokens; an item is its
    ``input_ids`` and its ``labels`` (:data:`IGNORE_INDEX` on the prompt), int64 tensors read from the memory map."""

    def __init__(self, cache: TokenCache, indices: np.ndarray, max_length: int) -> None:
        self.cache, self.indices, self.max_length = cache, indices, max_length

    def subset(self, positions: np.ndarray) -> _Examples:
        return _Examples(self.cache, self.indices[np.sort(positions)], self.max_length)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, length, prompt, _ = (int(v) for v in self.cache.examples[self.indices[index]])
        ids = torch.from_numpy(self.cache.tokens[start : start + min(length, self.max_length)].astype(np.int64))
        labels = ids.clone()
        labels[:prompt] = IGNORE_INDEX
        return {"input_ids": ids, "labels": labels}


def _pad_examples(rows: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example of the batch: ``pad_id`` in ``input_ids``, 0 in ``attention_mask``,
    :data:`IGNORE_INDEX` in ``labels``."""
    ids = [row["input_ids"] for row in rows]
    return {
        "input_ids": pad_sequence(ids, batch_first=True, padding_value=pad_id),
        "attention_mask": pad_sequence([torch.ones_like(t) for t in ids], batch_first=True),
        "labels": pad_sequence([row["labels"] for row in rows], batch_first=True, padding_value=IGNORE_INDEX),
    }


class SFTDataModule(_TokenCachedData[_Examples]):
    """Supervised fine-tuning data: JSON lines of prompt/response pairs, the loss taken on the responses only.

    Each line becomes one example, ``[BOS] prompt response EOS`` (BOS where the tokenizer has one distinct from its
    EOS: Llama, Mistral, Gemma; not GPT-2 or Qwen). Its ``labels`` are its tokens with :data:`IGNORE_INDEX` (-100)
    on BOS and the prompt, so the model learns to write the response and to end it. Prompt and response are
    tokenised separately: the response starts at a token boundary. Render a chat template into ``prompt_field``
    yourself if the model expects one.

    Examples are padded (on the right, to the longest in the batch; ``attention_mask`` 0 and labels -100 there), not
    packed: packed examples would attend to each other unless the model takes per-example masks. An example longer
    than ``max_length`` keeps its first ``max_length`` tokens, losing the end of its response and its EOS; one
    whose prompt leaves no response token within ``max_length`` is skipped. A warning counts both.

    The file is tokenised once into the token cache (``cache_dir``, as :class:`TextDataModule`'s); ``max_length``
    and the split can change without tokenising again.

    Args:
        train_file: ``.jsonl``, one object per line with a string in ``prompt_field`` and in ``response_field``.
        val_file: held-out file of the same kind; ``None`` holds out ``val_fraction`` of ``train_file``'s examples,
            chosen with ``seed``.
        prompt_field: the field holding the prompt (the model's input, no loss).
        response_field: the field holding the response (the loss is taken on it and on the EOS after it).
        max_length: tokens per example at most; at most the model's ``max_position_embeddings``.
        batch_size: examples per batch (per rank).
        val_fraction: share of the examples held out when ``val_file`` is ``None`` (0 disables validation).
        tokenizer_path: a local tokenizer directory; ``None`` takes the tokenizer of the model being trained.
        shuffle: shuffle the training examples each epoch (with ``seed``).
        seed: seed of the hold-out split and of the shuffle.
        num_workers: DataLoader worker processes.
        cache_dir: directory of the token cache; ``None``: ``$XDG_CACHE_HOME/lightning_smartinf/tokens``.
    """

    _UNIT = "usable example"
    _RENAMED: ClassVar[dict[str, str]] = {"train_examples": "train_data", "val_examples": "val_data"}

    def __init__(
        self,
        train_file: str,
        val_file: str | None = None,
        prompt_field: str = "prompt",
        response_field: str = "response",
        max_length: int = 512,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        tokenizer_path: str | None = None,
        shuffle: bool = True,
        seed: int = 42,
        num_workers: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        problems = Problems("SFTDataModule")
        _check_two_fields(problems, ("prompt_field", prompt_field), ("response_field", response_field), "field")
        problems.flag("shuffle", shuffle)
        problems.path("cache_dir", cache_dir, optional=True)
        super().__init__(
            train_file, val_file, batch_size, val_fraction, tokenizer_path, seed, num_workers, problems=problems
        )
        self.prompt_field, self.response_field, self.max_length = prompt_field, response_field, max_length
        self.shuffle, self.cache_dir = shuffle, cache_dir

    def _cache(self, tokenizer: PreTrainedTokenizerBase, argument: str, path: str) -> TokenCache:
        file = _check_file(path, argument, (".jsonl",), "SFTDataModule")
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"`SFTDataModule`: the tokenizer ({type(tokenizer).__name__}) has no `eos_token`, which ends every "
                "response. Give a tokenizer that has one (`tokenizer_path`), or set it and save the tokenizer again."
            )
        settings = {"prompt_field": self.prompt_field, "response_field": self.response_field}
        batches = functools.partial(_example_batches, tokenizer, file, self.prompt_field, self.response_field, argument)
        return self._token_cache(tokenizer, file, settings, batches)

    def _dataset(self, tokenizer: PreTrainedTokenizerBase, argument: str, path: str) -> _Examples:
        """The examples of ``path`` that keep a response token within ``max_length``; a warning counts the others
        and those cut short."""
        cache = self._cache(tokenizer, argument, path)
        table = cache.examples
        length, prompt = table[:, 1], table[:, 2]
        # The loss is on tokens 1… (the first has no prediction): keep an example with a response token among them.
        kept = np.maximum(prompt, 1) < np.minimum(length, self.max_length)
        skipped, cut = np.flatnonzero(~kept), int(np.count_nonzero(kept & (length > self.max_length)))
        if not kept.any():
            raise ValueError(
                f"`SFTDataModule({argument}={path!r})` has no example with a response token within "
                f"`max_length={self.max_length}` ({len(table)} example(s)). Raise `max_length` or shorten the prompts."
            )
        if cut or len(skipped):
            parts = [f"{cut} example(s) lose the end of their response and its EOS"] if cut else []
            if len(skipped):
                first = int(table[skipped[0], 3])
                parts.append(f"{len(skipped)} are skipped, their prompt filling it (the first on line {first})")
            rank_zero_warn(
                f"`SFTDataModule({argument}={path!r})`, `max_length={self.max_length}`: {'; '.join(parts)}. Raise "
                "`max_length` or shorten those examples."
            )
        return _Examples(cache, np.flatnonzero(kept), self.max_length)

    def _split(self, examples: _Examples, held_out: int) -> tuple[_Examples, _Examples]:
        train, val = self._random_split(len(examples), held_out)
        return examples.subset(train), examples.subset(val)  # each in file order

    def _prepare(self, tokenizer: PreTrainedTokenizerBase) -> None:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._collate = functools.partial(_pad_examples, pad_id=pad_id)


# ------------------------------------------------------------------------------------------------ classification


def _pad_rows(tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Pad encoded rows to the longest of the batch, on the tokenizer's padding side."""
    return dict(tokenizer.pad(rows, return_tensors="pt"))


class ClassificationDataModule(_FileData[list[dict[str, Any]]]):
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

    _UNIT = "row"
    _RENAMED: ClassVar[dict[str, str]] = {"train_rows": "train_data", "val_rows": "val_data"}

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
        problems = Problems("ClassificationDataModule")
        _check_two_fields(problems, ("text_field", text_field), ("label_field", label_field), "column")
        names = isinstance(labels, (list, tuple)) and all(isinstance(label, str) and label for label in labels)
        if labels is not None and not (names and len(labels) >= 2 and len(set(labels)) == len(labels)):
            problems.add(
                f"`labels={show(labels)}` is not a list of label names: it must be two or more distinct non-empty "
                "str, in index order, or None (derived from the training file). Pass e.g. `labels=['neg', 'pos']`."
            )
        super().__init__(
            train_file, val_file, batch_size, val_fraction, tokenizer_path, seed, num_workers, problems=problems
        )
        self.text_field, self.label_field, self.labels, self.max_length = text_field, label_field, labels, max_length
        self.label_names: list[str] | None = list(labels) if labels is not None else None

    @property
    def num_labels(self) -> int:
        """Number of classes (after :meth:`setup`, or from ``labels``)."""
        if self.label_names is None:
            self.label_names = self._derive_labels(self._read("train_file", self.train_file))
        return len(self.label_names)

    def _read(self, argument: str, path: str) -> list[dict[str, Any]]:
        file = _check_file(path, argument, TABLE_SUFFIXES, "ClassificationDataModule")
        fields = {"text_field": self.text_field, "label_field": self.label_field}
        if file.suffix.lower() == ".jsonl":
            rows = [row for _, row in _jsonl_rows(file, fields, argument, "ClassificationDataModule")]
        else:
            with open(file, encoding="utf-8", newline="") as f:
                reader = csv.DictReader(f)
                missing = [k for k in fields.values() if k not in (reader.fieldnames or [])]
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

    def _prepare(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._collate = functools.partial(_pad_rows, tokenizer)

    def _dataset(self, tokenizer: PreTrainedTokenizerBase, argument: str, path: str) -> list[dict[str, Any]]:
        """The rows of ``path``, encoded, each with the index of its label."""
        rows = self._read(argument, path)
        if self.label_names is None:  # setup reads the training file first: its labels are the labels
            self.label_names = self._derive_labels(rows)
        index = {name: i for i, name in enumerate(self.label_names)}
        encoded = tokenizer(
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

    def _split(self, rows: list[dict[str, Any]], held_out: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        train, val = self._random_split(len(rows), held_out)
        return [rows[i] for i in train], [rows[i] for i in val]  # in the order of the permutation
