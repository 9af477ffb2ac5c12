"""``smartinf serve``: run a remote device server next to the storage until interrupted.

    smartinf serve --storage /mnt/nvme0/smartinf /mnt/nvme1/smartinf --token-file ~/.smartinf-token \\
        [--listen 127.0.0.1:50051] [--tls-cert server.pem --tls-key server.key [--tls-client-ca ca.pem]]

It listens on loopback unless ``--listen`` names another address. The token file must be readable by its owner
only. Trainers name the server in ``SmartInfinityStrategy(backend="remote", remote_devices=["host:port"], ...)``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

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
    args = parser.parse_args(argv)
    try:
        from lightning_smartinf.devices.remote.server import serve
    except ImportError as exc:
        print(f"smartinf serve needs gRPC ({exc}): pip install 'lightning-smartinf[remote]'", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        token = read_token(args.token_file)
        tls = None
        if args.tls_cert or args.tls_key or args.tls_client_ca:
            if not (args.tls_cert and args.tls_key):
                raise ValueError("TLS needs both --tls-cert and --tls-key (and --tls-client-ca for mutual TLS).")
            tls = read_server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
        server, servicer, port = serve(
            args.storage, token, args.listen, device_timeout_s=args.device_timeout_s, tls=tls
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
