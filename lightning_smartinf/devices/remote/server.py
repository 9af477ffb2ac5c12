"""The remote device server: the ``cpu`` backend's devices next to the storage, serving trainers over gRPC.

``smartinf serve --storage PATH [PATH ...] --token-file FILE [--listen HOST:PORT]`` runs one :class:`DeviceServer`.
Each trainer rank opens a *session*: a :class:`~lightning_smartinf.devices.cpu.CpuBackend` with one device per storage
path, its state in ``<path>/sessions/<session>/`` — the same pipeline, pool, rules, prefetch, tentative slots and
on-disk and checkpoint formats as on the trainer's own machine.

Invariants:

- A call is authenticated before anything of it is read: one without the token gets no handler (:class:`TokenCheck`),
  so callers without the token cannot crowd out a trainer however many they send. Refusals are logged at most once
  per :data:`REFUSAL_LOG_EVERY_S`, with how many there were.
- What a client may take is decided here (:class:`ServerLimits`): sessions, shards per session and their size, each
  session's transfer pool and I/O threads, its state on disk, the bytes of all updates in flight together, and how
  long any call may last (the server cancels it then, whatever deadline the client set). gRPC's own settings bound
  concurrent calls, streams per connection, keepalive pings and idle connections.
- A malformed, oversized or out-of-order request ends that call with ``INVALID_ARGUMENT`` and a message saying what
  was wrong; the server and the session keep serving.
- Sessions and checkpoints are named by the server (unguessable ids, never logged: the log shows a digest); a save
  never replaces a checkpoint. Files are created only under the storage roots.
- Nothing outlives its owner: a session without a call for ``session_lease_s`` is closed and its state removed;
  sessions and killed saves left by a server that died are removed when a server starts over its roots.
- The server's identity (``server_id``) lives in its first storage root, written atomically: a server restarted over
  another root has another identity, which trainers resuming from a checkpoint refuse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import hmac
import json
import logging
import re
import secrets
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
import torch
from torch import Tensor

from lightning_smartinf.core.arguments import Problems
from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.compression import SparseGrad
from lightning_smartinf.core.format.layout import pool_bytes
from lightning_smartinf.core.format.state_files import (
    MANIFEST,
    ShardState,
    manifest_of,
    parse_manifest,
    saved_shard_masters,
    shard_file_name,
    verify_state_file,
    write_file_atomic,
)
from lightning_smartinf.core.io.checksum import CRC32C
from lightning_smartinf.core.io.leftovers import remove_leftovers
from lightning_smartinf.core.io.ownership import claim_directories, release_claims
from lightning_smartinf.core.io.storage import ensure_private_dir, readable_size
from lightning_smartinf.core.streaming.backend import check_device_timeout
from lightning_smartinf.devices.cpu import CpuBackend
from lightning_smartinf.devices.remote.policy import ServerLimits, check_storage_roots, check_transport
from lightning_smartinf.devices.remote.tokens import TlsFiles
from lightning_smartinf.devices.remote.wire import (
    DTYPES,
    MAX_MESSAGE_BYTES,
    MAX_UPDATES_IN_FLIGHT,
    PROTOCOL_VERSION,
    RETRY_PUSHBACK,
    SERVICE,
    Frame,
    WireError,
    decode_header,
    encode_file,
    encode_tensor,
    header_frame,
    hp_from_wire,
    read_tensor,
    shard_from_wire,
    write_frames,
)

__all__ = ["NAME", "DeviceServer", "ServerLimits", "serve"]

log = logging.getLogger(__name__)

#: Session, label and checkpoint names: one path component, no dots at the start.
#: Matched whole (``fullmatch``): ``$`` alone would let a trailing newline through.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
#: A session's label is the client's name for its rank, ``-`` and a lineage id the server makes at ``Open``; a session
#: that loads a checkpoint of a lineage label continues that lineage. Checkpoint caps and pruning count one label only,
#: so they never touch another run's checkpoints (older servers labelled every run's rank ``rank<NNN>`` alike: such
#: checkpoints are loaded, and never continued).
LINEAGE_HEX = 16
LINEAGE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_-]*-[0-9a-f]{{{LINEAGE_HEX}}}")
IDENTITY_FILE = ".smartinf-server.json"
#: What `ReadCheckpoint` sends of a saved shard: its fp32 masters, the rank's manifest, or the shard's state file.
CHECKPOINT_PARTS = ("masters", "manifest", "state")
#: Where a session's uploaded state files wait (inside its first device directory) until they are loaded.
UPLOAD_DIR = ".upload"
#: Beside a checkpoint's label directories, under mutual TLS: the identity of the certificate that saved it.
OWNER_FILE = "owner.json"
#: At most one log line per this many seconds about refused tokens, and about malformed requests (a flood must not
#: fill the disk).
REFUSAL_LOG_EVERY_S = 10.0
#: The most characters of a client's own text (a malformed request's reason) a log line or a reply repeats.
QUOTED_CHARS = 300


def _quoted(text: object) -> str:
    """``text`` cut to :data:`QUOTED_CHARS` characters: what a client sent is never repeated whole."""
    text = str(text)
    return text if len(text) <= QUOTED_CHARS else f"{text[:QUOTED_CHARS]}... ({len(text)} characters)"


class _ThrottledLog:
    """A warning about something that may come in floods (refused tokens, malformed requests): logged at most once
    per :data:`REFUSAL_LOG_EVERY_S`, with how many there were since the last line."""

    def __init__(self, message: str) -> None:
        self._message = message  # formatted with the count, then the arguments of :meth:`note`
        self._count = 0
        self._logged_at = -REFUSAL_LOG_EVERY_S
        self._lock = threading.Lock()

    def note(self, *args: Any) -> None:
        with self._lock:
            self._count += 1
            now = time.monotonic()
            if now - self._logged_at >= REFUSAL_LOG_EVERY_S:
                log.warning(self._message, self._count, *args)
                self._count, self._logged_at = 0, now


def _owner_record(identity: tuple[bytes, ...] | None) -> list[str]:
    """How a checkpoint's owner file records a certificate identity (empty: none)."""
    return [name.hex() for name in identity or ()]


def certificate_identity(context: grpc.ServicerContext) -> tuple[bytes, ...] | None:
    """The client certificate's names (common name and subject alternative names) where the client presented one
    (mutual TLS); ``None`` otherwise."""
    auth = context.auth_context() or {}
    names = {*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())}
    return tuple(sorted(names)) if names else None


def session_tag(session_id: str) -> str:
    """What the log and the disk show of a session id (a digest: the id itself is the session's key)."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:16]


class TokenCheck(grpc.ServerInterceptor):
    """Refuses, when gRPC looks up a call's handler, every call without this server's bearer token.

    A refused call gets no handler: gRPC answers it ``UNIMPLEMENTED`` from its polling thread, without a worker
    thread and without counting it among the calls in flight (``maximum_concurrent_rpcs``), and reads none of its
    request. (A handler that aborts with ``UNAUTHENTICATED`` would wait for a worker, and count, while it does.)
    Trainers read ``UNIMPLEMENTED`` at first contact as a refused token.
    """

    def __init__(self, token: bytes) -> None:
        self._token = token
        self._refusals = _ThrottledLog("refused %d call(s) without the right token (the last: %s)")

    def authorized(self, metadata: Sequence[tuple[str, Any]] | None) -> bool:
        """Whether ``metadata`` carries ``authorization: Bearer <token>`` once (compared in constant time)."""
        values = [value for key, value in metadata or () if key == "authorization"]
        if len(values) != 1:
            return False
        text = values[0] if isinstance(values[0], str) else values[0].decode(errors="replace")
        if not text.startswith("Bearer "):
            return False
        return hmac.compare_digest(text[len("Bearer ") :].encode(), self._token)

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        if self.authorized(handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        self._refusals.note(handler_call_details.method)
        return None


class CallError(Exception):
    """A call that cannot be served; ``code`` is the gRPC status the client sees. ``final``: asking again cannot
    help (a quota), so the client's retry policy is told not to (server pushback), whatever the code."""

    def __init__(self, code: grpc.StatusCode, message: str, *, final: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.final = final


class OverLimit(CallError):
    """A call past a limit of this server (``RESOURCE_EXHAUSTED``); ``final`` unless room may come by itself."""

    def __init__(self, message: str, *, final: bool = True) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message, final=final)


@dataclass
class Session:
    """One trainer rank's devices on this server; ``name`` is the id the server issued (its key), ``tag`` what the
    log and the disk show of it."""

    name: str
    tag: str
    label: str
    backend: CpuBackend
    dirs: list[Path]
    lock: threading.Lock = field(default_factory=threading.Lock)
    updates: threading.BoundedSemaphore = field(
        default_factory=lambda: threading.BoundedSemaphore(MAX_UPDATES_IN_FLIGHT)
    )
    last_call: float = field(default_factory=time.monotonic)
    calls: int = 0  # calls running now: a session is never expired under one
    owner: tuple[bytes, ...] | None = None  # the client certificate's identity under mutual TLS
    pool: int = 0  # bytes of its transfer buffers
    uploaded: dict[int, int] = field(default_factory=dict)  # shard -> CRC-32C of its uploaded state file
    state: int = 0  # bytes of one copy of its state (a checkpoint's size)
    on_disk: int = 0  # bytes its state files take (both copies with tentative updates)
    saved: list[Path] = field(default_factory=list)  # the checkpoints it saved, while they exist


def _tree_bytes(directory: Path) -> int:
    """Bytes of the files under ``directory`` (0 once it is gone)."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def server_identity(root: Path) -> str:
    """The server id stored in ``root`` (created on first use, atomically: a crash leaves no half-written file)."""
    path = root / IDENTITY_FILE
    if path.exists():
        try:
            data = json.loads(path.read_text())
            return str(data["server_id"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"The server identity file {str(path)!r} is damaged ({exc}); checkpoints on this server name its id. "
                "Restore it, or remove it to start over as a new server (its checkpoints are then refused)."
            ) from None
    server_id = uuid.uuid4().hex
    write_file_atomic(path, json.dumps({"server_id": server_id}).encode())
    return server_id


class DeviceServer:
    """Serves sessions of emulated devices over ``storage_roots`` to clients presenting ``token``.

    Args:
        storage_roots: one directory per device (created 0700 if missing).
        token: the bearer token every call must carry.
        device_timeout_s: the sessions' device timeout (see :class:`~lightning_smartinf.devices.cpu.CpuBackend`).
        limits: what one client may take (see :class:`ServerLimits`).
    """

    def __init__(
        self,
        storage_roots: Sequence[Path],
        token: str,
        *,
        device_timeout_s: float | None = 300.0,
        limits: ServerLimits | None = None,
    ) -> None:
        if not token:
            raise ValueError("The token is empty: give the server a token file with a non-empty secret.")
        # Refused here, not by each session's backend: a client would see every open fail.
        check_device_timeout(device_timeout_s)
        self.roots = [Path(root).resolve() for root in storage_roots]
        if not self.roots:
            raise ValueError("Give the server at least one storage root (`--storage PATH`).")
        problems = Problems("DeviceServer", ValueError)
        check_storage_roots(problems, "storage_roots", storage_roots)
        problems.raise_if_any()  # before any root is created
        for root in self.roots:
            ensure_private_dir(root)
        # One server per storage root at a time, like one training per storage path.
        self._claims = claim_directories(self.roots)
        try:
            self.server_id = server_identity(self.roots[0])
        except BaseException:
            release_claims(self._claims)
            raise
        self.token_check = TokenCheck(token.encode())
        self.device_timeout_s = device_timeout_s
        self.limits = limits or ServerLimits()
        self.pools_bytes = self.limits.pools_bytes or psutil.virtual_memory().total // 2
        self._sessions: dict[str, Session] = {}
        #: Sessions being built (outside the lock): their slot and transfer buffers, reserved, by name.
        self._opening: dict[str, int] = {}
        #: Calls in flight per client (see :meth:`_peer_slot`).
        self._peer_calls: dict[Any, int] = {}
        self._lock = threading.Lock()
        #: Bytes of tensors the calls of every session hold for their clients (:meth:`_reserved`), under its condition.
        self._budget = threading.Condition()
        self._budget_used = 0
        self._stopped = threading.Event()
        self._remove_what_a_dead_server_left()
        self._malformed = _ThrottledLog("%d malformed request(s) (the last: %s from %s: %s)")
        self._sessions_full = _ThrottledLog("refused %d session(s) (the last: %s)")
        self._reaper = threading.Thread(target=self._expire_sessions, name="smartinf-serve-leases", daemon=True)
        self._reaper.start()

    # ---------------------------------------------------------------------------------------------- plumbing

    def _remove_what_a_dead_server_left(self) -> None:
        """Sessions live only in a server's memory, so their directories under the roots (which this server now owns)
        belong to a server that died; so do the temporaries of saves it was killed in."""
        sessions = killed_saves = 0
        for root in self.roots:
            for directory in root.glob("sessions/*"):
                shutil.rmtree(directory, ignore_errors=True)
                sessions += 1
            for checkpoint in root.glob("checkpoints/*"):  # a save's temporaries sit beside its label's directory
                killed_saves += len(remove_leftovers(checkpoint))
                if checkpoint.is_dir() and not any(p.is_dir() for p in checkpoint.iterdir()):  # killed before it wrote
                    shutil.rmtree(checkpoint, ignore_errors=True)
                    killed_saves += 1
        if sessions or killed_saves:
            what = "removed %d session director(ies) and %d killed save(s) left by an earlier server"
            log.info(what, sessions, killed_saves)

    def _expire_sessions(self) -> None:
        lease = self.limits.session_lease_s
        while not self._stopped.wait(min(60.0, lease / 4)):
            now = time.monotonic()
            with self._lock:
                expired = [s for s in self._sessions.values() if s.calls == 0 and now - s.last_call > lease]
            for session in expired:
                log.info("session %s (%s): no call for %.0f s, closed", session.tag, session.label, lease)
                self._close(session)

    def _session(self, header: dict[str, Any], context: grpc.ServicerContext) -> Session:
        name = header.get("session")
        with self._lock:
            session = self._sessions.get(name) if isinstance(name, str) else None
            if session is not None and session.owner is not None and session.owner != certificate_identity(context):
                session = None  # another client's: answered as if it did not exist
            if session is not None:
                session.last_call = time.monotonic()
        if session is None:
            # The id is the session's key: never echoed, nor logged.
            raise CallError(
                grpc.StatusCode.NOT_FOUND,
                f"No such session on server {self.server_id} (it expired, was closed, or the server was restarted).",
            )
        return session

    @contextlib.contextmanager
    def _in_call(self, session: Session) -> Iterator[None]:
        """A call of ``session`` runs: the lease does not expire under it. At most ``max_session_calls`` run at once
        (a refusal is for a busy moment: the client retries it)."""
        cap = self.limits.max_session_calls
        with self._lock:
            if session.calls >= cap:
                raise OverLimit(
                    f"This session has {cap} calls in flight, the most this server takes of one session "
                    "(`smartinf serve --max-session-calls`).",
                    final=False,
                )
            session.calls += 1
        try:
            yield
        finally:
            with self._lock:
                session.calls -= 1
                session.last_call = time.monotonic()

    def _checked_name(self, value: Any, what: str) -> str:
        if not isinstance(value, str) or not NAME.fullmatch(value):
            raise CallError(
                grpc.StatusCode.INVALID_ARGUMENT, f"`{what}={value!r}` is not a valid name ({NAME.pattern})."
            )
        return value

    @contextlib.contextmanager
    def _shard_call(
        self, requests: Iterator[Any], context: grpc.ServicerContext, *required: str
    ) -> Iterator[tuple[dict[str, Any], Session, int]]:
        """A call on one shard of a session: the header (the first request, with ``session``, ``shard`` and
        ``required``), the session and the shard's index, checked; the session's lease does not expire under it."""
        header = decode_header(_first(requests), ("session", "shard", *required))
        session = self._session(header, context)
        with self._in_call(session):
            index = header.get("shard")
            count = len(session.backend.shards)
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
                raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"`shard={index!r}` is not one of 0..{count - 1}.")
            yield header, session, index

    @contextlib.contextmanager
    def _guarded(self, method: str, context: grpc.ServicerContext) -> Iterator[None]:
        """Run the block within the server's own deadline (a streamed reply's too: a client that stops reading holds
        the call no longer than any other); protocol and call errors end the call with a status, never the server.
        A call cancelled meanwhile (the client left, or the deadline passed) ends the block without an error."""
        deadline = threading.Timer(self.limits.call_timeout_s, context.cancel)  # whatever the client's deadline
        deadline.daemon = True
        deadline.start()
        try:
            yield
        except WireError as exc:
            self._malformed.note(method, context.peer(), _quoted(exc))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Malformed request: {_quoted(exc)}")
        except CallError as exc:
            if exc.final:  # gRPC's retry policy does not retry a call whose server pushes back negatively
                context.set_trailing_metadata(((RETRY_PUSHBACK, "-1"),))
            context.abort(exc.code, str(exc))
        except (ValueError, RuntimeError, OSError, grpc.RpcError) as exc:
            if not context.is_active():  # cancelled (by the deadline, or the client left) while reading
                what = "%s from %s ended: cancelled (the client left, or %.0f s passed)"
                log.warning(what, method, context.peer(), self.limits.call_timeout_s)
                return
            log.warning("%s from %s failed: %s", method, context.peer(), exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a defect of the server: said as such, never a bare UNKNOWN
            log.exception("%s from %s: internal error", method, context.peer())
            context.abort(grpc.StatusCode.INTERNAL, f"The server failed ({type(exc).__name__}: {exc}); see its log.")
        finally:
            deadline.cancel()

    # ---------------------------------------------------------------------------------------------- calls

    @contextlib.contextmanager
    def _peer_slot(self, context: grpc.ServicerContext) -> Iterator[None]:
        """One of the calls in flight of the client behind ``context`` (its certificate under mutual TLS, else its
        connection: one token is shared by every trainer, so nothing else tells them apart, and a trainer's rank keeps
        one connection): past ``max_peer_calls`` the call ends at once with ``RESOURCE_EXHAUSTED``, before anything of
        it is read, so one client holding calls open (stalled, or slow) never holds every worker."""
        cap = self.limits.max_peer_calls
        if cap is None:
            yield
            return
        peer = certificate_identity(context) or context.peer()
        with self._lock:
            held = self._peer_calls.get(peer, 0)
            if held < cap:
                self._peer_calls[peer] = held + 1
        if held >= cap:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"This client has {cap} calls in flight, the most this server takes of one client "
                "(`smartinf serve --max-peer-calls`).",
            )
        try:
            yield
        finally:
            with self._lock:
                self._peer_calls[peer] -= 1
                if not self._peer_calls[peer]:
                    del self._peer_calls[peer]

    def hello(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        return header_frame(
            server_id=self.server_id,
            devices=len(self.roots),
            protocol=PROTOCOL_VERSION,
            max_shard=self.limits.max_shard_numel,
        )

    def open(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        header = decode_header(_first(requests), ("label", "shards"))
        limits = self.limits
        label = self._checked_name(header["label"], "label")
        longest = 128 - 1 - LINEAGE_HEX  # a NAME is at most 128 characters: the lineage id and its "-" must fit
        if len(label) > longest:
            raise WireError(f"`label` has {len(label)} characters; at most {longest} (the server adds a lineage id).")
        label = f"{label}-{secrets.token_hex(LINEAGE_HEX // 2)}"
        shards_in = header["shards"]
        if not isinstance(shards_in, list) or not shards_in:
            raise WireError("`shards` must be a non-empty list.")
        if len(shards_in) > limits.max_shards:
            raise OverLimit(
                f"{len(shards_in)} shards asked for; this server takes at most {limits.max_shards} per session "
                "(`smartinf serve --max-shards`).",
            )
        options = {key: header.get(key) for key in ("chunk_elems", "buffer_count", "io_threads")}
        for key, value in options.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise WireError(f"`{key}={value!r}` must be a positive integer.")
        specs = []
        for index, entry in enumerate(shards_in):
            numel = entry.get("numel") if isinstance(entry, dict) else None
            if not isinstance(numel, int) or isinstance(numel, bool):
                raise WireError(f"shard {index}: needs an integer `numel` and a `rule`.")
            if not 0 < numel <= limits.max_shard_numel:
                raise OverLimit(
                    f"shard {index} has {numel} elements; this server takes at most {limits.max_shard_numel}.",
                )
            specs.append(shard_from_wire(index, entry))
        if options["io_threads"] > limits.max_io_threads:
            raise OverLimit(
                f"`io_threads={options['io_threads']}`: this server gives a session at most {limits.max_io_threads} "
                "per device (`smartinf serve --max-io-threads`).",
            )
        try:
            layouts = [spec.layout(options["chunk_elems"]) for spec in specs]
        except ValueError as exc:
            raise WireError(str(exc)) from None
        tensors = max(layout.pool_tensors for layout in layouts)
        pool = pool_bytes(len(self.roots), options["buffer_count"], options["chunk_elems"], tensors)
        if pool > limits.max_session_pool_bytes:
            raise OverLimit(
                f"`chunk_elems={options['chunk_elems']}` x `buffer_count={options['buffer_count']}` needs "
                f"{pool / 2**20:.0f} MiB of transfer buffers on {len(self.roots)} device(s); this server gives a "
                f"session at most {limits.max_session_pool_bytes / 2**20:.0f} MiB (`smartinf serve "
                "--max-session-pool`). Lower `chunk_size` or `buffer_count`.",
            )
        state = sum(layout.file_bytes for layout in layouts)
        copies = 2 if header.get("tentative", False) else 1
        if limits.max_session_state_bytes is not None and copies * state > limits.max_session_state_bytes:
            both = " in two copies (tentative updates)" if copies == 2 else ""
            raise OverLimit(
                f"The session's state takes {readable_size(copies * state)}{both}; this server gives a session at "
                f"most {readable_size(limits.max_session_state_bytes)} of disk, its checkpoints included "
                "(`smartinf serve --max-session-state`).",
            )
        name = secrets.token_urlsafe(32)
        tag = session_tag(name)
        with self._lock:  # reserve the session's slot and buffers; build it outside, no other call waiting on it
            full = len(self._sessions) + len(self._opening) >= limits.max_sessions
            refusal = self._why_sessions_are_full() if full else None
            held = sum(session.pool for session in self._sessions.values()) + sum(self._opening.values())
            if refusal is None and held + pool > self.pools_bytes:
                raise OverLimit(
                    f"The session's transfer buffers ({pool / 2**20:.0f} MiB) do not fit beside the open sessions' "
                    f"({held / 2**20:.0f} MiB of {self.pools_bytes / 2**20:.0f} MiB, `smartinf serve --max-pools`).",
                    final=False,
                )
            if refusal is None:
                self._opening[name] = pool
        if refusal is not None:  # logged outside the lock: a log handler may block
            self._sessions_full.note(refusal)
            raise OverLimit(refusal, final=False)
        dirs = [root / "sessions" / tag for root in self.roots]
        try:
            backend = self._build_session(dirs, specs, options, header)
            with self._lock:
                self._sessions[name] = Session(
                    name,
                    tag,
                    label,
                    backend,
                    dirs,
                    owner=certificate_identity(context),
                    pool=pool,
                    state=state,
                    on_disk=copies * state,
                )
        except BaseException:
            for directory in dirs:  # a failed open leaves nothing behind
                shutil.rmtree(directory, ignore_errors=True)
            raise
        finally:
            with self._lock:
                del self._opening[name]
        log.info("session %s (%s): %d shards on %d device(s)", tag, label, len(specs), len(dirs))
        return header_frame(devices=len(dirs), session=name, label=label)

    def _why_sessions_are_full(self) -> str:
        """Why ``Open`` is refused while every session slot is taken: the flag, how long the open sessions have gone
        without a call, when the first lease ends, and what to do. Called under ``self._lock``."""
        limits, now = self.limits, time.monotonic()
        idle = sorted((now - s.last_call for s in self._sessions.values() if s.calls == 0), reverse=True)
        taken = [f"{len(idle)} without a call for {', '.join(f'{t:.0f} s' for t in idle[:8])}"] if idle else []
        if len(idle) > 8:
            taken[0] += ", ..."
        if busy := len(self._sessions) - len(idle):
            taken.append(f"{busy} with a call in flight")
        if self._opening:
            taken.append(f"{len(self._opening)} opening")
        lease = limits.session_lease_s
        ends = (
            f" The longest idle one's lease ends in {max(0.0, lease - idle[0]):.0f} s (`--session-lease-s {lease:g}`); "
            f"the server closes it within {min(60.0, lease / 4):.0f} s after."
            if idle
            else ""
        )
        return (
            f"This server holds at most {limits.max_sessions} session(s) at once (`smartinf serve --max-sessions "
            f"{limits.max_sessions}`), and all are taken: {'; '.join(taken)}.{ends} A trainer killed before it closed "
            "its sessions (SIGKILL, out of memory, preemption) holds them until their lease ends. Wait for that, "
            "restart the server (which closes every session; checkpoints stay), or start it with a higher "
            "`--max-sessions` or a shorter `--session-lease-s`."
        )

    def _build_session(
        self, dirs: list[Path], specs: list[ShardSpec], options: dict[str, int], header: dict[str, Any]
    ) -> CpuBackend:
        """A session's devices in ``dirs``, its files made and its buffers allocated."""
        for directory in dirs:
            ensure_private_dir(directory.parent)
            ensure_private_dir(directory)
        backend = CpuBackend(
            dirs,
            **options,  # chunk_elems, buffer_count, io_threads
            owned_dirs=dirs,
            tentative_slots=bool(header.get("tentative", False)),
            prefetch_state=bool(header.get("prefetch", True)),
            device_timeout_s=self.device_timeout_s,
        )
        try:
            backend.open(specs)
        except BaseException:
            backend.close()  # removes `dirs`, which it owns
            raise
        return backend

    def initialize(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        with self._shard_call(requests, context) as (_, session, shard):
            numel = session.backend.shards[shard].spec.numel
            with self._reserved(4 * numel, "a shard's initial masters"):
                master = read_tensor(requests, "master", numel, (torch.float32,))
                with session.lock:
                    handle = session.backend.initialize(shard, master)
                session.backend.result(handle)
        return header_frame(ok=True)

    def update(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        """One shard's update: the gradient in, the parameters out (streamed as they are encoded). The bytes of both
        are reserved in the server-wide budget before the gradient is read; the session's update slot is taken only
        once the gradient is in, so a client sending slowly holds no slot."""
        budget = contextlib.ExitStack()  # the update's bytes, held until its reply is sent

        def body() -> Tensor:
            with self._shard_call(requests, context, "hp", "link_dtype", "out_dtype") as (header, session, shard):
                numel = session.backend.shards[shard].spec.numel
                link_dtype = _dtype(header["link_dtype"], "link_dtype")
                out_dtype = _dtype(header["out_dtype"], "out_dtype")
                hp = hp_from_wire(header["hp"])
                sparse = bool(header.get("sparse"))
                nbytes = numel * (link_dtype.itemsize + (4 if sparse else 0) + out_dtype.itemsize)
                budget.enter_context(self._reserved(nbytes, "an update's gradient and parameters"))
                if sparse:
                    indices = read_tensor(requests, "indices", numel, (torch.int32,), exact=False)
                    values = read_tensor(requests, "values", indices.numel(), (link_dtype,))
                    if indices.numel() and (
                        int(indices[0]) < 0 or int(indices[-1]) >= numel or bool((indices[1:] <= indices[:-1]).any())
                    ):
                        raise WireError("`indices` must be strictly ascending, within the shard.")
                    grad: Any = SparseGrad(indices, values, numel)
                else:
                    grad = read_tensor(requests, "grad", numel, (link_dtype,))
                if not session.updates.acquire(timeout=self.limits.call_timeout_s):
                    raise OverLimit("Too many updates in flight for this session.", final=False)
                try:
                    out = torch.empty(numel, dtype=out_dtype)
                    with session.lock:
                        handle = session.backend.submit(
                            shard, grad, hp, out, link_dtype=link_dtype, tentative=bool(header.get("tentative", False))
                        )
                    del grad
                    session.backend.result(handle)
                finally:
                    session.updates.release()
                return out

        with budget:
            out = None
            with self._guarded("Update", context):
                out = body()
            if out is not None:
                yield from encode_tensor("out", out)

    def upload(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        """One shard's whole state file (master and states, record by record, as the session's layout has it) from a
        checkpoint the client re-sharded: written to the session's upload directory as it arrives (never held whole)
        and checked against the CRC-32C the client declared. Its size is the session's own shard file's, so an
        upload takes at most the disk the session's state does. ``load_upload`` then loads every shard at once."""
        with self._shard_call(requests, context, CRC32C) as (header, session, shard):
            declared = header[CRC32C]
            if not isinstance(declared, int) or isinstance(declared, bool) or not 0 <= declared < 1 << 32:
                raise WireError(f"`{CRC32C}={declared!r}` is not a CRC-32C.")
            numel = session.backend.shards[shard].layout.file_bytes // 4
            directory = ensure_private_dir(session.dirs[0] / UPLOAD_DIR)
            path = directory / shard_file_name(shard)
            # Under the session's lock: `load_upload` never reads a file an upload of the session is rewriting.
            with session.lock:
                session.uploaded.pop(shard, None)
                crc = write_frames(requests, path, name="state", numel=numel, replace=True)
                if crc != declared:
                    raise CallError(
                        grpc.StatusCode.DATA_LOSS,
                        f"Shard {shard}'s state arrived with CRC-32C {crc:#010x}, not the {declared:#010x} declared.",
                    )
                session.uploaded[shard] = crc
        return header_frame(ok=True)

    def read_master(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        """A shard's fp32 masters, held (and their bytes reserved in the server-wide budget) until the last frame is
        sent, or the call ends."""
        with self._shard_call(requests, context) as (_, session, shard):
            numel = session.backend.shards[shard].spec.numel
            with self._reserved(4 * numel, "a shard's masters"):
                out = torch.empty(numel, dtype=torch.float32)
                with session.lock:
                    handle = session.backend.read_master(shard, out)
                session.backend.result(handle)
                yield from encode_tensor("master", out)

    def read_checkpoint(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        """One part of a saved checkpoint, after its digest is checked (no session needed): the fp32 masters of one
        shard (``part="masters"``, the default; for evaluation and export), the rank's manifest (``"manifest"``, the
        very bytes the digest covers) or one shard's whole state file (``"state"``; to re-shard on the trainer's
        host). A shard's file is CRC-checked against the manifest before any byte of it is sent."""
        header = decode_header(_first(requests), ("checkpoint", "label", "shard", "digest"))
        part = header.get("part", "masters")
        if part not in CHECKPOINT_PARTS:
            raise WireError(f"`part={part!r}` is not one of {', '.join(CHECKPOINT_PARTS)}.")
        directory, data, manifest = self._checkpoint(header, header["label"], certificate_identity(context))
        if part == "manifest":
            yield from encode_tensor("manifest", torch.frombuffer(bytearray(data), dtype=torch.uint8))
            return
        shard = header["shard"]
        if not isinstance(shard, int) or isinstance(shard, bool) or shard < 0:
            raise WireError(f"`shard={shard!r}` is not a shard index.")
        entry = next((e for e in manifest["shards"] if e.get("index") == shard), None)
        if entry is None:
            raise WireError(f"Checkpoint {header['checkpoint']!r} has no shard {shard} for {header['label']!r}.")
        if part == "masters":
            with self._reserved(4 * int(entry["numel"]), "a saved shard's masters"):
                yield from encode_tensor("master", saved_shard_masters(directory, shard, manifest=manifest))
            return
        path = directory / shard_file_name(shard)
        try:
            verify_state_file(path, entry)
        except ValueError as exc:
            raise CallError(grpc.StatusCode.DATA_LOSS, f"Server {self.server_id}: {exc}") from None
        yield from encode_file("state", path, torch.float32)

    @contextlib.contextmanager
    def _reserved(self, nbytes: int, what: str) -> Iterator[None]:
        """Hold ``nbytes`` of the server-wide byte budget (``--update-bytes-in-flight``) while a call keeps a tensor
        its client asked for: every such allocation is bounded together, whatever the clients ask and however slowly
        they read. Waits for room up to the call limit."""
        total = self.limits.update_bytes_in_flight
        if nbytes > total:
            raise OverLimit(
                f"{what.capitalize()} take {readable_size(nbytes)}, more than this server holds for all calls at once "
                f"({readable_size(total)}, `smartinf serve --update-bytes-in-flight`).",
            )
        with self._budget:
            if not self._budget.wait_for(lambda: self._budget_used + nbytes <= total, self.limits.call_timeout_s):
                raise OverLimit(
                    f"No room for {what} ({readable_size(nbytes)}) in the server's budget before the call limit.",
                    final=False,
                )
            self._budget_used += nbytes
        try:
            yield
        finally:
            with self._budget:
                self._budget_used -= nbytes
                self._budget.notify_all()

    def echo(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        """Counts the bytes of the frames it receives and drops them: the network's bandwidth, for calibration (at
        most ``max_echo_bytes`` a call)."""
        received = 0
        for frame in requests:
            received += frame.ByteSize()  # every field counts: a frame's header is bytes received too
            if received > self.limits.max_echo_bytes:
                raise OverLimit(
                    f"A calibration call may send at most {self.limits.max_echo_bytes} bytes.",
                )
        return header_frame(bytes=received)

    def control(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        header = decode_header(_first(requests), ("session", "op"))
        op = header["op"]
        session = self._session(header, context)
        backend = session.backend
        shards = header.get("shards", [])
        if not isinstance(shards, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s < len(backend.shards) for s in shards
        ):
            raise WireError(f"`shards={shards!r}` must list shard indices of this session.")
        if op == "close":
            return self._close(session)
        ops: dict[str, Callable[[], Any]] = {  # each returns its reply, or None for a bare `ok`
            "commit": lambda: backend.commit(shards),
            "rollback": lambda: backend.rollback(shards),
            "wait": backend.wait,
            "prefetch": lambda: backend.prefetch(shards),
            "check_storage": backend.check_storage,
            "traffic": lambda: header_frame(**backend.traffic_snapshot().as_dict()),
            "save": lambda: self._save(session),
            "load": lambda: self._load(session, header),
            "load_upload": lambda: self._load_upload(session),
        }
        run = ops.get(op) if isinstance(op, str) else None  # asked only now: an unknown session is NOT_FOUND first
        if run is None:
            raise WireError(f"Unknown control operation {op!r}.")
        with self._in_call(session), session.lock:
            reply = run()
        return header_frame(ok=True) if reply is None else reply

    def _save(self, session: Session) -> Any:
        """Save under a checkpoint id of the server's making; an existing checkpoint is never replaced. Refused before
        anything is written where it would take the session past ``--max-session-state`` or its label past its
        checkpoint cap (the oldest of the label's checkpoints go first only with ``--prune-checkpoints``)."""
        self._make_room_for_checkpoint(session)
        checkpoint = f"c{secrets.token_hex(16)}"
        directory = self.roots[0] / "checkpoints" / checkpoint / session.label
        ensure_private_dir(directory.parent.parent)
        directory.parent.mkdir(mode=0o700)  # a new id: exists only if ids collided, and then nothing is replaced
        try:
            if session.owner is not None:  # under mutual TLS the checkpoint answers to the certificate that saved it
                write_file_atomic(directory.parent / OWNER_FILE, json.dumps(_owner_record(session.owner)).encode())
            session.backend.save(directory)
        except BaseException:
            shutil.rmtree(directory.parent, ignore_errors=True)  # a failed save leaves no checkpoint id behind
            raise
        session.saved.append(directory.parent)
        log.info("session %s: saved a checkpoint", session.tag)
        digest = hashlib.sha256((directory / MANIFEST).read_bytes()).hexdigest()
        return header_frame(checkpoint=checkpoint, digest=digest)

    def _make_room_for_checkpoint(self, session: Session) -> None:
        """Check a save of ``session`` against the quotas, pruning its label's oldest checkpoints where the operator
        allows it; raise a final ``RESOURCE_EXHAUSTED`` otherwise (nothing written)."""
        limits = self.limits
        session.saved = [c for c in session.saved if c.exists()]
        if limits.max_session_state_bytes is not None:
            held = session.on_disk + sum(_tree_bytes(c) for c in session.saved)
            if held + session.state > limits.max_session_state_bytes:
                raise OverLimit(
                    f"A checkpoint of this session takes {readable_size(session.state)}; with its state files and "
                    f"the {len(session.saved)} checkpoint(s) it saved ({readable_size(held)}) that is more than the "
                    f"{readable_size(limits.max_session_state_bytes)} this server gives a session "
                    "(`smartinf serve --max-session-state`). Nothing was written.",
                )
        if limits.max_label_checkpoints is None and limits.max_label_checkpoint_bytes is None:
            return
        kept = self._label_checkpoints(session.label, session.owner)  # oldest first
        while kept and not self._label_has_room(kept, session.state):
            if not limits.prune_checkpoints:
                raise OverLimit(
                    f"Label {session.label!r} (this run's rank, and the runs it resumed) holds {len(kept)} "
                    f"checkpoint(s) ({readable_size(sum(kept.values()))}) on this server; another of "
                    f"{readable_size(session.state)} passes its cap ({self._label_caps()}). Nothing was written. Each "
                    "save of the trainer is one checkpoint here, and `ModelCheckpoint(save_last=True)` saves twice "
                    "(`last.ckpt` is a second full copy; `save_last='link'` links it instead). Remove some of this "
                    "label's checkpoints, raise the cap, or start the server with `--prune-checkpoints` to remove "
                    "the label's oldest.",
                )
            oldest = next(iter(kept))
            shutil.rmtree(oldest.parent, ignore_errors=True)
            log.info("label %s: removed its oldest checkpoint to make room (--prune-checkpoints)", session.label)
            del kept[oldest]
        if not self._label_has_room(kept, session.state):
            raise OverLimit(
                f"A checkpoint of {readable_size(session.state)} is larger than label {session.label!r}'s cap on this "
                "server (`smartinf serve --max-label-checkpoint-bytes`). Nothing was written.",
            )

    def _label_caps(self) -> str:
        """The label caps in force, as the flags that set them."""
        limits = self.limits
        caps = [
            f"`smartinf serve {flag} {value}`"
            for flag, value in (
                ("--max-label-checkpoints", limits.max_label_checkpoints),
                ("--max-label-checkpoint-bytes", limits.max_label_checkpoint_bytes),
            )
            if value is not None
        ]
        return " and ".join(caps)

    def _label_has_room(self, kept: dict[Path, int], nbytes: int) -> bool:
        limits = self.limits
        count_ok = limits.max_label_checkpoints is None or len(kept) + 1 <= limits.max_label_checkpoints
        bytes_ok = limits.max_label_checkpoint_bytes is None or sum(kept.values()) + nbytes <= (
            limits.max_label_checkpoint_bytes
        )
        return count_ok and bytes_ok

    def _label_checkpoints(self, label: str, owner: tuple[bytes, ...] | None) -> dict[Path, int]:
        """The checkpoints saved for ``label`` (by ``owner``'s certificate under mutual TLS), oldest first: their
        directory and bytes."""
        found = []
        for directory in (self.roots[0] / "checkpoints").glob(f"c*/{label}"):
            if (directory / MANIFEST).is_file() and self._owned_by(directory.parent, owner):
                found.append((directory.stat().st_mtime_ns, directory))
        return {directory: _tree_bytes(directory) for _, directory in sorted(found)}

    def _owned_by(self, checkpoint: Path, owner: tuple[bytes, ...] | None) -> bool:
        if owner is None:
            return True
        try:
            return json.loads((checkpoint / OWNER_FILE).read_text()) == _owner_record(owner)
        except (OSError, ValueError):
            return False

    def _checkpoint(
        self, header: dict[str, Any], label: Any, identity: tuple[bytes, ...] | None
    ) -> tuple[Path, bytes, dict[str, Any]]:
        """The directory of checkpoint ``header["checkpoint"]`` saved for ``label``, its manifest's bytes and the
        manifest they parse to, once the digest of those very bytes is ``header["digest"]`` (compared in constant
        time): ``NOT_FOUND`` without a manifest, or for a caller whose certificate (``identity``) is not the one that
        saved it under mutual TLS; ``DATA_LOSS`` for another manifest."""
        checkpoint = self._checked_name(header.get("checkpoint"), "checkpoint")
        label = self._checked_name(label, "label")
        directory = self.roots[0] / "checkpoints" / checkpoint / label
        path = directory / MANIFEST
        missing = CallError(
            grpc.StatusCode.NOT_FOUND, f"Server {self.server_id} has no checkpoint {checkpoint!r} for {label!r}."
        )
        owner_file = directory.parent / OWNER_FILE
        if owner_file.exists() and json.loads(owner_file.read_text()) != _owner_record(identity):
            raise missing  # answered as if it did not exist
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise missing from None
        manifest = parse_manifest(data, path)  # a manifest this version cannot read fails before any digest is compared
        presented = header.get("digest")
        digest = hashlib.sha256(data).hexdigest()
        if not isinstance(presented, str) or not hmac.compare_digest(digest.encode(), presented.encode()):
            raise CallError(
                grpc.StatusCode.DATA_LOSS,
                f"Checkpoint {checkpoint!r} on server {self.server_id} differs from the one the trainer recorded.",
            )
        return directory, data, manifest

    def _load(self, session: Session, header: dict[str, Any]) -> Any:
        """Load the checkpoint saved under ``header["label"]`` (default: the session's own). A session that loads a
        checkpoint of a lineage label takes that label: its saves count and prune with the checkpoints it resumed, as
        if the run had never stopped. Only a client holding the checkpoint's id and digest (and, under mutual TLS, its
        certificate) can continue a lineage."""
        saved = self._checked_name(header.get("label", session.label), "label")
        directory, _, manifest = self._checkpoint(header, saved, session.owner)
        session.backend.load(directory, manifest=manifest)  # the very manifest whose digest was checked
        if LINEAGE.fullmatch(saved):
            session.label = saved
        log.info("session %s (%s): loaded a checkpoint", session.tag, session.label)
        return header_frame(ok=True, label=session.label)

    def _load_upload(self, session: Session) -> Any:
        """Replace the session's state with the uploaded files, once every shard's has arrived; the upload directory
        is removed either way."""
        backend = session.backend
        directory = session.dirs[0] / UPLOAD_DIR
        try:
            if missing := sorted(set(range(len(backend.shards))) - set(session.uploaded)):
                raise CallError(grpc.StatusCode.FAILED_PRECONDITION, f"Shards {missing} were not uploaded.")
            states = [
                ShardState(shard.spec, shard.layout, directory / shard_file_name(i))
                for i, shard in enumerate(backend.shards)
            ]
            manifest = manifest_of(states, chunk_elems=backend.chunk_elems, crcs=session.uploaded)
            backend.load(directory, manifest=manifest)  # checks each file's size and CRC-32C again as it copies
        finally:
            session.uploaded.clear()
            shutil.rmtree(directory, ignore_errors=True)
        log.info("session %s: loaded an uploaded checkpoint", session.tag)
        return header_frame(ok=True)

    def _close(self, session: Session) -> Any:
        with self._lock:
            if self._sessions.pop(session.name, None) is None:
                return header_frame(ok=True)  # closed already (by its client, its lease, or the server's stop)
        with session.lock:
            session.backend.close()  # removes the session's directories, which it owns
        log.info("session %s (%s) closed", session.tag, session.label)
        return header_frame(ok=True)

    def close(self) -> None:
        """Close every session (their state directories are removed; checkpoints stay), then give up the roots."""
        self._stopped.set()
        with self._lock:
            sessions = list(self._sessions.values())
        try:
            for session in sessions:
                self._close(session)
        finally:
            release_claims(self._claims)

    def handler(self) -> grpc.GenericRpcHandler:
        """The gRPC handler of the ``smartinf.remote.Device`` service.

        Every method reads its request itself, as a stream (the wire is the same for a client's unary call): gRPC would
        read a unary request on a worker thread before the handler runs, outside the server's own deadline. Each but
        ``Hello`` (which reads nothing and returns at once) holds one of its client's call slots (:meth:`_peer_slot`)
        from before its request is read until its reply is sent, and runs guarded within it, once (:meth:`_guarded`;
        ``Update`` guards itself).
        """
        encode, decode = Frame.SerializeToString, Frame.FromString
        Method = Callable[[Iterator[Any], grpc.ServicerContext], Any]

        def one_reply(name: str, call: Method) -> grpc.RpcMethodHandler:
            def run(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                with self._peer_slot(context), self._guarded(name, context):
                    return call(requests, context)
                return None  # cancelled: the client left, or the deadline passed

            return grpc.stream_unary_rpc_method_handler(run, decode, encode)

        def streamed(name: str, call: Method, *, guarded: bool = True) -> grpc.RpcMethodHandler:
            def run(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                guard = self._guarded(name, context) if guarded else contextlib.nullcontext()  # entered after the slot
                with self._peer_slot(context), guard:
                    yield from call(requests, context)

            return grpc.stream_stream_rpc_method_handler(run, decode, encode)

        handlers = {
            "Hello": grpc.stream_unary_rpc_method_handler(self.hello, decode, encode),
            # Unguarded here: `update` guards its own reading and computing (its reply streams once the budget is held).
            "Update": streamed("Update", self.update, guarded=False),
            "Open": one_reply("Open", self.open),
            "Initialize": one_reply("Initialize", self.initialize),
            "Upload": one_reply("Upload", self.upload),
            "Control": one_reply("Control", self.control),
            "Echo": one_reply("Echo", self.echo),
            "ReadMaster": streamed("ReadMaster", self.read_master),
            "ReadCheckpoint": streamed("ReadCheckpoint", self.read_checkpoint),
        }
        return grpc.method_handlers_generic_handler(SERVICE, handlers)


def _dtype(name: Any, what: str) -> torch.dtype:
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None or not dtype.is_floating_point:
        raise WireError(f"`{what}={name!r}` is not a floating dtype the wire carries.")
    return dtype


def _first(requests: Iterator[Any]) -> Any:
    """The first message of a request stream (an empty stream is a malformed request)."""
    for message in requests:
        return message
    raise WireError("The request stream is empty.")


#: gRPC's own bounds on connections (see docs/remote.md, "Limits"): one client cannot hold every stream, keep an idle
#: connection forever, or ping the server busy.
CHANNEL_LIMITS = (
    ("grpc.max_concurrent_streams", 64),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 30_000),
    ("grpc.http2.max_ping_strikes", 3),
    ("grpc.max_connection_idle_ms", 15 * 60_000),
    # A connection lives at most an hour (a trainer's channel reconnects by itself); the calls on it may finish within
    # the call limit (``connection_age_grace_ms``, from the server's limits).
    ("grpc.max_connection_age_ms", 60 * 60_000),
)


def _port_in_use(listen: str) -> str | None:
    """Why ``listen`` cannot be bound, where its TCP port is in use on every address it names: the message, naming the
    processes that listen there (as far as this user may see them). ``None`` where a bind may succeed (or ``listen``
    is no TCP port of a name here), so gRPC binds it and reports any other failure. Checked by binding as gRPC does
    (``SO_REUSEADDR``) and closing at once: gRPC's own failure is a raw line of its log that names nobody."""
    host, _, port_text = listen.rpartition(":")
    if not port_text.isdigit() or int(port_text) == 0 or listen.startswith(("unix:", "unix-abstract:")):
        return None
    port = int(port_text)
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
                return None
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    return None
    holders = []
    with contextlib.suppress(psutil.Error, OSError):
        for connection in psutil.net_connections(kind="tcp"):
            if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.laddr.port == port:
                holders.append(_process_named(connection.pid))
    who = ", ".join(sorted(set(holders))) or "a process this user cannot see"
    return (
        f"Cannot listen on {listen!r}: port {port} is in use by {who} (`ss -ltnp 'sport = :{port}'` lists it; as "
        "root for another user's). Stop it, or give this server another port with `--listen HOST:PORT` (port 0: any "
        "free one)."
    )


def _process_named(pid: int | None) -> str:
    """``pid N (its command line)``, shortened; what is known where the process is not this user's."""
    if pid is None:
        return "a process of another user"
    try:
        command = " ".join(psutil.Process(pid).cmdline()) or psutil.Process(pid).name()
    except psutil.Error:
        return f"pid {pid}"
    return f"pid {pid} ({command if len(command) <= 120 else command[:117] + '...'})"


def serve(
    storage_roots: Sequence[Path],
    token: str,
    listen: str = "127.0.0.1:0",
    *,
    device_timeout_s: float | None = 300.0,
    workers: int = 16,
    tls: TlsFiles | None = None,
    limits: ServerLimits | None = None,
    allow_plaintext: bool = False,
    max_calls: int | None = None,
) -> tuple[grpc.Server, DeviceServer, int]:
    """Start a server on ``listen`` (loopback by default); returns it, its servicer and the bound port.

    With ``tls`` the port speaks TLS with ``tls.cert`` and ``tls.key``; a non-empty ``tls.ca`` also requires every
    client to present a certificate it signed (mutual TLS). Without it the server takes connections from this machine
    only (gRPC's local credentials), unless ``allow_plaintext`` (then ``listen`` may be any address, in clear).
    ``workers`` threads serve calls; at most ``max_calls`` are taken at once (the rest refused with
    ``RESOURCE_EXHAUSTED``; a call refused for its token never counts: gRPC ends it before). By default that is what
    every session may have in flight (``max_sessions`` x ``max_session_calls``), so that no busy moment of sessions
    within their limits is refused; a call waits for a worker reading nothing of its request past gRPC's flow-control
    window. ``limits``: what one client may take (its ``max_peer_calls``, unset, becomes three quarters of
    ``workers``).
    """
    check_transport(listen, tls, allow_plaintext)
    limits = limits or ServerLimits()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 2:
        raise ValueError(f"`workers={workers!r}`: a server needs at least 2 worker threads.")
    if limits.max_peer_calls is None:
        limits = dataclasses.replace(limits, max_peer_calls=max(1, 3 * workers // 4))
    max_calls = limits.max_sessions * limits.max_session_calls if max_calls is None else max_calls
    if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
        raise ValueError(f"`max_calls={max_calls!r}` must be a positive integer.")
    if in_use := _port_in_use(listen):  # before the roots are claimed: a refused server touches nothing
        raise OSError(in_use)
    servicer = DeviceServer(storage_roots, token, device_timeout_s=device_timeout_s, limits=limits)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="smartinf-serve"),
        interceptors=(servicer.token_check,),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # gRPC shares a port among servers by default: trainers would reach either, with other state.
            ("grpc.so_reuseport", 0),
            *CHANNEL_LIMITS,
            ("grpc.max_connection_age_grace_ms", int(limits.call_timeout_s * 1000)),
        ],
        maximum_concurrent_rpcs=max_calls,
    )
    server.add_generic_rpc_handlers((servicer.handler(),))
    try:
        if tls is not None:
            assert tls.cert is not None and tls.key is not None
            credentials = grpc.ssl_server_credentials(
                [(tls.key, tls.cert)], root_certificates=tls.ca or None, require_client_auth=bool(tls.ca)
            )
            transport = "mutual TLS" if tls.ca else "TLS"
            port = server.add_secure_port(listen, credentials)
        elif allow_plaintext:
            transport = "plain gRPC, NOT ENCRYPTED"
            port = server.add_insecure_port(listen)
        else:  # loopback: connections from this machine only
            transport = "this machine only"
            port = server.add_secure_port(listen, grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP))
    except RuntimeError:  # grpcio reports a failed bind so
        port = 0
    if port == 0:
        servicer.close()
        raise OSError(
            _port_in_use(listen)  # taken since it was checked
            or f"Cannot listen on {listen!r}: not an address of this machine (or its port is in use). Give this server "
            "one of its own addresses with `--listen HOST:PORT` (port 0: any free one)."
        )
    server.start()
    log.info(
        "serving device server %s on %s (port %d, %s): %d device(s) under %s; %d session(s), %d call(s) at most "
        "(%d per session, %d per client)",
        servicer.server_id,
        listen,
        port,
        transport,
        len(servicer.roots),
        ", ".join(map(str, servicer.roots)),
        limits.max_sessions,
        max_calls,
        limits.max_session_calls,
        limits.max_peer_calls,
    )
    return server, servicer, port
