"""``smartinf serve``: run a remote device server next to the storage until interrupted.

    smartinf serve --storage /mnt/nvme0/smartinf /mnt/nvme1/smartinf --token-file ~/.smartinf-token \\
        [--listen 127.0.0.1:50051] [--tls-cert server.pem --tls-key server.key [--tls-client-ca ca.pem]]

It listens on loopback unless ``--listen`` names another address, which needs TLS (or ``--allow-plaintext`` on a
network you trust). The token file must be readable by its owner only. What each client may take is the server's to
decide (``--max-sessions`` and the other limits; see docs/remote.md). Trainers name the server in
``SmartInfinityStrategy(backend="remote", remote_devices=["host:port"], ...)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading
from pathlib import Path

from lightning_smartinf.core.arguments import Problems
from lightning_smartinf.devices.remote.policy import ServerLimits, check_listen, check_storage_roots, check_transport
from lightning_smartinf.devices.remote.tokens import read_server_tls, read_token

#: ``--flag``: the :class:`ServerLimits` field it sets, its type (``str``: a size such as ``2GiB``), what it bounds.
LIMIT_FLAGS = {
    "--max-sessions": ("max_sessions", int, "sessions open at once"),
    "--max-shards": ("max_shards", int, "shards per session"),
    "--max-shard-numel": ("max_shard_numel", int, "elements per shard"),
    "--max-session-pool": ("max_session_pool_bytes", str, "transfer buffers per session"),
    "--max-pools": ("pools_bytes", str, "transfer buffers of all sessions together"),
    "--max-io-threads": ("max_io_threads", int, "I/O threads per device of a session"),
    "--max-session-calls": ("max_session_calls", int, "calls of one session in flight, more refused (retried)"),
    "--max-peer-calls": ("max_peer_calls", int, "calls of one client (certificate, else connection) in flight"),
    "--max-session-state": ("max_session_state_bytes", str, "disk per session: its state files and checkpoints"),
    "--max-label-checkpoints": ("max_label_checkpoints", int, "checkpoints kept per label"),
    "--max-label-checkpoint-bytes": ("max_label_checkpoint_bytes", str, "bytes of the checkpoints kept per label"),
    "--update-bytes-in-flight": ("update_bytes_in_flight", str, "tensors all calls hold at once (updates, masters)"),
    "--max-echo": ("max_echo_bytes", str, "bytes of one calibration call"),
    "--call-timeout-s": ("call_timeout_s", float, "longest call, in seconds; cancelled then"),
    "--session-lease-s": ("session_lease_s", float, "a session without a call this many seconds is closed"),
}
#: What ``--help`` says of the limits that are off by default.
UNSET_SHOWN = {
    "pools_bytes": "half of the memory",
    "max_session_state_bytes": "no cap",
    "max_label_checkpoints": "no cap",
    "max_label_checkpoint_bytes": "no cap",
    "max_peer_calls": "3/4 of --workers",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="smartinf serve", description=__doc__.split("\n")[0])
    parser.add_argument("--storage", nargs="+", type=Path, required=True, help="one directory per device")
    parser.add_argument("--token-file", type=Path, required=True, help="file (mode 0600) holding the bearer token")
    parser.add_argument("--listen", default="127.0.0.1:50051", help="host:port (default: loopback, port 50051)")
    parser.add_argument("--device-timeout-s", type=float, default=300.0, help="seconds a device may stall")
    parser.add_argument("--tls-cert", type=Path, help="the server's certificate (PEM): serve TLS instead of plain gRPC")
    parser.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM, mode 0600)")
    parser.add_argument("--tls-client-ca", type=Path, help="mutual TLS: the authority of the clients' certificates")
    parser.add_argument(
        "--allow-plaintext",
        action="store_true",
        help="serve plain gRPC on a non-loopback address (the token and the state cross the network in clear)",
    )
    limits = parser.add_argument_group("limits (what one server grants its clients)")
    limits.add_argument("--workers", type=int, default=16, help="threads serving calls (default 16)")
    limits.add_argument(
        "--max-calls",
        type=int,
        default=None,
        help="calls taken at once, more refused (default: --max-sessions x --max-session-calls)",
    )
    limits.add_argument(
        "--prune-checkpoints",
        action="store_true",
        help="a save past a label's checkpoint cap removes that label's oldest checkpoints first (default: refused)",
    )
    defaults = ServerLimits()
    for flag, (field, kind, what) in LIMIT_FLAGS.items():
        default = getattr(defaults, field)
        shown = UNSET_SHOWN[field] if default is None else f"{default / 2**30:g}GiB" if kind is str else default
        limits.add_argument(flag, type=kind, default=None, help=f"{what} (default: {shown})")
    args = parser.parse_args(argv)
    try:
        from lightning_smartinf.devices.remote.server import serve
    except ImportError as exc:
        print(f"smartinf serve needs gRPC ({exc}): pip install -e '.[remote]'", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        # The flags alone, all reported at once, before any file is read, created or bound.
        problems = Problems("smartinf serve", ValueError)
        check_listen(problems, args.listen)
        check_storage_roots(problems, "--storage", args.storage)
        # The rule of `check_device_timeout` (positive and finite), named by the flag (None, waiting forever, has none).
        problems.number("--device-timeout-s", args.device_timeout_s, low=0, above=True, unit="seconds", example=300)
        given = {}
        for flag, (field, kind, _) in LIMIT_FLAGS.items():
            value = getattr(args, flag[2:].replace("-", "_"))
            if value is not None:
                given[field] = problems.size(flag, value) if kind is str else value
        problems.raise_if_any()
        limits = dataclasses.replace(ServerLimits(), **given, prune_checkpoints=args.prune_checkpoints)
        if args.tls_cert or args.tls_key or args.tls_client_ca:
            if not (args.tls_cert and args.tls_key):
                raise ValueError("TLS needs both --tls-cert and --tls-key (and --tls-client-ca for mutual TLS).")
            tls = read_server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
        else:
            tls = None
        check_transport(args.listen, tls, args.allow_plaintext)  # before the token is read or anything bound
        token = read_token(args.token_file)
        server, servicer, port = serve(
            args.storage,
            token,
            args.listen,
            device_timeout_s=args.device_timeout_s,
            tls=tls,
            limits=limits,
            workers=args.workers,
            max_calls=args.max_calls,
            allow_plaintext=args.allow_plaintext,
        )
    except (ValueError, OSError) as exc:
        print(f"smartinf serve: {exc}", file=sys.stderr)
        return 2
    # The one line a launcher waits for: where the server listens and who it is.
    print(f"serving {servicer.server_id} on port {port}", flush=True)
    stop = threading.Event()
    received: list[int] = []

    def stop_on(sig: int, _frame: object) -> None:
        received.append(sig)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_on)
    stop.wait()
    server.stop(grace=5).wait()
    servicer.close()
    # The last line of a server's log: it stopped whole (a server killed otherwise never writes it).
    logging.getLogger(__name__).info(
        "stopped device server %s on %s: sessions closed, checkpoints kept",
        servicer.server_id,
        signal.Signals(received[0]).name,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
