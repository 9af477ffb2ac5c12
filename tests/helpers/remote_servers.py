"""Remote device servers as separate processes on loopback (``smartinf serve``), for the tests."""

from __future__ import annotations

import selectors
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from helpers.launch import worker_env

ROOT = Path(__file__).resolve().parents[2]


def write_token(path: Path, token: str = "s3cret-token-for-tests") -> Path:
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


@dataclass
class ServerProcess:
    """One ``smartinf serve`` process; ``address`` is where it listens."""

    storage: list[Path]
    token_file: Path
    process: subprocess.Popen | None = None
    port: int = 0
    log: Path | None = None
    extra: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, port: int = 0, timeout: float = 60.0) -> ServerProcess:
        self.log = self.storage[0].parent / f"server-{self.storage[0].name}.log"
        env = worker_env()
        command = [
            sys.executable,
            "-m",
            "lightning_smartinf",
            "serve",
            "--storage",
            *map(str, self.storage),
            "--token-file",
            str(self.token_file),
            "--listen",
            f"127.0.0.1:{port}",
            *self.extra,
        ]
        with open(self.log, "ab") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        assert self.process.stdout is not None
        ready = selectors.DefaultSelector()
        ready.register(self.process.stdout, selectors.EVENT_READ)
        # The server prints its ready line whole, or exits: either makes the pipe readable within the timeout.
        line = self.process.stdout.readline() if ready.select(timeout) else ""
        ready.close()
        if not line.startswith("serving"):
            self.stop()
            said = f"{line!r}" if line else f"nothing within {timeout:g} s"
            raise RuntimeError(f"smartinf serve did not start: {said}\n{self.log.read_text()}")
        self.port = int(line.split()[-1])
        return self

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_mark(self) -> int:
        """Where the log ends now: :meth:`log_text` from here shows only what comes after."""
        return self.log.stat().st_size if self.log is not None and self.log.exists() else 0

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log_text(self, since: int = 0) -> str:
        """The server's log (from ``since``, a :meth:`log_mark`)."""
        if self.log is None or not self.log.exists():
            return ""
        with open(self.log, "rb") as log:
            log.seek(since)
            return log.read().decode(errors="replace")


def server_pool(root: Path, token_file: Path, layouts: Sequence[Sequence[str]]) -> Iterator[list[ServerProcess]]:
    """Servers for a test module, one per layout (the names of its storage roots under ``root``), stopped at the end.

    Modules share them between tests (each test opens sessions of its own); :func:`running` gives a test back every
    server an earlier test killed or stopped.
    """
    made = [ServerProcess([root / name for name in layout], token_file) for layout in layouts]
    try:
        yield running(made)
    finally:
        for server in made:
            server.stop()


def running(servers: list[ServerProcess]) -> list[ServerProcess]:
    """``servers``, each started again (on a new port) if it is not running."""
    for server in servers:
        if not server.running:
            server.start()
    return servers


def make_certificates(directory: Path) -> Path:
    """A test CA, a server certificate for 127.0.0.1 and two client certificates (two identities), made with the
    openssl command.

    Returns ``directory``, laid out as ``remote_tls_dir`` expects (``ca.pem``, ``client.pem``, ``client.key``) plus
    ``server.pem``, ``server.key``, ``other.pem``, ``other.key`` (the second client) and ``ca.key``.
    """
    directory.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=smartinf-test-ca",
    )
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client", "other"):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN=smartinf-test-{name}",
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            "san.cnf",
        )
        (directory / f"{name}.key").chmod(0o600)
    return directory
