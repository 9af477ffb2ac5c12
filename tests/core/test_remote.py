"""Remote device servers: two ``smartinf serve`` processes on loopback against the in-process ``cpu`` backend.

The servers run the ``cpu`` backend's devices, so every comparison is bitwise: the same update code runs on the
same values, only further away.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import pytest
import torch
from helpers.remote_servers import ServerProcess, running, server_pool, write_token
from torch.testing import assert_close

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.compression import compress_topk
from lightning_smartinf.core.format.state_files import CheckpointError
from lightning_smartinf.core.io.storage import StorageError
from lightning_smartinf.core.rules import SGD, Adagrad, Adam, StepParams
from lightning_smartinf.devices.cpu import CpuBackend
from lightning_smartinf.devices.remote import client
from lightning_smartinf.devices.remote.client import RemoteBackend, checkpoint_masters
from lightning_smartinf.devices.remote.tokens import read_token
from lightning_smartinf.devices.remote.wire import SERVICE, Frame, header_frame

CHUNK = 4096
SIZES = [3 * CHUNK + 5, CHUNK, 2 * CHUNK - 1, 777]
RULES = [Adam(decoupled_weight_decay=True), SGD(with_momentum=True), Adagrad(initial_accumulator_value=0.1), Adam()]


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    return write_token(tmp_path_factory.mktemp("token") / "token")


@pytest.fixture(scope="module")
def pool(tmp_path_factory, token_file):
    """Two servers for the module: one with one storage root, one with two (two devices)."""
    yield from server_pool(tmp_path_factory.mktemp("servers"), token_file, [["s0"], ["s1a", "s1b"]])


@pytest.fixture
def servers(pool):
    """The module's servers, each running (a test before may have killed one)."""
    return running(pool)


def _specs() -> list[ShardSpec]:
    return [ShardSpec(index=i, numel=n, rule=r) for i, (n, r) in enumerate(zip(SIZES, RULES))]


def _remote(servers, token_file, **kwargs) -> RemoteBackend:
    kwargs = {"chunk_elems": CHUNK, "buffer_count": 4, "device_timeout_s": 60.0, **kwargs}
    return RemoteBackend([s.address for s in servers], read_token(token_file), **kwargs)


def _initialize(backends, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    masters = [torch.randn(n, generator=generator) for n in SIZES]
    for backend in backends:
        backend.open(_specs())
        for i, master in enumerate(masters):
            backend.initialize(i, master)
        backend.wait()


def _step(backend, grads, step: int, *, ratio: float | None = None, link=torch.bfloat16, tentative=False):
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    handles = []
    for i, grad in enumerate(grads):
        sent = grad if ratio is None else compress_topk(grad, ratio, value_dtype=link)
        hp = StepParams(step=step, lr=1e-2, weight_decay=0.01, momentum=0.9, betas=(0.9, 0.95))
        handles.append(backend.submit(i, sent, hp, outs[i], link_dtype=link, tentative=tentative))
    for handle in handles:
        backend.result(handle)
    return outs


def _masters(backend) -> list[torch.Tensor]:
    out = []
    for i, n in enumerate(SIZES):
        master = torch.empty(n)
        backend.result(backend.read_master(i, master))
        out.append(master)
    return out


def _grads(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=generator) for n in SIZES]


def test_updates_are_bitwise_those_of_the_cpu_backend(tmp_path, servers, token_file) -> None:
    remote = _remote(servers, token_file)
    local = CpuBackend([tmp_path / "local"], chunk_elems=CHUNK, buffer_count=4)
    _initialize([remote, local])
    assert remote.assignment == (0, 1, 0, 1)
    for step, ratio in enumerate([None, None, 0.05, 0.01, None], start=1):
        grads = _grads(step)
        ours, reference = _step(remote, grads, step, ratio=ratio), _step(local, grads, step, ratio=ratio)
        for a, b in zip(ours, reference):
            assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(_masters(remote), _masters(local)):
        assert_close(a, b, rtol=0, atol=0)
    # What crossed the network, and what the servers' devices moved inside, are what the local backend counts.
    remote.wait()
    local.wait()
    assert remote.traffic_snapshot() == local.traffic_snapshot()
    remote.close()
    local.close()
    # Closing a session removes its state; nothing else is left on the servers but their identity.
    for server in servers:
        assert not [entry for root in server.storage for entry in (root / "sessions").iterdir()]


def test_tentative_updates_commit_and_roll_back(servers, token_file) -> None:
    remote = _remote(servers, token_file, tentative_slots=True)
    _initialize([remote])
    before = _masters(remote)
    _step(remote, _grads(1), 1, tentative=True)
    remote.rollback(range(len(SIZES)))
    for a, b in zip(_masters(remote), before):
        assert torch.equal(a, b)
    outs = _step(remote, _grads(1), 1, tentative=True)
    remote.commit(range(len(SIZES)))
    for out, master in zip(outs, _masters(remote)):
        assert torch.equal(out, master.to(torch.bfloat16))
    assert not any(torch.equal(a, b) for a, b in zip(_masters(remote), before))
    remote.close()


def test_wrong_token_is_refused_and_logged(servers, token_file) -> None:
    mark = servers[0].log_mark()
    with pytest.raises(StorageError, match=r"refused the token.*remote_token_file"):
        RemoteBackend([servers[0].address], "not-the-token", device_timeout_s=10.0)
    time.sleep(0.2)
    logged = servers[0].log_text(since=mark)
    assert "without the right token" in logged and "Device/Hello" in logged


def test_a_failing_server_address_closes_the_connections_made_before_it(servers, token_file, monkeypatch) -> None:
    closed = []
    close = client._Server.close
    monkeypatch.setattr(client._Server, "close", lambda server: (closed.append(server.address), close(server))[-1])
    with pytest.raises(ValueError, match="not on this machine"):  # refused as its connection is made
        RemoteBackend([servers[0].address, "192.0.2.1:50051"], read_token(token_file), device_timeout_s=10.0)
    assert closed == [servers[0].address]


def test_malformed_and_oversized_frames_are_dropped_and_the_server_keeps_serving(servers, token_file) -> None:
    remote = _remote(servers, token_file)
    _initialize([remote])
    metadata = (("authorization", f"Bearer {read_token(token_file)}"),)
    with grpc.insecure_channel(servers[0].address) as channel:
        control = channel.unary_unary(
            f"/{SERVICE}/Control", request_serializer=Frame.SerializeToString, response_deserializer=Frame.FromString
        )
        with pytest.raises(grpc.RpcError) as error:
            control(Frame(header="{not json"), metadata=metadata, timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not JSON" in error.value.details()
        update = channel.stream_stream(
            f"/{SERVICE}/Update", request_serializer=Frame.SerializeToString, response_deserializer=Frame.FromString
        )
        session = servers[0].address  # any name: the server must not find it, nor leave its root for it
        bad = header_frame(session="../../etc", shard=0, hp={}, link_dtype="bfloat16", out_dtype="bfloat16")
        with pytest.raises(grpc.RpcError) as error:
            list(update(iter([bad]), metadata=metadata, timeout=10))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND, session
        with pytest.raises(grpc.RpcError) as error:
            control(Frame(header="{}", data=b"x" * (16 << 20)), metadata=metadata, timeout=10)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The session is intact and serves the next step.
    grads = _grads(1)
    local = CpuBackend([servers[0].storage[0].parent / "local"], chunk_elems=CHUNK, buffer_count=4)
    _initialize([local])
    for a, b in zip(_step(remote, grads, 1), _step(local, grads, 1)):
        assert torch.equal(a, b)
    remote.close()
    local.close()


def test_a_server_killed_mid_step_fails_the_step_naming_it(servers, token_file) -> None:
    remote = _remote(servers, token_file)
    _initialize([remote])
    servers[1].kill()
    with pytest.raises(StorageError, match=rf"server {servers[1].address}.* unreachable"):
        _step(remote, _grads(1), 1)
    assert remote.failure is not None
    with pytest.raises(StorageError, match="failed earlier"):
        _step(remote, _grads(2), 2)
    remote.close()


@pytest.mark.parametrize(
    "operation",
    [lambda backend: backend.check_storage(), lambda backend: backend.prefetch([0, 1])],
    ids=["check_storage", "prefetch"],
)
def test_a_server_killed_between_steps_fails_the_next_operation_and_close_raises_nothing_over_it(
    servers, token_file, operation
) -> None:
    """The step's own error is the one the trainer sees: ``close`` (a Trainer's teardown, while that error propagates)
    releases what it can and raises no second error of its own."""
    remote = _remote(servers, token_file)
    _initialize([remote])
    servers[1].kill()
    with pytest.raises(StorageError, match=rf"server {servers[1].address}.* unreachable") as failed:
        operation(remote)
    remote.close()  # raises nothing
    assert remote.failure is failed.value


def test_a_stalled_server_raises_after_the_timeout(servers, token_file) -> None:
    remote = _remote(servers, token_file, device_timeout_s=3.0)
    _initialize([remote])
    servers[0].process.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(StorageError, match=rf"{servers[0].address}.*within device_timeout_s=3.0"):
            _step(remote, _grads(1), 1)
        assert time.monotonic() - started < 30
    finally:
        servers[0].process.send_signal(signal.SIGCONT)
    remote.close()


def test_resume_after_a_server_restart_is_bit_identical(tmp_path, servers, token_file) -> None:
    # The run without interruption.
    straight = _remote(servers, token_file)
    _initialize([straight])
    for step in (1, 2):
        _step(straight, _grads(step), step)
    expected = [_step(straight, _grads(3), 3), _masters(straight)]
    straight.close()
    # The run that saves after step 2, loses its servers and resumes.
    first = _remote(servers, token_file)
    _initialize([first])
    for step in (1, 2):
        _step(first, _grads(step), step)
    first.save(tmp_path / "ckpt")
    for server in servers:
        server.kill()
    for server in servers:
        server.start()  # same storage, new port
    resumed = _remote(servers, token_file)
    resumed.open(_specs())
    resumed.load(tmp_path / "ckpt")
    outs = _step(resumed, _grads(3), 3)
    for a, b in zip(outs, expected[0]):
        assert torch.equal(a, b)
    for a, b in zip(_masters(resumed), expected[1]):
        assert torch.equal(a, b)
    resumed.close()


def test_a_server_restarted_over_another_storage_root_is_refused(tmp_path, servers, token_file) -> None:
    remote = _remote(servers, token_file)
    _initialize([remote])
    remote.save(tmp_path / "ckpt")
    remote.close()
    servers[1].kill()
    storage, servers[1].storage = servers[1].storage, [tmp_path / "elsewhere"]
    servers[1].start()
    try:
        resumed = _remote(servers, token_file)
        resumed.open(_specs())
        with pytest.raises(CheckpointError, match=rf"server at {servers[1].address} is .* restarted with another"):
            resumed.load(tmp_path / "ckpt")
        resumed.close()
    finally:  # the next test gets it back on its own roots (`running`)
        servers[1].kill()
        servers[1].storage = storage


# ------------------------------------------------------------------------------------------------------- TLS


@pytest.fixture
def certificates(tmp_path) -> Path:
    from helpers.remote_servers import make_certificates

    return make_certificates(tmp_path / "tls")


def _tls_server(tmp_path, token_file, certificates, *, mutual: bool) -> ServerProcess:
    extra = ["--tls-cert", str(certificates / "server.pem"), "--tls-key", str(certificates / "server.key")]
    if mutual:
        extra += ["--tls-client-ca", str(certificates / "ca.pem")]
    return ServerProcess([tmp_path / ("mtls" if mutual else "tls")], token_file, extra=extra).start()


def _client_dir(certificates: Path, tmp_path: Path, *, with_certificate: bool) -> Path:
    import shutil

    client = tmp_path / ("client-mtls" if with_certificate else "client-tls")
    client.mkdir()
    shutil.copy(certificates / "ca.pem", client / "ca.pem")
    if with_certificate:
        shutil.copy(certificates / "client.pem", client / "client.pem")
        shutil.copy(certificates / "client.key", client / "client.key")
        (client / "client.key").chmod(0o600)
    return client


@pytest.mark.slow
@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_tls_and_mutual_tls(tmp_path, token_file, certificates, mutual) -> None:
    from lightning_smartinf.devices.remote.tokens import read_tls_dir

    server = _tls_server(tmp_path, token_file, certificates, mutual=mutual)
    try:
        assert f"(port {server.port}, {'mutual TLS' if mutual else 'TLS'})" in server.log_text()
        tls = read_tls_dir(_client_dir(certificates, tmp_path, with_certificate=mutual))
        remote = RemoteBackend([server.address], read_token(token_file), chunk_elems=CHUNK, buffer_count=4, tls=tls)
        local = CpuBackend([tmp_path / "local"], chunk_elems=CHUNK, buffer_count=4)
        _initialize([remote, local])
        for a, b in zip(_step(remote, _grads(1), 1), _step(local, _grads(1), 1)):
            assert torch.equal(a, b)
        remote.close()
        local.close()
        # A plain client cannot talk to a TLS server; without a certificate, not to a mutual-TLS one either.
        with pytest.raises(StorageError, match=rf"{server.address} cannot be reached .*TLS settings differ"):
            RemoteBackend([server.address], read_token(token_file), device_timeout_s=10.0)
        if mutual:
            anonymous = read_tls_dir(_client_dir(certificates, tmp_path, with_certificate=False))
            with pytest.raises(StorageError, match=rf"{server.address} cannot be reached .*client certificate"):
                RemoteBackend([server.address], read_token(token_file), device_timeout_s=10.0, tls=anonymous)
    finally:
        server.stop()


def test_under_mutual_tls_a_session_belongs_to_the_certificate_that_opened_it(tmp_path, token_file, certificates):
    """Another client with the token and its own certificate signed by the same authority, holding the session's
    id, still cannot reach the session: it is answered as if the session did not exist."""
    import shutil

    from lightning_smartinf.devices.remote.tokens import read_tls_dir

    server = _tls_server(tmp_path, token_file, certificates, mutual=True)
    try:
        owner = RemoteBackend(
            [server.address],
            read_token(token_file),
            chunk_elems=CHUNK,
            buffer_count=4,
            tls=read_tls_dir(_client_dir(certificates, tmp_path, with_certificate=True)),
        )
        owner.open(_specs()[:1])
        owner.initialize(0, torch.randn(SIZES[0]))
        owner.wait()
        other_dir = tmp_path / "client-other"
        other_dir.mkdir()
        shutil.copy(certificates / "ca.pem", other_dir / "ca.pem")
        shutil.copy(certificates / "other.pem", other_dir / "client.pem")
        shutil.copy(certificates / "other.key", other_dir / "client.key")
        intruder = RemoteBackend([server.address], read_token(token_file), tls=read_tls_dir(other_dir))
        intruder.servers[0].session = owner.servers[0].session  # the id, leaked
        with pytest.raises(StorageError, match="No such session"):
            intruder._control(intruder.servers[0], "traffic", "reading another client's traffic")
        intruder.servers[0].shards = []  # nothing of its own to close
        intruder.close()
        owner.result(owner.read_master(0, torch.empty(SIZES[0])))  # the owner goes on
        # Its checkpoint too answers only to the certificate that saved it, even to a client with its id and digest.
        owner.save(tmp_path / "ckpt")
        owner_tls = read_tls_dir(tmp_path / "client-mtls")  # the owner's certificate
        masters = checkpoint_masters([server.address], read_token(token_file), tls=owner_tls)(tmp_path / "ckpt")
        assert len(masters) == 1
        with pytest.raises(StorageError, match="has no checkpoint"):
            checkpoint_masters([server.address], read_token(token_file), tls=read_tls_dir(other_dir))(tmp_path / "ckpt")
        owner.close()
    finally:
        server.stop()


def test_tls_directory_is_checked(tmp_path) -> None:
    from lightning_smartinf.devices.remote.tokens import read_tls_dir

    with pytest.raises(ValueError, match="has no ca.pem"):
        read_tls_dir(tmp_path)
    (tmp_path / "ca.pem").write_text("x")
    (tmp_path / "client.pem").write_text("x")
    with pytest.raises(ValueError, match="needs both, or neither"):
        read_tls_dir(tmp_path)
    (tmp_path / "client.key").write_text("x")
    (tmp_path / "client.key").chmod(0o644)
    with pytest.raises(ValueError, match="readable by other users.*chmod 600"):
        read_tls_dir(tmp_path)


def test_resume_with_a_server_missing_names_the_servers(tmp_path, servers, token_file) -> None:
    remote = _remote(servers, token_file)
    _initialize([remote])
    remote.save(tmp_path / "ckpt")
    remote.close()
    fewer = _remote(servers[:1], token_file)
    fewer.open(_specs())
    with pytest.raises(CheckpointError, match=rf"on 2 remote server\(s\): .*{servers[1].address}.*this run has 1"):
        fewer.load(tmp_path / "ckpt")
    fewer.close()


@pytest.mark.slow
def test_a_second_server_on_the_same_root_or_port_is_refused(tmp_path, servers, token_file) -> None:
    with pytest.raises(RuntimeError, match=r"did not start") as same_root:
        ServerProcess(servers[0].storage, token_file).start()
    assert "is in use by pid" in str(same_root.value)
    with pytest.raises(RuntimeError, match=r"did not start") as same_port:
        ServerProcess([tmp_path / "other"], token_file).start(port=servers[0].port)
    said = str(same_port.value)
    assert f"port {servers[0].port} is in use by pid {servers[0].process.pid} (" in said, said
    assert "add_port" not in said, "the refusal is the server's own, not gRPC's raw log line"
    # The refused server gave its root back: a server starts on it now.
    ServerProcess([tmp_path / "other"], token_file).start().stop()
