"""Bring any Hugging Face model, take it back out (issue 18): a user's own LightningModule holding
``AutoModelForX.from_pretrained(path)`` trains with ``smart_infinity``, and ``smartinf export --save-pretrained``
writes the right head from the checkpoint alone (attribute and head found from the weights' names and shapes).

Proof: transformers' own ``from_pretrained`` reloads each export, and its weights are those of a plain
``torch.optim.AdamW`` fine-tuning of the same model on the same batches (fp32, dropout off) within 1e-5 relative:
all-MiniLM-L6-v2 (config ``architectures: ["BertModel"]``) as sequence and as token classifier, a small GPT-2 made
here as causal LM, on 1 rank and on 2 (``Trainer(devices=2)`` launching its second rank itself).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from hf_models import BATCH, KINDS, LENGTH, NUM_LABELS, STEPS, minilm, samples, tiny_gpt2
from launch import SCRIPTS, python
from lightning.pytorch.callbacks import ModelCheckpoint
from models import max_relative_error
from torch.utils.data import DataLoader
from transformers import (
    AutoTokenizer,
)

from lightning_smartinf import SmartInfinityStrategy, checkpoint_folder
from lightning_smartinf.export import main as export_main
from lightning_smartinf.hf import load_tokenizer
from lightning_smartinf.hf.pretrained import build_model, find_attribute, find_head


def plain_fine_tune(kind: str, model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The reference: the same module and batches, ``loss.backward(); optimizer.step()`` by hand, no Lightning."""
    L.seed_everything(0)  # the new head's initialization
    module = KINDS[kind][0](str(model_dir)).train()
    optimizer = module.configure_optimizers()
    for index, batch in enumerate(DataLoader(samples(kind, model_dir), batch_size=BATCH)):
        optimizer.zero_grad()
        module.training_step(batch, index).backward()
        optimizer.step()
    return {name: param.detach().clone() for name, param in module.model.named_parameters()}


def smart_fine_tune(kind: str, model_dir: str | Path, root: Path) -> Path:
    """The module trained with ``smart_infinity`` and a stock ``ModelCheckpoint``; the checkpoint of its last step."""
    L.seed_everything(0)
    module = KINDS[kind][0](str(model_dir))
    checkpoint = ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=STEPS)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=SmartInfinityStrategy(storage_paths=[str(root)]),
        precision="32-true",
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        callbacks=[checkpoint],
        use_distributed_sampler=False,  # the reference's batches in its order (Lightning would add a sampler)
    )
    trainer.fit(module, DataLoader(samples(kind, model_dir), batch_size=BATCH))
    return Path(checkpoint.best_model_path)


def comparable(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights with those of zero gradient in exact arithmetic left out: attention key biases (softmax ignores a
    shift shared by all keys) get only rounding noise, which Adam scales to order-one updates."""
    out = {}
    for name, value in state.items():
        if name.endswith("attention.self.key.bias"):
            continue
        if name.endswith("c_attn.bias"):  # GPT-2: [query | key | value]
            third = value.shape[0] // 3
            value = torch.cat([value[:third], value[2 * third :]])
        out[name] = value
    return out


def assert_round_trip(kind: str, model_dir: Path, out: Path, reference: dict[str, torch.Tensor]) -> None:
    """``out`` reloads with transformers as the right class, holding the reference weights and the tokenizer."""
    _, architecture, auto = KINDS[kind]
    assert json.loads((out / "config.json").read_text())["architectures"] == [architecture]
    reloaded = auto.from_pretrained(out)
    assert type(reloaded).__name__ == architecture
    ours = {name: param.detach() for name, param in reloaded.named_parameters()}
    errors = max_relative_error(comparable(ours), comparable(reference))
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda item: -item[1])[:4]
    if kind == "causal":
        assert reloaded.lm_head.weight is reloaded.transformer.wte.weight  # tied stays tied
    else:
        assert reloaded.config.num_labels == NUM_LABELS  # from the weights: the model dir's config says 2
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "the for statement"
    assert tokenizer(text)["input_ids"] == load_tokenizer(model_dir)(text)["input_ids"]


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    return minilm()


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small GPT-2 without dropout and its byte-level BPE tokenizer, both made here."""
    return tiny_gpt2(tmp_path_factory.mktemp("gpt2") / "model", vocab_size=512, n_embd=32, n_positions=LENGTH)


@pytest.fixture(scope="module")
def model_dirs(minilm_dir: Path, gpt2_dir: Path) -> dict[str, Path]:
    return {"sequence": minilm_dir, "token": minilm_dir, "causal": gpt2_dir}


@pytest.fixture(scope="module")
def references(model_dirs: dict[str, Path]) -> dict[str, dict[str, torch.Tensor]]:
    return {kind: plain_fine_tune(kind, model_dirs[kind]) for kind in KINDS}


@pytest.fixture(scope="module")
def sequence_checkpoint(tmp_path_factory: pytest.TempPathFactory, minilm_dir: Path) -> Path:
    return smart_fine_tune("sequence", minilm_dir, tmp_path_factory.mktemp("sequence"))


# ---------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", list(KINDS))
def test_user_module_round_trip(kind, tmp_path, model_dirs, references, sequence_checkpoint):
    """1 rank: export from the checkpoint alone (and the model dir), reload with transformers, equal torch.optim."""
    model_dir = model_dirs[kind]
    ckpt = sequence_checkpoint if kind == "sequence" else smart_fine_tune(kind, model_dir, tmp_path)
    out = tmp_path / "hf"
    assert export_main([str(ckpt), "--save-pretrained", str(out), "--hf-model-dir", str(model_dir)]) == 0
    assert_round_trip(kind, model_dir, out, references[kind])
    # Training moved the weights well beyond the tolerance.
    start = comparable({k: v.detach() for k, v in KINDS[kind][2].from_pretrained(model_dir).named_parameters()})
    trained = comparable(references[kind])
    common = [k for k in trained if k in start and start[k].shape == trained[k].shape]  # not a new head
    moved = max_relative_error({k: start[k] for k in common}, {k: trained[k] for k in common})
    assert min(moved.values()) > 1e-5 and max(moved.values()) > 1e-3, sorted(moved.items(), key=lambda kv: kv[1])[:4]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_ranks_round_trip(tmp_path, model_dirs, references):
    """2 ranks (``Trainer(devices=2)`` starts rank 1 itself): each rank holds half of every parameter's masters and
    sees half of each batch; the export joins the halves to the weights of the 1-process reference."""
    kinds = ",".join(KINDS)
    dirs = ",".join(str(model_dirs[kind]) for kind in KINDS)
    python(SCRIPTS / "hf_export_two_ranks.py", tmp_path, kinds, dirs)
    for kind in KINDS:
        ckpt = tmp_path / kind / "ckpts" / f"epoch=0-step={STEPS}.ckpt"
        assert (ckpt / "checkpoint" / "smartinf" / "rank001").is_dir()
        out = tmp_path / kind / "hf"
        assert export_main([str(ckpt), "--save-pretrained", str(out), "--hf-model-dir", str(model_dirs[kind])]) == 0
        assert_round_trip(kind, model_dirs[kind], out, references[kind])


def test_auto_class_flag_and_errors(tmp_path, minilm_dir, gpt2_dir, sequence_checkpoint, capsys):
    """`--auto-class` / `--hf-attribute` name the head and attribute; weights that fit no head are refused."""
    ckpt, out = str(sequence_checkpoint), str(tmp_path / "hf")
    common = [ckpt, "--save-pretrained", out, "--hf-model-dir", str(minilm_dir)]
    args = [*common, "--auto-class", "AutoModelForSequenceClassification", "--hf-attribute", "model"]
    assert export_main(args) == 0
    assert "BertForSequenceClassification" in capsys.readouterr().out

    def refused(argv: list[str], pattern: str) -> None:
        assert export_main(argv) == 1
        err = capsys.readouterr().err
        assert re.search(pattern, err, re.S), err

    refused(
        [*common, "--auto-class", "AutoModelForTokenClassification"],
        r"fit no AutoModelForTokenClassification of this `bert` config.*BertForTokenClassification: missing 0 \[\], "
        r"unexpected 2 \['bert.pooler.dense.bias'.*--auto-class",
    )
    refused([*common, "--auto-class", "AutoTokenizer"], r"`auto_class='AutoTokenizer'` is not a transformers auto")
    refused([*common, "--hf-attribute", "encoder"], r"`attribute='encoder'`.*no parameters under it.*\['model'\]")
    refused(
        [ckpt, "--save-pretrained", out, "--hf-model-dir", str(gpt2_dir)],
        r"No attribute of the module holds a `gpt2` model.*\['model'\].*--hf-model-dir",
    )
    with pytest.raises(SystemExit):
        export_main([ckpt, "out.safetensors", "--auto-class", "AutoModel"])
    assert "`--auto-class` goes with `--save-pretrained DIR`" in capsys.readouterr().err


class Hostile:
    """Unpickling this runs ``Path.touch(marker)``: the stand-in for any code a pickle can carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_export_never_unpickles(tmp_path, minilm_dir, sequence_checkpoint, capsys):
    """A user module's checkpoint records no HF metadata, but export still reads its client state: never as code."""
    import shutil

    copy = shutil.copytree(sequence_checkpoint, tmp_path / "hostile.ckpt")
    victim = copy / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    state = torch.load(victim, weights_only=True)
    state["hyper_parameters"] = {"evil": Hostile(tmp_path / "pwned")}
    torch.save(state, victim)
    seal = json.loads((copy / checkpoint_folder.SEAL).read_text())
    checkpoint_folder.seal(copy, global_step=seal["global_step"], world_size=seal["world_size"])  # no signature
    args = [str(copy), "--save-pretrained", str(tmp_path / "hf"), "--hf-model-dir", str(minilm_dir)]
    assert export_main(args) == 1
    assert re.search(re.escape(str(victim)) + ".*refused", capsys.readouterr().err)
    assert not (tmp_path / "pwned").exists(), "code from the checkpoint ran"


# ---------------------------------------------------------------------------------------------- matching (no training)


def _shapes(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Size]:
    return {prefix + name: param.shape for name, param in model.named_parameters()}


@pytest.mark.parametrize(
    ("auto", "expected"),
    [
        ("AutoModelForQuestionAnswering", "AutoModelForQuestionAnswering"),
        ("AutoModelForMaskedLM", "AutoModelForMaskedLM"),  # BertLMHeadModel has the same weights: not a decoder
        ("AutoModel", "AutoModel"),
        ("AutoModelForTokenClassification", "AutoModelForTokenClassification"),
    ],
)
def test_find_head_from_weights(auto, expected, minilm_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(minilm_dir, local_files_only=True)
    config.num_labels = 7
    shapes = _shapes(build_model(config, auto, device="meta"))
    config.num_labels = 2  # as the model directory says: the weights tell 7
    head, fitted = find_head(shapes, config)
    assert head == expected
    if auto == "AutoModelForTokenClassification":
        assert fitted.num_labels == 7
    config.is_decoder = True
    if auto == "AutoModelForMaskedLM":
        assert find_head(shapes, config)[0] == "AutoModelForCausalLM"


def test_find_attribute_from_names(minilm_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(minilm_dir, local_files_only=True)
    encoder = _shapes(build_model(config, "AutoModel", device="meta"), "net.encoder.")
    classifier = _shapes(build_model(config, "AutoModelForSequenceClassification", device="meta"), "student.")
    own = {"head.weight": (3, 384), "LayerNorm.weight": (384,), "pooler.dense.bias": (384,)}
    assert find_attribute([*encoder, *own], config) == "net.encoder"
    assert find_attribute([*classifier, *own], config) == "student"
    teacher = _shapes(build_model(config, "AutoModelForSequenceClassification", device="meta"), "teacher.")
    with pytest.raises(ValueError, match=r"Several attributes.*\['student', 'teacher'\].*--hf-attribute student"):
        find_attribute([*classifier, *teacher], config)
