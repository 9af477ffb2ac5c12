"""Fixtures shared by the core's xrt tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lightning_smartinf.devices.xrt import XrtBackend


@pytest.fixture
def backends() -> Iterator[list[XrtBackend]]:
    """Backends a test appends here are closed at its teardown."""
    made: list[XrtBackend] = []
    yield made
    for backend in made:
        backend.close()
