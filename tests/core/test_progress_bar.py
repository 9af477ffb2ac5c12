"""A long operation's bar on a terminal, as tqdm draws it for bytes and for counts."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import sys
import termios

from lightning_smartinf.core import progress
from lightning_smartinf.core.progress import Progress


def drawn(monkeypatch, total: int | None, unit: str) -> str:
    """What a bar of ``total`` ``unit`` drew on a pseudo-terminal once all of it was done."""
    controller, terminal = os.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a new one has 0 columns
    with os.fdopen(terminal, "w") as stderr:
        monkeypatch.setattr(sys, "stderr", stderr)
        # Bars on, shown at once (a Trainer built earlier in this process may have switched bars off).
        monkeypatch.setattr(progress, "_settings", progress._Settings(enabled=True, bars=True, min_seconds=0.0))
        monkeypatch.delenv("SMARTINF_PROGRESS", raising=False)
        with Progress("tokenising a.txt into the token cache", total, unit=unit) as bar:
            bar.update(2_806_926)
        stderr.flush()
    chunks = []
    while select.select([controller], [], [], 1.0)[0]:  # all the terminal holds: one read may return part of it
        try:
            chunks.append(os.read(controller, 65536))
        except OSError:  # its other side is closed and drained
            break
    os.close(controller)
    return b"".join(chunks).decode()


def test_a_count_reads_as_a_number_and_a_word(monkeypatch):
    text = drawn(monkeypatch, None, "tokens")
    assert "2.81M tokens" in text and "tokens/s" in text, text
    assert "2806926tokens" not in text


def test_bytes_read_in_decimal_units(monkeypatch):
    assert "2.81M/2.81M [" in drawn(monkeypatch, 2_806_926, "B")  # and its rate in B/s
