"""A Hugging Face Hub cache laid out here, as ``huggingface_hub`` lays out what it downloads: the tests run offline
(``HF_HUB_OFFLINE=1``), as a user on a node without internet does with a cache filled elsewhere."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest


def cache_model(cache: Path, repo_id: str, source: Path, *, revision: str = "main") -> Path:
    """``source``'s files in ``cache`` as ``huggingface_hub`` keeps a downloaded snapshot: each file a blob named by
    its hash, the snapshot a directory of relative links to them, ``refs/<revision>`` the commit. Returns the
    snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


def offline_cache(directory: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hub cache in ``directory``, offline, for this process and the processes it starts."""
    import huggingface_hub.constants

    directory.mkdir(parents=True, exist_ok=True)
    # huggingface_hub reads its environment once, at import: its constants too, for this process.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(directory))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(directory))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return directory
