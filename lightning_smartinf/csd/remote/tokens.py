"""The bearer token shared by device servers and their trainers: read from a file only its owner can read."""

from __future__ import annotations

from pathlib import Path

__all__ = ["read_token"]


def read_token(path: Path) -> str:
    """The bearer token in ``path`` (whitespace stripped); the file must not be readable by others."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"Cannot read the token file {str(path)!r}: {exc.strerror}.") from None
    if mode & 0o077:
        raise ValueError(
            f"The token file {str(path)!r} is readable by other users (mode {oct(mode & 0o777)}); `chmod 600 {path}`."
        )
    if not text:
        raise ValueError(f"The token file {str(path)!r} is empty; put a long random secret in it.")
    return text
