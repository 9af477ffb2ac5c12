"""What one client may take of a remote device server: sessions, updates in flight, and what a stop leaves behind.

Servers run in this process (the real ``serve``) where a test only talks to one, and as ``smartinf serve`` processes
where the test signals the process.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from remote_servers import ServerProcess, write_token

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.io.storage import StorageError
from lightning_smartinf.core.rules import Adam, StepParams
from lightning_smartinf.devices.remote.client import RemoteBackend
from lightning_smartinf.devices.remote.server import MAX_UPDATES_IN_FLIGHT, serve
from lightning_smartinf.devices.remote.wire import SERVICE, Frame, encode_tensor, header_frame

TOKEN = "a-token-of-the-limits-tests"
CHUNK = 4096
SPECS = [ShardSpec(index=0, numel=CHUNK, rule=Adam(decoupled_weight_decay=True))]


def _client(port: int, **kwargs) -> RemoteBackend:
    kwargs = {"chunk_elems": CHUNK, "buffer_count": 2, "device_timeout_s": 30.0, **kwargs}
    return RemoteBackend([f"127.0.0.1:{port}"], TOKEN, **kwargs)


def _opened(port: int) -> RemoteBackend:
    client = _client(port)
    client.open(SPECS)
    client.initialize(0, torch.randn(CHUNK))
    client.wait()
    return client


def test_a_server_holds_at_most_its_sessions_and_takes_more_once_one_closes(tmp_path) -> None:
    server, servicer, port = serve([tmp_path / "root"], TOKEN, max_sessions=2)
    try:
        first, second = _opened(port), _opened(port)
        third = _client(port)
        with pytest.raises(StorageError, match="2 sessions are open already"):
            third.open(SPECS)
        first.close()
        _opened(port).close()  # the freed place is taken
        second.close()
        third.close()
    finally:
        server.stop(None).wait()
        servicer.close()


def test_a_session_runs_at_most_its_updates_in_flight(tmp_path) -> None:
    """Updates of one session that hold their slots (their gradient still coming) leave one more waiting, which
    the server refuses once its device timeout passes; the session serves again once they end."""
    server, servicer, port = serve([tmp_path / "root"], TOKEN, device_timeout_s=2.0)
    client = _opened(port)
    session = client.servers[0].session
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    update = channel.stream_stream(
        f"/{SERVICE}/Update", request_serializer=Frame.SerializeToString, response_deserializer=Frame.FromString
    )
    metadata = [("authorization", f"Bearer {TOKEN}")]
    hp = {"step": 1, "lr": 1e-3}
    release = threading.Event()

    def header() -> Frame:
        return header_frame(session=session, shard=0, hp=hp, link_dtype="float32", out_dtype="float32")

    def stalled():
        yield header()
        release.wait(30)  # the gradient never comes while the test looks

    def whole():
        yield header()
        yield from encode_tensor("grad", torch.zeros(CHUNK))

    try:
        held = [update(stalled(), metadata=metadata, timeout=30) for _ in range(MAX_UPDATES_IN_FLIGHT)]
        time.sleep(0.5)  # each took its slot on the server (the header is all it sent)
        with pytest.raises(grpc.RpcError) as refused:
            list(update(whole(), metadata=metadata, timeout=30))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Too many updates in flight" in refused.value.details()
        release.set()
        for call in held:
            with pytest.raises(grpc.RpcError):
                list(call)  # each ended when its stream did, without a gradient
        out = torch.empty(CHUNK)
        client.result(client.submit(0, torch.zeros(CHUNK), StepParams(step=1, lr=1e-3), out))
    finally:
        release.set()
        channel.close()
        client.close()
        server.stop(None).wait()
        servicer.close()


def test_sigterm_removes_the_state_of_open_sessions_and_keeps_checkpoints(tmp_path) -> None:
    """A server stopped as a service manager stops it (SIGTERM) with a session still open: the session's state files
    are gone, its checkpoint stays, and the server gives its root up for the next one."""
    token_file = write_token(tmp_path / "token", TOKEN)
    process = ServerProcess([tmp_path / "root"], token_file).start()
    client = _opened(process.port)
    client.save(tmp_path / "ckpt")
    sessions = tmp_path / "root" / "sessions"
    assert [p.name for p in sessions.iterdir()] == [client.servers[0].session]
    process.stop(signal.SIGTERM)
    assert not list(sessions.iterdir()), list(sessions.iterdir())
    assert list((tmp_path / "root" / "checkpoints").rglob("*.state")), "the checkpoint stays"
    ServerProcess([tmp_path / "root"], token_file).start().stop()  # the root is free again
    client._closed = True  # its server is gone: nothing to close


def test_a_session_name_of_the_client_is_one_path_component(tmp_path) -> None:
    """A name that is not one plain path component (a trailing newline, a dot first) is refused before anything is
    made on the disk."""
    server, servicer, port = serve([tmp_path / "root"], TOKEN)
    try:
        for name in ("rank000\n", ".hidden", "../up"):
            client = _client(port)
            client.servers[0].session = name
            with pytest.raises(StorageError, match="not a valid name"):
                client.open(SPECS)
            client.close()
        assert not list(Path(tmp_path / "root").glob("sessions/*"))
    finally:
        server.stop(None).wait()
        servicer.close()
