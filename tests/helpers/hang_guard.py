"""Running a call that might hang without hanging the test suite."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

#: Seconds a call that should return promptly gets before the test fails as a hang.
GUARD_S = 30.0


def run_with_timeout(fn: Callable[[], object], timeout: float = GUARD_S) -> BaseException | None:
    """Run ``fn`` in a daemon thread; return its exception (or ``None``); fail the test if it does not return."""
    box: list[BaseException | None] = [None]

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box[0] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__qualname__', fn)} did not return within {timeout} s (hang)")
    return box[0]
