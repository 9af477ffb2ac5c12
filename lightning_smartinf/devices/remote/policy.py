"""What a remote device server grants its clients, and when a secret may cross the network: policy with no gRPC in
it, shared by the server, its command line, and the trainers' side."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, fields

from lightning_smartinf.devices.remote.tokens import TlsFiles

__all__ = ["MAX_SHARD_NUMEL", "ServerLimits", "check_transport", "is_loopback"]

#: Largest shard a client may open (int32 indices address it).
MAX_SHARD_NUMEL = (1 << 31) - 1


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


def check_transport(listen: str, tls: TlsFiles | None, allow_plaintext: bool) -> None:
    """Refuse plain gRPC on anything but loopback unless ``allow_plaintext`` says it is wanted: the token and the
    optimizer state would cross the network in clear. Checked before anything is bound."""
    if tls is None and not allow_plaintext and not is_loopback(listen):
        raise ValueError(
            f"`--listen {listen}` is not a loopback address, and without TLS the token and every gradient and "
            "weight would cross the network in clear. Give the server a certificate (`--tls-cert` and `--tls-key`, "
            "with `--tls-client-ca` for mutual TLS), listen on 127.0.0.1, or pass `--allow-plaintext` on a network "
            "you trust."
        )
