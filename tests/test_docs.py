"""The documentation runs as written: the README's Python snippets and its export command execute (with small sizes),
and every flag of every command line in ``README.md`` and ``docs/*.md`` is one its command's ``--help`` lists, so a
renamed flag breaks the build instead of the reader's run."""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT
from helpers.hf_hub import cache_model, offline_cache
from helpers.launch import worker_env

README = REPO_ROOT / "README.md"
DOCS = sorted((REPO_ROOT / "docs").glob("*.md"))
DATA = REPO_ROOT / "recipes" / "data"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks(path: Path, languages: tuple[str, ...]) -> list[str]:
    return [body for language, body in FENCE.findall(path.read_text()) if language in languages]


def substitute(text: str, replacements: dict[str, str]) -> str:
    """``text`` with each replacement made; a replacement that finds nothing fails (the README changed under it)."""
    for old, new in replacements.items():
        assert old in text, f"the README no longer says {old!r}: update this test's replacements with it"
        text = text.replace(old, new)
    return text


def run_python(code: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=worker_env(), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def tiny_llama(out: Path) -> Path:
    """A two-layer Llama with a byte-level BPE tokenizer trained here, saved in bf16 like a downloaded model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_smartinf.hf import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer([DATA / "python_docs.txt"], out / "tokenizer", vocab_size=512)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model_dir = out / "model"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(model_dir, max_shard_size="100KB")
    tokenizer.save_pretrained(model_dir)
    return model_dir


@pytest.mark.slow
def test_the_readme_python_snippets_run(tmp_path, monkeypatch):
    """Every Python snippet of the README runs, each in a fresh process and directory; the fine-tuning snippet on a
    tiny Llama under the README's own Hub id (in an offline Hub cache), then the README's export command on its
    checkpoint."""
    snippets = blocks(README, ("python",))
    quick = [s for s in snippets if "class Regression" in s]
    finetune = [s for s in snippets if "class MyLM" in s]
    assert len(quick) == len(finetune) == 1 and len(snippets) == 2, "a new README snippet needs a run here"

    (tmp_path / "quick").mkdir()
    quick_run = run_python(substitute(quick[0], {"max_steps=100": "max_steps=3"}), tmp_path / "quick")
    assert "holds no optimizer state" not in quick_run.stderr  # both drives of the example hold state

    model_dir = tiny_llama(tmp_path / "models")
    cache_model(offline_cache(tmp_path / "hub-cache", monkeypatch), "meta-llama/Llama-3.1-8B", model_dir)
    work = tmp_path / "finetune"
    work.mkdir()
    code = substitute(
        finetune[0],
        {
            '["/mnt/nvme0/state", "/mnt/nvme1/state"]': '["state0", "state1"]',
            'state_memory_budget="64GiB"': 'state_memory_budget="16KiB"',
            "max_steps=1000": "max_steps=2",
            "every_n_train_steps=250": "every_n_train_steps=2",
            '"pairs.jsonl"': repr(str(DATA / "python_docs_sft_train.jsonl")),
            "max_length=2048": "max_length=64",
        },
    )
    run_python(code, work)
    export = [
        line
        for block in blocks(README, ("bash",))
        for line in block.splitlines()
        if "--save-pretrained out/my-lm" in line
    ]
    assert len(export) == 1
    command = substitute(export[0], {"step=1000": "step=2"})
    argv = shlex.split(command)
    assert argv[0] == "smartinf"
    done = subprocess.run(
        [sys.executable, "-m", "lightning_smartinf", *argv[1:]],
        cwd=work,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(work / "out" / "my-lm")
    assert exported.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------ command lines

#: Leading words that make a line a command of this repository, and how to call it.
PYTHON = re.compile(r"^(?:\S*/)?python3?$")


def command_of(words: list[str]) -> tuple[str, ...] | None:
    """The argv prefix whose ``--help`` documents ``words``' flags, or ``None`` when it is not one of ours."""
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # environment assignments
        words = words[1:]
    if not words:
        return None
    if words[0] == "smartinf":
        subcommand = next((w for w in words[1:] if not w.startswith("-")), None)
        return ("-m", "lightning_smartinf", subcommand) if subcommand else ("-m", "lightning_smartinf")
    if PYTHON.match(words[0]) and len(words) > 1:
        if words[1] == "-m" and len(words) > 2 and words[2].startswith("lightning_smartinf"):
            return ("-m", words[2])
        if words[1].endswith(".py") and (REPO_ROOT / words[1]).is_file():
            return (words[1],)
    return None


INLINE = re.compile(r"`((?:smartinf|python -m lightning_smartinf)[^`]*)`")


def command_lines(path: Path) -> list[tuple[str, tuple[str, ...], list[str]]]:
    """(line, argv prefix, flags) of each command of ours in ``path``'s shell blocks and inline code."""
    found = []
    text = path.read_text()
    inline = INLINE.findall(FENCE.sub("", text))
    for block in [*blocks(path, ("bash", "sh", "console", "")), *inline]:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip().removeprefix("$ ")
            for part in re.split(r"&&|;|\|", line):
                try:
                    words = shlex.split(part)
                except ValueError:
                    continue
                prefix = command_of(words)
                if prefix is not None:
                    flags = [w.split("=", 1)[0] for w in words if w.startswith("--") and len(w) > 2]
                    found.append((part.strip(), prefix, flags))
    return found


def help_text(prefix: tuple[str, ...]) -> str:
    """What ``python <prefix> --help`` prints, run in this process (argparse and jsonargparse exit after it)."""
    argv = [prefix[1], *prefix[2:], "--help"] if prefix[0] == "-m" else [*prefix, "--help"]
    out = io.StringIO()
    saved = sys.argv
    sys.argv = argv
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
            if prefix[0] == "-m":
                runpy.run_module(prefix[1], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(REPO_ROOT / prefix[0]), run_name="__main__")
    finally:
        sys.argv = saved
    assert exited.value.code in (0, None), f"`{' '.join(argv)}` exited with {exited.value.code}"
    return out.getvalue()


def test_every_documented_command_line_uses_flags_its_help_lists():
    lines = [(path, *found) for path in [README, *DOCS] for found in command_lines(path)]
    assert len(lines) > 30  # the README and docs hold dozens: the parser found them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules after import of package"
        helps = {prefix: help_text(prefix) for prefix in sorted({prefix for _, _, prefix, flags in lines if flags})}
    unknown = []
    for path, line, prefix, flags in [entry for entry in lines if entry[3]]:
        listed = set(re.findall(r"--[\w.-]+", helps[prefix]))
        unknown += [f"{path.relative_to(REPO_ROOT)}: {flag} in `{line}`" for flag in flags if flag not in listed]
    assert not unknown, "flags the commands do not have:\n" + "\n".join(unknown)


@pytest.mark.parametrize(
    "line, prefix",
    [
        ("smartinf plan --model 7B", ("-m", "lightning_smartinf", "plan")),
        ("PYTHONPATH=. .venv/bin/python benchmarks/bench_step.py --dim 8", ("benchmarks/bench_step.py",)),
        ("python -m lightning_smartinf.commands.export a b", ("-m", "lightning_smartinf.commands.export")),
        ("bash scripts/setup.sh", None),
    ],
)
def test_command_lines_are_recognised(line, prefix):
    assert command_of(shlex.split(line)) == prefix


def test_every_file_the_docs_link_or_name_exists():
    """Links and the repository paths the docs name in code spans point at files that are there (what benchmarks
    write under ``benchmarks/out/`` aside: it is made by running them)."""
    missing = []
    for path in [README, *DOCS, REPO_ROOT / "recipes" / "README.md"]:
        text = path.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not target.startswith(("http://", "https://", "mailto:")) and not (path.parent / target).exists():
                missing.append(f"{path.relative_to(REPO_ROOT)}: link {target}")
        for target in re.findall(
            r"`((?:lightning_smartinf|tests|benchmarks|scripts|recipes|docs|hls_kernels)/[\w./-]+\.\w+)`", text
        ):
            if not target.startswith("benchmarks/out/") and not (REPO_ROOT / target).exists():  # outputs
                missing.append(f"{path.relative_to(REPO_ROOT)}: {target}")
    assert not missing, "\n".join(missing)
