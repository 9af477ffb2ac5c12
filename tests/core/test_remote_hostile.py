"""A remote device server against hostile and broken clients: a real ``smartinf serve`` process on loopback.

Each test talks to the server as a client that does not follow the protocol would: without the token, stalling,
asking for more than the server grants, guessing another client's session, or leaving without closing. The server
must refuse with a status and go on serving the well-behaved client beside it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from helpers.leftovers import left_over
from helpers.remote_servers import ServerProcess, write_token

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.format.state_files import CheckpointError
from lightning_smartinf.core.io.checksum import crc32c
from lightning_smartinf.core.io.storage import StorageError
from lightning_smartinf.core.rules import Adam, StepParams
from lightning_smartinf.devices.remote.client import RemoteBackend, channel_credentials
from lightning_smartinf.devices.remote.server import session_tag
from lightning_smartinf.devices.remote.wire import SERVICE, Frame, encode_tensor, header_frame

TOKEN = "a-token-of-the-hostile-client-tests"
CHUNK = 4096
SPECS = [ShardSpec(index=0, numel=CHUNK, rule=Adam(decoupled_weight_decay=True))]
METHODS = ("Hello", "Open", "Initialize", "Upload", "Update", "ReadMaster", "Control", "Echo", "ReadCheckpoint")
#: Seconds a test waits for an answer the server should give at once.
PROMPT_S = 10.0


@pytest.fixture
def server(tmp_path) -> Iterator[ServerProcess]:
    """A server with few workers (so that a handful of calls could hold them all) and a short call limit."""
    process = ServerProcess(
        [tmp_path / "root"],
        write_token(tmp_path / "token", TOKEN),
        extra=["--workers", "4", "--call-timeout-s", "4", "--max-io-threads", "4", "--max-shards", "8"],
    ).start()
    yield process
    process.stop()


def _channel(address: str, *, credentials: bool = True) -> grpc.Channel:
    """A channel to a loopback server: the trainer's credentials, or none (the same transport, no token)."""
    if credentials:
        return grpc.secure_channel(address, channel_credentials(address, TOKEN, None, False))
    return grpc.secure_channel(address, grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP))


def _stream(channel: grpc.Channel, method: str):  # noqa: ANN202 - a grpc multi-callable
    return channel.stream_stream(
        f"/{SERVICE}/{method}", request_serializer=Frame.SerializeToString, response_deserializer=Frame.FromString
    )


def _client(server: ServerProcess, **kwargs) -> RemoteBackend:
    kwargs = {"chunk_elems": CHUNK, "buffer_count": 2, "io_threads": 1, "device_timeout_s": 30.0, **kwargs}
    return RemoteBackend([server.address], TOKEN, **kwargs)


def _opened(server: ServerProcess, **kwargs) -> RemoteBackend:
    client = _client(server, **kwargs)
    client.open(SPECS)
    client.initialize(0, torch.randn(CHUNK))
    client.wait()
    return client


def _status(call) -> grpc.StatusCode:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as failed:
        list(call)
    return failed.value.code()


class Stalls:
    """Calls that send their headers and never a message, until :meth:`release` (the ``stalls`` fixture's teardown)."""

    def __init__(self) -> None:
        self._released = threading.Event()

    def call(self, channel: grpc.Channel, method: str):  # noqa: ANN201 - a grpc call
        def never() -> Iterator[Frame]:
            self._released.wait(60)
            yield from ()

        return _stream(channel, method)(never(), timeout=60)

    def release(self) -> None:
        self._released.set()


@pytest.fixture
def stalls() -> Iterator[Stalls]:
    made = Stalls()
    yield made
    made.release()


def _refusals(server: ServerProcess, method: str, frame: Frame, times: int) -> list[grpc.RpcError]:
    """Send ``method`` the one ``frame`` ``times`` times with the token; each must end in an error, returned."""
    channel = _channel(server.address)
    errors = []
    try:
        for _ in range(times):
            with pytest.raises(grpc.RpcError) as failed:
                list(_stream(channel, method)(iter([frame]), timeout=PROMPT_S))
            errors.append(failed.value)
    finally:
        channel.close()
    return errors


def _server_with(tmp_path: Path, *flags: str) -> ServerProcess:
    """A started server of this test's own with ``flags`` (stop it in the test)."""
    return ServerProcess([tmp_path / "root"], write_token(tmp_path / "token", TOKEN), extra=list(flags)).start()


@pytest.mark.slow
@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer not-the-token-at-all", TOKEN, f"Bearer {TOKEN}x", f"bearer {TOKEN}"],
    ids=["none", "wrong", "no_bearer_prefix", "longer", "lowercase_scheme"],
)
def test_every_method_is_refused_without_the_token(server, authorization) -> None:
    channel = _channel(server.address, credentials=False)
    metadata = None if authorization is None else (("authorization", authorization),)
    try:
        for method in METHODS:
            call = _stream(channel, method)(iter([header_frame()]), metadata=metadata, timeout=PROMPT_S)
            assert _status(call) == grpc.StatusCode.UNIMPLEMENTED, method  # refused before it is looked up
    finally:
        channel.close()


def test_stalled_calls_without_the_token_do_not_delay_an_authorised_one(server, stalls) -> None:
    """Three times as many calls as the server has workers send their headers and never a message: each is refused
    at once, holding no worker, and a trainer's first contact is answered."""
    stranger = _channel(server.address, credentials=False)
    try:
        stalled = [stalls.call(stranger, method) for method in ("Hello", "Open", "Control") * 4]
        client = _client(server)  # greets the server (Hello), within its device timeout
        client.close()
        assert all(_status(call) == grpc.StatusCode.UNIMPLEMENTED for call in stalled)
    finally:
        stalls.release()
        stranger.close()


@pytest.mark.slow
def test_calls_without_the_token_take_no_call_slot_while_the_workers_are_busy(tmp_path, stalls) -> None:
    """Both workers busy with a token holder's calls, and ten calls without the token arriving: those are ended at
    once, taking none of the server's six call slots, and a trainer's first contact waits for a worker and is
    served (it was refused with ``RESOURCE_EXHAUSTED`` when refusals counted as calls)."""
    server = _server_with(
        tmp_path, "--workers", "2", "--max-calls", "6", "--max-peer-calls", "2", "--call-timeout-s", "3"
    )
    busy, stranger = _channel(server.address), _channel(server.address, credentials=False)
    try:
        held = [stalls.call(busy, "Open") for _ in range(2)]
        time.sleep(0.5)  # each holds a worker, reading its request
        strangers = [stalls.call(stranger, method) for method in METHODS + METHODS[:1]]
        client = _client(server)  # greets the server once a worker is free (the server ends the held calls)
        client.close()
        assert all(_status(call) == grpc.StatusCode.UNIMPLEMENTED for call in strangers)
        assert all(_status(call) == grpc.StatusCode.CANCELLED for call in held)
    finally:
        stalls.release()
        busy.close()
        stranger.close()
        server.stop()


@pytest.mark.slow
def test_stalled_calls_with_the_token_are_bounded_and_ended_by_the_server(tmp_path, stalls) -> None:
    """A token holder that stalls as many calls as the server takes at once gets no more: the next call is refused
    at once (``RESOURCE_EXHAUSTED``), and the server ends the stalled ones when its call limit (4 s) is up, whatever
    deadline the client set; then it serves again."""
    server = _server_with(
        tmp_path, "--workers", "4", "--max-calls", "4", "--max-peer-calls", "4", "--call-timeout-s", "4"
    )
    channel = _channel(server.address)
    try:
        stalled = [stalls.call(channel, "Open") for _ in range(4)]
        time.sleep(0.5)  # each holds a worker, reading its request
        one_more = _stream(channel, "Control")(iter([header_frame(session="x", op="wait")]), timeout=PROMPT_S)
        assert _status(one_more) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert all(_status(call) == grpc.StatusCode.CANCELLED for call in stalled)
        # gRPC counts a cancelled call as running until its worker has let it go: a moment after the client sees it.
        deadline = time.monotonic() + PROMPT_S
        while True:
            try:
                _opened(server).close()
                break
            except StorageError as exc:
                if "RESOURCE_EXHAUSTED" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        stalls.release()
        channel.close()
        server.stop()


def _steps(client: RemoteBackend, steps: int = 3, params: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Open, initialize and update one shard ``steps`` times with seeded gradients; its masters after them (and each
    step's parameters appended to ``params``)."""
    generator = torch.Generator().manual_seed(0)
    client.open(SPECS)
    client.initialize(0, torch.randn(CHUNK, generator=generator))
    client.wait()  # as the controller does: the initial state is written before the first update is sent
    out = torch.empty(CHUNK, dtype=torch.bfloat16)
    for step in range(1, steps + 1):
        grad = torch.randn(CHUNK, generator=generator).bfloat16()
        client.result(client.submit(0, grad, StepParams(step=step, lr=1e-2), out, link_dtype=torch.bfloat16))
        if params is not None:
            params.append(out.clone())
    masters = torch.empty(CHUNK)
    client.read_master(0, masters)
    client.wait()
    client.close()
    return masters


def test_a_busy_moment_is_retried_and_the_run_ends_as_without_it(tmp_path, stalls) -> None:
    """Every call slot of the server taken by a token holder's stalled calls when a trainer starts: its calls are
    refused (``RESOURCE_EXHAUSTED``) until the server ends the stalled ones (2 s), and the trainer retries them with
    backoff instead of failing; its updates end bit for bit as on an idle server."""
    server = _server_with(
        tmp_path, "--workers", "4", "--max-calls", "4", "--max-peer-calls", "4", "--call-timeout-s", "2"
    )
    channel = _channel(server.address)
    try:
        reference_params: list[torch.Tensor] = []
        reference = _steps(_client(server), params=reference_params)
        stalled = [stalls.call(channel, "Open") for _ in range(4)]
        time.sleep(0.5)  # each holds a slot
        busy_at_start = _stream(channel, "Control")(iter([header_frame(session="x", op="wait")]), timeout=PROMPT_S)
        assert _status(busy_at_start) == grpc.StatusCode.RESOURCE_EXHAUSTED  # (a channel without retries)
        busy_params: list[torch.Tensor] = []
        busy = _steps(_client(server), params=busy_params)
        assert torch.equal(busy, reference), _unequal(busy, reference, busy_params, reference_params, server)
        assert all(_status(call) == grpc.StatusCode.CANCELLED for call in stalled)
    finally:
        stalls.release()
        channel.close()
        server.stop()


def _unequal(
    masters: torch.Tensor,
    reference: torch.Tensor,
    params: list[torch.Tensor],
    reference_params: list[torch.Tensor],
    server: ServerProcess,
) -> str:
    """What differs between two runs of :func:`_steps`, for a failure's message: the masters, each step's
    parameters, and the end of the server's log."""
    steps = [int((a != b).sum()) for a, b in zip(params, reference_params)]
    return (
        f"{int((masters != reference).sum())} of {masters.numel()} masters differ (largest by "
        f"{float((masters - reference).abs().max()):.3g}); parameters differing after each step: {steps}\n"
        f"server log:\n{server.log_text()[-4000:]}"
    )


def _own_connection(address: str) -> grpc.Channel:
    """A channel with the trainer's credentials on a connection of its own (gRPC shares one between channels of a
    process with equal settings): a second client, as the server tells clients apart without mutual TLS."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    return grpc.secure_channel(address, channel_credentials(address, TOKEN, None, False), options=options)


def test_a_client_holding_calls_open_leaves_workers_to_the_others(tmp_path, stalls) -> None:
    """A token holder stalls as many calls as one client may hold (three quarters of four workers): its next call is
    refused at once, naming the flag, and another client's whole run is served on the worker left, long before the
    server ends the stalled calls."""
    server = _server_with(tmp_path, "--workers", "4", "--call-timeout-s", "60")
    hog = _own_connection(server.address)
    try:
        held = [stalls.call(hog, "Echo") for _ in range(3)]
        time.sleep(0.5)  # each holds a worker, reading its request
        one_more = _stream(hog, "Echo")(iter([header_frame()]), timeout=PROMPT_S)
        with pytest.raises(grpc.RpcError) as refused:
            list(one_more)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "3 calls in flight" in refused.value.details() and "--max-peer-calls" in refused.value.details()
        started = time.monotonic()
        _steps(_client(server))
        assert time.monotonic() - started < 30, "served beside the stalled calls, not after them"
        stalls.release()
        assert all(len(list(call)) == 1 for call in held)  # they end as calls of their own, once they send
    finally:
        stalls.release()
        hog.close()
        server.stop()


@pytest.mark.slow
def test_one_sessions_calls_in_flight_are_capped_and_a_refused_update_is_sent_again(tmp_path) -> None:
    """A session may have ``--max-session-calls`` calls in flight: with its one slot held by an update whose gradient
    never comes, the trainer's own update (a 1 MiB gradient, four times gRPC's retry buffer) is refused for a busy
    moment; the trainer sends it again with backoff until the server has ended the stalled call (2 s), and its
    masters end bit for bit as on an idle server."""
    numel = 1 << 19  # bf16 gradient: 1 MiB
    specs = [ShardSpec(index=0, numel=numel, rule=Adam(decoupled_weight_decay=True))]
    server = _server_with(tmp_path, "--max-session-calls", "1", "--call-timeout-s", "2")
    release = threading.Event()

    def run(stall: bool) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        client = _client(server, chunk_elems=1 << 16)
        client.open(specs)
        client.initialize(0, torch.randn(numel, generator=generator))
        client.wait()
        channel = _own_connection(server.address)
        if stall:
            session = client.servers[0].session
            header = header_frame(
                session=session, shard=0, hp={"step": 1, "lr": 1e-2}, link_dtype="bfloat16", out_dtype="bfloat16"
            )

            def stalled() -> Iterator[Frame]:
                yield header
                release.wait(60)

            held = _stream(channel, "Update")(stalled(), timeout=60)
            time.sleep(0.5)  # it holds the session's one call slot, waiting for its gradient
            busy = _stream(channel, "Control")(iter([header_frame(session=session, op="wait")]), timeout=PROMPT_S)
            with pytest.raises(grpc.RpcError) as refused:
                list(busy)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-session-calls" in refused.value.details()
        out = torch.empty(numel, dtype=torch.bfloat16)
        for step in range(1, 3):
            grad = torch.randn(numel, generator=generator).bfloat16()
            client.result(client.submit(0, grad, StepParams(step=step, lr=1e-2), out, link_dtype=torch.bfloat16))
        if stall:
            assert _status(held) == grpc.StatusCode.CANCELLED  # ended by the server, not by the client's 60 s
        masters = torch.empty(numel)
        client.read_master(0, masters)
        client.wait()
        client.close()
        channel.close()
        return masters

    try:
        reference = run(stall=False)
        assert torch.equal(run(stall=True), reference)
    finally:
        release.set()
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kwargs", "specs", "refused"),
    [
        ({"io_threads": 1000}, SPECS, r"io_threads=1000.*at most 4.*--max-io-threads"),
        ({"buffer_count": 1 << 20}, SPECS, r"transfer buffers.*--max-session-pool.*Lower `chunk_size`"),
        ({}, [ShardSpec(index=i, numel=CHUNK, rule=Adam()) for i in range(9)], r"9 shards.*at most 8.*--max-shards"),
        ({}, [ShardSpec(index=0, numel=1 << 31, rule=Adam())], r"has 2147483648 elements; this server takes at most"),
    ],
    ids=["io_threads", "pool", "shard_count", "shard_size"],
)
def test_what_a_session_may_take_is_the_servers_to_decide(server, tmp_path, kwargs, specs, refused) -> None:
    client = _client(server, **kwargs)
    with pytest.raises(StorageError, match=refused):
        client.open(specs)
    client.close()
    assert not list((tmp_path / "root").glob("sessions/*")), "refused before anything was made"
    _opened(server).close()  # the server goes on serving


@pytest.mark.slow
def test_the_sessions_buffers_together_are_bounded(tmp_path) -> None:
    """Each session's transfer buffers fit its own cap; together they fit the server's (`--max-pools`): a session
    that would pass it is refused until another closes."""
    process = ServerProcess(
        [tmp_path / "root"], write_token(tmp_path / "token", TOKEN), extra=["--max-pools", "150KiB"]
    ).start()
    try:
        first = _opened(process)  # 2 buffers x 4096 elements x 3 tensors (Adam) x 4 B = 96 KiB
        second = _client(process)
        with pytest.raises(StorageError, match=r"do not fit beside the open sessions' .*--max-pools"):
            second.open(SPECS)
        second.close()
        first.close()
        _opened(process).close()  # the freed buffers are given again
    finally:
        process.stop()


def test_a_session_over_the_state_quota_is_refused_before_anything_is_allocated(tmp_path) -> None:
    process = ServerProcess(
        [tmp_path / "root"], write_token(tmp_path / "token", TOKEN), extra=["--max-session-state", "64KiB"]
    ).start()
    try:
        client = _client(process)
        with pytest.raises(StorageError, match=r"state takes 96 KiB; this server gives a session at most 64 KiB"):
            client.open([ShardSpec(index=0, numel=CHUNK * 2, rule=Adam())])  # 96 KiB of state
        client.close()
        assert not list((tmp_path / "root").glob("sessions/*"))
    finally:
        process.stop()


def test_a_failed_open_leaves_no_session_behind(server, tmp_path) -> None:
    """An ``Open`` whose devices cannot be built (one transfer buffer: a device needs two) fails with a reason, five
    times over, and leaves no session directory and no reserved slot: a well-formed session opens after."""
    from lightning_smartinf.devices.remote.wire import rule_to_wire

    shards = [{"numel": CHUNK, "rule": rule_to_wire(Adam())}]
    header = header_frame(label="broken", shards=shards, chunk_elems=CHUNK, buffer_count=1, io_threads=1)
    for refused in _refusals(server, "Open", header, 5):
        assert "buffer" in refused.details(), refused.details()
    assert not list((tmp_path / "root").glob("sessions/*"))
    _opened(server).close()


def test_a_second_client_with_the_same_token_cannot_touch_the_first_ones_session(server, tmp_path) -> None:
    """Sessions are named by the server, unguessably, and the name is never logged or made a directory: another
    token holder who guesses, or reads the server's log and disk, reaches nothing; the first client goes on."""
    mark = server.log_mark()
    first = _opened(server)
    session = first.servers[0].session
    assert len(session) >= 32 and session not in server.log_text(since=mark)
    assert [p.name for p in (tmp_path / "root" / "sessions").iterdir()] == [session_tag(session)]
    channel = _channel(server.address)
    try:
        for guess in ("rank000", "s" + "0" * 32, session_tag(session), session[:-1]):
            for op in ("close", "traffic"):
                call = _stream(channel, "Control")(iter([header_frame(session=guess, op=op)]), timeout=PROMPT_S)
                assert _status(call) == grpc.StatusCode.NOT_FOUND, (guess, op)
    finally:
        channel.close()
    out = torch.empty(CHUNK)
    first.result(first.submit(0, torch.zeros(CHUNK), StepParams(step=1, lr=1e-3), out))
    first.close()


def test_checkpoints_are_named_by_the_server_and_never_replaced(server, tmp_path) -> None:
    client = _opened(server)
    client.save(tmp_path / "a")
    client.save(tmp_path / "b")
    client.close()
    saved = sorted(p.name for p in (tmp_path / "root" / "checkpoints").iterdir())
    assert len(saved) == 2, saved  # two saves, two checkpoints: the first is still there


def test_malformed_requests_end_with_invalid_argument_and_a_reason(server) -> None:
    client = _opened(server)
    session = client.servers[0].session
    channel = _channel(server.address)
    header = {"session": session, "shard": 0, "link_dtype": "float32", "out_dtype": "float32"}
    cases = {
        "an empty stream": ("Update", []),
        "hyperparameters without lr": ("Update", [header_frame(**header, hp={"step": 1})]),
        "a shard that is a bool": ("ReadMaster", [header_frame(session=session, shard=True)]),
        "a header that is not JSON": ("Control", [Frame(header=b"{not json")]),
        "an unknown operation": ("Control", [header_frame(session=session, op="format_disk")]),
        "one beta": ("Update", [header_frame(**header, hp={"step": 1, "lr": 1e-3, "betas": [0.9]})]),
        "step 0 (NaN in Adam's bias correction)": ("Update", [header_frame(**header, hp={"step": 0, "lr": 1e-3})]),
        "a beta of 1": ("Update", [header_frame(**header, hp={"step": 1, "lr": 1e-3, "betas": [0.9, 1.0]})]),
        "a negative learning rate": ("Update", [header_frame(**header, hp={"step": 1, "lr": -1.0})]),
    }
    out_of_range = {
        "one beta": "betas=[0.9] (two values in [0, 1))",
        "step 0 (NaN in Adam's bias correction)": "step=0 (steps count from 1)",
        "a beta of 1": "betas=[0.9, 1.0]",
        "a negative learning rate": "lr=-1.0 (at least 0)",
    }
    try:
        for what, (method, frames) in cases.items():
            call = _stream(channel, method)(iter(frames), timeout=PROMPT_S)
            with pytest.raises(grpc.RpcError) as failed:
                list(call)
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, failed.value)
            assert len(failed.value.details()) > 20, (what, failed.value.details())  # a reason, not a bare status
            if what in out_of_range:
                assert out_of_range[what] in failed.value.details(), (what, failed.value.details())
    finally:
        channel.close()
    masters = torch.empty(CHUNK)
    client.result(client.read_master(0, masters))  # the session still serves, its state untouched
    assert torch.isfinite(masters).all()
    client.close()


def test_a_flood_of_malformed_requests_fills_no_log(server) -> None:
    """Fifty requests naming an update rule of 200 KiB: each ends with ``INVALID_ARGUMENT`` and a reason of bounded
    length, and the server's log gains a few short lines, not the clients' text."""
    before = server.log.stat().st_size
    shards = [{"numel": CHUNK, "rule": {"name": "x" * (200 << 10)}}]
    junk = header_frame(label="flood", shards=shards, chunk_elems=CHUNK, buffer_count=2, io_threads=1)
    for refused in _refusals(server, "Open", junk, 50):
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(refused.details()) < 1000
    assert server.log.stat().st_size - before < 4096


def test_uploads_are_checked_and_loaded_only_whole(server, tmp_path) -> None:
    """State files sent to resume a checkpoint of another backend (`Upload`, then `load_upload`): a file of another
    size, chunks out of order, another dtype, a shard not in the session or a CRC-32C that does not match are
    refused with a reason; loading before every shard arrived is refused; nothing live changes until a whole upload
    loads, and no upload is left on the server's disk."""
    client = _opened(server)
    session = client.servers[0].session
    before = torch.empty(CHUNK)
    client.result(client.read_master(0, before))
    layout = ChunkLayout(CHUNK, CHUNK, 2)
    record = torch.randn(layout.tensors_per_record, layout.padded_len(0)).abs()
    state = torch.zeros(layout.file_bytes // 4)
    start = layout.record_offset(0) // 4
    state[start : start + record.numel()] = record.flatten()
    crc = crc32c(state.numpy().tobytes())
    channel = _channel(server.address)

    def upload(frames: list[Frame]) -> grpc.StatusCode | None:
        try:
            _stream(channel, "Upload")(iter(frames), timeout=PROMPT_S).__next__()
        except grpc.RpcError as failed:
            assert len(failed.details()) > 20, failed.details()  # a reason, not a bare status
            return failed.code()
        return None

    header = header_frame(session=session, shard=0, crc32c=crc)
    frames = list(encode_tensor("state", state, chunk_bytes=4096))
    cases = {
        "one element short": ([header, *encode_tensor("state", state[:-1])], grpc.StatusCode.INVALID_ARGUMENT),
        "chunks out of order": ([header, *reversed(frames)], grpc.StatusCode.INVALID_ARGUMENT),
        "another dtype": (
            [header, *encode_tensor("state", state.to(torch.bfloat16))],
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        "the stream ends early": ([header, *frames[:-1]], grpc.StatusCode.INVALID_ARGUMENT),
        "a shard not in the session": (
            [header_frame(session=session, shard=1, crc32c=crc), *frames],
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        "another CRC-32C": (
            [header_frame(session=session, shard=0, crc32c=crc ^ 1), *frames],
            grpc.StatusCode.DATA_LOSS,
        ),
    }
    try:
        for what, (request, status) in cases.items():
            assert upload(request) == status, what
        load = header_frame(session=session, op="load_upload")
        assert (
            _status(_stream(channel, "Control")(iter([load]), timeout=PROMPT_S)) == grpc.StatusCode.FAILED_PRECONDITION
        )
        now = torch.empty(CHUNK)
        client.result(client.read_master(0, now))
        assert torch.equal(now, before)  # nothing live changed
        assert upload([header, *frames]) is None
        list(_stream(channel, "Control")(iter([load]), timeout=PROMPT_S))
    finally:
        channel.close()
    client.result(client.read_master(0, now))
    assert torch.equal(now, record[0, :CHUNK])
    assert not list((tmp_path / "root").rglob(".upload"))
    client.close()


@pytest.mark.parametrize("servers", ["x", ["x"], {"0": {}}])
def test_a_remote_manifest_whose_servers_are_not_entries_is_refused_by_name(server, tmp_path, servers) -> None:
    client = _opened(server)
    client.save(tmp_path / "saved")
    path = tmp_path / "saved" / "remote.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "servers": servers}))
    try:
        for attempt in (client.loads_as_saved, client.load):
            with pytest.raises(CheckpointError, match=rf"{path} is not a remote device-state manifest"):
                attempt(tmp_path / "saved")
    finally:
        client.close()


def test_a_saved_checkpoint_is_sent_only_for_its_digest_and_only_when_its_file_checks(server, tmp_path) -> None:
    """`ReadCheckpoint` sends a saved checkpoint's manifest and state files (to re-shard it on the trainer's host):
    only to a client that names its digest, only shards the manifest lists, and a file that does not match its
    manifest's CRC is refused before any byte of it is sent."""
    client = _opened(server)
    client.save(tmp_path / "saved")
    client.close()
    (entry,) = json.loads((tmp_path / "saved" / "remote.json").read_text())["servers"]
    saved = tmp_path / "root" / "checkpoints" / entry["checkpoint"] / entry["label"]
    request = {"checkpoint": entry["checkpoint"], "label": entry["label"], "digest": entry["digest"], "shard": 0}
    channel = _channel(server.address)

    def read(**header: object) -> list[Frame]:
        return list(_stream(channel, "ReadCheckpoint")(iter([header_frame(**{**request, **header})]), timeout=30))

    try:
        manifest = b"".join(frame.data for frame in read(part="manifest"))
        assert hashlib.sha256(manifest).hexdigest() == entry["digest"]
        assert manifest == (saved / "manifest.json").read_bytes()
        frames = read(part="state")
        assert b"".join(frame.data for frame in frames) == (saved / "shard00000.state").read_bytes()
        assert {(frame.tensor, frame.dtype) for frame in frames} == {("state", "float32")}
        cases = {
            "another part": ({"part": "everything"}, grpc.StatusCode.INVALID_ARGUMENT),
            "another digest": ({"part": "state", "digest": "0" * 64}, grpc.StatusCode.DATA_LOSS),
            "a shard the manifest lacks": ({"part": "state", "shard": 1}, grpc.StatusCode.INVALID_ARGUMENT),
            "a negative shard": ({"part": "state", "shard": -1}, grpc.StatusCode.INVALID_ARGUMENT),
            "a label that is a path": ({"part": "state", "label": "../x"}, grpc.StatusCode.INVALID_ARGUMENT),
        }
        for what, (header, status) in cases.items():
            with pytest.raises(grpc.RpcError) as failed:
                read(**header)
            assert failed.value.code() == status, (what, failed.value)
        with open(saved / "shard00000.state", "r+b") as f:  # one flipped bit on the server's disk
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 1]))
        call = _stream(channel, "ReadCheckpoint")(iter([header_frame(**request, part="state")]), timeout=30)
        received = []
        with pytest.raises(grpc.RpcError) as failed:
            for frame in call:
                received.append(frame)
        assert failed.value.code() == grpc.StatusCode.DATA_LOSS and "corrupt" in failed.value.details()
        assert not received, "nothing of a corrupt file is sent"
    finally:
        channel.close()


def test_a_calibration_call_is_bounded(tmp_path) -> None:
    process = ServerProcess(
        [tmp_path / "root"], write_token(tmp_path / "token", TOKEN), extra=["--max-echo", "8MiB"]
    ).start()
    channel = _channel(process.address)
    try:
        echo = _stream(channel, "Echo")
        frames = (frame for _ in range(4) for frame in encode_tensor("probe", torch.zeros(1 << 20)))  # 16 MiB
        assert _status(echo(frames, timeout=120)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        small = list(encode_tensor("probe", torch.zeros(1 << 10)))
        (reply,) = echo(iter(small), timeout=PROMPT_S)  # within the bound: counted, every field of every frame
        assert f'"bytes":{sum(frame.ByteSize() for frame in small)}' in reply.header
        # Frames of headers only (no `data`) count too: 8 MiB of them are refused.
        headers = (Frame(header=b"x" * (64 << 10)) for _ in range(200))  # 12.5 MiB
        assert _status(echo(headers, timeout=120)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        channel.close()
        process.stop()


def test_a_session_without_calls_expires_and_its_state_is_removed(tmp_path) -> None:
    process = ServerProcess(
        [tmp_path / "root"], write_token(tmp_path / "token", TOKEN), extra=["--session-lease-s", "1"]
    ).start()
    try:
        client = _opened(process)
        deadline = time.monotonic() + 30
        while list((tmp_path / "root" / "sessions").iterdir()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not list((tmp_path / "root" / "sessions").iterdir()), "the lease ran out: the session is gone"
        with pytest.raises(StorageError, match="No such session"):
            client.result(client.read_master(0, torch.empty(CHUNK)))
        client.close()
    finally:
        process.stop()


@pytest.mark.slow
def test_a_killed_servers_sessions_and_saves_are_gone_after_its_restart(tmp_path) -> None:
    token_file = write_token(tmp_path / "token", TOKEN)
    process = ServerProcess([tmp_path / "root"], token_file).start()
    client = _opened(process)
    client.save(tmp_path / "ckpt")
    killed_save = left_over(next((tmp_path / "root" / "checkpoints").iterdir()) / "rank000")
    killed_save.mkdir()
    (killed_save / "shard00000.state").write_bytes(b"half")
    empty = tmp_path / "root" / "checkpoints" / "c0123456789abcdef0123456789abcdef"  # killed before a file
    empty.mkdir()
    process.stop(signal.SIGKILL)
    assert list((tmp_path / "root" / "sessions").iterdir()), "a killed server leaves its sessions"
    restarted = ServerProcess([tmp_path / "root"], token_file).start()
    try:
        assert not list((tmp_path / "root" / "sessions").iterdir())
        assert not killed_save.exists() and not empty.exists()
        assert list((tmp_path / "root" / "checkpoints").rglob("manifest.json")), "the complete checkpoint stays"
    finally:
        restarted.stop()
        client._closed = True  # its server was killed: nothing to close


@pytest.mark.slow
def test_the_client_closes_its_sessions_on_every_server_when_one_fails(tmp_path) -> None:
    token_file = write_token(tmp_path / "token", TOKEN)
    servers = [ServerProcess([tmp_path / f"root{i}"], token_file).start() for i in range(2)]
    try:
        client = RemoteBackend(
            [s.address for s in servers], TOKEN, chunk_elems=CHUNK, buffer_count=2, io_threads=1, device_timeout_s=10.0
        )
        client.open([ShardSpec(index=i, numel=CHUNK, rule=Adam()) for i in range(2)])
        for i in range(2):
            client.initialize(i, torch.randn(CHUNK))
        client.wait()
        servers[0].stop(signal.SIGKILL)
        with pytest.raises(StorageError):
            client.result(client.read_master(0, torch.empty(CHUNK)))
        client.close()
        assert not list((tmp_path / "root1" / "sessions").iterdir()), "the surviving server freed the session"
    finally:
        for process in servers:
            process.stop()


@pytest.mark.slow
@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0", "10.1.2.3:50051", "storage1.example:50051"])
def test_a_server_on_a_public_address_without_tls_refuses_to_start(tmp_path, listen) -> None:
    """Checked before anything is bound or read: the message names the fixes."""
    from helpers.launch import python

    token_file = write_token(tmp_path / "token", TOKEN)
    command = ["-m", "lightning_smartinf", "serve", "--storage", tmp_path / "root", "--token-file", token_file]
    done = python(*command, "--listen", listen, check=False, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "without TLS" in done.stderr and "--tls-cert" in done.stderr and "--allow-plaintext" in done.stderr
    assert "serving" not in done.stdout


def _serve_main(tmp_path: Path, monkeypatch, *flags: str, storage: tuple[str, ...] = ()) -> int:
    """``smartinf serve`` in this process (its exit status); a server it gets as far as starting fails the test."""
    from lightning_smartinf.devices.remote import serve as serve_command
    from lightning_smartinf.devices.remote import server as server_module

    def bound(*args, **kwargs):
        raise AssertionError(f"smartinf serve {' '.join(flags)} started a server")

    monkeypatch.setattr(server_module, "serve", bound)
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)  # no handler on pytest's captured stream
    token_file = write_token(tmp_path / "token", TOKEN)
    roots = storage or (str(tmp_path / "root"),)
    return serve_command.main(["--storage", *roots, "--token-file", str(token_file), *flags])


@pytest.mark.parametrize(
    ("listen", "said"),
    [
        ("127.0.0.1:99999", "the port must be an int 0..65535 (0: any free port), not '99999'"),  # gRPC: mod 65536
        ("127.0.0.1:-1", "the port must be an int 0..65535 (0: any free port), not '-1'"),  # gRPC: 65535
        ("127.0.0.1:abc", "the port must be an int 0..65535 (0: any free port), not 'abc'"),
        ("127.0.0.1:", "the port must be an int 0..65535 (0: any free port), not ''"),  # gRPC: 443
        ("127.0.0.1", "has no port"),  # said to be no loopback address
        ("[::1]", "has no port"),
        (":50051", "names no host"),
        ("::1:50051", "an IPv6 host is written in brackets"),
    ],
)
def test_serve_refuses_a_listen_address_that_is_not_host_and_port_before_binding(
    tmp_path, monkeypatch, capsys, listen, said
) -> None:
    """gRPC would bind another port than the one given, or fail naming no cause: refused first, with an example."""
    from lightning_smartinf.devices.remote.policy import check_transport

    assert _serve_main(tmp_path, monkeypatch, "--listen", listen) == 2
    error = capsys.readouterr().err
    assert f"`--listen {listen}`" in error and said in error and ":50051`" in error, error
    assert not (tmp_path / "root").exists()
    with pytest.raises(ValueError, match=re.escape(said)):  # `serve()` checks it too, before binding
        check_transport(listen, None, False)


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "127.0.0.1:65535", "localhost:50051", "[::1]:50051", "[::1]:0"])
def test_a_loopback_address_with_a_port_is_taken_in_either_ip_version(listen) -> None:
    from lightning_smartinf.devices.remote.policy import check_transport, is_loopback

    check_transport(listen, None, False)
    assert is_loopback(listen)


@pytest.mark.parametrize("seconds", ["nan", "-5", "0", "inf"])
def test_serve_refuses_a_device_timeout_that_is_not_positive_and_finite(tmp_path, monkeypatch, capsys, seconds) -> None:
    """Refused at startup, not by every session a client opens."""
    from lightning_smartinf.devices.remote.server import DeviceServer

    assert _serve_main(tmp_path, monkeypatch, "--device-timeout-s", seconds) == 2
    error = capsys.readouterr().err
    assert f"`--device-timeout-s={float(seconds)!r}`" in error, error
    assert "a finite number of seconds > 0" in error and "`--device-timeout-s=300`" in error, error
    with pytest.raises(ValueError, match=r"must be a positive, finite number of seconds"):
        DeviceServer([tmp_path / "root"], TOKEN, device_timeout_s=float(seconds))
    assert not (tmp_path / "root").exists()


def test_serve_refuses_a_storage_folder_named_twice_before_creating_it(tmp_path, monkeypatch, capsys) -> None:
    """Not "in use by this process": the folder is one, named twice (compared resolved)."""
    from lightning_smartinf.devices.remote.server import DeviceServer

    root = tmp_path / "root"
    again = tmp_path / "other" / ".." / "root"
    assert _serve_main(tmp_path, monkeypatch, storage=(str(root), f"{root}/")) == 2
    error = capsys.readouterr().err
    assert f"`--storage` names {root} twice: each device needs a folder of its own" in error, error
    assert _serve_main(tmp_path, monkeypatch, storage=(str(root), str(again), str(tmp_path / "b"))) == 2
    assert f"`--storage` names {root} twice (as {str(root)!r}, {str(again)!r})" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"`storage_roots` names .* twice"):
        DeviceServer([root, again], TOKEN)
    assert not root.exists() and not (tmp_path / "b").exists()
    root.mkdir()
    (tmp_path / "link").symlink_to(root)
    with pytest.raises(ValueError, match=r"`storage_roots` names .* twice"):
        DeviceServer([root, tmp_path / "link"], TOKEN)


def test_a_trainer_refuses_to_send_its_token_in_clear_to_another_machine(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"not on this machine and no TLS is set.*remote_allow_plaintext=True"):
        RemoteBackend(["10.1.2.3:50051"], TOKEN, device_timeout_s=1.0)


def test_a_short_token_is_refused(tmp_path) -> None:
    from lightning_smartinf.devices.remote.tokens import read_token

    with pytest.raises(ValueError, match="at least 16 printable characters"):
        read_token(write_token(tmp_path / "token", "short"))
    assert read_token(write_token(tmp_path / "token2", TOKEN)) == TOKEN
    Path(tmp_path / "token2").chmod(0o640)
    with pytest.raises(ValueError, match="readable by other users"):
        read_token(tmp_path / "token2")


def test_a_full_disk_on_the_server_is_named_to_the_trainer_and_leaves_nothing(tmp_path, ext4_fs) -> None:
    """A server whose root is a real ext4 filled by another job: a session's state files and a checkpoint are each
    refused with one error that names the server's path, what and the bytes; nothing partial is left; once space is
    back, the same session saves and its state reads back."""
    fs = ext4_fs("16m")
    process = ServerProcess([fs / "root"], write_token(tmp_path / "token", TOKEN)).start()

    def fill(leave: int) -> None:
        with open(fs / "ballast", "ab") as f:
            f.write(b"\0" * max(0, shutil.disk_usage(fs).free - leave))

    specs = [ShardSpec(index=0, numel=8 * CHUNK, rule=Adam())]
    try:
        fill(16 << 10)
        client = _client(process)
        refused = (
            r"No space left on the filesystem of '.*/root/sessions/[0-9a-f]+' for the optimizer state placed there: "
            r"it needs [\d.]+ KiB and the filesystem has"
        )
        with pytest.raises(StorageError, match=refused):
            client.open(specs)
        client.close()
        assert not list((fs / "root" / "sessions").iterdir())
        (fs / "ballast").unlink()
        client = _client(process)
        client.open(specs)
        master = torch.randn(8 * CHUNK)
        client.initialize(0, master)
        client.wait()
        fill(16 << 10)
        refused = (
            r"No space left on the filesystem of '.*/root/checkpoints/.*' for the checkpoint's device state: it needs "
            r".* Nothing was written"
        )
        with pytest.raises(StorageError, match=refused):
            client.save(tmp_path / "refused")
        assert not [p for p in (fs / "root" / "checkpoints").rglob("*") if p.is_file()]
        (fs / "ballast").unlink()
        client.save(tmp_path / "saved")
        out = torch.empty(8 * CHUNK)
        client.read_master(0, out).result()
        assert torch.equal(out, master)
        client.close()
    finally:
        process.stop()


def _raw_save(server: ServerProcess, client: RemoteBackend) -> grpc.RpcError:
    """A save of ``client``'s session sent as a plain gRPC call, with the trainer's retry policy: its error."""
    channel = _channel(server.address)
    try:
        control = channel.unary_unary(
            f"/{SERVICE}/Control", request_serializer=Frame.SerializeToString, response_deserializer=Frame.FromString
        )
        with pytest.raises(grpc.RpcError) as refused:
            control(header_frame(session=client.servers[0].session, op="save"), timeout=PROMPT_S)
        return refused.value
    finally:
        channel.close()


def test_the_session_quota_counts_tentative_copies_and_checkpoints(tmp_path) -> None:
    """``--max-session-state`` is every byte a session makes on disk: both copies of its state with tentative
    updates, and the checkpoints it saves. Past it, ``Open`` and saves are refused before anything is written, with
    ``RESOURCE_EXHAUSTED`` that the client's retry policy is told not to retry (negative server pushback)."""
    state = ChunkLayout(CHUNK, CHUNK, len(SPECS[0].rule.state_names)).file_bytes
    quota = 3 * state + state // 2  # two copies and one checkpoint, not two
    server = _server_with(tmp_path, "--max-session-state", str(quota))
    try:
        with pytest.raises(StorageError, match=r"RESOURCE_EXHAUSTED.* in two copies \(tentative updates\); this "
                           r"server gives a session at most .* of disk, its checkpoints included"):  # fmt: skip
            _client(server, tentative_slots=True).open(
                [ShardSpec(index=0, numel=2 * CHUNK, rule=SPECS[0].rule)]  # fits once, not twice
            )
        client = _opened(server, tentative_slots=True)
        client.save(tmp_path / "first")
        with pytest.raises(StorageError, match=r"RESOURCE_EXHAUSTED.* with its state files and the 1 checkpoint\(s\) "
                           r"it saved .* Nothing was written"):  # fmt: skip
            client.save(tmp_path / "second")
        refused = _raw_save(server, client)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("grpc-retry-pushback-ms", "-1") in tuple(refused.trailing_metadata() or ())
        assert len(list((tmp_path / "root" / "checkpoints").iterdir())) == 1
        client.close()
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("prune", [False, True], ids=["refused", "pruned"])
def test_a_labels_checkpoints_are_capped_and_pruned_only_when_asked(tmp_path, prune) -> None:
    """``--max-label-checkpoints 2``: the third save of a label is refused before anything is written, or, with
    ``--prune-checkpoints``, takes the place of the oldest; the newest two stand and load."""
    server = _server_with(tmp_path, "--max-label-checkpoints", "2", *(["--prune-checkpoints"] if prune else []))
    try:
        client = _opened(server)
        for name in ("a", "b"):
            client.save(tmp_path / name)
        if prune:
            client.save(tmp_path / "c")
        else:
            with pytest.raises(StorageError, match=r"RESOURCE_EXHAUSTED.*Label 'rank000-[0-9a-f]{16}' \(this run's "
                               r"rank.*\) holds 2 checkpoint\(s\).*`smartinf serve --max-label-checkpoints 2`.*"
                               r"save_last=True.*--prune-checkpoints"):  # fmt: skip
                client.save(tmp_path / "c")
        standing = ("b", "c") if prune else ("a", "b")
        saved = {json.loads((tmp_path / n / "remote.json").read_text())["servers"][0]["checkpoint"] for n in standing}
        assert {p.name for p in (tmp_path / "root" / "checkpoints").iterdir()} == saved
        client.close()
        for name in standing:
            again = _client(server)
            again.open(SPECS)
            again.load(tmp_path / name)
            again.close()
    finally:
        server.stop()


def _checkpoint_id(directory: Path) -> str:
    return json.loads((directory / "remote.json").read_text())["servers"][0]["checkpoint"]


@pytest.mark.parametrize("prune", [False, True], ids=["refused", "pruned"])
def test_a_labels_caps_and_pruning_count_only_its_own_runs_checkpoints(tmp_path, prune) -> None:
    """Two unrelated runs (both rank 0, one token, no client certificates) share a server capped at 2 checkpoints a
    label: neither run's saves are refused for, or remove, the other's checkpoints. A run resumed from a checkpoint
    continues its lineage: its saves prune that run's oldest, still none of the other's."""
    server = _server_with(tmp_path, "--max-label-checkpoints", "2", *(["--prune-checkpoints"] if prune else []))
    try:
        first = _opened(server)
        first.save(tmp_path / "a1")
        first.close()
        other = _opened(server)
        for name in ("b1", "b2", *(["b3"] if prune else [])):
            other.save(tmp_path / name)
        other.close()
        resumed = _client(server)
        resumed.open(SPECS)
        resumed.load(tmp_path / "a1")  # the first run's checkpoint is still there
        resumed.save(tmp_path / "a2")
        if prune:
            resumed.save(tmp_path / "a3")  # the third of the first run's lineage removes its oldest, a1
            standing = ("a2", "a3", "b2", "b3")
        else:
            with pytest.raises(StorageError, match=r"RESOURCE_EXHAUSTED.* holds 2 checkpoint\(s\)"):
                resumed.save(tmp_path / "a3")  # a1 and a2 count against the resumed run, b1 and b2 do not
            standing = ("a1", "a2", "b1", "b2")
        resumed.close()
        assert {p.name for p in (tmp_path / "root" / "checkpoints").iterdir()} == {
            _checkpoint_id(tmp_path / n) for n in standing
        }
    finally:
        server.stop()


def _rss(pid: int) -> int:
    """Resident bytes of process ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.slow
def test_masters_a_client_never_reads_stay_within_the_servers_byte_budget(tmp_path) -> None:
    """Six ``ReadMaster`` calls on a 32 MiB shard whose replies are never read, under ``--update-bytes-in-flight
    64MiB``: at most two shards' masters are held at once (the others wait for room), so the server grows by the
    budget and a constant, not by six shards; once the calls end the budget serves a well-behaved read."""
    numel = 8 << 20  # 32 MiB of fp32 masters
    server = _server_with(tmp_path, "--update-bytes-in-flight", "64MiB", "--call-timeout-s", "20")
    channel = _channel(server.address)
    try:
        client = _client(server, chunk_elems=1 << 20)
        client.open([ShardSpec(index=0, numel=numel, rule=Adam())])
        client.initialize(0, torch.zeros(numel))
        client.wait()
        assert server.process is not None
        before = _rss(server.process.pid)
        calls = [
            _stream(channel, "ReadMaster")(iter([header_frame(session=client.servers[0].session, shard=0)]), timeout=60)
            for _ in range(6)
        ]
        time.sleep(3)  # the server serves what it has room for; nothing is read
        grown = _rss(server.process.pid) - before
        assert grown < (64 + 48) << 20, f"the server grew by {grown >> 20} MiB under six unread 32 MiB reads"
        for call in calls:
            call.cancel()
        out = torch.empty(numel)
        client.read_master(0, out).result()
        assert torch.equal(out, torch.zeros(numel))
        client.close()
    finally:
        channel.close()
        server.stop()
