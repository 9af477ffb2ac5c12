"""The secrets of remote device servers and their trainers: the bearer token, and the TLS files.

Each is read from a file; private ones (the token, private keys) must be readable by their owner only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TlsFiles", "read_tls_dir", "read_token"]


#: Shortest token a server or a trainer takes: a guessable secret guards nothing.
MIN_TOKEN_CHARS = 16


def read_token(path: Path) -> str:
    """The bearer token in ``path`` (whitespace stripped): at least :data:`MIN_TOKEN_CHARS` characters, in a file
    no other user may read (mode and contents taken from one open descriptor, so neither can change in between)."""
    path = Path(path)
    try:
        data = _read_private(path)
    except OSError as exc:
        raise ValueError(f"Cannot read the token file {str(path)!r}: {exc.strerror}.") from None
    text = data.decode(errors="replace").strip()
    if not text:
        raise ValueError(f"The token file {str(path)!r} is empty; put a long random secret in it.")
    if len(text) < MIN_TOKEN_CHARS or any(c.isspace() or not c.isprintable() for c in text):
        raise ValueError(
            f"The token in {str(path)!r} must be at least {MIN_TOKEN_CHARS} printable characters with no spaces "
            f"(it has {len(text)}); e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))' > {path}`."
        )
    return text


def _read_private(path: Path) -> bytes:
    """The bytes of ``path``, refused if group or others may read it; mode and bytes come from one descriptor."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as file:
        mode = os.fstat(file.fileno()).st_mode
        if mode & 0o077:
            raise ValueError(
                f"{str(path)!r} is readable by other users (mode {oct(mode & 0o777)}); `chmod 600 {path}`."
            )
        return file.read()


@dataclass(frozen=True)
class TlsFiles:
    """PEM bytes: the certificate authority to verify the other side with, and this side's own certificate and key
    (``None`` for a client without a certificate: TLS without client authentication)."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None


def read_tls_dir(directory: Path) -> TlsFiles:
    """The TLS files of a trainer in ``directory``: ``ca.pem``, and for mutual TLS ``client.pem`` and ``client.key``."""
    directory = Path(directory)
    if not (directory / "ca.pem").is_file():
        raise ValueError(
            f"{str(directory)!r} has no ca.pem: put the certificate authority of the servers' certificates there."
        )
    cert, key = directory / "client.pem", directory / "client.key"
    if cert.exists() != key.exists():
        raise ValueError(f"{str(directory)!r} has one of client.pem and client.key: mutual TLS needs both, or neither.")
    if not cert.exists():
        return TlsFiles(ca=(directory / "ca.pem").read_bytes())
    return TlsFiles(ca=(directory / "ca.pem").read_bytes(), cert=cert.read_bytes(), key=_read_private(key))


def read_server_tls(cert: Path, key: Path, client_ca: Path | None) -> TlsFiles:
    """A server's certificate and key, and the authority of its clients' certificates for mutual TLS (``ca``:
    empty without it)."""
    for path in (cert, key, *([client_ca] if client_ca else [])):
        if not Path(path).is_file():
            raise ValueError(f"TLS file {str(path)!r} does not exist.")
    ca = Path(client_ca).read_bytes() if client_ca else b""
    return TlsFiles(ca=ca, cert=Path(cert).read_bytes(), key=_read_private(Path(key)))
