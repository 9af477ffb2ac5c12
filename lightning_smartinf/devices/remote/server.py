"""The remote device server: the ``cpu`` backend's devices next to the storage, serving trainers over gRPC.

``smartinf serve --storage PATH [PATH ...] --token-file FILE [--listen HOST:PORT]`` runs one :class:`DeviceServer`.
Each trainer rank opens a *session*: a :class:`~lightning_smartinf.devices.cpu.CpuBackend` with one device per storage
path, its state in ``<path>/sessions/<session>/`` — the same pipeline, pool, rules, prefetch, tentative slots and
on-disk and checkpoint formats as on the trainer's own machine.

Invariants:

- Every call carries ``authorization: Bearer <token>``, compared in constant time; any other call is refused
  (``UNAUTHENTICATED``) and logged with its peer.
- A malformed, oversized or out-of-order frame ends that call with ``INVALID_ARGUMENT`` and a message saying what
  was wrong; the server and the session keep serving.
- Files are created only under the storage roots: session and checkpoint names are checked against
  :data:`NAME`, so no path leaves its root.
- A session holds at most :data:`MAX_UPDATES_IN_FLIGHT` updates at once (gradient in, parameters out), each of at
  most ``max_shard_numel`` elements: the memory one client can take is bounded.
- The server's identity (``server_id``) lives in its first storage root: a server restarted over another root has
  another identity, which trainers resuming from a checkpoint refuse.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.compression import SparseGrad
from lightning_smartinf.core.format.state_files import MANIFEST, saved_shard_masters
from lightning_smartinf.core.io.ownership import claim_directories, release_claims
from lightning_smartinf.core.io.storage import ensure_private_dir
from lightning_smartinf.devices.cpu import CpuBackend
from lightning_smartinf.devices.remote.tokens import TlsFiles
from lightning_smartinf.devices.remote.wire import (
    DTYPES,
    MAX_MESSAGE_BYTES,
    SERVICE,
    Frame,
    TensorReader,
    WireError,
    decode_header,
    encode_tensor,
    header_frame,
    hp_from_wire,
    rule_from_wire,
)

__all__ = ["NAME", "DeviceServer", "serve"]

log = logging.getLogger(__name__)

#: Session, label and checkpoint names: one path component, no dots at the start.
#: Matched whole (``fullmatch``): ``$`` alone would let a trailing newline through.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
IDENTITY_FILE = ".smartinf-server.json"
MAX_UPDATES_IN_FLIGHT = 4
#: Largest shard a client may open (int32 indices address it) and chunk size bounds.
MAX_SHARD_NUMEL = (1 << 31) - 1
PROTOCOL_VERSION = 1


class CallError(Exception):
    """A call that cannot be served; ``code`` is the gRPC status the client sees."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Session:
    """One trainer rank's devices on this server."""

    name: str
    label: str
    backend: CpuBackend
    dirs: list[Path]
    lock: threading.Lock = field(default_factory=threading.Lock)
    updates: threading.BoundedSemaphore = field(
        default_factory=lambda: threading.BoundedSemaphore(MAX_UPDATES_IN_FLIGHT)
    )


def server_identity(root: Path) -> str:
    """The server id stored in ``root`` (created on first use)."""
    path = root / IDENTITY_FILE
    if path.exists():
        data = json.loads(path.read_text())
        return str(data["server_id"])
    server_id = uuid.uuid4().hex
    path.write_text(json.dumps({"server_id": server_id}))
    path.chmod(0o600)
    return server_id


class DeviceServer:
    """Serves sessions of emulated devices over ``storage_roots`` to clients presenting ``token``.

    Args:
        storage_roots: one directory per device (created 0700 if missing).
        token: the bearer token every call must carry.
        device_timeout_s: the sessions' device timeout (see :class:`~lightning_smartinf.devices.cpu.CpuBackend`).
        max_sessions: sessions open at once.
        max_shard_numel: largest shard a session may open.
    """

    def __init__(
        self,
        storage_roots: Sequence[Path],
        token: str,
        *,
        device_timeout_s: float | None = 300.0,
        max_sessions: int = 64,
        max_shard_numel: int = MAX_SHARD_NUMEL,
    ) -> None:
        if not token:
            raise ValueError("The token is empty: give the server a token file with a non-empty secret.")
        self.roots = [Path(root).resolve() for root in storage_roots]
        if not self.roots:
            raise ValueError("Give the server at least one storage root (`--storage PATH`).")
        for root in self.roots:
            ensure_private_dir(root)
        # One server per storage root at a time, like one training per storage path.
        self._claims = claim_directories(self.roots)
        self.server_id = server_identity(self.roots[0])
        self._token = token.encode()
        self.device_timeout_s = device_timeout_s
        self.max_sessions = max_sessions
        self.max_shard_numel = max_shard_numel
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    # ---------------------------------------------------------------------------------------------- plumbing

    def authorized(self, metadata: Sequence[tuple[str, Any]]) -> bool:
        """Whether ``metadata`` carries this server's bearer token (compared in constant time)."""
        presented = b""
        for key, value in metadata:
            if key == "authorization":
                text = value if isinstance(value, str) else value.decode(errors="replace")
                presented = text.removeprefix("Bearer ").encode()
        return hmac.compare_digest(presented, self._token)

    def _guard(self, method: str, context: grpc.ServicerContext) -> None:
        if not self.authorized(context.invocation_metadata()):
            log.warning("refused %s from %s: missing or wrong token", method, context.peer())
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "Missing or wrong bearer token.")

    def _session(self, header: dict[str, Any]) -> Session:
        name = header.get("session")
        with self._lock:
            session = self._sessions.get(name) if isinstance(name, str) else None
        if session is None:
            raise CallError(
                grpc.StatusCode.NOT_FOUND,
                f"Session {name!r} is not open on server {self.server_id} (was the server restarted?).",
            )
        return session

    def _checked_name(self, value: Any, what: str) -> str:
        if not isinstance(value, str) or not NAME.fullmatch(value):
            raise CallError(
                grpc.StatusCode.INVALID_ARGUMENT, f"`{what}={value!r}` is not a valid name ({NAME.pattern})."
            )
        return value

    def _shard(self, session: Session, header: dict[str, Any]) -> int:
        index = header.get("shard")
        count = len(session.backend.shards)
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"`shard={index!r}` is not one of 0..{count - 1}.")
        return index

    def _run(self, method: str, context: grpc.ServicerContext, body: Callable[[], Any]) -> Any:
        """Run ``body``; protocol and call errors end the call with a status, never the server."""
        try:
            return body()
        except WireError as exc:
            log.warning("%s from %s: malformed request: %s", method, context.peer(), exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Malformed request: {exc}")
        except CallError as exc:
            context.abort(exc.code, str(exc))
        except (ValueError, RuntimeError, OSError) as exc:
            log.warning("%s from %s failed: %s", method, context.peer(), exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{type(exc).__name__}: {exc}")

    # ---------------------------------------------------------------------------------------------- calls

    def hello(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._guard("Hello", context)
        return header_frame(
            server_id=self.server_id, devices=len(self.roots), protocol=PROTOCOL_VERSION, max_shard=self.max_shard_numel
        )

    def open(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._guard("Open", context)
        return self._run("Open", context, lambda: self._open(decode_header(request, ("session", "label", "shards"))))

    def _open(self, header: dict[str, Any]) -> Any:
        name = self._checked_name(header["session"], "session")
        label = self._checked_name(header["label"], "label")
        shards_in = header["shards"]
        if not isinstance(shards_in, list) or not shards_in:
            raise WireError("`shards` must be a non-empty list.")
        specs = []
        for index, entry in enumerate(shards_in):
            if not isinstance(entry, dict) or not isinstance(entry.get("numel"), int):
                raise WireError(f"shard {index}: needs an integer `numel` and a `rule`.")
            if not 0 < entry["numel"] <= self.max_shard_numel:
                raise CallError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"shard {index} has {entry['numel']} elements; this server takes at most {self.max_shard_numel}.",
                )
            specs.append(ShardSpec(index=index, numel=entry["numel"], rule=rule_from_wire(entry.get("rule"))))
        options = {key: header.get(key) for key in ("chunk_elems", "buffer_count", "io_threads")}
        for key, value in options.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise WireError(f"`{key}={value!r}` must be a positive integer.")
        with self._lock:
            if name in self._sessions:
                raise CallError(grpc.StatusCode.ALREADY_EXISTS, f"Session {name!r} is already open.")
            if len(self._sessions) >= self.max_sessions:
                raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.max_sessions} sessions are open already.")
            dirs = [root / "sessions" / name for root in self.roots]
            for directory in dirs:
                ensure_private_dir(directory.parent)
                ensure_private_dir(directory)
            backend = CpuBackend(
                dirs,
                chunk_elems=options["chunk_elems"],
                buffer_count=options["buffer_count"],
                io_threads=options["io_threads"],
                owned_dirs=dirs,
                tentative_slots=bool(header.get("tentative", False)),
                prefetch_state=bool(header.get("prefetch", True)),
                device_timeout_s=self.device_timeout_s,
            )
            try:
                backend.open(specs)
            except BaseException:
                backend.close()
                raise
            self._sessions[name] = Session(name, label, backend, dirs)
        log.info("session %s (%s): %d shards on %d device(s)", name, label, len(specs), len(dirs))
        return header_frame(devices=len(dirs))

    def initialize(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        self._guard("Initialize", context)

        def body() -> Any:
            header = decode_header(next(requests), ("session", "shard"))
            session = self._session(header)
            shard = self._shard(session, header)
            numel = session.backend.shards[shard].spec.numel
            master = _read_tensor(requests, "master", numel, (torch.float32,))
            with session.lock:
                handle = session.backend.initialize(shard, master)
            session.backend.result(handle)
            return header_frame(ok=True)

        return self._run("Initialize", context, body)

    def update(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        self._guard("Update", context)
        frames: list[Any] = []

        def body() -> None:
            header = decode_header(next(requests), ("session", "shard", "hp", "link_dtype", "out_dtype"))
            session = self._session(header)
            shard = self._shard(session, header)
            numel = session.backend.shards[shard].spec.numel
            link_dtype = _dtype(header["link_dtype"], "link_dtype")
            out_dtype = _dtype(header["out_dtype"], "out_dtype")
            hp = hp_from_wire(header["hp"])
            if not session.updates.acquire(timeout=self.device_timeout_s):
                raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED, "Too many updates in flight for this session.")
            try:
                if header.get("sparse"):
                    indices = _read_tensor(requests, "indices", numel, (torch.int32,))
                    values = _read_tensor(requests, "values", indices.numel(), (link_dtype,))
                    if values.numel() != indices.numel():
                        raise WireError("`values` and `indices` differ in length.")
                    if indices.numel() and (
                        int(indices[0]) < 0 or int(indices[-1]) >= numel or bool((indices[1:] <= indices[:-1]).any())
                    ):
                        raise WireError("`indices` must be strictly ascending, within the shard.")
                    grad: Any = SparseGrad(indices, values, numel)
                else:
                    grad = _read_tensor(requests, "grad", numel, (link_dtype,))
                    if grad.numel() != numel:
                        raise WireError(f"`grad` has {grad.numel()} elements; shard {shard} has {numel}.")
                out = torch.empty(numel, dtype=out_dtype)
                with session.lock:
                    handle = session.backend.submit(
                        shard, grad, hp, out, link_dtype=link_dtype, tentative=bool(header.get("tentative", False))
                    )
                session.backend.result(handle)
                frames.extend(encode_tensor("out", out))
            finally:
                session.updates.release()

        self._run("Update", context, body)
        yield from frames

    def read_master(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self._guard("ReadMaster", context)
        frames: list[Any] = []

        def body() -> None:
            header = decode_header(request, ("session", "shard"))
            session = self._session(header)
            shard = self._shard(session, header)
            out = torch.empty(session.backend.shards[shard].spec.numel, dtype=torch.float32)
            with session.lock:
                handle = session.backend.read_master(shard, out)
            session.backend.result(handle)
            frames.extend(encode_tensor("master", out))

        self._run("ReadMaster", context, body)
        yield from frames

    def read_checkpoint(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        """The fp32 masters of one shard of a saved checkpoint, after its digest and CRC-32 are checked (for
        evaluation and export; no session needed)."""
        self._guard("ReadCheckpoint", context)
        frames: list[Any] = []

        def body() -> None:
            header = decode_header(request, ("checkpoint", "label", "shard", "digest"))
            checkpoint = self._checked_name(header["checkpoint"], "checkpoint")
            label = self._checked_name(header["label"], "label")
            directory = self.roots[0] / "checkpoints" / checkpoint / label
            if not (directory / MANIFEST).is_file():
                raise CallError(
                    grpc.StatusCode.NOT_FOUND,
                    f"Server {self.server_id} has no checkpoint {checkpoint!r} for {label!r}.",
                )
            if _digest(directory) != header["digest"]:
                raise CallError(
                    grpc.StatusCode.DATA_LOSS,
                    f"Checkpoint {checkpoint!r} on server {self.server_id} differs from the one the trainer recorded.",
                )
            shard = header["shard"]
            if not isinstance(shard, int) or isinstance(shard, bool) or shard < 0:
                raise WireError(f"`shard={shard!r}` is not a shard index.")
            frames.extend(encode_tensor("master", saved_shard_masters(directory, shard)))

        self._run("ReadCheckpoint", context, body)
        yield from frames

    def echo(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        """Counts the bytes of the frames it receives and drops them: the network's bandwidth, for calibration."""
        self._guard("Echo", context)
        received = sum(len(frame.data) for frame in requests)
        return header_frame(bytes=received)

    def control(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._guard("Control", context)
        return self._run("Control", context, lambda: self._control(decode_header(request, ("session", "op"))))

    def _control(self, header: dict[str, Any]) -> Any:
        op = header["op"]
        session = self._session(header)
        backend = session.backend
        shards = header.get("shards", [])
        if not isinstance(shards, list) or not all(isinstance(s, int) and 0 <= s < len(backend.shards) for s in shards):
            raise WireError(f"`shards={shards!r}` must list shard indices of this session.")
        if op == "close":
            return self._close(session)
        with session.lock:
            if op == "commit":
                backend.commit(shards)
            elif op == "rollback":
                backend.rollback(shards)
            elif op == "wait":
                backend.wait()
            elif op == "prefetch":
                backend.prefetch(shards)
            elif op == "check_storage":
                backend.check_storage()
            elif op == "traffic":
                return header_frame(**backend.traffic_snapshot().as_dict())
            elif op == "save":
                return self._save(session, header)
            elif op == "load":
                return self._load(session, header)
            else:
                raise WireError(f"Unknown control operation {op!r}.")
        return header_frame(ok=True)

    def _checkpoint_dir(self, session: Session, header: dict[str, Any]) -> Path:
        checkpoint = self._checked_name(header.get("checkpoint"), "checkpoint")
        return self.roots[0] / "checkpoints" / checkpoint / session.label

    def _save(self, session: Session, header: dict[str, Any]) -> Any:
        directory = self._checkpoint_dir(session, header)
        ensure_private_dir(directory.parent.parent)
        ensure_private_dir(directory.parent)
        session.backend.save(directory)
        log.info("session %s: saved checkpoint %s", session.name, directory.parent.name)
        return header_frame(digest=_digest(directory))

    def _load(self, session: Session, header: dict[str, Any]) -> Any:
        directory = self._checkpoint_dir(session, header)
        if not (directory / MANIFEST).is_file():
            raise CallError(
                grpc.StatusCode.NOT_FOUND,
                f"Server {self.server_id} has no checkpoint {directory.parent.name!r} for {session.label!r}.",
            )
        digest = _digest(directory)
        if digest != header.get("digest"):
            raise CallError(
                grpc.StatusCode.DATA_LOSS,
                f"Checkpoint {directory.parent.name!r} on server {self.server_id} differs from the one the trainer "
                f"recorded (manifest digest {digest[:12]}, expected {str(header.get('digest'))[:12]}).",
            )
        session.backend.load(directory)
        log.info("session %s: loaded checkpoint %s", session.name, directory.parent.name)
        return header_frame(ok=True)

    def _close(self, session: Session) -> Any:
        with self._lock:
            self._sessions.pop(session.name, None)
        with session.lock:
            session.backend.close()
        for directory in session.dirs:
            shutil.rmtree(directory, ignore_errors=True)
        log.info("session %s (%s) closed", session.name, session.label)
        return header_frame(ok=True)

    def close(self) -> None:
        """Close every session (their state directories are removed; checkpoints stay), then give up the roots."""
        with self._lock:
            sessions = list(self._sessions.values())
        try:
            for session in sessions:
                self._close(session)
        finally:
            release_claims(self._claims)

    def handler(self) -> grpc.GenericRpcHandler:
        """The gRPC handler of the ``smartinf.remote.Device`` service."""
        encode, decode = Frame.SerializeToString, Frame.FromString
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Hello": grpc.unary_unary_rpc_method_handler(self.hello, decode, encode),
                "Open": grpc.unary_unary_rpc_method_handler(self.open, decode, encode),
                "Initialize": grpc.stream_unary_rpc_method_handler(self.initialize, decode, encode),
                "Update": grpc.stream_stream_rpc_method_handler(self.update, decode, encode),
                "ReadMaster": grpc.unary_stream_rpc_method_handler(self.read_master, decode, encode),
                "Control": grpc.unary_unary_rpc_method_handler(self.control, decode, encode),
                "Echo": grpc.stream_unary_rpc_method_handler(self.echo, decode, encode),
                "ReadCheckpoint": grpc.unary_stream_rpc_method_handler(self.read_checkpoint, decode, encode),
            },
        )


def _dtype(name: Any, what: str) -> torch.dtype:
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None or not dtype.is_floating_point:
        raise WireError(f"`{what}={name!r}` is not a floating dtype the wire carries.")
    return dtype


def _read_tensor(frames: Iterator[Any], name: str, max_numel: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    reader = TensorReader(name, max_numel=max_numel, dtypes=dtypes)
    for frame in frames:
        if reader.add(frame):
            assert reader.tensor is not None
            return reader.tensor
    raise WireError(f"The stream ended before {name!r} was complete.")


def _digest(directory: Path) -> str:
    return hashlib.sha256((directory / MANIFEST).read_bytes()).hexdigest()


def serve(
    storage_roots: Sequence[Path],
    token: str,
    listen: str = "127.0.0.1:0",
    *,
    device_timeout_s: float | None = 300.0,
    workers: int = 16,
    tls: TlsFiles | None = None,
    max_sessions: int = 64,
) -> tuple[grpc.Server, DeviceServer, int]:
    """Start a server on ``listen`` (loopback by default); returns it, its servicer and the bound port.

    With ``tls`` the port speaks TLS with ``tls.cert`` and ``tls.key``; a non-empty ``tls.ca`` also requires every
    client to present a certificate it signed (mutual TLS). ``max_sessions``: sessions open at once.
    """
    servicer = DeviceServer(storage_roots, token, device_timeout_s=device_timeout_s, max_sessions=max_sessions)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="smartinf-serve"),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # gRPC shares a port among servers by default: trainers would reach either, with other state.
            ("grpc.so_reuseport", 0),
        ],
    )
    server.add_generic_rpc_handlers((servicer.handler(),))
    try:
        if tls is None:
            port = server.add_insecure_port(listen)
        else:
            assert tls.cert is not None and tls.key is not None
            credentials = grpc.ssl_server_credentials(
                [(tls.key, tls.cert)], root_certificates=tls.ca or None, require_client_auth=bool(tls.ca)
            )
            port = server.add_secure_port(listen, credentials)
    except RuntimeError:  # grpcio reports a failed bind so
        port = 0
    if port == 0:
        servicer.close()
        raise OSError(f"Cannot listen on {listen!r} (in use, or not an address of this machine).")
    server.start()
    log.info(
        "serving device server %s on %s (port %d, %s): %d device(s) under %s",
        servicer.server_id,
        listen,
        port,
        "plain gRPC, not encrypted" if tls is None else "mutual TLS" if tls.ca else "TLS",
        len(servicer.roots),
        ", ".join(map(str, servicer.roots)),
    )
    return server, servicer, port
