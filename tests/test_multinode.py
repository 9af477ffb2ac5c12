"""More than one machine: 2 "nodes" x 1 rank on localhost, as Lightning's multi-node path launches them.

Each node is its own ``torchrun --nnodes 2 --node_rank K`` launch with its own storage root (its ``storage_paths``
exist on that node only), and checkpoints go to one shared folder, as on a shared filesystem. The result must be
the one of 1 node x 2 ranks, which shards data and ZeRO partitions the same way (by global rank).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.launch import worker_env
from lightning.fabric.plugins.environments import LightningEnvironment
from scripts.ckpt_common import EVERY, TOTAL

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.commands.export import consolidate_fp32_state_dict, is_complete
from lightning_smartinf.core.format import checkpoint_folder
from lightning_smartinf.core.format.state_files import MANIFEST
from lightning_smartinf.lightning import engine_setup as engine

SCRIPT = Path(__file__).parent / "scripts" / "train_nodes.py"
TIMEOUT_S = 300


def _launch(shared: Path, storage: Path, *, nodes: int, node_rank: int, devices: int, port: int, tag: str, mode: str):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--node_rank={node_rank}",
        f"--nproc_per_node={devices}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        str(SCRIPT),
        *map(str, (shared, storage, nodes, devices, tag, mode)),
    ]
    log = shared / f"{tag}_node{node_rank}.log"
    with open(log, "w") as out:
        # Its own session, so a hung launch and its workers can be ended together.
        process = subprocess.Popen(
            command, env=worker_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return process, log


def _wait(launches) -> None:
    """Wait for every launch; on a failure or a hang, end the others and fail with each one's log tail."""
    codes = []
    try:
        for process, _ in launches:
            codes.append(process.wait(timeout=TIMEOUT_S))
    except subprocess.TimeoutExpired:
        codes.append("timeout")
    finally:
        for process, _ in launches:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    if codes != [0] * len(launches):
        tails = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for _, log in launches)
        pytest.fail(f"launches ended with {codes}:\n{tails}")


def _assert_identical(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], what: str) -> None:
    assert ours.keys() == reference.keys()
    differ = {
        n: float((ours[n] - reference[n]).abs().max()) for n in reference if not torch.equal(ours[n], reference[n])
    }
    assert not differ, f"{what}: parameters differ bitwise (max abs diff): {differ}"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_nodes_train_checkpoint_resume_and_match_one_node(tmp_path, free_port) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    nodes = [tmp_path / "node0", tmp_path / "node1"]  # each node's local disks
    for node in nodes:
        node.mkdir()

    port = free_port()
    two_nodes = [
        _launch(shared, nodes[k], nodes=2, node_rank=k, devices=1, port=port, tag="two_nodes", mode="resume")
        for k in range(2)
    ]
    _wait(two_nodes)
    one = tmp_path / "one"  # the reference: 1 node x 2 ranks, one storage path per rank
    one.mkdir()
    _wait([_launch(shared, one, nodes=1, node_rank=0, devices=2, port=free_port(), tag="one_node", mode="full")])

    # Every rank found its own storage: node k's rank (local rank 0) drives all of node k's paths, and its
    # device directories are named by its global rank.
    for rank in range(2):
        reports = json.loads((shared / f"two_nodes_rank{rank}.json").read_text())
        for phase, paths in (("full", ["ssd_a0"]), ("resumed", ["ssd_b0", "ssd_b1"])):
            report = reports[phase]
            assert (report["global_rank"], report["local_rank"], report["node_rank"]) == (rank, 0, rank)
            mine = [str((nodes[rank] / p).resolve()) for p in paths]
            assert report["rank_storage_paths"] == report["storage_paths"] == mine
            assert report["device_dirs"] == [f"{p}/smartinf/rank{rank:03d}" for p in mine]
            assert report["files"] and all(str(Path(f).parent) in report["device_dirs"] for f in report["files"])
        # The paths did not exist: the strategy created them, private.
        assert all((nodes[rank] / p).stat().st_mode & 0o777 == 0o700 for p in ("ssd_a0", "ssd_b0", "ssd_b1"))
    one_node = [json.loads((shared / f"one_node_rank{r}.json").read_text())["full"] for r in range(2)]
    assert [r["rank_storage_paths"] for r in one_node] == [[str((one / f"ssd_a{r}").resolve())] for r in range(2)]

    # Both nodes' parts are in each checkpoint of the shared folder, sealed by global rank 0.
    final = shared / "ckpts_two_nodes" / f"step={TOTAL}.ckpt"
    assert is_complete(final)
    assert checkpoint_folder.verify(final, checksum_shards=True)["world_size"] == 2
    for rank in range(2):
        assert (final / "checkpoint" / "smartinf" / f"rank{rank:03d}" / MANIFEST).is_file()

    reference = torch.load(shared / "one_node_full.pt", weights_only=True)
    full = torch.load(shared / "two_nodes_full.pt", weights_only=True)
    _assert_identical(full, reference, "2 nodes x 1 rank vs 1 node x 2 ranks")
    _assert_identical(
        torch.load(shared / "two_nodes_resumed.pt", weights_only=True), full, f"resumed from step {EVERY}"
    )
    _assert_identical(consolidate_fp32_state_dict(final), full, "export of the 2-node checkpoint")


def test_rank_of_a_later_node_takes_its_local_share_and_names_dirs_by_global_rank(tmp_path, monkeypatch) -> None:
    """2 nodes x 2 ranks: global rank 3 is local rank 1 of node 1; it takes ``storage_paths[1::2]`` of its node."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("NODE_RANK", "1")
    environment = LightningEnvironment()
    environment.set_world_size(4)
    environment.set_global_rank(3)
    storage = [tmp_path / f"nvme{i}" for i in range(4)]
    strategy = SmartInfinityStrategy(
        storage_paths=storage, parallel_devices=[torch.device("cpu")] * 2, cluster_environment=environment
    )
    assert (strategy.global_rank, strategy.local_rank, strategy.node_rank) == (3, 1, 1)
    assert strategy.rank_storage_paths() == [storage[1].resolve(), storage[3].resolve()]
    directories, owned = engine.rank_devices(strategy.rank_place())
    assert directories == [storage[i].resolve() / "smartinf" / "rank003" for i in (1, 3)] and owned == []
    assert not storage[0].exists() and not storage[2].exists(), "local rank 0's paths are its own to create"
