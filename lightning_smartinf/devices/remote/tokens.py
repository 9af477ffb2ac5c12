"""The secrets of remote device servers and their trainers: the bearer token, and the TLS files.

Each is read from a file; private ones (the token, private keys) must be readable by their owner only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["TlsFiles", "read_tls_dir", "read_token"]


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


@dataclass(frozen=True)
class TlsFiles:
    """PEM bytes: the certificate authority to verify the other side with, and this side's own certificate and key
    (``None`` for a client without a certificate: TLS without client authentication)."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None


def _private(path: Path) -> bytes:
    mode = path.stat().st_mode
    if mode & 0o077:
        raise ValueError(f"{str(path)!r} is readable by other users (mode {oct(mode & 0o777)}); `chmod 600 {path}`.")
    return path.read_bytes()


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
    return TlsFiles(ca=(directory / "ca.pem").read_bytes(), cert=cert.read_bytes(), key=_private(key))


def read_server_tls(cert: Path, key: Path, client_ca: Path | None) -> TlsFiles:
    """A server's certificate and key, and the authority of its clients' certificates for mutual TLS (``ca``:
    empty without it)."""
    for path in (cert, key, *([client_ca] if client_ca else [])):
        if not Path(path).is_file():
            raise ValueError(f"TLS file {str(path)!r} does not exist.")
    return TlsFiles(
        ca=Path(client_ca).read_bytes() if client_ca else b"", cert=Path(cert).read_bytes(), key=_private(Path(key))
    )
