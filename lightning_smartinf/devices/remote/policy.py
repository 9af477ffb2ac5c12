"""What a remote device server grants its clients, and when a secret may cross the network: policy with no gRPC in
it, shared by the server, its command line, and the trainers' side."""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from lightning_smartinf.core.arguments import Problems, show
from lightning_smartinf.devices.remote.tokens import TlsFiles

__all__ = [
    "MAX_CALL_TIMEOUT_S",
    "MAX_SHARD_NUMEL",
    "ServerLimits",
    "check_listen",
    "check_storage_roots",
    "check_transport",
    "is_loopback",
]

#: Largest shard a client may open (int32 indices address it).
MAX_SHARD_NUMEL = (1 << 31) - 1
#: Longest call, in whole seconds: gRPC takes the call limit (as ``grpc.max_connection_age_grace_ms``) in
#: milliseconds in a signed 32-bit int.
MAX_CALL_TIMEOUT_S = ((1 << 31) - 1) // 1000
#: Addresses gRPC binds that have no port (a Unix socket): served as they are.
_SOCKET_SCHEMES = ("unix:", "unix-abstract:")


@dataclass(frozen=True)
class ServerLimits:
    """What one server grants, whatever its clients ask (``smartinf serve --help`` names a flag for each).

    Args:
        max_sessions: sessions open at once.
        max_shards: shards in one session.
        max_shard_numel: elements of one shard.
        max_session_pool_bytes: the transfer pool of one session (its ``chunk_elems`` x ``buffer_count`` x devices).
        pools_bytes: the transfer pools of all sessions together (``None``: half of this machine's memory).
        max_io_threads: I/O threads per device of one session.
        max_session_calls: calls of one session in flight at once (a trainer's rank makes at most its four updates
            and one other call); more are refused with ``RESOURCE_EXHAUSTED``, which trainers retry.
        max_peer_calls: calls of one client in flight at once, counted per client certificate under mutual TLS, else
            per connection (``None``: three quarters of the server's worker threads, so that one client, stalling,
            leaves a quarter of them to the others); more are refused with ``RESOURCE_EXHAUSTED``.
        max_session_state_bytes: what one session makes on disk: its state files (both copies with tentative
            updates) and the checkpoints it saves (``None``: what the disks hold).
        max_label_checkpoints: checkpoints kept for one label (``None``: no cap).
        max_label_checkpoint_bytes: bytes of the checkpoints kept for one label (``None``: no cap).
        prune_checkpoints: a save past a label's cap first removes that label's oldest checkpoints (else it is
            refused).
        update_bytes_in_flight: what every call holds for its client, all sessions together: the gradients and
            parameters of updates in flight, and the masters read, written or read from a checkpoint.
        call_timeout_s: longest call; the server cancels it then.
        session_lease_s: a session without a call for this long is closed and its state removed.
        max_echo_bytes: bytes of one calibration call.
    """

    max_sessions: int = 64
    max_shards: int = 4096
    max_shard_numel: int = MAX_SHARD_NUMEL
    max_session_pool_bytes: int = 2 << 30
    pools_bytes: int | None = None
    max_io_threads: int = 16
    max_session_calls: int = 8
    max_peer_calls: int | None = None
    max_session_state_bytes: int | None = None
    max_label_checkpoints: int | None = None
    max_label_checkpoint_bytes: int | None = None
    prune_checkpoints: bool = False
    update_bytes_in_flight: int = 8 << 30
    call_timeout_s: float = 900.0
    session_lease_s: float = 3600.0
    max_echo_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            # A limit whose default is ``None`` is off unless the operator sets it.
            if value is None and item.default is None or item.name == "prune_checkpoints":
                continue
            whole = not item.name.endswith("_s")
            if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) or not value > 0:
                kind = "a positive integer" if whole else "a positive number of seconds"
                raise ValueError(f"`{item.name}={value!r}`: a server limit must be {kind}.")
        if not math.isfinite(self.call_timeout_s) or self.call_timeout_s > MAX_CALL_TIMEOUT_S:
            raise ValueError(
                f"`call_timeout_s={self.call_timeout_s!r}` (`smartinf serve --call-timeout-s`) is too long: gRPC "
                f"counts a call's time in milliseconds in 32 bits, so a call may last at most {MAX_CALL_TIMEOUT_S} s "
                f"(about 24 days). Pass e.g. `call_timeout_s=900` (the default)."
            )
        if self.max_shard_numel > MAX_SHARD_NUMEL:
            raise ValueError(
                f"`max_shard_numel={self.max_shard_numel}`: shards are addressed by int32 indices, at most "
                f"{MAX_SHARD_NUMEL} elements."
            )


def is_loopback(listen: str) -> bool:
    """Whether ``listen`` ("host:port") names this machine's loopback interface only (no name is resolved)."""
    host = listen.rpartition(":")[0].strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_listen(problems: Problems, listen: object) -> bool:
    """Whether ``listen`` is an address gRPC binds as it reads: ``host:port`` or ``[IPv6]:port`` with a port in
    0..65535 (else a line is added to ``problems``), or a Unix socket (``unix:PATH``). gRPC takes a port past 65535
    modulo 65536 and an empty one as 443, so the port is checked here; no name is resolved."""
    fix = "Pass e.g. `--listen 127.0.0.1:50051` (`--listen [::1]:50051` for IPv6)."
    if not isinstance(listen, str):
        problems.add(f"`--listen={show(listen)}` is not a str: it must be host:port. {fix}")
        return False
    if listen.startswith(_SOCKET_SCHEMES):
        return True
    host, colon, port = listen.rpartition(":")
    shown = f"`--listen {listen}`"
    if not colon or (host.startswith("[") and not host.endswith("]")):  # `127.0.0.1`, `[::1]`
        problems.add(f"{shown} has no port: it must be host:port, the port an int 0..65535 (0: any free port). {fix}")
        return False
    if not host or host == "[]":
        problems.add(f"{shown} names no host: it must be host:port (0.0.0.0 listens on every interface). {fix}")
        return False
    if ":" in host and not host.startswith("["):  # `::1:50051`: gRPC would read the last group as the port
        problems.add(f"{shown}: an IPv6 host is written in brackets, as in `--listen [::1]:50051`.")
        return False
    # At most 5 digits before int(): a longer string may be too long for int() to parse at all.
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and int(port) <= 65535):
        problems.add(f"{shown}: the port must be an int 0..65535 (0: any free port), not {port!r}. {fix}")
        return False
    return True


def check_storage_roots(problems: Problems, key: str, roots: Sequence[str | Path]) -> bool:
    """Whether each of ``roots`` names another folder (compared resolved: ``/x``, ``/x/`` and a link to ``/x`` are one
    folder); else a line is added to ``problems``. Nothing is created."""
    named: dict[Path, list[str]] = {}
    for root in roots:
        named.setdefault(Path(root).resolve(), []).append(str(root))
    repeated = []
    for folder, names in named.items():
        if len(names) > 1:
            times = "twice" if len(names) == 2 else f"{len(names)} times"
            spellings = list(dict.fromkeys(names))  # as the user wrote them, each once
            shown = "" if spellings == [str(folder)] else f" (as {', '.join(map(repr, spellings))})"
            repeated.append(f"{folder} {times}{shown}")
    if repeated:
        problems.add(
            f"`{key}` names {'; '.join(repeated)}: each device needs a folder of its own. Name each folder once."
        )
    return not repeated


def check_transport(listen: str, tls: TlsFiles | None, allow_plaintext: bool) -> None:
    """Refuse an address that is not ``host:port`` (:func:`check_listen`), and plain gRPC on anything but loopback
    unless ``allow_plaintext`` says it is wanted: the token and the optimizer state would cross the network in clear.
    Checked before anything is bound."""
    problems = Problems("smartinf serve", ValueError)
    check_listen(problems, listen)
    problems.raise_if_any()
    if tls is None and not allow_plaintext and not is_loopback(listen):
        raise ValueError(
            f"`--listen {listen}` is not a loopback address, and without TLS the token and every gradient and "
            "weight would cross the network in clear. Give the server a certificate (`--tls-cert` and `--tls-key`, "
            "with `--tls-client-ca` for mutual TLS), listen on 127.0.0.1, or pass `--allow-plaintext` on a network "
            "you trust."
        )
