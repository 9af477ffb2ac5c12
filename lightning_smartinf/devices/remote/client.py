"""``RemoteBackend``: a trainer rank's devices on remote device servers (:mod:`.server`).

Shards are placed on servers by a :class:`~lightning_smartinf.core.placement.Placement` (round-robin by default);
each server holds this rank's shards in a session of its own, so several trainers share one pool of servers. A
gradient crosses the network in the link dtype (dense, or top-k pairs) and the updated parameters come back in the
partition's dtype: the bytes the ``cpu`` backend counts as link traffic are the bytes sent.

Invariants:

- Every call carries the bearer token as gRPC call credentials, which gRPC sends only over TLS or to this machine
  (local credentials); plain gRPC to another machine only with ``allow_plaintext``. Every call has a deadline of
  ``device_timeout_s``: a stalled network or server raises
  :class:`~lightning_smartinf.core.io.storage.StorageError` naming the server, never hangs.
- A server speaks this client's protocol version, or is refused at first contact; a malformed reply is that server's
  failure, named, like any other.
- The first server error stops the backend (:attr:`failure`), like a device error of the local backends.
- A checkpoint records each server's identity and the digest of the state it saved; loading refuses another server
  (one restarted over another storage root) or other state, naming the server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import random
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeoutError
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import torch
from torch import Tensor

from lightning_smartinf.core.accelerator import AcceleratorCopies, Fence, current_accelerator, thread_pool
from lightning_smartinf.core.backend import Handle, LatchingBackend, ShardSpec
from lightning_smartinf.core.compression import SparseGrad
from lightning_smartinf.core.format.rank_state import HOST_STATE, PartitionIndex
from lightning_smartinf.core.format.reshard import Fetch, Reshard
from lightning_smartinf.core.format.state_files import (
    MANIFEST,
    CheckpointError,
    ShardState,
    parse_manifest,
    read_json,
    read_manifest,
    shard_file_name,
    write_file_atomic,
)
from lightning_smartinf.core.io.checksum import CRC32C, file_checksum
from lightning_smartinf.core.io.clone import clone_file
from lightning_smartinf.core.io.leftovers import scratch_directory
from lightning_smartinf.core.io.storage import StorageError
from lightning_smartinf.core.placement import Placement, RoundRobin, by_holder, check_assignment
from lightning_smartinf.core.rules import StepParams
from lightning_smartinf.core.tiers.tiered import LOCAL_DIR, saved_local_shards
from lightning_smartinf.core.traffic import Traffic, TrafficSnapshot
from lightning_smartinf.devices.remote.policy import is_loopback
from lightning_smartinf.devices.remote.tokens import TlsFiles
from lightning_smartinf.devices.remote.wire import (
    MAX_MESSAGE_BYTES,
    MAX_UPDATES_IN_FLIGHT,
    PROTOCOL_VERSION,
    RETRY_PUSHBACK,
    SERVICE,
    Frame,
    WireError,
    decode_header,
    dtype_name,
    encode_file,
    encode_tensor,
    header_frame,
    hp_to_wire,
    read_tensor,
    shard_to_wire,
    write_frames,
)

__all__ = [
    "REMOTE_MANIFEST",
    "RemoteBackend",
    "checkpoint_masters",
    "fetch_saved_state",
    "greeted",
    "measure_network",
]

FIRST_CONTACT = "the first contact"
#: Where the state is (each server's address, identity, session label, shards) and the digest of what each saved.
REMOTE_MANIFEST = "remote.json"
#: Seconds a session's close may take once a server of the run has failed.
CLOSE_AFTER_FAILURE_S = 10.0
#: The largest checkpoint manifest a server may send (a few hundred bytes per shard; servers take at most 4096).
MAX_MANIFEST_BYTES = 16 << 20


def channel_credentials(address: str, token: str, tls: TlsFiles | None, allow_plaintext: bool) -> Any:
    """How a client reaches the server at ``address``: TLS, or gRPC's local credentials on loopback, both with the
    token as call credentials (which gRPC refuses to send in clear); ``None`` for plain gRPC (``allow_plaintext``)."""
    if tls is not None:
        transport = grpc.ssl_channel_credentials(
            root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
        )
    elif is_loopback(address):
        transport = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    elif allow_plaintext:
        return None
    else:
        raise ValueError(
            f"The remote device server {address} is not on this machine and no TLS is set (`remote_tls_dir`): the "
            "token and the optimizer state would cross the network in clear. Give the servers TLS and this run "
            "`remote_tls_dir`, or `remote_allow_plaintext=True` on a network you trust."
        )
    return grpc.composite_channel_credentials(transport, grpc.access_token_call_credentials(token))


#: How a call the server refused for a busy moment is made again: all its call slots taken, or this session's or
#: this client's calls in flight at their caps (``RESOURCE_EXHAUSTED`` without a negative pushback, which the server
#: sends only before it changed anything). The client makes the call again with a fresh request after a jittered
#: exponential backoff (0.2 s, doubling up to 5 s), for up to :data:`RETRY_WITHIN_S` seconds; then the call fails and
#: names the server and what it refused (:meth:`_Server.call`).
RETRY_BACKOFF_S = (0.2, 5.0)
RETRY_WITHIN_S = 60.0
#: gRPC's own retry policy, for the calls whose requests are small (:data:`SMALL_REQUESTS`): it also retries a
#: connection lost before the reply began (``UNAVAILABLE``), holding the request in its 256 KiB retry buffer. The calls
#: that send tensors are left to the client's own retry: grpcio 1.85's retry layer aborts the process (``ILLEGAL STATE:
#: FORWARDED_BATCH``) when a server refuses a call whose request outgrew that buffer.
SMALL_REQUESTS = ("Hello", "Open", "Control", "ReadMaster", "ReadCheckpoint")
RETRY_ATTEMPTS = 5
RETRY_POLICY = {
    "methodConfig": [
        {
            "name": [{"service": SERVICE, "method": method} for method in SMALL_REQUESTS],
            "retryPolicy": {
                "maxAttempts": RETRY_ATTEMPTS,
                "initialBackoff": "0.2s",
                "maxBackoff": "5s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["RESOURCE_EXHAUSTED", "UNAVAILABLE"],
            },
        }
    ]
}


class _Server:
    """One server: its channel, stubs, identity, session and the shards it holds for this rank."""

    def __init__(
        self,
        address: str,
        token: str,
        timeout: float | None,
        tls: TlsFiles | None = None,
        allow_plaintext: bool = False,
    ) -> None:
        self.address = address
        self.timeout = timeout
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.enable_retries", 1),
            ("grpc.service_config", json.dumps(RETRY_POLICY)),
        ]
        credentials = channel_credentials(address, token, tls, allow_plaintext)
        if credentials is None:  # plain gRPC, asked for: the token travels as metadata, in clear
            self.metadata: tuple[tuple[str, str], ...] | None = (("authorization", f"Bearer {token}"),)
            self.channel = grpc.insecure_channel(address, options=options)
        else:
            self.metadata = None
            self.channel = grpc.secure_channel(address, credentials, options=options)
        encode, decode = Frame.SerializeToString, Frame.FromString

        def method(kind: str, name: str) -> Any:
            return getattr(self.channel, kind)(
                f"/{SERVICE}/{name}", request_serializer=encode, response_deserializer=decode
            )

        self.hello = method("unary_unary", "Hello")
        self.open = method("unary_unary", "Open")
        self.initialize = method("stream_unary", "Initialize")
        self.upload = method("stream_unary", "Upload")
        self.update = method("stream_stream", "Update")
        self.read_master = method("unary_stream", "ReadMaster")
        self.control = method("unary_unary", "Control")
        self.echo = method("stream_unary", "Echo")
        self.read_checkpoint = method("unary_stream", "ReadCheckpoint")
        self.server_id = ""
        self.session = ""  # issued by the server when this rank opens its shards there
        self.label = ""  # the session's label, as the server named it (the rank's name and its run's lineage id)
        self.shards: list[int] = []  # global shard indices, in local order
        self.storage_bytes = (0, 0)  # storage read and write bytes of the session, as the server last counted them
        # Calls in flight per server: one shard's gradient crossing while another's update runs (the server admits
        # as many per session).
        # Its threads run on this rank's accelerator: they copy gradients and parameters to and from its memory.
        self.executor = thread_pool(MAX_UPDATES_IN_FLIGHT, f"smartinf-remote-{address}", current_accelerator())

    def greet(self) -> None:
        """First contact: the server's identity, and its protocol, which must be this client's."""
        reply = self.reply(self.call(self.hello, header_frame(), FIRST_CONTACT), FIRST_CONTACT, ("server_id",))
        if reply.get("protocol") != PROTOCOL_VERSION:
            raise StorageError(
                f"The remote device server {self.address} speaks protocol {reply.get('protocol')!r}; this "
                f"lightning_smartinf speaks {PROTOCOL_VERSION}. Run the same version of lightning_smartinf on both."
            )
        self.server_id = str(reply["server_id"])

    def reply(self, frame: Any, what: str, required: Iterable[str] = ()) -> dict[str, Any]:
        """The header of a reply; a malformed one is this server's failure, named (:func:`_from_server`)."""
        with _from_server(self, "reply", what):
            return decode_header(frame, required)

    def call(self, method: Any, request: Any, what: str, timeout: float | None = None) -> Any:
        """``method(request)`` within ``timeout`` (default: the device timeout); errors name this server.

        A call the server refuses for a busy moment is made again as :data:`RETRY_BACKOFF_S` says (see also
        :data:`RETRY_POLICY`): ``request`` is one frame, or a function making the stream of frames (a stream given as
        such is sent once). A streamed reply is returned once its first frame is in."""
        make = request if callable(request) else lambda: request
        again = callable(request) or not isinstance(request, Iterator)
        backoff, most = RETRY_BACKOFF_S
        give_up = time.monotonic() + RETRY_WITHIN_S
        while True:
            try:
                reply = method(make(), timeout=timeout or self.timeout, metadata=self.metadata)
                if not isinstance(reply, Iterator):
                    return reply
                first = next(reply, None)  # (a frame is never None)
                return iter(()) if first is None else itertools.chain((first,), reply)
            except grpc.RpcError as exc:
                if not again or time.monotonic() + backoff > give_up or not _refused_for_a_busy_moment(exc):
                    raise self.error(exc, what) from None
                time.sleep(random.uniform(0.0, backoff))  # noqa: S311 - jitter, not a secret
                backoff = min(most, 2 * backoff)

    def receive(
        self, method: Any, request: Any, what: str, name: str, *, numel: int, dtype: torch.dtype, exact: bool = True
    ) -> Tensor:
        """The tensor ``name`` of ``numel`` ``dtype`` elements (at most, unless ``exact``) that the streamed reply of
        :meth:`call` carries, read as it arrives, and nothing after it; a server that sends more, less or something
        malformed fails, named."""
        frames = self.call(method, request, what)
        with _from_server(self, name, what):
            tensor = read_tensor(frames, name, numel, (dtype,), exact=exact)
            if next(frames, None) is not None:
                raise WireError(f"More frames followed {name!r}.")
        return tensor

    def error(self, exc: grpc.RpcError | None, what: str) -> StorageError:
        """The failure of ``what`` on this server, named as ``exc`` says (``None``: no answer within the timeout)."""
        code = grpc.StatusCode.DEADLINE_EXCEEDED if exc is None else exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        name = f"remote device server {self.address}" + (f" ({self.server_id[:12]})" if self.server_id else "")
        if code == grpc.StatusCode.UNAVAILABLE and "ssl" in str(details).lower() + str(exc).lower():
            reason = f"refused the TLS handshake ({details}): check `remote_tls_dir` against the server's certificates"
        elif code == grpc.StatusCode.UNAVAILABLE and what == FIRST_CONTACT:
            reason = (
                f"cannot be reached ({details}): it is not running, the network is down, or its TLS settings differ "
                "from this run's `remote_tls_dir` (a TLS server needs one; a mutual-TLS server, one with a client "
                "certificate)"
            )
        elif code == grpc.StatusCode.UNAVAILABLE:
            reason = "is unreachable: it was stopped, or the network is down"
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            reason = f"did not answer within device_timeout_s={self.timeout} s (a stalled network or server)"
        elif code == grpc.StatusCode.UNAUTHENTICATED or code == grpc.StatusCode.UNIMPLEMENTED and what == FIRST_CONTACT:
            # A server refuses a call without its token before looking it up: the call ends UNIMPLEMENTED.
            reason = (
                "refused the token: check `remote_token_file` against the server's `--token-file` (or the address "
                "is not a smartinf device server)"
            )
        else:
            reason = f"failed ({code.name if code else 'error'}): {details}"
        return StorageError(f"The {name} {reason}, during {what}.")

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.channel.close()


def _refused_for_a_busy_moment(exc: grpc.RpcError) -> bool:
    """Whether the server refused a call for a busy moment, which may pass (not for a quota: that refusal carries a
    negative retry pushback)."""
    if not hasattr(exc, "code") or exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return (RETRY_PUSHBACK, "-1") not in tuple(trailing or ())


@contextlib.contextmanager
def _from_server(server: _Server, name: str, what: str) -> Iterator[None]:
    """Receive ``name`` from ``server`` during ``what`` in the block: a malformed or incomplete frame stream, or a
    failed call, fails with a :class:`StorageError` naming the server."""
    try:
        yield
    except WireError as exc:
        malformed = f"The remote device server {server.address} sent a malformed {name} during {what}: {exc}"
        raise StorageError(malformed) from None
    except grpc.RpcError as exc:
        raise server.error(exc, what) from None


def measure_network(
    address: str,
    token: str,
    *,
    megabytes: int = 64,
    pings: int = 20,
    tls: TlsFiles | None = None,
    allow_plaintext: bool = False,
) -> dict[str, float]:
    """Bandwidth (GB/s, trainer to server) and round trip (ms, median of ``pings`` calls) to the server at
    ``address``; the server only counts the bytes, so no device or disk is in the figures."""
    server = _Server(address, token, timeout=120.0, tls=tls, allow_plaintext=allow_plaintext)
    try:
        times = []
        for _ in range(pings):
            started = time.perf_counter()
            server.call(server.hello, header_frame(), "a round-trip probe")
            times.append(time.perf_counter() - started)
        payload = torch.zeros((megabytes << 20) // 4, dtype=torch.float32)
        started = time.perf_counter()
        reply = server.call(server.echo, encode_tensor("probe", payload), "a bandwidth probe")
        seconds = time.perf_counter() - started
        received = int(server.reply(reply, "a bandwidth probe", ("bytes",))["bytes"])
        return {
            "network_gbps": round(received / seconds / 1e9, 3),
            "network_latency_ms": round(statistics.median(times) * 1e3, 3),
        }
    finally:
        server.close()


def checkpoint_masters(
    addresses: Sequence[str],
    token: str,
    *,
    tls: TlsFiles | None = None,
    timeout: float | None = 300.0,
    allow_plaintext: bool = False,
) -> Callable[[Path], list[Tensor]]:
    """A reader of the fp32 masters of one rank's device state that a checkpoint keeps on remote servers.

    The servers are found among ``addresses`` by identity, so they may have moved to other ports; each checks the
    digest it recorded and the shard files' CRC-32 before sending anything.
    """

    def read(directory: Path) -> list[Tensor]:
        manifest, entries = _remote_manifest(directory)
        with contextlib.ExitStack() as connected:
            servers = greeted(addresses, token, timeout, tls, allow_plaintext, connected)
            by_id = {server.server_id: server for server in servers}
            masters: dict[int, Tensor] = {}
            for entry in entries:
                server = _keeper(by_id, entry, Path(directory))
                numels = entry.get("numels") or _recorded_numels(Path(directory), entry["shards"])
                for local, (shard, numel) in enumerate(zip(entry["shards"], numels)):
                    request = header_frame(**_saved_request(entry, manifest), shard=local)
                    what = f"reading shard {shard} of a checkpoint"
                    masters[int(shard)] = server.receive(
                        server.read_checkpoint, request, what, "master", numel=int(numel), dtype=torch.float32
                    )
            if sorted(masters) != list(range(len(masters))):
                raise CheckpointError(f"{directory / REMOTE_MANIFEST} does not list every shard of the rank.")
            return [masters[i] for i in range(len(masters))]

    return read


def _remote_manifest(directory: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ``remote.json`` of a rank's device state in ``directory``, and its servers' entries."""
    manifest = read_json(Path(directory) / REMOTE_MANIFEST, "the remote device state", ("checkpoint", "servers"))
    entries = manifest["servers"]
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise CheckpointError(f"{Path(directory) / REMOTE_MANIFEST} is not a remote device-state manifest.")
    return manifest, entries


def _recorded_numels(directory: Path, shards: Sequence[int]) -> list[int]:
    """The elements of each of ``shards`` as this rank recorded them beside its ``remote.json`` (``host_state.json``:
    the parameters each shard holds): what a server may send for them. A ``remote.json`` of format 1 records no
    sizes, and a server's word is no bound."""
    recorded = PartitionIndex.of(read_json(directory / HOST_STATE, "the device state", ("shards",))["shards"]).numels
    for shard in shards:
        if not isinstance(shard, int) or isinstance(shard, bool) or not 0 <= shard < len(recorded):
            raise CheckpointError(f"{directory / REMOTE_MANIFEST} names shard {shard!r}, which {HOST_STATE} lacks.")
    return [recorded[shard] for shard in shards]


def greeted(
    addresses: Sequence[str],
    token: str,
    timeout: float | None,
    tls: TlsFiles | None,
    allow_plaintext: bool,
    connected: contextlib.ExitStack,
) -> list[_Server]:
    """A connection to each server at ``addresses``, greeted (its identity known; no session opened), each closed
    when ``connected`` closes."""
    servers = []
    for address in addresses:
        server = _Server(address, token, timeout, tls, allow_plaintext)
        connected.callback(server.close)
        server.greet()
        servers.append(server)
    return servers


def fetch_saved_state(
    servers: Sequence[_Server], rank_dirs: Sequence[Path], into: Path, traffic: Traffic | None = None
) -> tuple[list[Path], Fetch]:
    """A checkpoint kept on ``servers`` (greeted), made readable for re-sharding: each saved rank's manifest is
    fetched from the servers that hold its shards (found among ``servers`` by identity; each checked against the
    digest the trainer recorded) and written under ``into/rankNNN`` with the trainer's shard indices, beside a copy of
    its host state; a shard's state file is fetched (CRC-checked by the server before it sends it, and by the
    re-sharding after) only when the plan reads it, counted in ``traffic`` as a link read. Shards that tiers kept in
    memory beside the servers are in the checkpoint on this host (``local/``): cloned from there where the
    filesystem can, else copied."""
    by_id = {server.server_id: server for server in servers}
    sources: dict[tuple[int, int], _SavedShard] = {}
    local_dirs = []
    for rank, directory in enumerate(map(Path, rank_dirs)):
        target = into / f"rank{rank:03d}"
        target.mkdir(mode=0o700)
        local_dirs.append(target)
        shutil.copyfile(directory / HOST_STATE, target / HOST_STATE)
        count = len(read_json(target / HOST_STATE, "the device state", ("shards",))["shards"])
        in_tiers = saved_local_shards(directory)  # kept in host or accelerator memory beside the servers
        # The servers number their shards as the backend the tiers wrapped did: the others, in order.
        numbers = sorted(set(range(count)) - set(in_tiers))
        found = _kept_on_servers(by_id, directory, numbers)
        manifests = [manifest for manifest, _ in found]
        shards = [shard for _, kept in found for shard in kept]
        if in_tiers:
            manifest = read_manifest(directory / LOCAL_DIR)
            manifests.append(manifest)
            shards += _numbered(manifest, in_tiers, None, {"directory": directory / LOCAL_DIR}, directory / LOCAL_DIR)
        if sorted(shard.entry["index"] for shard in shards) != list(range(count)) or not manifests:
            raise CheckpointError(
                f"The servers and {directory / LOCAL_DIR} hold shards {sorted(s.entry['index'] for s in shards)} of "
                f"saved rank {rank}, whose host state lists {count}: the checkpoint is incomplete. Resume from "
                "another checkpoint."
            )
        chunks = {int(m["chunk_elems"]) for m in manifests}
        if len(chunks) != 1:
            raise CheckpointError(f"Rank {rank} was saved with different chunk sizes: {sorted(chunks)}.")
        entries = sorted((shard.entry for shard in shards), key=lambda e: e["index"])
        merged = {"format": manifests[0]["format"], "chunk_elems": chunks.pop(), "shards": entries}
        write_file_atomic(target / MANIFEST, json.dumps(merged).encode())
        sources.update({(rank, shard.entry["index"]): shard for shard in shards})

    def fetch(rank: int, shard: int, path: Path) -> None:
        server, request, entry = sources[(rank, shard)]
        if server is None:  # in the checkpoint on this host: cloned where the filesystem can, else copied
            clone_file(request["directory"] / shard_file_name(request["shard"]), path, int(entry["bytes"]), fsync=False)
            return
        what = f"fetching shard {shard} of saved rank {rank}"
        frames = server.call(server.read_checkpoint, header_frame(part="state", **request), what)
        with _from_server(server, "state", what):  # written as it arrives, never held whole
            write_frames(frames, path, name="state", numel=int(entry["bytes"]) // 4)
        if traffic is not None:
            traffic.add(link_read_bytes=int(entry["bytes"]))

    return local_dirs, fetch


class _SavedShard(NamedTuple):
    """Where one saved shard's state file is: on ``server`` (``request`` asks for it), or on this host (``server``
    ``None``: shard ``request["shard"]`` of ``request["directory"]``); ``entry`` is its manifest entry, indexed as the
    trainer numbers it."""

    server: _Server | None
    request: dict[str, Any]
    entry: dict[str, Any]


def _kept_on_servers(
    by_id: Mapping[str, _Server], directory: Path, numbers: Sequence[int]
) -> list[tuple[dict[str, Any], list[_SavedShard]]]:
    """Each server's manifest of the rank whose ``remote.json`` is in ``directory`` (checked against the digest the
    trainer recorded), with that server's shards; ``numbers[i]``: the trainer's index of the servers' shard ``i``."""
    saved, entries = _remote_manifest(directory)
    found = []
    for entry in entries:
        server = _keeper(by_id, entry, directory)
        request = _saved_request(entry, saved)
        manifest = _saved_manifest(server, request, directory)
        indices = [int(shard) for shard in entry.get("shards", [])]
        if any(not 0 <= shard < len(numbers) for shard in indices):
            raise CheckpointError(f"{directory / REMOTE_MANIFEST} names shards {indices}, out of range.")
        trainer = [numbers[shard] for shard in indices]
        found.append((manifest, _numbered(manifest, trainer, server, request, f"server {server.address}'s checkpoint")))
    return found


def _keeper(by_id: Mapping[str, _Server], entry: dict[str, Any], directory: Path) -> _Server:
    """The server among ``by_id`` (greeted, by identity) that kept the state ``entry`` of ``directory``'s
    ``remote.json`` describes; otherwise the error names it and says what to do."""
    server = by_id.get(str(entry.get("server_id")))
    if server is not None:
        return server
    known = ", ".join(f"{s.address} ({s.server_id[:12]})" for s in by_id.values())
    replaced = any(s.address == entry.get("address") for s in by_id.values())
    raise CheckpointError(
        f"{directory / REMOTE_MANIFEST}: the state of shards {entry.get('shards')} is on server "
        f"{str(entry.get('server_id'))[:12]} (last at {entry.get('address')}), which is not among the servers "
        f"given: {known}. "
        + (
            "Another server answers at that address (one restarted over another storage root?): start the server "
            "over the root that holds the checkpoint, or add it to `remote_devices`."
            if replaced
            else "Add it to `remote_devices`."
        )
    )


def _saved_request(entry: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """What asks a server for the checkpoint ``entry`` of the ``remote.json`` ``saved`` describes (with a ``shard``
    and ``part`` added per call)."""
    return {
        "checkpoint": entry.get("checkpoint", saved["checkpoint"]),  # format 1: one id for every server
        "label": entry.get("label"),
        "digest": entry.get("digest"),
    }


def _numbered(
    manifest: dict[str, Any], trainer: Sequence[int], server: _Server | None, request: dict[str, Any], what: object
) -> list[_SavedShard]:
    """The shards of ``manifest`` (its shard ``i`` is the trainer's ``trainer[i]``), each entry renumbered so, each
    fetched with ``request`` and its own ``shard`` number."""
    by_local = {int(e["index"]): e for e in manifest["shards"]}
    shards = []
    for local, index in enumerate(trainer):
        if local not in by_local:
            raise CheckpointError(f"{what} has no shard {local}.")
        by_local[local]["index"] = index  # the trainer's index: the re-sharding plan's
        shards.append(_SavedShard(server, {**request, "shard": local}, by_local[local]))
    return shards


def _saved_manifest(server: _Server, request: dict[str, Any], directory: Path) -> dict[str, Any]:
    """The manifest of a checkpoint ``server`` saved, checked against the digest ``request`` carries."""
    what = "fetching a checkpoint's manifest"
    ask = header_frame(part="manifest", shard=0, **request)
    data = server.receive(
        server.read_checkpoint, ask, what, "manifest", numel=MAX_MANIFEST_BYTES, dtype=torch.uint8, exact=False
    )
    data_bytes = data.numpy().tobytes()
    if hashlib.sha256(data_bytes).hexdigest() != request["digest"]:
        raise StorageError(
            f"The remote device server {server.address} sent a manifest that is not the one the trainer recorded "
            f"in {directory / REMOTE_MANIFEST}, during {what}."
        )
    try:
        return parse_manifest(data_bytes, directory / REMOTE_MANIFEST)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


class RemoteBackend(LatchingBackend):
    """Devices on remote device servers, one session per server for this rank.

    Args:
        addresses: ``host:port`` of each server.
        token: the servers' bearer token.
        label: this rank's name on the servers, e.g. ``rank000``. Each server adds a lineage id of its making: its
            checkpoints are kept under that label, which a session that loads one of them continues, so that a
            server's checkpoint caps and pruning only ever count this run's (and the runs it resumed).
        chunk_elems, buffer_count, io_threads, tentative_slots, prefetch_state: the sessions' devices, as for
            :class:`~lightning_smartinf.devices.cpu.CpuBackend`.
        device_timeout_s: deadline of every call; ``None`` waits forever.
        placement: which server holds each shard (default: shard ``s`` on server ``s mod N``).
        tls: verify the servers with ``tls.ca`` over TLS, presenting ``tls.cert`` for mutual TLS; ``None``: plain
            gRPC (not encrypted).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        token: str,
        *,
        label: str = "rank000",
        chunk_elems: int = 1 << 20,
        buffer_count: int = 16,
        io_threads: int = 3,
        tentative_slots: bool = False,
        prefetch_state: bool = True,
        device_timeout_s: float | None = 300.0,
        placement: Placement = RoundRobin(),
        tls: TlsFiles | None = None,
        allow_plaintext: bool = False,
    ) -> None:
        super().__init__(tentative_slots)
        if not addresses:
            raise ValueError("`remote_devices=[]` is empty: give at least one server as 'host:port'.")
        self.label = label
        self.chunk_elems = chunk_elems
        self.buffer_count = buffer_count
        self.io_threads = io_threads
        self.prefetch_state = prefetch_state
        self.device_timeout_s = device_timeout_s
        self.placement = placement
        with contextlib.ExitStack() as connected:  # a failure closes the servers built before it
            self.servers = greeted(addresses, token, device_timeout_s, tls, allow_plaintext, connected)
            connected.pop_all()  # every one greeted: closed with the backend from now on
        self._specs: list[ShardSpec] = []
        self._where: list[tuple[_Server, int]] = []
        # One AcceleratorCopies per calling thread: a link's staging slots belong to one worker.
        self._links = threading.local()
        self._all_links: list[AcceleratorCopies] = []
        self._released = False

    # ---------------------------------------------------------------------------------------------- views

    @property
    def num_devices(self) -> int:
        return len(self.servers)

    @property
    def assignment(self) -> tuple[int, ...]:
        """The server index of each shard."""
        return tuple(self.servers.index(server) for server, _ in self._where)

    def check_usable(self, what: str) -> None:
        super().check_usable(what)
        if self._released or (self.closed and what not in ("save", "read_master")):
            raise RuntimeError(f"`{what}` on a closed RemoteBackend.")

    # ---------------------------------------------------------------------------------------------- set-up

    def open(self, shards: Sequence[ShardSpec]) -> None:
        self.check_usable("open")
        assignment = check_assignment(self.placement, shards, len(self.servers))
        self._specs = list(shards)
        self._where = []
        for spec, index in zip(shards, assignment):
            server = self.servers[index]
            self._where.append((server, len(server.shards)))
            server.shards.append(spec.index)
        for server in self._holding:
            header = header_frame(
                label=self.label,
                chunk_elems=self.chunk_elems,
                buffer_count=self.buffer_count,
                io_threads=self.io_threads,
                tentative=self.tentative_slots,
                prefetch=self.prefetch_state,
                shards=[shard_to_wire(self._specs[i]) for i in server.shards],
            )
            what = f"opening {len(server.shards)} shards"
            try:
                reply = server.reply(server.call(server.open, header, what), what, ("session", "label"))
                server.session, server.label = str(reply["session"]), str(reply["label"])
            except StorageError:
                server.shards = []  # no session there: `close` has nothing to wait for or close on it
                raise

    def _locate(self, shard: int, numel: int, what: str) -> tuple[_Server, int]:
        if not 0 <= shard < len(self._specs):
            raise ValueError(f"Shard {shard} is not open (shards are 0..{len(self._specs) - 1}).")
        if numel != self._specs[shard].numel:
            raise ValueError(f"{what} of shard {shard} has {numel} elements, expected {self._specs[shard].numel}.")
        return self._where[shard]

    def _start(self, server: _Server, work: Any, what: str) -> Handle:
        def run() -> None:
            try:
                work()  # its calls go through `_Server.call`, which names the server in a StorageError
            except StorageError as exc:
                raise self.latch_error(exc) from None

        handle = server.executor.submit(run)
        handle.what = what  # type: ignore[attr-defined]
        handle.server = server  # type: ignore[attr-defined]
        return self.pending_work.add(handle)

    def initialize(self, shard: int, master: Tensor) -> Handle:
        self.check_usable("initialize")
        server, local = self._locate(shard, master.numel(), "`master`")
        host = master.detach().to(torch.float32).cpu()

        def frames() -> Iterator[Any]:
            yield header_frame(session=server.session, shard=local)
            yield from encode_tensor("master", host)

        what = f"the initialisation of shard {shard}"

        def work() -> None:
            server.call(server.initialize, frames, what)
            self.traffic.add(link_write_bytes=host.numel() * 4)

        return self._start(server, work, what)

    def submit(
        self,
        shard: int,
        grad: Tensor | SparseGrad,
        hp: StepParams,
        out: Tensor,
        link_dtype: torch.dtype | None = None,
        tentative: bool = False,
        ready: Fence | None = None,
    ) -> Handle:
        """See :meth:`Backend.submit`: the gradient crosses in ``link_dtype``, ``out`` comes back in its own dtype."""
        self.check_usable("submit")
        sparse = isinstance(grad, SparseGrad)
        server, local = self._locate(shard, grad.numel if sparse else grad.numel(), "`grad`")
        self._locate(shard, out.numel(), "`out`")
        self.tentative_updates.start(shard, tentative)
        link = link_dtype or (grad.values.dtype if sparse else grad.dtype)
        header = header_frame(
            session=server.session,
            shard=local,
            hp=hp_to_wire(hp),
            link_dtype=dtype_name(link),
            out_dtype=dtype_name(out.dtype),
            tentative=tentative,
            sparse=sparse,
        )
        what = f"the update of shard {shard}"

        def work() -> None:
            if ready is not None:
                ready.synchronize()
            if sparse:  # the controller brought the pairs to the host already
                tensors = [("indices", grad.indices.cpu()), ("values", grad.values.cpu().to(link))]
            else:
                tensors = [("grad", self._accelerator_copies().to_host(grad.detach()).to(link))]

            def request() -> Iterator[Any]:  # each attempt's frames
                # gRPC draws these on a thread of its own: only host tensors are touched here.
                yield header
                for name, tensor in tensors:
                    yield from encode_tensor(name, tensor)

            self._deliver(out, server.receive(server.update, request, what, "out", numel=out.numel(), dtype=out.dtype))
            sent = sum(tensor.numel() * tensor.element_size() for _, tensor in tensors)  # the answered attempt's
            self.traffic.add(link_write_bytes=sent, link_read_bytes=out.numel() * out.element_size())

        return self._start(server, work, what)

    def read_master(self, shard: int, out: Tensor) -> Handle:
        self.check_usable("read_master")
        server, local = self._locate(shard, out.numel(), "`out`")

        what = f"reading the masters of shard {shard}"

        def work() -> None:
            request = header_frame(session=server.session, shard=local)
            received = server.receive(
                server.read_master, request, what, "master", numel=out.numel(), dtype=torch.float32
            )
            self._deliver(out, received)
            self.traffic.add(link_read_bytes=out.numel() * 4)

        return self._start(server, work, what)

    def _accelerator_copies(self) -> AcceleratorCopies:
        """This worker thread's own :class:`AcceleratorCopies`: copies to and from accelerator memory through pinned
        staging, on streams of its own, off the training stream."""
        link = getattr(self._links, "link", None)
        if link is None:
            link = self._links.link = AcceleratorCopies()
            self._all_links.append(link)  # list.append is atomic: closed with the backend
        return link

    def _deliver(self, out: Tensor, received: Tensor) -> None:
        """``received`` into ``out`` (through this worker thread's :meth:`_accelerator_copies` when ``out`` is in
        accelerator memory); returns once it has landed."""
        link = self._accelerator_copies()
        link.put(out, received)
        link.settle()

    def result(self, handle: Handle) -> None:
        try:
            handle.result(timeout=self.device_timeout_s)
        except FutureTimeoutError:
            server, what = handle.server, handle.what  # type: ignore[attr-defined] # set by `_start`
            raise self.latch_error(server.error(None, what)) from None

    # ---------------------------------------------------------------------------------------------- control

    def _control(
        self,
        server: _Server,
        op: str,
        what: str,
        timeout: float | None = None,
        required: Iterable[str] = (),
        **args: Any,
    ) -> dict[str, Any]:
        request = header_frame(session=server.session, op=op, **args)
        return server.reply(server.call(server.control, request, what, timeout=timeout), what, required)

    def _step_control(self, server: _Server, op: str, what: str, **args: Any) -> dict[str, Any]:
        """:meth:`_control` for an operation of the step (a commit, a rollback, prefetch advice, a storage check) or
        one that may leave the state torn (loading uploaded state): its failure stops the backend (:attr:`failure`)
        as an update's does, so that :meth:`close` releases what it can and raises nothing over the step's error."""
        try:
            return self._control(server, op, what, **args)
        except StorageError as exc:
            raise self.latch_error(exc) from None

    @property
    def _holding(self) -> list[_Server]:
        """The servers that hold shards of this rank (each has a session)."""
        return [server for server in self.servers if server.shards]

    def commit(self, shards: Iterable[int]) -> None:
        self.check_usable("commit")
        shards = self.tentative_updates.check_commit(shards)
        self.wait()
        for server, local in by_holder(self._where, shards).items():
            self._step_control(server, "commit", "a commit", shards=local)
        self.tentative_updates.end(shards)

    def rollback(self, shards: Iterable[int]) -> None:
        shards = list(shards)
        try:
            self.wait()
            for server, local in by_holder(self._where, shards).items():
                self._step_control(server, "rollback", "a rollback", shards=local)
        finally:
            self.tentative_updates.end(shards)

    def prefetch(self, shards: Sequence[int]) -> None:
        if self.failure is not None or not self.prefetch_state:
            return
        grouped = by_holder(self._where, (i for i in shards if i not in self.tentative_updates))
        for server in self._holding:
            self._step_control(server, "prefetch", "prefetch advice", shards=grouped.get(server, []))

    def check_storage(self) -> None:
        self.check_usable("check_storage")
        for server in self._holding:
            self._step_control(server, "check_storage", "a storage check")

    def wait(self) -> None:
        errors = []
        for handle in self.pending_work.take():
            try:
                self.result(handle)
            except BaseException as exc:  # noqa: BLE001 - the first is raised below
                errors.append(exc)
        if not errors:
            for server in self._holding:
                try:
                    self._control(server, "wait", "waiting for write-back")
                except StorageError as exc:
                    errors.append(exc)
        if errors:
            raise self.latch_error(errors[0])

    # ---------------------------------------------------------------------------------------------- checkpoints

    def save(self, directory: Path) -> None:
        """Each server saves its shards under a new checkpoint id; ``directory/remote.json`` records where."""
        self.check_usable("save")
        self.wait()
        entries = []
        for server in self._holding:
            what = "saving a checkpoint"
            reply = self._control(server, "save", what)
            if not isinstance(reply.get("checkpoint"), str) or not isinstance(reply.get("digest"), str):
                unnamed = (
                    f"The remote device server {server.address} did not name the checkpoint it saved, during {what}."
                )
                raise self.latch_error(StorageError(unnamed))
            entries.append(
                {
                    "address": server.address,
                    "server_id": server.server_id,
                    "checkpoint": reply["checkpoint"],  # named by the server: each save is a new one
                    "label": server.label,
                    "shards": server.shards,
                    "numels": [self._specs[i].numel for i in server.shards],
                    "digest": reply["digest"],
                }
            )
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        manifest = {"format": 2, "checkpoint": None, "servers": entries}
        write_file_atomic(directory / REMOTE_MANIFEST, json.dumps(manifest, indent=1).encode())

    def load(self, directory: Path) -> None:
        """Have each server load the state this rank saved there; refuses another server or other state (the
        strategy's load sends a checkpoint placed otherwise through :meth:`load_resharded`: :meth:`loads_as_saved`)."""
        self.check_usable("load")
        self.tentative_updates.refuse_held("loading a checkpoint")
        self.wait()
        manifest, entries = _remote_manifest(directory)
        mine = self._holding
        if len(entries) != len(mine):
            saved = ", ".join(f"{entry.get('address')} ({str(entry.get('server_id'))[:12]})" for entry in entries)
            current = ", ".join(f"{server.address} ({server.server_id[:12]})" for server in mine)
            raise CheckpointError(
                f"The checkpoint's device state is on {len(entries)} remote server(s): {saved}; this run has "
                f"{len(mine)}: {current}. Load it with the same `remote_devices`, in the same order, or through the "
                "strategy, which re-shards it onto these servers."
            )
        for server, entry in zip(mine, entries):
            if entry.get("shards") != server.shards:
                raise CheckpointError(
                    f"The checkpoint placed other shards on {entry.get('address')} than this run places on "
                    f"{server.address}. Load it with the same `remote_devices` in order, or through the strategy, "
                    "which re-shards it."
                )
            if entry.get("server_id") != server.server_id:
                raise CheckpointError(
                    f"The remote device server at {server.address} is {server.server_id[:12]}, but the checkpoint was "
                    f"saved on {str(entry.get('server_id'))[:12]} ({entry.get('address')}): a server restarted with "
                    "another storage root, or another server at that address. Start the server over the storage "
                    "root that holds the checkpoint."
                )
        for server, entry in zip(mine, entries):
            request = _saved_request(entry, manifest)
            reply = self._control(server, "load", "loading a checkpoint", required=("label",), **request)
            server.label = str(reply["label"])  # the checkpoint's lineage, continued by this run's saves

    def loads_as_saved(self, directory: Path) -> bool:
        """Only a checkpoint the servers kept (a ``remote.json``) placed as this run places its shards: the same
        servers, by identity, each with the same shards. Any other goes through :meth:`load_resharded`, which sends
        each shard to the server this run places it on: state files on this host (saved by ``cpu`` or ``xrt``, or
        before a change of layout), or state kept on these servers in another order or partly on others."""
        if not (Path(directory) / REMOTE_MANIFEST).is_file():
            return False
        _, entries = _remote_manifest(directory)
        return [(e.get("server_id"), e.get("shards")) for e in entries] == [
            (s.server_id, s.shards) for s in self._holding
        ]

    def fetch_saved_state(self, rank_dirs: Sequence[Path], into: Path) -> tuple[list[Path], Fetch] | None:
        """A checkpoint kept on servers, made readable for re-sharding (:func:`fetch_saved_state`, from this run's
        servers); the state files it fetches count as link reads."""
        self.check_usable("load")
        return fetch_saved_state(self.servers, rank_dirs, into, self.traffic)

    def load_resharded(self, reshard: Reshard) -> None:
        """Replace every shard's state from state files on this host (a checkpoint of a ``cpu`` or ``xrt`` run, of any
        layout): each shard's file is rebuilt in this run's layout in a private temporary directory, sent to its
        server (which writes it to disk as it arrives and checks its CRC-32C), and removed, so this host holds one
        shard's file at a time; each server then loads all of its shards at once. Nothing is replaced on a server
        until every one of its shards has arrived."""
        self.check_usable("load")
        self.tentative_updates.refuse_held("loading a checkpoint")
        self.wait()

        def send(state: ShardState) -> None:
            server, local = self._where[state.spec.index]
            size = state.layout.file_bytes
            _, crc = file_checksum(state.path, CRC32C)
            what = f"sending shard {state.spec.index}'s state from a checkpoint"

            def frames() -> Iterator[Any]:
                yield header_frame(session=server.session, shard=local, **{CRC32C: crc})
                yield from encode_file("state", state.path, torch.float32)  # a chunk at a time

            server.call(server.upload, frames, what)
            self.traffic.add(link_write_bytes=size)
            state.path.unlink()

        with scratch_directory("smartinf-upload") as tmp:
            states = [
                ShardState(spec, spec.layout(self.chunk_elems), tmp / f"{i}") for i, spec in enumerate(self._specs)
            ]
            reshard.write(states, then=send)  # a failure here changed nothing on the servers
        for server in self._holding:  # a server that fails here may have replaced some shards: the state is torn
            self._step_control(server, "load_upload", "loading a checkpoint")

    def release_storage(self) -> None:
        """Close the sessions (their state is removed from the servers; checkpoints stay) and the channels:
        ``close(keep_claims=True)`` leaves them open until this, so that :meth:`save` can still copy the final state."""
        if self._released:
            return
        self._released = True
        for server in self.servers:
            try:
                # Also after another server failed: every server still reachable frees this rank's session now
                # (an unreachable one removes it when its lease runs out, or at its next start).
                if server.shards and server.session:
                    # After a failure, briefly: a server that hangs must not hold the trainer's exit.
                    brief = None if self.failure is None else min(CLOSE_AFTER_FAILURE_S, self.device_timeout_s or 1e9)
                    self._control(server, "close", "closing the session", timeout=brief)
            except StorageError:
                pass  # the server is gone: nothing left to release there
            finally:
                server.close()
        for link in self._all_links:
            link.close()

    def traffic_snapshot(self) -> TrafficSnapshot:
        """Link bytes as this rank sent and received them; storage bytes as the servers counted them (the last
        figures they gave once the sessions are closed or a server failed)."""
        if not self._released and self.failure is None:
            for server in self._holding:
                counters = ("storage_read_bytes", "storage_write_bytes")
                try:
                    reply = self._control(server, "traffic", "reading the traffic counters", required=counters)
                except StorageError:
                    continue  # reported by the next call that needs the server
                figures = tuple(reply[name] for name in counters)
                if all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in figures):
                    server.storage_bytes = figures  # a malformed reply keeps the last figures, like a failed one
        link = self.traffic.snapshot()
        return dataclasses.replace(
            link,
            storage_read_bytes=sum(server.storage_bytes[0] for server in self.servers),
            storage_write_bytes=sum(server.storage_bytes[1] for server in self.servers),
        )
