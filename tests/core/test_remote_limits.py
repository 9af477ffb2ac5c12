"""What one client may take of a remote device server: sessions, updates in flight, and what a stop leaves behind.

Servers run in this process (the real ``serve``) where a test only talks to one, and as ``smartinf serve`` processes
where the test signals the process.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from helpers.launch import worker_env
from helpers.remote_servers import ServerProcess, write_token

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.io.storage import StorageError
from lightning_smartinf.core.rules import Adam, StepParams
from lightning_smartinf.devices.remote.client import RemoteBackend, channel_credentials
from lightning_smartinf.devices.remote.server import DeviceServer, ServerLimits, serve, session_tag
from lightning_smartinf.devices.remote.wire import MAX_UPDATES_IN_FLIGHT, SERVICE, Frame, header_frame, rule_to_wire

TOKEN = "a-token-of-the-limits-tests"
CHUNK = 4096
SPECS = [ShardSpec(index=0, numel=CHUNK, rule=Adam(decoupled_weight_decay=True))]
#: The longest call gRPC counts: 2**31 - 1 milliseconds, in whole seconds.
LONGEST_CALL_S = 2147483


def _client(port: int, **kwargs) -> RemoteBackend:
    kwargs = {"chunk_elems": CHUNK, "buffer_count": 2, "device_timeout_s": 30.0, **kwargs}
    return RemoteBackend([f"127.0.0.1:{port}"], TOKEN, **kwargs)


def _opened(port: int) -> RemoteBackend:
    client = _client(port)
    client.open(SPECS)
    client.initialize(0, torch.randn(CHUNK))
    client.wait()
    return client


def test_a_limit_that_is_on_by_default_cannot_be_turned_off() -> None:
    with pytest.raises(ValueError, match="`max_sessions=None`: a server limit must be a positive integer."):
        ServerLimits(max_sessions=None)
    ServerLimits(max_peer_calls=None)  # off by default, so it may be


@pytest.mark.parametrize("seconds", [math.inf, LONGEST_CALL_S + 1, 1e10])
def test_a_call_limit_longer_than_grpc_counts_is_refused(seconds) -> None:
    """gRPC takes the call limit in milliseconds in 32 bits: past that it raised OverflowError from its internals."""
    with pytest.raises(ValueError, match=r"milliseconds in 32 bits, so a call may last at most 2147483 s"):
        ServerLimits(call_timeout_s=seconds)


def test_serve_refuses_a_call_limit_longer_than_grpc_counts(tmp_path, monkeypatch, capsys) -> None:
    from lightning_smartinf.devices.remote.serve import main

    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)  # no handler on pytest's captured stream
    token_file = write_token(tmp_path / "token", TOKEN)
    argv = ["--storage", str(tmp_path / "root"), "--token-file", str(token_file), "--call-timeout-s", "inf"]
    assert main(argv) == 2
    assert "`call_timeout_s=inf` (`smartinf serve --call-timeout-s`) is too long" in capsys.readouterr().err
    assert not (tmp_path / "root").exists()


def test_the_longest_call_limit_serves(tmp_path) -> None:
    server, servicer, port = serve([tmp_path / "root"], TOKEN, limits=ServerLimits(call_timeout_s=LONGEST_CALL_S))
    server.stop(None).wait()
    servicer.close()


@pytest.mark.slow
def test_a_server_holds_at_most_its_sessions_and_takes_more_once_one_closes(tmp_path) -> None:
    server, servicer, port = serve([tmp_path / "root"], TOKEN, limits=ServerLimits(max_sessions=2))
    try:
        first, second = _opened(port), _opened(port)
        third = _client(port)
        with pytest.raises(StorageError, match=r"at most 2 session\(s\) at once \(`smartinf serve --max-sessions 2`\)"):
            third.open(SPECS)
        first.close()
        _opened(port).close()  # the freed place is taken
        second.close()
        third.close()
    finally:
        server.stop(None).wait()
        servicer.close()


#: A trainer's rank that opens its session on the server at ``argv[1]`` (token ``argv[2]``), says so, and waits to be
#: killed.
KILLED_TRAINER = f"""
import sys, time
from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.rules import Adam
from lightning_smartinf.devices.remote.client import RemoteBackend
client = RemoteBackend([sys.argv[1]], sys.argv[2], chunk_elems={CHUNK}, buffer_count=2)
client.open([ShardSpec(index=0, numel={CHUNK}, rule=Adam())])
print("open", flush=True)
time.sleep(600)
"""


def test_a_killed_trainers_session_refuses_the_next_naming_the_flag_its_idle_time_and_the_lease(tmp_path) -> None:
    """A trainer killed with SIGKILL leaves its session open. Under ``--max-sessions 1`` the next ``Open`` is refused
    with a message naming the flag, how long the open session has gone without a call, when its lease ends, and what
    to do; the server logs the refusal."""
    token_file = write_token(tmp_path / "token", TOKEN)
    process = ServerProcess([tmp_path / "root"], token_file, extra=["--max-sessions", "1"]).start()
    trainer = subprocess.Popen(
        [sys.executable, "-c", KILLED_TRAINER, process.address, TOKEN],
        env=worker_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None and trainer.stdout.readline() == "open\n"
        trainer.kill()
        trainer.wait()
        channel = grpc.secure_channel(process.address, channel_credentials(process.address, TOKEN, None, False))
        open_call = channel.stream_unary(
            f"/{SERVICE}/Open", request_serializer=Frame.SerializeToString, response_deserializer=Frame.FromString
        )
        shards = [{"numel": CHUNK, "rule": rule_to_wire(Adam())}]
        header = header_frame(label="rank000", shards=shards, chunk_elems=CHUNK, buffer_count=2, io_threads=1)
        with pytest.raises(grpc.RpcError) as refused:
            open_call(iter([header]), timeout=30)  # one call: gRPC's retry policy is the client's, not the stub's
        channel.close()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        expected = (
            r"at most 1 session\(s\) at once \(`smartinf serve --max-sessions 1`\), and all are taken: 1 without a "
            r"call for \d+ s\. The longest idle one's lease ends in \d+ s \(`--session-lease-s 3600`\).*killed.*"
            r"restart the server.*a higher `--max-sessions` or a shorter `--session-lease-s`"
        )
        assert re.search(expected, refused.value.details()), refused.value.details()
        assert re.search(r"WARNING refused 1 session\(s\) \(the last: This server holds at most 1", process.log_text())
    finally:
        trainer.kill()
        process.stop()


def _update_stub(port: int) -> tuple[grpc.Channel, object]:
    channel = grpc.secure_channel(f"127.0.0.1:{port}", channel_credentials(f"127.0.0.1:{port}", TOKEN, None, False))
    update = channel.stream_stream(
        f"/{SERVICE}/Update", request_serializer=Frame.SerializeToString, response_deserializer=Frame.FromString
    )
    return channel, update


def test_a_client_sending_slowly_holds_no_update_slot_and_the_server_ends_its_calls(tmp_path) -> None:
    """Updates whose gradient never comes hold only their bytes of the server's budget, not the session's update
    slots: more of them than the slots leave a whole update served. The server ends them when its own call time is
    up, whatever deadline the client set."""
    limits = ServerLimits(call_timeout_s=3.0)
    server, servicer, port = serve([tmp_path / "root"], TOKEN, limits=limits)
    client = _opened(port)
    session = client.servers[0].session
    channel, update = _update_stub(port)
    hp = {"step": 1, "lr": 1e-3}
    release = threading.Event()

    def header() -> Frame:
        return header_frame(session=session, shard=0, hp=hp, link_dtype="float32", out_dtype="float32")

    def stalled():
        yield header()
        release.wait(60)  # the gradient never comes while the test looks

    try:
        held = [update(stalled(), timeout=60) for _ in range(MAX_UPDATES_IN_FLIGHT + 1)]
        time.sleep(0.5)  # each sent its header and waits for its gradient on the server
        out = torch.empty(CHUNK)
        client.result(client.submit(0, torch.zeros(CHUNK), StepParams(step=1, lr=1e-3), out))
        for call in held:
            with pytest.raises(grpc.RpcError) as ended:
                list(call)  # ended by the server after 3 s, not by the client's 60
            assert ended.value.code() == grpc.StatusCode.CANCELLED, ended.value
    finally:
        release.set()
        channel.close()
        client.close()
        server.stop(None).wait()
        servicer.close()


def test_an_update_larger_than_the_servers_budget_is_refused_and_the_server_keeps_serving(tmp_path) -> None:
    """The gradients and parameters of every update in flight share one budget; one that can never fit is refused
    at once, naming the flag, and the server goes on serving."""
    per_update = CHUNK * (4 + 4)  # fp32 gradient in, fp32 parameters out
    limits = ServerLimits(update_bytes_in_flight=per_update - 1)
    server, servicer, port = serve([tmp_path / "root"], TOKEN, limits=limits)
    client = _opened(port)
    try:
        out = torch.empty(CHUNK)
        with pytest.raises(StorageError, match="--update-bytes-in-flight"):
            client.result(client.submit(0, torch.zeros(CHUNK), StepParams(step=1, lr=1e-3), out))
        client.close()
        other = _opened(port)  # the server goes on serving
        other.result(other.read_master(0, out))
        other.close()
    finally:
        server.stop(None).wait()
        servicer.close()


@pytest.mark.slow
def test_sigterm_removes_the_state_of_open_sessions_and_keeps_checkpoints(tmp_path) -> None:
    """A server stopped as a service manager stops it (SIGTERM) with a session still open: the session's state files
    are gone, its checkpoint stays, and the server gives its root up for the next one."""
    token_file = write_token(tmp_path / "token", TOKEN)
    process = ServerProcess([tmp_path / "root"], token_file).start()
    client = _opened(process.port)
    client.save(tmp_path / "ckpt")
    sessions = tmp_path / "root" / "sessions"
    assert [p.name for p in sessions.iterdir()] == [session_tag(client.servers[0].session)]  # no id on the disk
    mark = process.log_mark()
    process.stop(signal.SIGTERM)
    stopping = process.log_text(mark)
    assert re.search(r"session \w+ \(rank000-[0-9a-f]{16}\) closed\n.*INFO stopped device server \w+ on SIGTERM: "
                     r"sessions closed, checkpoints kept\n$", stopping), stopping  # fmt: skip
    assert not list(sessions.iterdir()), list(sessions.iterdir())
    assert list((tmp_path / "root" / "checkpoints").rglob("*.state")), "the checkpoint stays"
    ServerProcess([tmp_path / "root"], token_file).start().stop()  # the root is free again
    client._closed = True  # its server is gone: nothing to close


def test_a_label_of_the_client_is_one_path_component(tmp_path) -> None:
    """A label (it names the rank's directory in a checkpoint) that is not one plain path component (a trailing
    newline, a dot first) is refused before anything is made on the disk."""
    server, servicer, port = serve([tmp_path / "root"], TOKEN)
    try:
        for label in ("rank000\n", ".hidden", "../up"):
            client = _client(port, label=label)
            with pytest.raises(StorageError, match="not a valid name"):
                client.open(SPECS)
            client.close()
        assert not list(Path(tmp_path / "root").glob("sessions/*"))
    finally:
        server.stop(None).wait()
        servicer.close()


@pytest.mark.parametrize(
    "reply",
    [{"storage_read_bytes": 1}, {"storage_read_bytes": "many", "storage_write_bytes": 2}],
    ids=["missing", "not_a_count"],
)
def test_a_malformed_traffic_reply_keeps_the_last_counters(tmp_path, monkeypatch, reply) -> None:
    """A server that answers the traffic counters malformed (a field missing, or not a count) is a server that
    cannot be trusted for them: the trainer keeps the figures it had, and neither raises ``KeyError`` nor takes
    the server's word."""
    original = DeviceServer.control

    def lying(self, requests, context):  # noqa: ANN001, ANN202 - a gRPC handler
        first = next(requests)
        if json.loads(first.header).get("op") == "traffic" and lies.is_set():
            return header_frame(**reply)
        return original(self, itertools.chain([first], requests), context)

    lies = threading.Event()
    monkeypatch.setattr(DeviceServer, "control", lying)
    server, servicer, port = serve([tmp_path / "root"], TOKEN)
    try:
        client = _opened(port)
        out = torch.empty(CHUNK)
        client.result(client.submit(0, torch.ones(CHUNK), StepParams(step=1, lr=1e-3), out))
        client.wait()
        honest = client.traffic_snapshot()
        assert honest.storage_write_bytes > 0
        lies.set()
        client.result(client.submit(0, torch.ones(CHUNK), StepParams(step=2, lr=1e-3), out))
        client.wait()
        after = client.traffic_snapshot()
        assert (after.storage_read_bytes, after.storage_write_bytes) == (
            honest.storage_read_bytes,
            honest.storage_write_bytes,
        )
        assert after.link_write_bytes > honest.link_write_bytes  # what this rank counts itself goes on
        client.close()
    finally:
        server.stop(None).wait()
        servicer.close()
