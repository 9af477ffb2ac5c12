"""Fixtures shared by the core's tests: xrt backends to close; host memory fenced as an accelerator's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.remote_servers import server_pool, write_token

from lightning_smartinf.devices.xrt import XrtBackend


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    """A token file for the module's remote servers and clients."""
    return write_token(tmp_path_factory.mktemp("token") / "token")


@pytest.fixture(scope="module")
def servers(tmp_path_factory, token_file):
    """Two device servers shared by the module's tests (a test that kills one defines its own)."""
    yield from server_pool(tmp_path_factory.mktemp("servers"), token_file, [["s0"], ["s1"]])


@pytest.fixture
def backends() -> Iterator[list[XrtBackend]]:
    """Backends a test appends here are closed at its teardown."""
    made: list[XrtBackend] = []
    yield made
    for backend in made:
        backend.close()


class FakeEvent:
    """An event of a stream that runs asynchronously to the host, as a CUDA event: it logs when it is recorded and
    when a thread waits for it."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log = log

    def record(self, stream: object = None) -> None:
        self.log.append(("record", id(self)))

    def synchronize(self) -> None:
        self.log.append(("wait", id(self)))


@pytest.fixture
def asynchronous_host(monkeypatch) -> list[tuple[str, int]]:
    """Host memory that behaves as an accelerator's for fencing: work on it counts as queued on a stream, and every
    event recorded or waited for is logged. Returns the log."""
    from lightning_smartinf.core import accelerator

    log: list[tuple[str, int]] = []
    stream = object()
    monkeypatch.setattr(accelerator, "runs_async", lambda device: True, raising=False)
    monkeypatch.setattr(accelerator, "on_cuda", lambda tensor: True)
    monkeypatch.setattr(accelerator, "cuda_event", lambda: FakeEvent(log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    return log
