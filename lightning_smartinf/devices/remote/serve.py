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
import logging
import signal
import sys
import threading
from pathlib import Path

from lightning_smartinf.core.arguments import Problems
from lightning_smartinf.devices.remote.tokens import read_server_tls, read_token


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
        "--max-calls", type=int, default=None, help="calls taken at once, more refused (default: 4 per worker)"
    )
    limits.add_argument("--max-sessions", type=int, default=64, help="sessions open at once (default 64)")
    limits.add_argument("--max-shards", type=int, default=4096, help="shards per session (default 4096)")
    limits.add_argument("--max-shard-numel", type=int, default=(1 << 31) - 1, help="elements per shard")
    limits.add_argument("--max-session-pool", default="2GiB", help="transfer buffers per session (default 2GiB)")
    limits.add_argument(
        "--max-pools", default=None, help="transfer buffers of all sessions together (default: half of the memory)"
    )
    limits.add_argument("--max-io-threads", type=int, default=16, help="I/O threads per device of a session")
    limits.add_argument("--max-session-state", default=None, help="state on disk per session (default: no cap)")
    limits.add_argument(
        "--update-bytes-in-flight", default="8GiB", help="gradients and parameters in flight, all sessions (8GiB)"
    )
    limits.add_argument("--max-echo", default="1GiB", help="bytes of one calibration call (default 1GiB)")
    limits.add_argument("--call-timeout-s", type=float, default=900.0, help="longest call; cancelled then (900)")
    limits.add_argument(
        "--session-lease-s", type=float, default=3600.0, help="a session without a call this long is closed (3600)"
    )
    args = parser.parse_args(argv)
    try:
        from lightning_smartinf.devices.remote.server import ServerLimits, check_transport, serve
    except ImportError as exc:
        print(f"smartinf serve needs gRPC ({exc}): pip install 'lightning-smartinf[remote]'", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        if args.tls_cert or args.tls_key or args.tls_client_ca:
            if not (args.tls_cert and args.tls_key):
                raise ValueError("TLS needs both --tls-cert and --tls-key (and --tls-client-ca for mutual TLS).")
            tls = read_server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
        else:
            tls = None
        check_transport(args.listen, tls, args.allow_plaintext)  # before the token is read or anything bound
        token = read_token(args.token_file)
        sizes = Problems("smartinf serve", ValueError)
        pool = sizes.size("--max-session-pool", args.max_session_pool)
        state = sizes.size("--max-session-state", args.max_session_state)
        in_flight = sizes.size("--update-bytes-in-flight", args.update_bytes_in_flight)
        echo = sizes.size("--max-echo", args.max_echo)
        pools = sizes.size("--max-pools", args.max_pools)
        sizes.raise_if_any()
        limits = ServerLimits(
            max_sessions=args.max_sessions,
            max_shards=args.max_shards,
            max_shard_numel=args.max_shard_numel,
            max_session_pool_bytes=pool,
            pools_bytes=pools,
            max_io_threads=args.max_io_threads,
            max_session_state_bytes=state,
            update_bytes_in_flight=in_flight,
            call_timeout_s=args.call_timeout_s,
            session_lease_s=args.session_lease_s,
            max_echo_bytes=echo,
        )
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
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=5).wait()
    servicer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
