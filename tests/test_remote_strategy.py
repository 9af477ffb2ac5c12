"""``SmartInfinityStrategy(backend="remote")`` in the shapes users write: Trainer.fit, checkpoints, resume, 2 ranks."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from helpers.launch import SCRIPTS, torchrun
from helpers.models import LMModule, adamw_factory, assert_identical, fit, max_relative_error
from helpers.remote_servers import ServerProcess, running, server_pool, write_token
from scripts.ckpt_common import EVERY, train

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.core.format import checkpoint_folder
from lightning_smartinf.core.format.checkpoint_folder import CheckpointError

STEPS = 6


adamw = adamw_factory(betas=(0.9, 0.95), cosine_steps=STEPS)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    root = tmp_path_factory.mktemp("servers")
    yield from server_pool(root, write_token(root / "token"), [["srv0"], ["srv1"]])


@pytest.fixture
def servers(pool):
    """The module's two servers, each running (a test before may have restarted them)."""
    return running(pool)


def _strategy(tmp_path, name: str, servers=None, **kwargs) -> SmartInfinityStrategy:
    kwargs = {"sub_group_size": 3000, "chunk_size": 2048, "buffer_count": 3, **kwargs}
    if servers is not None:
        kwargs.update(
            backend="remote",
            remote_devices=[s.address for s in servers],
            remote_token_file=str(servers[0].token_file),
        )
    return SmartInfinityStrategy(storage_paths=[tmp_path / name], **kwargs)


def _remote(servers) -> dict:
    """The strategy settings of a run on ``servers``."""
    return {
        "backend": "remote",
        "remote_devices": [s.address for s in servers],
        "remote_token_file": str(servers[0].token_file),
    }


def _saved_on(servers, tmp_path):
    """The checkpoint at step EVERY of a run on ``servers`` (its device state kept there)."""
    train(tmp_path / "saved", steps=EVERY, strategy_kwargs=_remote(servers))
    return tmp_path / "saved" / "ckpts" / f"step={EVERY}.ckpt"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "compression"),
    [("32-true", None), ("bf16-mixed", 0.05), ("bf16-mixed", {"ratio": 0.05, "rule": "ef_adafactor"})],
    ids=["fp32-dense-overlap", "bf16-topk", "bf16-topk-ef_adafactor"],
)
def test_training_on_remote_servers_is_bitwise_the_local_run(tmp_path, servers, precision, compression):
    _, local = fit(
        LMModule(adamw),
        _strategy(tmp_path, "local", compression=compression),
        steps=STEPS,
        precision=precision,
        clip=1.0,
    )
    trainer, remote = fit(
        LMModule(adamw),
        _strategy(tmp_path, "remote", servers, compression=compression),
        steps=STEPS,
        precision=precision,
        clip=1.0,
    )
    for name, value in local.items():
        assert torch.equal(remote[name], value), name
    smart_update = trainer.strategy.smart_update
    assert smart_update.placement == tuple(i % 2 for i in range(len(smart_update.sub_groups)))
    if compression is None:  # sub-groups went to the servers during backward
        assert smart_update.early_kept + smart_update.early_rolled_back > 0


def test_bad_remote_settings_are_named(tmp_path):
    token = tmp_path / "token"
    token.write_text("x")
    token.chmod(0o644)
    with pytest.raises(Exception, match=r"readable by other users.*chmod 600") as error:
        SmartInfinityStrategy(backend="remote", remote_devices=["localhost"], remote_token_file=str(token))
    assert "'localhost' is not 'host:port'" in str(error.value)
    with pytest.raises(Exception, match=r"applies to `backend='remote'` only"):
        SmartInfinityStrategy(remote_devices=["h:1"])
    with pytest.raises(Exception, match=r"`remote_devices=None`: `backend='remote'` needs a list"):
        SmartInfinityStrategy(backend="remote", remote_token_file=str(token))
    token.chmod(0o600)
    with pytest.raises(Exception, match=r"`remote_devices` names 'h:1' more than once: each entry is one device"):
        SmartInfinityStrategy(backend="remote", remote_devices=["h:1", "h:2", "h:1"], remote_token_file=str(token))
    with pytest.raises(Exception, match=r"`remote_allow_plaintext='yes'` is a str: it must be True or False\."):
        SmartInfinityStrategy(
            backend="remote", remote_devices=["h:1"], remote_token_file=str(token), remote_allow_plaintext="yes"
        )


@pytest.mark.slow
def test_save_last_then_resume_after_the_servers_restart_is_bit_identical(tmp_path, servers):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from scripts.ckpt_common import train

    def remote():
        return {
            "backend": "remote",
            "remote_devices": [s.address for s in servers],
            "remote_token_file": str(servers[0].token_file),
        }

    reference = train(tmp_path / "reference", checkpointing="last", strategy_kwargs=remote())
    train(tmp_path / "run", checkpointing="last", steps=8, strategy_kwargs=remote())
    state = tmp_path / "run" / "ckpts" / "last.ckpt" / "checkpoint" / "smartinf"
    assert sorted(p.name for p in state.rglob("remote.json")), "the checkpoint records where the device state is"
    for server in servers:
        server.kill()
        server.start()  # same storage roots, new ports
    resumed = train(
        tmp_path / "run",
        checkpointing="last",
        ckpt_path=tmp_path / "run" / "ckpts" / "last.ckpt",
        strategy_kwargs=remote(),
    )
    for name, value in reference.items():
        assert torch.equal(resumed[name], value), name


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({}, marks=pytest.mark.slow),  # (the main suite's case goes the same way: re-sharded, sent)
        {"sub_group_size": 1000, "chunk_size": 2048},
        pytest.param({"state_memory_budget": 130_000}, marks=pytest.mark.slow),
    ],
    ids=["the checkpoint's layout", "another sub_group_size and chunk_size", "a memory tier beside the servers"],
)
def test_a_checkpoint_of_the_cpu_backend_resumes_on_the_servers_bit_identically(
    checkpoint_reference, tmp_path, servers, layout
):
    """Its state files are re-sharded on this host a shard at a time, sent to the servers and loaded there; the run
    then equals the `cpu` run that never stopped (remote updates are bitwise the local ones)."""
    root, expected = checkpoint_reference
    remote = {
        "backend": "remote",
        "remote_devices": [s.address for s in servers],
        "remote_token_file": str(servers[0].token_file),
    }
    trainers: list = []
    checkpoint = root / "ckpts" / f"step={EVERY}.ckpt"
    marks = {server.address: server.log_mark() for server in servers}
    resumed = train(tmp_path, ckpt_path=checkpoint, every=None, strategy_kwargs={**remote, **layout}, trainers=trainers)
    assert_identical(resumed, expected)
    for server in servers:
        assert "loaded an uploaded checkpoint" in server.log_text(marks[server.address])
    assert not list(tmp_path.rglob(".upload")) and not [
        p for s in servers for root in s.storage for p in root.rglob(".upload")
    ], "no upload is left behind"


@pytest.mark.parametrize(
    "layout",
    [
        {"sub_group_size": 1000, "chunk_size": 2048},
        pytest.param({"state_memory_budget": 130_000}, marks=pytest.mark.slow),
    ],
    ids=["another sub_group_size and chunk_size", "a memory tier beside the servers"],
)
def test_a_checkpoint_kept_on_the_servers_resumes_on_them_under_another_layout_bit_identically(
    checkpoint_reference, tmp_path, servers, layout
):
    """The servers send the saved manifests and, as the re-sharding reads them, the saved state files; each shard is
    rebuilt in this run's layout on this host and sent back. The run equals the `cpu` run that never stopped, and
    nothing fetched is left on this host."""
    _, expected = checkpoint_reference
    remote = _remote(servers)
    checkpoint = _saved_on(servers, tmp_path)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", str(scratch))  # where the fetched files go: checked empty after
        resumed = train(tmp_path / "resumed", ckpt_path=checkpoint, every=None, strategy_kwargs={**remote, **layout})
    assert_identical(resumed, expected)
    assert not list(scratch.iterdir()), "nothing fetched is left on this host"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_checkpoint_kept_on_the_servers_by_two_ranks_resumes_on_one(tmp_path, servers, free_port):
    """2 ranks save on the servers; 1 rank with another `sub_group_size` resumes there, fetching both saved ranks'
    state, within the summation-order tolerance of the 2-rank run that never stopped (as on the `cpu` backend)."""
    remote = ["--remote-devices", *[s.address for s in servers], "--remote-token-file", str(servers[0].token_file)]

    def run(ranks: int, tag: str, *args: str | Path) -> dict[str, torch.Tensor]:
        torchrun(SCRIPTS / "train_ranks_reshard.py", tmp_path, tag, *args, *remote, port=free_port(), ranks=ranks)
        return torch.load(tmp_path / f"{tag}.pt", weights_only=True)

    full = run(2, "full2")
    step = tmp_path / "ckpts_full2" / f"step={EVERY}.ckpt"
    after = run(1, "resumed1", "--resume", step, "--sub-group-size", "1000")
    errors = max_relative_error(after, full)
    assert max(errors.values()) < 1e-5, errors


def test_a_checkpoint_kept_on_the_servers_resumes_with_them_in_another_order(checkpoint_reference, tmp_path, servers):
    """`remote_devices` reordered, the layout the same: each shard's saved state is fetched from the server that kept
    it, rebuilt here and sent to the server this run places it on; bit for bit the run that never stopped."""
    _, expected = checkpoint_reference
    checkpoint = _saved_on(servers, tmp_path)
    reordered = {**_remote(servers), "remote_devices": [s.address for s in reversed(servers)]}
    resumed = train(tmp_path / "resumed", ckpt_path=checkpoint, every=None, strategy_kwargs=reordered)
    assert_identical(resumed, expected)


def test_a_checkpoint_kept_on_the_servers_resumes_on_this_hosts_devices_from_the_servers(
    checkpoint_reference, tmp_path, servers
):
    """A `cpu` run given the servers in `saved_state_from` fetches the state they kept (its layout, then another
    `sub_group_size` and `chunk_size`) and equals, bit for bit, the `cpu` run that never stopped; nothing fetched is
    left on this host, and the servers still hold the checkpoint (another run resumes it again)."""
    _, expected = checkpoint_reference
    checkpoint = _saved_on(servers, tmp_path)
    source = _remote(servers)
    for i, layout in enumerate(({}, {"sub_group_size": 1000, "chunk_size": 4096})):
        scratch = tmp_path / f"tmp{i}"
        scratch.mkdir()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tempfile, "tempdir", str(scratch))
            resumed = train(
                tmp_path / f"resumed{i}",
                ckpt_path=checkpoint,
                every=None,
                strategy_kwargs={"saved_state_from": source, **layout},
            )
        assert_identical(resumed, expected)
        assert not list(scratch.iterdir()), "nothing fetched is left on this host"


def test_a_checkpoint_kept_on_the_servers_resumes_on_smartssds_from_the_servers(
    checkpoint_reference, tmp_path, servers, tmp_path_factory, csim_library
):
    """`backend="xrt"` (the software model of XRT running this repository's kernels) given the servers in
    `saved_state_from`, with another `sub_group_size`: bit for bit the `xrt` run resumed, in the same layout, from the
    same state saved on this host (the kernels round sqrt unlike torch, so the `cpu` run is not the reference)."""
    from lightning_smartinf.devices.xrt import forget_platform, write_model_xclbin

    root = tmp_path_factory.mktemp("xrt")
    xclbin = write_model_xclbin(root / "smartinf.json", csim_library, devices=1, dram_root=root / "ddr")
    try:
        saved_here, _ = checkpoint_reference
        xrt = {"backend": "xrt", "xclbin": xclbin, "sub_group_size": 1000}
        expected = train(
            tmp_path / "here", ckpt_path=saved_here / "ckpts" / f"step={EVERY}.ckpt", every=None, strategy_kwargs=xrt
        )
        checkpoint = _saved_on(servers, tmp_path)
        resumed = train(
            tmp_path / "there",
            ckpt_path=checkpoint,
            every=None,
            strategy_kwargs={**xrt, "saved_state_from": _remote(servers)},
        )
        assert_identical(resumed, expected)
    finally:
        forget_platform(xclbin)


def test_a_checkpoint_kept_on_the_servers_is_refused_where_it_cannot_load_naming_what_to_do(tmp_path, servers):
    """Its state is on the servers, not on this host: a `cpu` run without `saved_state_from` is refused with a message
    saying how to resume it, before anything live changes; `saved_state_from` with the wrong servers names the one
    missing."""
    checkpoint = _saved_on(servers, tmp_path)
    for kwargs in ({}, {"sub_group_size": 1000}):
        with pytest.raises(
            CheckpointError,
            match=r"holds no manifest\.json: .* kept by the devices .* `backend='remote'`.*saved_state_from",
        ):
            train(tmp_path / "resumed", ckpt_path=checkpoint, every=None, strategy_kwargs=kwargs)
    only_one = {**_remote(servers), "remote_devices": [servers[0].address]}
    with pytest.raises(
        CheckpointError, match=r"is on server .* not among the servers given.*Add it to `remote_devices`"
    ):
        train(tmp_path / "resumed", ckpt_path=checkpoint, every=None, strategy_kwargs={"saved_state_from": only_one})


def test_a_checkpoint_on_a_server_restarted_over_another_root_is_refused_naming_it(tmp_path, servers):
    """What a user with fixed ports meets after restarting a server over the wrong storage: the resume names the
    server that kept the state, says another answers at its address, and what to do; the checkpoint is untouched."""

    checkpoint = _saved_on(servers, tmp_path)
    restarted = servers[1]
    port, storage = restarted.port, restarted.storage
    restarted.kill()
    restarted.storage = [tmp_path / "elsewhere"]
    restarted.start(port=port)
    try:
        with pytest.raises(
            CheckpointError, match=r"not among the servers given.*Another server answers at that address"
        ):
            train(tmp_path / "resumed", ckpt_path=checkpoint, every=None, strategy_kwargs=_remote(servers))
    finally:  # the next test gets it back on its own root (`running`)
        restarted.kill()
        restarted.storage = storage
    checkpoint_folder.verify(checkpoint)  # as it was saved


def _server_labels(checkpoint: Path) -> set[str]:
    """The labels under which the servers keep ``checkpoint``'s device state."""
    found = (checkpoint / "checkpoint" / "smartinf").rglob("remote.json")
    return {entry["label"] for path in found for entry in json.loads(path.read_text())["servers"]}


@pytest.mark.slow
def test_two_runs_on_a_server_that_prunes_keep_each_others_checkpoints(tmp_path):
    """Two unrelated trainers on one server that keeps 2 checkpoints a label and prunes the oldest: the second run's
    saves leave the first run's checkpoints, which it then resumes; its saves after the resume rotate its own."""
    root = tmp_path / "server"
    root.mkdir()
    server = ServerProcess(
        [root / "srv"], write_token(root / "token"), extra=["--max-label-checkpoints", "2", "--prune-checkpoints"]
    ).start()
    try:
        remote = _remote([server])
        train(tmp_path / "a", steps=EVERY, checkpointing="last", strategy_kwargs=remote)  # step=4 and last: 2 saves
        first = _server_labels(tmp_path / "a" / "ckpts" / "last.ckpt")
        train(tmp_path / "b", steps=3 * EVERY, checkpointing="last", strategy_kwargs=remote)  # 6 saves, 4 pruned
        last = tmp_path / "a" / "ckpts" / "last.ckpt"
        train(tmp_path / "a", ckpt_path=last, steps=2 * EVERY, checkpointing="last", strategy_kwargs=remote)
        assert _server_labels(last) == first, "the resumed run saves in the lineage of the checkpoint it resumed"
        assert len(list((root / "srv" / "checkpoints").iterdir())) == 4, "each run keeps its newest 2"
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"remote_devices": ["h:1"]}, r"must be a dict naming the `backend` whose devices kept .* \('remote'\)"),
        ({"backend": "cpu"}, r"must be a dict naming the `backend`"),
        ("remote", r"`saved_state_from='remote'` must be a dict"),
        ({"backend": "remote", "xclbin": "k.xclbin"}, r"'xclbin' are not arguments of `backend='remote'`; it takes"),
        ({"backend": "remote", "remote_devices": "h:1"}, r"needs a list of device servers"),
    ],
)
def test_bad_saved_state_from_is_named(source, message):
    with pytest.raises(Exception, match=message):
        SmartInfinityStrategy(saved_state_from=source)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("ratio", "budget"),
    [
        pytest.param("none", None, marks=pytest.mark.slow, id="dense"),
        pytest.param("0.05", None, marks=pytest.mark.slow, id="topk"),
        pytest.param("none", "16MiB", marks=pytest.mark.slow, id="dense-memory"),
    ],
)
def test_two_ranks_share_the_servers_and_match_the_local_run(tmp_path, servers, free_port, ratio, budget):
    remote = {
        "backend": "remote",
        "remote_devices": [s.address for s in servers],
        "remote_token_file": str(servers[0].token_file),
        "state_memory_budget": budget,  # each rank keeps a share of its state in its own memory
    }
    params = {}
    marks = [server.log_mark() for server in servers]
    for name, extra in (("local", {}), ("remote", remote)):
        out = tmp_path / name
        storage = [out / "ssd0", out / "ssd1"]
        for path in storage:
            path.mkdir(parents=True)
        paths = ",".join(map(str, storage))
        torchrun(SCRIPTS / "train_two_ranks.py", out, paths, "4", ratio, json.dumps(extra), port=free_port())
        params[name] = torch.load(out / "params.pt", weights_only=True)
        reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        params[name + "-traffic"] = [r["traffic"]["link_write_bytes"] for r in reports]
        if name == "remote":
            assert all((r["traffic"]["memory_read_bytes"] > 0) == bool(budget) for r in reports)
    for name, value in params["local"].items():
        assert torch.equal(params["remote"][name], value), name
    if budget is None:
        assert params["remote-traffic"] == params["local-traffic"]
    else:  # sub-groups in memory are never handed off during backward, so none is sent twice after a rollback
        assert all(r <= lo for r, lo in zip(params["remote-traffic"], params["local-traffic"]))
    # Each rank held its own session on each server: two ranks, two sessions per server, both closed at the end.
    for server, mark in zip(servers, marks):
        assert server.log_text(since=mark).count("closed") == 2


@pytest.mark.slow
def test_mutual_tls_through_the_strategy(tmp_path):
    import shutil

    from helpers.remote_servers import make_certificates

    certificates = make_certificates(tmp_path / "tls")
    token = write_token(tmp_path / "token")
    extra = ["--tls-cert", str(certificates / "server.pem"), "--tls-key", str(certificates / "server.key")]
    extra += ["--tls-client-ca", str(certificates / "ca.pem")]
    server = ServerProcess([tmp_path / "srv"], token, extra=extra).start()
    client = tmp_path / "client"
    client.mkdir()
    for name in ("ca.pem", "client.pem", "client.key"):
        shutil.copy(certificates / name, client / name)
    try:
        _, local = fit(LMModule(adamw), _strategy(tmp_path, "local"), steps=3)
        strategy = _strategy(tmp_path, "remote", [server], remote_tls_dir=str(client))
        _, remote = fit(LMModule(adamw), strategy, steps=3)
    finally:
        server.stop()
    for name, value in local.items():
        assert torch.equal(remote[name], value), name
    with pytest.raises(Exception, match=r"`remote_tls_dir=.*has no ca.pem"):
        SmartInfinityStrategy(
            backend="remote", remote_devices=["h:1"], remote_token_file=str(token), remote_tls_dir=str(tmp_path)
        )


class LMWithValidation(LMModule):
    def validation_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = torch.nn.functional.cross_entropy(self.model(tokens).float().flatten(0, 1), targets.flatten())
        self.log("val_loss", loss)


@pytest.mark.slow
def test_evaluate_and_export_a_checkpoint_kept_on_the_servers(tmp_path, servers, capsys):
    import lightning as L
    from helpers.models import CaptureParams, token_loader
    from safetensors.torch import load_file

    from lightning_smartinf.commands.export import main as export_main

    def trainer(name: str, callbacks=(), strategy=None) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=strategy or _strategy(tmp_path, name, servers),
            max_steps=4,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=list(callbacks),
        )

    capture = CaptureParams()
    first = trainer("fit", [capture])
    first.fit(LMWithValidation(adamw), token_loader(4))
    first.save_checkpoint(tmp_path / "remote.ckpt")  # after fit: the sessions still hold the state
    expected = first.validate(LMWithValidation(adamw), token_loader(2), ckpt_path=tmp_path / "remote.ckpt")
    # A new trainer (new sessions) evaluates the checkpoint: its masters come from the servers' copy.
    got = trainer("eval").validate(LMWithValidation(adamw), token_loader(2), ckpt_path=tmp_path / "remote.ckpt")
    assert got == expected
    # A run on this host's devices evaluates it through the servers named in `saved_state_from`, and without them
    # is refused with a message saying so.
    here = _strategy(tmp_path, "here", saved_state_from=_remote(servers))
    got = trainer("here", strategy=here).validate(
        LMWithValidation(adamw), token_loader(2), ckpt_path=tmp_path / "remote.ckpt"
    )
    assert got == expected
    with pytest.raises(CheckpointError, match=r"holds no manifest\.json: .* on other devices with `saved_state_from="):
        trainer("alone", strategy=_strategy(tmp_path, "alone")).validate(
            LMWithValidation(adamw), token_loader(2), ckpt_path=tmp_path / "remote.ckpt"
        )
    out = tmp_path / "weights.safetensors"
    assert export_main([str(tmp_path / "remote.ckpt"), str(out)]) == 1
    assert "remote device servers" in capsys.readouterr().err
    flags = ["--remote-devices", *[s.address for s in servers], "--remote-token-file", str(servers[0].token_file)]
    assert export_main([str(tmp_path / "remote.ckpt"), str(out), *flags]) == 0
    weights = load_file(str(out))
    assert weights.keys() == capture.params.keys()
    for name, value in capture.params.items():  # fp32 training: the masters are the parameters
        assert torch.equal(weights[name], value), name

    # A `remote.json` without shard sizes (as format 1 wrote them) exports the same: each shard's size comes from
    # the rank's own record beside it, not from what a server sends.
    (manifest,) = (tmp_path / "remote.ckpt").rglob("remote.json")
    saved = json.loads(manifest.read_text())
    saved["servers"] = [{k: v for k, v in e.items() if k != "numels"} for e in saved["servers"]]
    manifest.write_text(json.dumps({**saved, "format": 1}))
    reseal = {"global_step": 4, "world_size": 1}  # as the checkpoint was sealed when it was written so
    checkpoint_folder.seal(tmp_path / "remote.ckpt", **reseal)
    again = tmp_path / "format-1.safetensors"
    assert export_main([str(tmp_path / "remote.ckpt"), str(again), *flags]) == 0
    assert all(torch.equal(a, weights[name]) for name, a in load_file(str(again)).items())
    # A record smaller than what the servers hold: what they send beyond it is refused, naming the server.
    host = manifest.parent / "host_state.json"
    record = json.loads(host.read_text())
    record["shards"][0][0]["partition_numel"] -= 1
    host.write_text(json.dumps(record))
    checkpoint_folder.seal(tmp_path / "remote.ckpt", **reseal)
    assert export_main([str(tmp_path / "remote.ckpt"), str(again), *flags]) == 1
    assert "The remote device server" in capsys.readouterr().err


@pytest.mark.slow
def test_a_memory_tier_beside_the_servers_trains_saves_and_resumes_bit_identically(tmp_path, servers, capsys):
    """What a user with servers and spare RAM writes: `state_memory_budget` beside `backend="remote"`, stock
    `ModelCheckpoint(save_last=True)`, `fit(ckpt_path=...)`, then export. Resumed under another split (all on the
    servers), and by a `cpu` run with another `sub_group_size` given the servers in `saved_state_from`, the state kept
    in memory comes from the checkpoint on this host and the rest from the servers: bit for bit again."""
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    sys.path.insert(0, str(Path(__file__).parent))
    from scripts.ckpt_common import train

    from lightning_smartinf.commands.export import main as export_main

    def remote(budget):
        return {
            "backend": "remote",
            "remote_devices": [s.address for s in servers],
            "remote_token_file": str(servers[0].token_file),
            "state_memory_budget": budget,
        }

    reference = train(tmp_path / "reference", checkpointing="last")  # all state on the local emulated device
    trainers = []
    train(tmp_path / "run", checkpointing="last", steps=8, strategy_kwargs=remote("64MiB"), trainers=trainers)
    backend = trainers[0].strategy.smart_update.backend
    assert backend.local_shards, "some sub-groups were kept in host memory"
    assert backend.inner.num_devices == 2 and len(backend.local_shards) < len(backend.assignment)
    last = tmp_path / "run" / "ckpts" / "last.ckpt"
    assert list(last.rglob("local_tiers.json"))
    source = {k: v for k, v in remote(None).items() if k != "state_memory_budget"}
    for i, kwargs in enumerate((remote(None), {"saved_state_from": source, "sub_group_size": 1000})):
        other = train(tmp_path / f"other{i}", checkpointing="last", ckpt_path=last, strategy_kwargs=kwargs)
        for name, value in reference.items():
            assert torch.equal(other[name], value), (kwargs, name)
    resumed = train(tmp_path / "run", checkpointing="last", ckpt_path=last, strategy_kwargs=remote("64MiB"))
    for name, value in reference.items():
        assert torch.equal(resumed[name], value), name
    out = tmp_path / "weights.safetensors"
    flags = ["--remote-devices", *[s.address for s in servers], "--remote-token-file", str(servers[0].token_file)]
    assert export_main([str(last), str(out), *flags]) == 0, capsys.readouterr().err
    weights = load_file(str(out))
    assert weights.keys() == resumed.keys()
    for name, value in resumed.items():  # fp32 training: the masters are the parameters
        assert torch.equal(weights[name], value), name
