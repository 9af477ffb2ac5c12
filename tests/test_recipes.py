"""The YAML recipes in ``recipes/``: a comment on every key, the CPU-sized ones train through ``smartinf fit``, and a
bad model/data key or value is refused naming the key. (``tests/test_cli.py`` parses every recipe.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO_ROOT, SHORT_FIT
from helpers.hf_models import minilm

from lightning_smartinf.commands.fit import main

RECIPES = sorted((REPO_ROOT / "recipes").glob("*.yaml"))
KEY = re.compile(r"^(\s*)(- )?([A-Za-z_][\w.]*):")
#: A few steps, one short validation, no TensorBoard files: enough to run every part of a recipe.
SHORT = SHORT_FIT


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    for task in ("gpt2-pretrain", "causal-lm-finetune", "seqcls-finetune"):
        assert {f"{task}-cpu.yaml", f"{task}-gpu.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_key_has_a_comment(path):
    """Each key is preceded by a comment line (``init_args`` excepted: its ``class_path`` carries the comment)."""
    lines = path.read_text().splitlines()
    uncommented = []
    for number, line in enumerate(lines):
        match = KEY.match(line)
        if not match or match.group(3) == "init_args":
            continue
        previous = next((p for p in reversed(lines[:number]) if p.strip()), "")
        if not previous.strip().startswith("#"):
            uncommented.append(f"line {number + 1}: {line.strip()}")
    assert not uncommented, uncommented


@pytest.mark.parametrize("path", [p for p in RECIPES if p.name.endswith("-gpu.yaml")], ids=lambda p: p.name)
def test_gpu_recipes_state_what_they_need(path):
    header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    assert re.search(r"Needs: a GPU with >= \d+ GB.*>= \d+ GB free across storage_paths", header), header
    config = yaml.safe_load(path.read_text())
    assert config["trainer"]["accelerator"] == "cuda" and config["trainer"]["precision"] == "bf16-mixed"
    assert config["trainer"]["strategy"]["init_args"]["storage_paths"]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Recipes use paths relative to the repository root; run them in a scratch copy of that layout."""
    (tmp_path / "recipes").symlink_to(REPO_ROOT / "recipes")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.slow
def test_cpu_recipes_train_and_save_pretrained(gpt2_recipe_run, monkeypatch):
    """Pre-train the GPT-2 from scratch (with `smartinf fit`), fine-tune the result, fine-tune MiniLM: 3 steps each,
    exported fp32."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    workdir, _ = gpt2_recipe_run
    monkeypatch.chdir(workdir)
    pretrained = workdir / "out" / "gpt2-pretrain-cpu" / "hf"
    weights = load_file(pretrained / "model.safetensors")
    assert AutoConfig.from_pretrained(pretrained).vocab_size == 4096 == weights["transformer.wte.weight"].shape[0]
    # Built under ZeRO-3 with GPT-2's own initialisation (N(0, 0.02)), then 3 small warm-up steps.
    assert float(weights["transformer.wte.weight"].std()) == pytest.approx(0.02, rel=0.1)
    assert (workdir / "out" / "tokenizers" / "python-docs-bpe-4k" / "tokenizer.json").is_file()

    assert main(["fit", "--config", "recipes/causal-lm-finetune-cpu.yaml", *SHORT]) == 0
    finetuned = load_file(workdir / "out" / "causal-lm-finetune-cpu" / "hf" / "model.safetensors")
    assert finetuned.keys() == weights.keys()
    assert all(not torch.equal(finetuned[k], weights[k]) for k in weights)

    minilm()  # installed by set-up
    assert main(["fit", "--config", "recipes/seqcls-finetune-cpu.yaml", *SHORT, "--trainer.max_steps", "2"]) == 0
    classifier = workdir / "out" / "seqcls-finetune-cpu" / "hf"
    assert AutoConfig.from_pretrained(classifier).id2label == {0: "statement", 1: "type"}
    assert load_file(classifier / "model.safetensors")["classifier.weight"].shape == (2, 384)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--model.init_args.lrr", "0.1"], r"HFCausalLM'.*\n\s*Option 'lrr' is not accepted"),
        (["--model.init_args.lr", "fast"], r'Parser key "lr":\n\s*Expected a <class .float.>. Got value: fast'),
        (["--data.init_args.block_size", "big"], r'Parser key "block_size":\n\s*Expected a <class .int.>'),
        (
            ["--model.init_args.optimizer", "rmsprop"],
            r"Parser key \"optimizer\":\n\s*Expected a typing.Literal\['adamw', 'adam', 'sgd', 'adagrad'\]",
        ),
    ],
)
def test_bad_key_or_value_names_it(workdir, capsys, override, message):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", "recipes/gpt2-pretrain-cpu.yaml", *override])
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (workdir / "out").exists()  # refused before anything was built


def test_unknown_key_inside_a_recipe_file(workdir, capsys):
    config = yaml.safe_load((REPO_ROOT / "recipes" / "seqcls-finetune-cpu.yaml").read_text())
    config["data"]["init_args"]["max_lenght"] = 64
    (workdir / "bad.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit):
        main(["fit", "--config", "bad.yaml"])
    assert "Option 'max_lenght' is not accepted" in capsys.readouterr().err


@pytest.mark.slow
def test_sft_recipe_trains(gpt2_recipe_run, monkeypatch, tmp_path):
    """Supervised fine-tuning of the pre-trained GPT-2 on prompt/response pairs (`SFTDataModule`), 3 steps, exported
    fp32; the tokenised pairs go to the token cache given on the command line, one entry per file."""
    from safetensors.torch import load_file

    workdir, _ = gpt2_recipe_run
    monkeypatch.chdir(workdir)
    cache = tmp_path / "tokens"
    recipe = ["fit", "--config", "recipes/causal-lm-sft-cpu.yaml", *SHORT, "--data.init_args.cache_dir", str(cache)]
    assert main(recipe) == 0
    pretrained = load_file(workdir / "out" / "gpt2-pretrain-cpu" / "hf" / "model.safetensors")
    finetuned = load_file(workdir / "out" / "causal-lm-sft-cpu" / "hf" / "model.safetensors")
    assert finetuned.keys() == pretrained.keys()
    assert all(not torch.equal(finetuned[k], pretrained[k]) for k in pretrained)
    assert sorted(p.name.split("-")[0] for p in cache.iterdir()) == ["python_docs_sft_train", "python_docs_sft_val"]
