"""Bring any Hugging Face model, take it back out (issue 18): a user's own LightningModule holding
``AutoModelForX.from_pretrained(path)`` trains with ``smart_infinity``, and ``smartinf export --save-pretrained``
writes the right head from the checkpoint alone (attribute and head found from the weights' names and shapes).

Proof: transformers' own ``from_pretrained`` reloads each export, and its weights are those of a plain
``torch.optim.AdamW`` fine-tuning of the same model on the same batches (fp32, dropout off) within 1e-5 relative:
all-MiniLM-L6-v2 (config ``architectures: ["BertModel"]``) as sequence and as token classifier, a small GPT-2 made
here as causal LM, on 1 rank and on 2 (``Trainer(devices=2)`` launching its second rank itself).

Export that fits the model: ``--dtype`` writes the consolidated masters cast to bf16, fp16 or fp32 bit for bit (by
default the dtype the model was loaded in), ``--max-shard-size`` splits them over the files and index transformers'
own ``save_pretrained`` writes of the same model, and the export's peak memory grows by a weight file, not the model.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.hf_models import BATCH, KINDS, LENGTH, NUM_LABELS, STEPS, minilm, samples, tiny_gpt2
from helpers.launch import SCRIPTS, python, worker_env
from helpers.models import max_relative_error
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.commands.export import consolidate_fp32_state_dict, export_pretrained
from lightning_smartinf.commands.export import main as export_main
from lightning_smartinf.core.format import checkpoint_folder
from lightning_smartinf.hf import HFCausalLM, load_tokenizer
from lightning_smartinf.hf.pretrained import build_model, find_attribute, find_head
from lightning_smartinf.hf.weight_files import export_dtype, shard_bytes


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


@pytest.fixture(scope="module")
def causal_checkpoint(tmp_path_factory: pytest.TempPathFactory, gpt2_dir: Path) -> Path:
    return smart_fine_tune("causal", gpt2_dir, tmp_path_factory.mktemp("causal"))


# ---------------------------------------------------------------------------------------------- round trips


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_user_module_round_trip(kind, tmp_path, model_dirs, references, request):
    """1 rank: export from the checkpoint alone (and the model dir), reload with transformers, equal torch.optim."""
    model_dir = model_dirs[kind]
    checkpoints = {"sequence": "sequence_checkpoint", "causal": "causal_checkpoint"}
    if kind in checkpoints:
        ckpt = request.getfixturevalue(checkpoints[kind])
    else:
        ckpt = smart_fine_tune(kind, model_dir, tmp_path)
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
    for flag, value in (("--auto-class", "AutoModel"), ("--dtype", "bf16"), ("--max-shard-size", "1GB")):
        with pytest.raises(SystemExit):
            export_main([ckpt, "out.safetensors", flag, value])
        assert f"`{flag}` goes with `--save-pretrained DIR`" in capsys.readouterr().err


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


# ---------------------------------------------------------------------------------------------- dtype and weight files

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def masters_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's consolidated fp32 masters by Hugging Face name (the user modules hold it as ``model``)."""
    return {name.removeprefix("model."): value for name, value in consolidate_fp32_state_dict(checkpoint).items()}


def written(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the weight files in ``out``, through the index when there is one."""
    index = out / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    return {name: value for file in files for name, value in load_file(out / file).items()}


def model_dir_saying(tmp_path: Path, gpt2_dir: Path, **fields: str) -> Path:
    """A copy of ``gpt2_dir`` whose config.json has ``fields`` instead of its ``dtype``."""
    copy = Path(shutil.copytree(gpt2_dir, tmp_path / "-".join(fields.values())))
    config = json.loads((copy / "config.json").read_text())
    config.pop("dtype", None)
    (copy / "config.json").write_text(json.dumps({**config, **fields}))
    return copy


@pytest.mark.parametrize("flag", list(DTYPES))
def test_dtype_writes_the_masters_cast(flag, tmp_path, gpt2_dir, causal_checkpoint):
    """`--dtype`: transformers reloads the model in that dtype (config.json says it), each weight the consolidated
    fp32 master cast to it, bit for bit; the head stays tied to the embedding."""
    out, dtype = tmp_path / "hf", DTYPES[flag]
    argv = [str(causal_checkpoint), "--save-pretrained", str(out), "--hf-model-dir", str(gpt2_dir), "--dtype", flag]
    assert export_main(argv) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    assert {value.dtype for value in written(out).values()} == {dtype}
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert reloaded.dtype == dtype
    masters = masters_of(causal_checkpoint)
    params = dict(reloaded.named_parameters())
    assert params.keys() == masters.keys()
    different = [name for name, value in params.items() if not torch.equal(value, masters[name].to(dtype))]
    assert not different, different[:4]
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight


def test_sharded_files_are_those_transformers_writes(tmp_path, gpt2_dir, causal_checkpoint):
    """`--max-shard-size 20KB`: several weight files and an index, the very files, index and config transformers'
    own `save_pretrained` writes of the model built from its config and holding these weights (what the export wrote
    before it split them); an export as one file into the same directory then leaves no file of the split behind."""
    out, theirs = tmp_path / "hf", tmp_path / "transformers"
    argv = [str(causal_checkpoint), "--save-pretrained", str(out), "--hf-model-dir", str(gpt2_dir)]
    assert export_main([*argv, "--dtype", "bf16", "--max-shard-size", "20KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(path.name for path in out.glob("model*.safetensors")) == files
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    masters = masters_of(causal_checkpoint)
    assert all(torch.equal(value, masters[name].bfloat16()) for name, value in reloaded.named_parameters())
    # A model transformers loaded itself would save its weights sorted by name (it renames them back as it loads).
    built = AutoModelForCausalLM.from_config(reloaded.config, dtype=torch.bfloat16)
    built.load_state_dict(reloaded.state_dict())
    built.save_pretrained(theirs, max_shard_size="20KB")
    assert json.loads((theirs / "model.safetensors.index.json").read_text()) == index
    assert json.loads((theirs / "config.json").read_text()) == json.loads((out / "config.json").read_text())
    for file in files:
        ours, expected = load_file(out / file), load_file(theirs / file)
        assert ours.keys() == expected.keys() and all(torch.equal(ours[k], expected[k]) for k in ours), file

    assert export_main([*argv, "--max-shard-size", "1GiB"]) == 0
    assert sorted(path.name for path in out.glob("model*")) == ["model.safetensors"]
    assert torch.equal(written(out)["transformer.wte.weight"], masters["transformer.wte.weight"])


def test_default_dtype_is_the_loaded_models(tmp_path, gpt2_dir, causal_checkpoint):
    """Without `--dtype` the weights are written in the dtype the model was loaded in: what its model directory's
    config.json says (`dtype`; `torch_dtype` as transformers 4 wrote it), or what `HFCausalLM` recorded in the
    checkpoint of the config it loaded; fp32 when nothing says."""
    bf16_dir = model_dir_saying(tmp_path, gpt2_dir, dtype="bfloat16")
    cases = {
        gpt2_dir: torch.float32,  # saved by an fp32 model
        bf16_dir: torch.bfloat16,
        model_dir_saying(tmp_path, gpt2_dir, torch_dtype="float16"): torch.float16,
        model_dir_saying(tmp_path, gpt2_dir, comment="none"): torch.float32,
    }
    for model_dir, dtype in cases.items():
        out = tmp_path / f"out-{model_dir.name}"
        assert (
            export_main([str(causal_checkpoint), "--save-pretrained", str(out), "--hf-model-dir", str(model_dir)]) == 0
        )
        assert {value.dtype for value in written(out).values()} == {dtype}, model_dir.name
        assert json.loads((out / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch."), model_dir

    # What `HFCausalLM` records of the model it loads, put into the checkpoint: the export needs no model directory.
    record: dict = {}
    HFCausalLM(str(bf16_dir)).on_save_checkpoint(record)
    copy = Path(shutil.copytree(causal_checkpoint, tmp_path / "recorded.ckpt"))
    client = copy / "checkpoint" / checkpoint_folder.MODEL_STATES
    state = torch.load(client, weights_only=True)
    torch.save({**state, "smartinf_hf": record["smartinf_hf"]}, client)
    seal = json.loads((copy / checkpoint_folder.SEAL).read_text())
    checkpoint_folder.seal(copy, global_step=seal["global_step"], world_size=seal["world_size"])
    assert export_main([str(copy), "--save-pretrained", str(tmp_path / "recorded")]) == 0
    assert {value.dtype for value in written(tmp_path / "recorded").values()} == {torch.bfloat16}


def test_bad_dtype_or_shard_size_is_refused_before_anything_is_written(tmp_path, gpt2_dir, causal_checkpoint, capsys):
    out = tmp_path / "hf"
    argv = [str(causal_checkpoint), "--save-pretrained", str(out), "--hf-model-dir", str(gpt2_dir)]
    refused = {
        ("--dtype", "int8"): r"`--dtype='int8'` is not a dtype the weights can be written in\. Give 'bf16'",
        ("--max-shard-size", "5XB"): r"`--max-shard-size='5XB'` is not a size: .*'8GiB' \(2\*\*30 B\).*'2GB'",
        ("--max-shard-size", "0"): r"`--max-shard-size='0'` is too small: it must be an int number of bytes >= 1",
        ("--max-shard-size", "-1MB"): r"`--max-shard-size='-1MB'` is not a size",
    }
    for (flag, value), pattern in refused.items():
        assert export_main([*argv, f"{flag}={value}"]) == 1
        assert re.search(pattern, capsys.readouterr().err)
        assert not out.exists(), flag
    with pytest.raises(ValueError, match=r"`dtype=torch\.int8` is not a dtype.*torch\.bfloat16"):
        export_pretrained(causal_checkpoint, out, model_dir=gpt2_dir, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"`max_shard_size=1\.5` is a float"):
        export_pretrained(causal_checkpoint, out, model_dir=gpt2_dir, max_shard_size=1.5)
    assert not out.exists()


def test_dtype_and_size_spellings():
    assert {export_dtype(v) for v in ("bf16", "BFloat16", "torch.bfloat16", torch.bfloat16)} == {torch.bfloat16}
    assert {export_dtype(v) for v in ("fp16", "float16", "half", torch.float16)} == {torch.float16}
    assert {export_dtype(v) for v in ("fp32", "float32", "float", torch.float32)} == {torch.float32}
    for bad in ("fp8", "float64", torch.float64, torch.int8, None, 16):
        with pytest.raises(ValueError, match=r"is not a dtype the weights can be written in"):
            export_dtype(bad)
    sizes = {"5GB": 5 * 10**9, "500MB": 500 * 10**6, "2GiB": 2 * 2**30, "1.5 kib": 1536, " 100 ": 100, 7: 7}
    assert {value: shard_bytes(value) for value in sizes} == sizes
    for bad in (0, -5, True, 1.5, None, "", "GB", "5XB", "5 G B", "0.1B", "lots"):
        with pytest.raises(ValueError, match=r"`max_shard_size=.*` .*: it must be an int number of bytes >= 1"):
            shard_bytes(bad)


@pytest.fixture(scope="module")
def deep_gpt2(tmp_path_factory: pytest.TempPathFactory, gpt2_dir: Path) -> tuple[Path, Path]:
    """A GPT-2 of 12 narrow layers (9.6 M parameters, 38 MB in fp32, none above 1.1 MB) and its checkpoint after
    fine-tuning: a model of many parameters."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("deep")
    config = GPT2Config.from_pretrained(gpt2_dir, n_layer=12, n_embd=256)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(root / "model")
    for tokenizer_file in gpt2_dir.glob("*token*"):
        shutil.copy(tokenizer_file, root / "model")
    return root / "model", smart_fine_tune("causal", root / "model", root)


def test_export_memory_grows_by_a_weight_file_not_the_model(tmp_path, deep_gpt2):
    """In a process of its own: writing the 38 MB model in files of 2 MB raises the peak RSS by less than a third of
    the model (the 8 MB block the checksums are read in, and a file), while consolidating it all, measured the same
    way, raises it by about the model. Blocks of 128 kB and more are mapped and unmapped by themselves
    (``MALLOC_MMAP_THRESHOLD_``), so RSS follows what is alive, not what the allocator kept."""
    model_dir, checkpoint = deep_gpt2
    env = worker_env(MALLOC_MMAP_THRESHOLD_=str(128 << 10))
    done = python(SCRIPTS / "export_rss.py", checkpoint, model_dir, tmp_path / "hf", env=env)
    growth = json.loads(done.stdout.strip().splitlines()[-1])
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    model_bytes = index["metadata"]["total_size"]
    assert model_bytes > 35e6 and len(set(index["weight_map"].values())) > 15
    assert growth["consolidate"] > 0.9 * model_bytes, growth
    assert growth["export"] < model_bytes / 3, growth


# ---------------------------------------------------------------------------------------------- a full disk


def fill(fs: Path, leave: int) -> None:
    """Another job takes all of ``fs`` but ``leave`` bytes."""
    with open(fs / "ballast", "ab") as f:
        f.write(b"\0" * max(0, shutil.disk_usage(fs).free - leave))


def test_export_to_a_full_disk_keeps_the_earlier_export(tmp_path, ext4_fs, gpt2_dir, causal_checkpoint, monkeypatch,
                                                        capsys):  # fmt: skip
    """`smartinf export` on a disk without room: refused before writing, or, when the disk fills while it writes,
    stopped with one message; neither leaves a weight file to load, and an earlier export in the same directory
    stays whole. With the space back, the same command writes it."""
    from lightning_smartinf.hf import weight_files

    fs = ext4_fs("16m")
    out, single = fs / "hf", fs / "masters.safetensors"
    command = [str(causal_checkpoint), "--save-pretrained", str(out), "--hf-model-dir", str(gpt2_dir)]
    assert export_main([*command, "--max-shard-size", "200KB"]) == 0
    earlier = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix in (".safetensors", ".json")}
    capsys.readouterr()

    fill(fs, 100 << 10)  # less than the weights: refused before anything is written
    assert export_main([str(causal_checkpoint), str(single)]) == 1
    assert re.search(r"No space left on the filesystem of .* for the fp32 weights: it needs [\d.]+ [KM]iB and the "
                     r"filesystem has [\d.]+ KiB free\. Nothing was written", capsys.readouterr().err)  # fmt: skip
    assert not single.exists() and not list(fs.glob(".masters*"))
    (fs / "ballast").unlink()

    real = weight_files.require_room

    def room_then_fill(directory, what, nbytes, fix):  # noqa: ANN001, ANN202 - passes, then the disk fills
        real(directory, what, nbytes, fix)
        fill(fs, nbytes // 2)

    monkeypatch.setattr(weight_files, "require_room", room_then_fill)
    assert export_main([*command, "--max-shard-size", "100KB"]) == 1
    err = capsys.readouterr().err
    assert re.search(rf"No space left on the filesystem of '{out}' for the exported weights \(\d+ safetensors "
                     r"file\(s\)\): .* Nothing was kept; an earlier export there is untouched\.", err), err  # fmt: skip
    now = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix in (".safetensors", ".json")}
    assert {k: v for k, v in now.items() if k in earlier} == earlier and not list(out.glob(".weights*"))
    monkeypatch.undo()
    (fs / "ballast").unlink()
    assert export_main([*command, "--max-shard-size", "100KB"]) == 0
    assert AutoModelForCausalLM.from_pretrained(out) is not None
