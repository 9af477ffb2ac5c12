"""Data at scale for the Hugging Face modules: the memory-mapped token cache of ``TextDataModule`` and
``SFTDataModule`` (built once, streaming, atomically; reused; rebuilt when the file changes) and supervised
fine-tuning (the loss, and so the gradient, on the responses only); what all three data modules share (the error
when too little is left to train on, the old names of their datasets).

Text: Python's documentation (``recipes/data``); tokenizer: a byte-level BPE trained here on it.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import stat
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT
from helpers.hf_models import tiny_gpt2
from helpers.leftovers import left_over

from lightning_smartinf.hf import (
    ClassificationDataModule,
    HFCausalLM,
    SFTDataModule,
    TextDataModule,
    load_tokenizer,
    train_bpe_tokenizer,
)
from lightning_smartinf.hf import data as data_module

DATA = REPO_ROOT / "recipes" / "data"
TEXT, TRAIN_JSONL, SFT_JSONL = (
    DATA / "python_docs.txt",
    DATA / "python_docs_train.jsonl",
    DATA / "python_docs_sft_train.jsonl",
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(train_bpe_tokenizer([TEXT], tmp_path_factory.mktemp("bpe") / "tokenizer", vocab_size=1024).name_or_path)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


class Counting:
    """A tokenizer that counts its calls; call number ``fail_at`` raises, and with ``barrier`` the first call waits
    for the other builders there."""

    def __init__(self, tokenizer, fail_at: int | None = None, barrier: threading.Barrier | None = None) -> None:
        self._tokenizer, self.fail_at, self.barrier, self.calls = tokenizer, fail_at, barrier, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the tokenizer crashed")
        if self.barrier is not None and self.calls == 1:
            self.barrier.wait(timeout=60)
        return self._tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)


def blocks_in_memory(tokenizer, path: Path, block_size: int, text_field: str = "text") -> torch.Tensor:
    """`TextDataModule`'s blocks before the token cache: the whole corpus tokenised into one list in memory."""
    if path.suffix == ".jsonl":
        lines = path.read_text(encoding="utf-8").splitlines()
        documents = [str(json.loads(line)[text_field]) for line in lines if line.strip()]
    else:
        documents = [path.read_text(encoding="utf-8")]
    ids: list[int] = []
    for document in documents:
        ids += tokenizer(document, add_special_tokens=False, verbose=False)["input_ids"]
        ids.append(tokenizer.eos_token_id)
    count = len(ids) // block_size
    return torch.tensor(ids[: count * block_size], dtype=torch.long).view(count, block_size)


def entries(cache_dir: Path) -> list[str]:
    """Everything in the cache directory, temporary siblings included."""
    return sorted(p.name for p in cache_dir.iterdir()) if cache_dir.exists() else []


# ---------------------------------------------------------------------------------------------- token cache


@pytest.mark.parametrize(
    ("path", "piece_chars"), [(TEXT, None), (TEXT, 2048), (TRAIN_JSONL, None)], ids=["txt", "txt-in-pieces", "jsonl"]
)
def test_blocks_equal_the_in_memory_result(tmp_path, monkeypatch, tokenizer_dir, tokenizer, path, piece_chars):
    """The cached blocks, split and batches are today's in-memory ones, token for token; a `.txt` read in over a hundred
    pieces (cut at line breaks) and tokenised a few pieces per call gives the ids of the whole text."""
    if piece_chars is not None:
        monkeypatch.setattr(data_module, "TEXT_PIECE_CHARS", piece_chars)
        monkeypatch.setattr(data_module, "BATCH_CHARS", 4 * piece_chars)
        assert len(list(data_module._text_pieces(path, "test"))) > 100
    reference = blocks_in_memory(tokenizer, path, 32)
    data = TextDataModule(
        str(path), block_size=32, batch_size=4, tokenizer_path=str(tokenizer_dir), cache_dir=str(tmp_path)
    )
    data.setup()

    train, val = data.train_data.array, data.val_data.array
    assert isinstance(train, np.memmap) and isinstance(val, np.memmap)  # views of the file, not lists in memory
    assert Path(train.filename).parent.parent == tmp_path and train.dtype == np.uint16
    np.testing.assert_array_equal(np.concatenate([train, val]), reference.numpy())
    held_out = max(1, round(len(reference) * 0.05))
    assert len(val) == held_out  # the tail, as before
    # The same shuffled batches as a DataLoader over the in-memory blocks.
    old = torch.utils.data.DataLoader(
        list(reference[: len(reference) - held_out]),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(42),
    )
    for new_batch, old_batch in zip(data.train_dataloader(), old):
        assert torch.equal(new_batch["input_ids"], old_batch)
        assert torch.equal(new_batch["attention_mask"], torch.ones_like(old_batch))  # packed: nothing is padding


def test_cache_is_reused_and_rebuilt_when_the_file_changes(tmp_path, tokenizer):
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(TRAIN_JSONL, corpus)
    cache_dir = tmp_path / "cache"

    def blocks(block_size: int = 32) -> tuple[np.ndarray, int]:
        counting = Counting(tokenizer)
        data = TextDataModule(str(corpus), block_size=block_size, cache_dir=str(cache_dir))
        return data._dataset(counting, "train_file", str(corpus)).array, counting.calls

    first, calls = blocks()
    assert calls > 0
    [entry] = entries(cache_dir)
    assert entry.startswith("corpus-")
    assert stat.S_IMODE((cache_dir / entry).stat().st_mode) == 0o700
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700
    meta = json.loads((cache_dir / entry / "meta.json").read_text())
    assert meta["source"] == str(corpus.resolve()) and meta["tokens"] == first.size + meta["tokens"] % 32

    again, calls = blocks()
    assert calls == 0 and entries(cache_dir) == [entry]  # read back, not tokenised again
    np.testing.assert_array_equal(again, first)
    _, calls = blocks(block_size=16)
    assert calls == 0  # blocks are views: another block size needs no new tokens

    shutil.copytree(cache_dir / entry, tmp_path / "previous")
    with open(corpus, "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "One more document at the end. " * 50}) + "\n")
    changed, calls = blocks()
    assert calls > 0
    [new_entry] = entries(cache_dir)  # the entry of the previous version is gone
    assert new_entry != entry and new_entry.rsplit("-", 1)[0] == entry.rsplit("-", 1)[0]
    # A build killed right after its entry was renamed in left the previous version's: the next read removes it.
    shutil.copytree(tmp_path / "previous", cache_dir / entry)
    _, calls = blocks()
    assert calls == 0 and entries(cache_dir) == [new_entry]
    assert len(changed) > len(first)
    np.testing.assert_array_equal(changed[: len(first) - 1], first[:-1])
    np.testing.assert_array_equal(changed, blocks_in_memory(tokenizer, corpus, 32).numpy())

    os.utime(corpus, ns=(corpus.stat().st_atime_ns, corpus.stat().st_mtime_ns + 10**9))  # same bytes, newer file
    _, calls = blocks()
    assert calls > 0


def test_a_cache_dir_is_made_private_where_missing_and_refused_by_name_where_it_cannot_be(tmp_path):
    from lightning_smartinf.hf.token_cache import make_cache_dir

    (tmp_path / "kept").mkdir(mode=0o755)
    nested = tmp_path / "kept" / "a" / "b"
    assert make_cache_dir(nested, "cache_dir", "TextDataModule") == nested
    assert [stat.S_IMODE(p.stat().st_mode) for p in (nested.parent, nested)] == [0o700, 0o700]
    assert stat.S_IMODE((tmp_path / "kept").stat().st_mode) == 0o755  # an existing directory is used as it is
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"`TextDataModule\(cache_dir='.*file/c'\)`: cannot create the token cache"):
        make_cache_dir(tmp_path / "file" / "c", "cache_dir", "TextDataModule")
    with pytest.raises(ValueError, match=r"`SFTDataModule\(cache_dir='.*file'\)` is not a directory"):
        make_cache_dir(tmp_path / "file", "cache_dir", "SFTDataModule")


def test_default_cache_dir_is_private_under_xdg_cache_home(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    old = os.umask(0o022)  # the common umask, which would leave new directories readable by all
    try:
        TextDataModule(str(TEXT), block_size=32)._dataset(tokenizer, "train_file", str(TEXT))
    finally:
        os.umask(old)
    for directory in (tmp_path / "xdg" / "lightning_smartinf", tmp_path / "xdg" / "lightning_smartinf" / "tokens"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    [entry] = entries(tmp_path / "xdg" / "lightning_smartinf" / "tokens")
    assert entry.startswith("python_docs-")


def test_a_crash_mid_build_leaves_nothing_that_is_read(tmp_path, monkeypatch, tokenizer):
    """An exception from the tokenizer partway leaves no entry and no temporary files; a process killed partway
    leaves a temporary sibling, which is never read and which the next build removes; that build is complete."""
    monkeypatch.setattr(data_module, "BATCH_RECORDS", 4)  # 18 tokenizer calls for the 71 documents: fail in the 5th
    cache_dir = tmp_path / "cache"
    data = TextDataModule(str(TRAIN_JSONL), block_size=32, cache_dir=str(cache_dir))
    crashing = Counting(tokenizer, fail_at=5)
    with pytest.raises(RuntimeError, match="the tokenizer crashed"):
        data._dataset(crashing, "train_file", str(TRAIN_JSONL))
    assert entries(cache_dir) == []

    reference = blocks_in_memory(tokenizer, TRAIN_JSONL, 32).numpy()
    data._dataset(tokenizer, "train_file", str(TRAIN_JSONL))
    [entry] = entries(cache_dir)
    shutil.rmtree(cache_dir / entry)
    # What `kill -9` in mid-build leaves: a temporary sibling of a process that is gone, with a plausible meta.json.
    staging = left_over(cache_dir / entry)
    staging.mkdir()
    (staging / "tokens.bin").write_bytes(b"\0" * 64)
    (staging / "meta.json").write_text(json.dumps({"dtype": "uint16", "tokens": 32, "examples": None}))

    counting = Counting(tokenizer)
    blocks = TextDataModule(str(TRAIN_JSONL), block_size=32, cache_dir=str(cache_dir))._dataset(
        counting, "train_file", str(TRAIN_JSONL)
    )
    assert counting.calls > 0 and entries(cache_dir) == [entry]
    np.testing.assert_array_equal(blocks.array, reference)


def test_two_builders_at_once_keep_one_complete_entry(tmp_path, tokenizer):
    """Ranks (or nodes sharing the directory) that build the same entry at the same moment: each finishes its own
    temporary sibling, the first rename wins, both read the same complete tokens."""
    barrier = threading.Barrier(2)
    results: list[np.ndarray] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            data = TextDataModule(str(TRAIN_JSONL), block_size=32, cache_dir=str(tmp_path))
            results.append(data._dataset(Counting(tokenizer, barrier=barrier), "train_file", str(TRAIN_JSONL)).array)
        except BaseException as exc:  # noqa: BLE001  (reported by the main thread)
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert len(entries(tmp_path)) == 1  # no temporary sibling left
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], blocks_in_memory(tokenizer, TRAIN_JSONL, 32).numpy())


def test_dataset_pickles_without_its_tokens(tmp_path, tokenizer):
    """A DataLoader worker started by spawn or forkserver gets the entry's path and maps the file itself."""
    blocks = TextDataModule(str(TEXT), block_size=32, cache_dir=str(tmp_path))._dataset(
        tokenizer, "train_file", str(TEXT)
    )
    payload = pickle.dumps(blocks)
    assert len(payload) < 2000 < blocks.array.nbytes
    copy = pickle.loads(payload)
    assert torch.equal(copy[len(copy) - 1], blocks[len(blocks) - 1])


def test_text_field_errors_name_file_line_and_field(tmp_path, tokenizer):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "a"}\n\n{"body": "b", "id": 2}\n')
    data = TextDataModule(str(rows), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(
        ValueError,
        match=r"`TextDataModule\(train_file='.*rows.jsonl'\)`: line 3 has no 'text' field \(its fields: 'body', "
        r"'id'\)\. Each line must be an object with 'text'; set `text_field` to the name of the field that holds it\.",
    ):
        data._dataset(tokenizer, "train_file", str(rows))
    assert entries(tmp_path / "cache") == []  # the error came mid-build: nothing kept
    rows.write_text('{"text": "a"}\n["b"]\n')
    with pytest.raises(ValueError, match=r"line 2 is not a JSON object \('\[\"b\"\]'\)"):
        data._dataset(tokenizer, "train_file", str(rows))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt'\)`: not UTF-8 text after line 0 .*Save the file as UTF-8"):
        data._dataset(tokenizer, "train_file", str(tmp_path / "latin1.txt"))
    (tmp_path / "cache.txt").write_text("x")
    with pytest.raises(ValueError, match=r"`TextDataModule\(cache_dir='.*cache.txt'\)` is not a directory"):
        TextDataModule(str(TEXT), cache_dir=str(tmp_path / "cache.txt"))._dataset(tokenizer, "train_file", str(TEXT))


# ---------------------------------------------------------------------------------------------- supervised fine-tuning


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def sft(path: Path, tokenizer_dir: Path, cache_dir: Path, **kwargs) -> SFTDataModule:
    kwargs = {"val_fraction": 0.0, "shuffle": False, "batch_size": 8} | kwargs
    data = SFTDataModule(str(path), tokenizer_path=str(tokenizer_dir), cache_dir=str(cache_dir), **kwargs)
    data.setup()
    return data


def test_sft_batches_mask_the_prompt_and_the_padding(tmp_path, tokenizer_dir, tokenizer):
    rows = [
        {"prompt": "What does `pass` do?\n", "response": "Nothing: it is a null operation."},
        {"prompt": "Name a loop statement.\n", "response": "for"},
        {"prompt": "", "response": "An empty prompt is allowed."},
    ]
    data = sft(write_jsonl(tmp_path / "pairs.jsonl", rows), tokenizer_dir, tmp_path / "cache", max_length=64)
    assert isinstance(data.train_data.cache.tokens, np.memmap)
    batch = next(iter(data.train_dataloader()))
    eos = tokenizer.eos_token_id  # GPT-2 style: BOS is EOS, so no BOS is put in front
    longest = batch["input_ids"].shape[1]
    for i, row in enumerate(rows):
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        response = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [eos]
        n, pad = len(prompt) + len(response), longest - len(prompt) - len(response)
        assert batch["input_ids"][i].tolist() == prompt + response + [eos] * pad  # padded with the pad token (EOS)
        assert batch["labels"][i].tolist() == [-100] * len(prompt) + response + [-100] * pad
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * pad


def test_sft_max_length_cuts_and_skips_with_a_warning(tmp_path, tokenizer_dir, tokenizer):
    long = "word " * 100
    rows = [
        {"prompt": "Short.\n", "response": "Short answer."},
        {"prompt": "Short.\n", "response": long},  # cut: keeps 32 tokens, loses its end and the EOS
        {"prompt": long, "response": "Never seen."},  # skipped: the prompt fills max_length
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.warns(
        UserWarning,
        match=r"max_length=32`: 1 example\(s\) lose the end of their response and its EOS; "
        r"1 are skipped, their prompt filling it \(the first on line 3\)\. Raise `max_length`",
    ):
        data = sft(path, tokenizer_dir, tmp_path / "cache", max_length=32)
    assert len(data.train_data) == 2
    cut = data.train_data[1]
    assert len(cut["input_ids"]) == 32 and cut["input_ids"][-1] != tokenizer.eos_token_id
    # A new max_length reads the same cache entry: nothing is tokenised again.
    counting = Counting(tokenizer)
    again = SFTDataModule(str(path), max_length=2, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"has no example with a response token within `max_length=2` \(3 example"):
        again._dataset(counting, "train_file", str(path))
    assert counting.calls == 0


@pytest.mark.filterwarnings("ignore:.*not attached to a Trainer")  # the model is built here, outside a fit
def test_sft_loss_has_no_gradient_at_prompt_positions(tmp_path):
    """One batch through HFCausalLM's own loss: the logits predicting a prompt token (or padding) get no gradient,
    those predicting a response token (or its EOS) do; the loss is the one transformers computes from `labels`."""
    model_dir = tiny_gpt2(tmp_path / "gpt2", vocab_size=512, n_embd=32, n_positions=64)
    rows = [
        {"prompt": "The for statement\n", "response": "iterates over the elements of a sequence."},
        {"prompt": "Explain the while statement in one paragraph, please.\n", "response": "It repeats."},
    ]
    data = sft(write_jsonl(tmp_path / "pairs.jsonl", rows), model_dir, tmp_path / "cache", max_length=64)
    batch = next(iter(data.train_dataloader()))
    module = HFCausalLM(str(model_dir))
    module.configure_model()
    captured = {}

    def keep_logits(_module, _inputs, logits: torch.Tensor) -> None:
        logits.retain_grad()
        captured["logits"] = logits

    module.model.lm_head.register_forward_hook(keep_logits)
    loss, _ = module._loss(batch)
    loss.backward()

    per_position = captured["logits"].grad.abs().sum(-1)  # (batch, positions): logit t predicts token t + 1
    predicts_response = batch["labels"][:, 1:] != -100
    assert predicts_response.any() and (~predicts_response & batch["attention_mask"][:, 1:].bool()).any()
    assert torch.equal(per_position[:, :-1] > 0, predicts_response)
    assert not per_position[:, -1].any()
    hf_loss = module.model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    torch.testing.assert_close(loss, hf_loss)


def test_sft_errors_name_file_line_and_field(tmp_path, tokenizer_dir, tokenizer):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "response": "b"}, {"prompt": "c", "answer": "d"}])
    data = SFTDataModule(str(bad), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(
        ValueError,
        match=r"`SFTDataModule\(train_file='.*bad.jsonl'\)`: line 2 has no 'response' field \(its fields: 'prompt', "
        r"'answer'\)\. Each line must be an object with 'prompt' and 'response'; set `response_field` to the name",
    ):
        data._dataset(tokenizer, "train_file", str(bad))
    assert entries(tmp_path / "cache") == []
    write_jsonl(bad, [{"prompt": "a", "response": "b"}, {"prompt": 7, "response": "d"}])
    with pytest.raises(ValueError, match=r"line 2 field 'prompt' is int 7, not a string\. .*set `prompt_field`"):
        data._dataset(tokenizer, "train_file", str(bad))
    with pytest.raises(ValueError, match=r"`SFTDataModule\(train_file='pairs.txt'\)`: unsupported file type '.txt'"):
        SFTDataModule("pairs.txt")._dataset(tokenizer, "train_file", "pairs.txt")
    with pytest.raises(ValueError, match=r"`prompt_field='text'` and `response_field='text'` name the same field"):
        SFTDataModule(str(bad), prompt_field="text", response_field="text")


def test_sft_holds_out_a_seeded_share(tmp_path, tokenizer_dir):
    """The recipe's data without a `val_file`: a share of the pairs is held out, chosen with the seed."""
    data = sft(SFT_JSONL, tokenizer_dir, tmp_path, max_length=512, val_fraction=0.1, seed=3)
    assert (len(data.train_data), len(data.val_data)) == (63, 7)
    assert not set(data.train_data.indices) & set(data.val_data.indices)


# ---------------------------------------------------------------------------------------------- all three


def small(cls: type, tmp_path: Path, tokenizer_dir: Path, val_fraction: float):
    """A data module of ``cls`` on a file of a few items: a short text, two prompt/response pairs, two labelled rows."""
    if cls is TextDataModule:
        (tmp_path / "short.txt").write_text("The for statement iterates over a sequence. " * 8)
        kwargs = {"block_size": 32, "cache_dir": str(tmp_path / "cache")}
        return cls(str(tmp_path / "short.txt"), val_fraction=val_fraction, tokenizer_path=str(tokenizer_dir), **kwargs)
    if cls is SFTDataModule:
        pairs = [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}]
        path = write_jsonl(tmp_path / "pairs.jsonl", pairs)
        return cls(str(path), val_fraction=val_fraction, tokenizer_path=str(tokenizer_dir), cache_dir=str(tmp_path))
    (tmp_path / "rows.csv").write_text("text,label\nthe for statement,a\nthe while statement,b\n")
    return cls(str(tmp_path / "rows.csv"), val_fraction=val_fraction, tokenizer_path=str(tokenizer_dir))


@pytest.mark.parametrize(
    ("cls", "unit", "also"),
    [(TextDataModule, "block", ", a smaller `block_size`"), (SFTDataModule, "usable example", ""),
     (ClassificationDataModule, "row", "")],
    ids=["text", "sft", "classification"],
)  # fmt: skip
def test_too_few_to_hold_out_is_one_error(tmp_path, tokenizer_dir, cls, unit, also):
    """Holding out would leave nothing to train on: the same error from each, naming the file, the count, what it
    counts and the fixes; with `val_fraction=0` all of it trains."""
    data = small(cls, tmp_path, tokenizer_dir, val_fraction=0.9)
    with pytest.raises(
        ValueError,
        match=rf"`{cls.__name__}\(train_file='{data.train_file}'\)` has [1-5] {unit}\(s\): too few to hold out "
        rf"`val_fraction=0\.9` for validation\. Give more data{also}, a `val_file`, or `val_fraction=0`\.$",
    ):
        data.setup()
    data.val_fraction = 0.0
    data.setup()
    assert len(data.train_data) > 0 and len(data.val_data) == 0


@pytest.mark.parametrize(
    ("cls", "old"),
    [(TextDataModule, "blocks"), (SFTDataModule, "examples"), (ClassificationDataModule, "rows")],
    ids=["text", "sft", "classification"],
)
def test_old_dataset_names_still_work_with_a_deprecation_warning(tmp_path, tokenizer_dir, cls, old):
    data = small(cls, tmp_path, tokenizer_dir, val_fraction=0.0)
    data.setup()
    for split in ("train", "val"):
        with pytest.warns(
            DeprecationWarning, match=rf"`{cls.__name__}\.{split}_{old}` is deprecated: use `{split}_data`"
        ):
            assert getattr(data, f"{split}_{old}") is getattr(data, f"{split}_data")
    with pytest.warns(DeprecationWarning, match=rf"`{cls.__name__}\.train_{old}` is deprecated: use `train_data`"):
        setattr(data, f"train_{old}", data.val_data)
    assert data.train_data is data.val_data and f"train_{old}" not in vars(data)
    with pytest.raises(AttributeError, match="no attribute 'train_blobs'"):
        data.train_blobs  # noqa: B018  (any other unknown name is still an error)


def test_an_unknown_label_is_named_by_its_row_in_the_file(tmp_path, tokenizer_dir):
    """The rows are encoded before a share is held out: the error counts rows in the file, not in one share."""
    rows = "".join(f"text {i},{'ab'[i % 2]}\n" for i in range(9)) + "text 9,c\n"
    (tmp_path / "rows.csv").write_text("text,label\n" + rows)
    data = ClassificationDataModule(str(tmp_path / "rows.csv"), labels=["a", "b"], tokenizer_path=str(tokenizer_dir))
    with pytest.raises(ValueError, match=r"`ClassificationDataModule\(train_file=...\)`: row 10 has label 'c', which"):
        data.setup()


def test_a_tokenizer_is_not_trained_from_bad_arguments(tmp_path):
    """A path given alone (it was read character by character) and a vocabulary below the byte alphabet (it was
    silently raised to 257 tokens, and the tokenizer saved for later runs) are refused before any training."""
    one_path = r"`files='.*'` is one path: pass a list of text files, e.g. `files=\['.*train.txt'\]`"
    with pytest.raises(ValueError, match=one_path):
        train_bpe_tokenizer(str(tmp_path / "train.txt"), tmp_path / "tok")
    with pytest.raises(ValueError, match=r"`vocab_size=0` is too small.*Pass `vocab_size=257` or more"):
        train_bpe_tokenizer([TEXT], tmp_path / "tok", vocab_size=0)
    assert not (tmp_path / "tok").exists()


@pytest.mark.parametrize(
    ("cls", "arguments", "message"),
    [
        (TextDataModule, {"batch_size": 0}, r"`batch_size=0` is too small"),
        (TextDataModule, {"batch_size": "8"}, r"`batch_size='8'` is a str"),
        (TextDataModule, {"batch_size": None}, r"`batch_size=None`"),
        (TextDataModule, {"num_workers": -1}, r"`num_workers=-1` is too small"),
        (TextDataModule, {"seed": "abc"}, r"`seed='abc'` is a str"),
        (TextDataModule, {"seed": 2**70}, r"`seed=1180591620717411303424` is too large"),
        (TextDataModule, {"val_fraction": "0.1"}, r"`val_fraction='0.1'` is not a share to hold out"),
        (TextDataModule, {"val_fraction": None}, r"`val_fraction=None` is not a share"),
        (TextDataModule, {"val_fraction": float("nan")}, r"`val_fraction=nan` is not a share"),
        (TextDataModule, {"shuffle": "no"}, r"`shuffle='no'` is a str: it must be True or False"),
        (TextDataModule, {"text_field": None}, r"`text_field=None` is not a field name"),
        (TextDataModule, {"cache_dir": ""}, r"`cache_dir=''` is not a path"),
        (TextDataModule, {"train_file": None}, r"`train_file=None` is not a path"),
        (SFTDataModule, {"prompt_field": ""}, r"`prompt_field=''` is not a field name"),
        (ClassificationDataModule, {"labels": ["pos", "neg", "pos"]}, r"`labels=\['pos', 'neg', 'pos'\]` is not a"),
        (ClassificationDataModule, {"labels": "pos,neg"}, r"`labels='pos,neg'` is not a list of label names"),
        (ClassificationDataModule, {"label_field": "text"}, r"`text_field='text'` and `label_field='text'` name the"),
    ],
)
def test_data_module_arguments_are_refused_by_name_when_built(tmp_path, cls, arguments, message):
    """Refused at construction, with the module's name, where they failed inside torch once the corpus was
    tokenised, or were taken silently (a truthy 'no' shuffled; JSON lines were tokenised raw; a label was twice)."""
    arguments = {"train_file": str(tmp_path / "train.jsonl"), **arguments}
    with pytest.raises(ValueError, match=rf"`{cls.__name__}` got 1 invalid argument:\n- {message}"):
        cls(**arguments)
