"""A pretrained Hugging Face model loaded in a user's own LightningModule with ``hf.from_pretrained``.

The weights must land in ZeRO-3's partitions exactly as a plain ``from_pretrained`` reads them (bitwise), a head the
checkpoint lacks must be initialised while every loaded weight is kept, and the load must not hold the model in host
memory: measured in fresh processes, the peak grows with a shard, not with the model, where transformers' own ZeRO-3
loading grows by the model's 16-bit size.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import deepspeed
import lightning as L
import pytest
import torch
from helpers.launch import worker_env
from safetensors.torch import load_file, save_file

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.hf import from_pretrained

SCRIPT = Path(__file__).parent / "scripts" / "hf_load_rss.py"


def llama(out: Path, *, layers: int = 2, hidden: int = 64, vocab: int = 256, head: bool = True, shard: str = "40KB"):
    """A small Llama saved in bf16 as several safetensors shards with an index (or one file), seed 0."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    model = (LlamaForCausalLM if head else LlamaModel)(config).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size=shard)
    return out


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


class OwnModule(L.LightningModule):
    """What a user writes: the model loaded in ``configure_model``; it records the loaded weights, gathered."""

    def __init__(self, path: Path, **load: object) -> None:
        super().__init__()
        self.path, self.load = path, load
        self.model: torch.nn.Module | None = None
        self.loaded: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = from_pretrained(self, self.path, **self.load)
        named = dict(self.model.named_parameters())
        assert all(hasattr(p, "ds_id") for p in named.values())  # partitioned as they were built
        with deepspeed.zero.GatheredParameters(list(named.values())):
            self.loaded = {n: p.detach().clone() for n, p in named.items()}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(module: L.LightningModule, tmp_path: Path, steps: int = 2) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=SmartInfinityStrategy(storage_paths=[tmp_path / "state"], sub_group_size=20_000),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    batches = [torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(i)) for i in range(steps)]
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=1))
    return trainer


def test_a_users_module_loads_sharded_weights_into_partitions_bitwise(tmp_path):
    from transformers import AutoModelForCausalLM

    path = llama(tmp_path / "llama")
    assert len(list(path.glob("model-*.safetensors"))) > 2 and (path / "model.safetensors.index.json").is_file()
    module = OwnModule(path)
    trainer = fit(module, tmp_path)
    plain = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
    assert module.loaded.keys() == plain.keys()
    for name, value in plain.items():
        assert torch.equal(module.loaded[name], value), name
    assert module.model.training
    assert torch.isfinite(trainer.callback_metrics["train_loss"])


def test_a_new_head_is_initialised_and_every_loaded_weight_kept(tmp_path):
    """A base-model checkpoint (no ``model.`` prefix in its names) into a classifier: the head is new."""
    path = llama(tmp_path / "base", head=False)
    module = OwnModule(path, auto_class="AutoModelForSequenceClassification", num_labels=3)
    with pytest.warns(UserWarning, match=r"1 parameter\(s\) are not in the checkpoint.*newly initialized: score"):
        fit(module, tmp_path, steps=0)
    saved = checkpoint_tensors(path)
    assert {f"model.{k}" for k in saved} | {"score.weight"} == module.loaded.keys()
    for name, value in saved.items():
        assert torch.equal(module.loaded[f"model.{name}"], value.float()), name
    head = module.loaded["score.weight"]
    assert head.shape == (3, 64) and 0.01 < float(head.std()) < 0.04  # transformers' init: N(0, 0.02)


def test_names_transformers_must_convert_take_its_own_loading(tmp_path):
    """A tensor with no place in the model: transformers' own loading (which skips it) instead of a wrong copy."""
    path = llama(tmp_path / "llama", shard="10MB")
    tensors = load_file(path / "model.safetensors")
    save_file({**tensors, "model.extra.weight": torch.ones(3)}, path / "model.safetensors", metadata={"format": "pt"})
    module = OwnModule(path)
    fit(module, tmp_path, steps=0)
    for name, value in tensors.items():
        assert torch.equal(module.loaded[name], value.float()), name


def test_bad_arguments_are_refused_before_anything_loads(tmp_path):
    path = llama(tmp_path / "llama")
    module = OwnModule(path)
    with pytest.raises(TypeError, match=r"`module` must be the LightningModule.*configure_model"):
        from_pretrained(torch.nn.Linear(1, 1), path)
    with pytest.raises(FileNotFoundError, match=r"`model_path='.*nope'` is neither a directory nor a Hugging Face Hub"):
        from_pretrained(module, tmp_path / "nope")
    with pytest.raises(TypeError, match=r"`from_pretrained\(dtype='bf16'\)`.*torch.dtype"):
        from_pretrained(module, path, dtype="bf16")
    with pytest.raises(ValueError, match=r"`auto_class='AutoNothing'` is not a transformers auto model class"):
        from_pretrained(module, path, auto_class="AutoNothing")
    # Outside a trainer it is a plain load, and says where the call belongs.
    with pytest.warns(UserWarning, match=r"not attached to a Trainer: the whole model is loaded.*configure_model"):
        model = from_pretrained(module, path)
    assert model.training and not hasattr(next(model.parameters()), "ds_id")


def _load_growth(tmp_path: Path, model_dir: Path, kind: str) -> dict:
    storage = tmp_path / f"state-{model_dir.name}-{kind}"
    storage.mkdir()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(model_dir), str(storage), kind],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_loading_grows_host_memory_by_a_shard_not_by_the_model(tmp_path):
    """Parameters on storage, a Llama of 4 then 16 layers (35M, 120M parameters; every matrix over DeepSpeed's 1 MB
    minimum for a file of its own), each in one safetensors file: the peak RSS growth while the model loads moves by
    less than a tenth of the 16-bit size the model gained. Transformers' own ZeRO-3 loading of the larger model (it
    maps every file at once) grows by more than half the model's 16-bit size beyond ours, so the measure can tell."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small = llama(tmp_path / "small", layers=4, hidden=768, vocab=4096, shard="1GB")
        large = llama(tmp_path / "large", layers=16, hidden=768, vocab=4096, shard="1GB")
    ours_small = _load_growth(tmp_path, small, "ours")
    ours_large = _load_growth(tmp_path, large, "ours")
    theirs_large = _load_growth(tmp_path, large, "transformers")
    assert ours_small["max_error"] == ours_large["max_error"] == theirs_large["max_error"] == 0.0
    gained = 2 * (ours_large["params"] - ours_small["params"])  # bytes of the extra layers in bf16
    assert ours_large["load_growth"] - ours_small["load_growth"] < 0.1 * gained, (ours_small, ours_large)
    assert theirs_large["load_growth"] - ours_large["load_growth"] > 0.5 * 2 * ours_large["params"], theirs_large


def test_tensor_files_read_as_safetensors_does_and_refuse_what_is_not_one(tmp_path):
    from lightning_smartinf.hf.loading import tensor_file

    tensors = {
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(2, 2, 2, dtype=torch.float16),
        "d": torch.tensor([True, False]),
        "e": torch.randn(()),
    }
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    file = tensor_file(tmp_path / "x.safetensors")
    assert file.keys() == tensors.keys()
    for name, value in tensors.items():
        read = file[name].load()
        assert read.dtype == value.dtype and read.shape == value.shape and torch.equal(read, value), name
    (tmp_path / "short.safetensors").write_bytes((tmp_path / "x.safetensors").read_bytes()[:-8])
    with pytest.raises(ValueError, match=r"short.safetensors' is not a safetensors file .*end at byte"):
        tensor_file(tmp_path / "short.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"junk.safetensors' is not a safetensors file"):
        tensor_file(tmp_path / "junk.safetensors")
