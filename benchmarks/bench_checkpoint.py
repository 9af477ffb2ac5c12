"""What saving the device state costs: seconds and bytes, by filesystem, against a raw copy of the same files.

A ``cpu`` backend holds ``--params`` parameters of AdamW state (12 B per parameter: master, ``exp_avg``,
``exp_avg_sq``) in shards of ``--sub-group-size`` on two storage paths of one filesystem, written by its devices
(``initialize``, then one update of every shard). Then, in alternating rounds, with the page cache dropped before each:

- ``save``: ``backend.save(dir)``, what a checkpoint does for the device state (files cloned where the filesystem
  can, else copied in the kernel; checksums from the devices' writes);
- ``python copy``: the save before record checksums, each file copied through Python with its CRC-32
  (``copy_with_crc``, devices in parallel, as the save did);
- ``cp``: ``cp --reflink=never`` of the same files, the disk's raw copy speed (both paths in parallel).

Before each copy, every shard is updated once (``--no-step-between`` to skip it), as a training step rewrites the
state before a checkpoint: on ext4 the first copy after writes pays about 5 s more for 4.8 GB, whichever method
makes it, so without the step the first method of each round would carry that cost alone.

Each row reports seconds, GB/s of state and the bytes the filesystem used for the copy (``statvfs`` before and after,
so a clone shows ~0). Filesystems: ``--work`` (this machine's, ext4 here) and, with ``--xfs-size``, an XFS with
reflinks in a sparse image under ``--work``, loop-mounted (needs root and ``mkfs.xfs``; ``fstrim`` after each round
gives the space of deleted copies back to the image's filesystem, outside the timed part)::

    .venv/bin/python benchmarks/bench_checkpoint.py --work /var/tmp/ckpt-bench --params 0.8e9 --xfs-size 24g

Records go to ``--out`` (JSON; default ``benchmarks/out/checkpoint.json``) and a markdown table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from lightning_smartinf.core.backend import ShardSpec  # noqa: E402
from lightning_smartinf.core.format.state_files import copy_with_crc  # noqa: E402
from lightning_smartinf.core.rules import Adam, StepParams  # noqa: E402
from lightning_smartinf.devices.cpu import CpuBackend  # noqa: E402

GB = 1e9
CHUNK = 1 << 22


def drop_caches() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        print(f"[bench] cannot drop the page cache ({exc}): copies may read from memory", file=sys.stderr)


def used(path: Path) -> int:
    usage = shutil.disk_usage(path)
    return usage.total - usage.free


def make_state(root: Path, params: int, sub_group: int) -> CpuBackend:
    """A backend whose devices wrote AdamW state for ``params`` parameters under ``root/nvme{0,1}``."""
    sizes = [min(sub_group, params - start) for start in range(0, params, sub_group)]
    specs = [ShardSpec(i, n, Adam(decoupled_weight_decay=True)) for i, n in enumerate(sizes)]
    backend = CpuBackend([root / "nvme0", root / "nvme1"], chunk_elems=CHUNK, buffer_count=4)
    backend.open(specs)
    generator = torch.Generator().manual_seed(0)
    master = torch.randn(max(sizes), generator=generator)
    grad = torch.randn(max(sizes), generator=generator).bfloat16()
    t0 = time.perf_counter()
    for spec in specs:
        backend.initialize(spec.index, master[: spec.numel])
    backend.wait()
    update_all(backend, grad, 1)
    print(f"[bench] {params / 1e9:.2f}B parameters written and updated in {time.perf_counter() - t0:.1f} s", flush=True)
    return backend


def update_all(backend: CpuBackend, grad: torch.Tensor, step: int) -> None:
    """One AdamW update of every shard, as a training step writes the state before a checkpoint."""
    hp = StepParams(step=step, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for shard in backend.shards:
        out = torch.empty(shard.spec.numel, dtype=torch.bfloat16)
        backend.submit(shard.spec.index, grad[: shard.spec.numel], hp, out)
    backend.wait()


def state_files(root: Path) -> list[Path]:
    return sorted(p for d in ("nvme0", "nvme1") for p in (root / d).rglob("shard*.state") if ".slot" not in p.name)


def measure(method: str, backend: CpuBackend, root: Path, files: list[Path], trim: Path | None) -> dict[str, Any]:
    target = root / f"copy-{method.replace(' ', '-')}"
    shutil.rmtree(target, ignore_errors=True)
    drop_caches()
    before = used(root)
    t0 = time.perf_counter()
    if method == "save":
        backend.save(target)
    else:
        target.mkdir()
        groups = [[f for f in files if "nvme0" in f.parts], [f for f in files if "nvme1" in f.parts]]

        def one_path(group: list[Path]) -> None:
            for f in group:
                if method == "cp":
                    subprocess.run(["cp", "--reflink=never", str(f), str(target / f.name)], check=True)
                else:
                    copy_with_crc(f, target / f.name)

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(one_path, groups))
        if method == "cp":
            os.sync()
    seconds = time.perf_counter() - t0
    os.sync()
    grown = used(root) - before
    record = {"method": method, "seconds": seconds, "used_bytes": grown}
    if method == "save":
        stats = backend.last_save
        record.update(cloned_bytes=stats.cloned_bytes, copied_bytes=stats.copied_bytes,
                      checksummed_bytes=stats.checksummed_bytes, by_method=stats.by_method)  # fmt: skip
    shutil.rmtree(target)
    os.sync()
    if trim is not None:  # give the deleted copy's blocks back to the image's filesystem (not timed)
        subprocess.run(["fstrim", str(trim)], check=False, capture_output=True)
    return record


def run_on(root: Path, filesystem: str, args: argparse.Namespace, trim: Path | None = None) -> list[dict[str, Any]]:
    root.mkdir(parents=True, exist_ok=True)
    backend = make_state(root, int(args.params), int(args.sub_group_size))
    files = state_files(root)
    state = sum(f.stat().st_size for f in files)
    assert files and state > 0, f"no state files under {root}"
    records = []
    grad = torch.randn(int(args.sub_group_size), generator=torch.Generator().manual_seed(1)).bfloat16()
    step = 1
    try:
        for rnd in range(args.rounds):
            for method in ("save", "python copy", "cp") if rnd % 2 == 0 else ("cp", "python copy", "save"):
                if args.step_between:  # as in training: every copy follows a step that rewrote the state
                    step += 1
                    update_all(backend, grad, step)
                record = measure(method, backend, root, files, trim)
                record.update(filesystem=filesystem, round=rnd, state_bytes=state, params=int(args.params))
                records.append(record)
                print(f"[bench] {filesystem} round {rnd} {method}: {record['seconds']:.2f} s, "
                      f"{record['used_bytes'] / GB:.2f} GB used", flush=True)  # fmt: skip
    finally:
        backend.close()
        shutil.rmtree(root, ignore_errors=True)
    return records


def mounted_xfs(work: Path, size: str) -> tuple[Path, Path]:
    image, mount = work / "xfs.img", work / "xfs"
    mount.mkdir(parents=True, exist_ok=True)
    subprocess.run(["truncate", "-s", size, str(image)], check=True)
    subprocess.run(["mkfs.xfs", "-q", "-f", "-m", "reflink=1", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
    return image, mount


def table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| filesystem | method | seconds (each round) | GB/s of state | GB the copy used | how the save moved it |",
        "|---|---|---|---|---|---|",
    ]
    for fs in dict.fromkeys(r["filesystem"] for r in records):
        for method in ("save", "python copy", "cp"):
            rows = [r for r in records if r["filesystem"] == fs and r["method"] == method]
            if not rows:
                continue
            state = rows[0]["state_bytes"]
            best = min(r["seconds"] for r in rows)
            how = ", ".join(f"{k} {v / GB:.1f} GB" for k, v in rows[0].get("by_method", {}).items()) or "-"
            each = " / ".join(f"{r['seconds']:.2f}" for r in rows)
            lines.append(
                f"| {fs} | {method} | {each} | {state / best / GB:.2f} "
                f"| {max(r['used_bytes'] for r in rows) / GB:.2f} | {how} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="a directory on the filesystem to measure")
    parser.add_argument("--params", type=float, default=0.8e9, help="parameters of AdamW state (12 B each)")
    parser.add_argument("--sub-group-size", type=float, default=1e8, help="elements per shard file")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the three methods, order alternating")
    parser.add_argument(
        "--step-between",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="update every shard before each copy, as a training step does before a checkpoint (default: on; the "
        "first copy after writes pays the filesystem's settling of them, whichever method it is)",
    )
    parser.add_argument("--xfs-size", default=None, help="also measure on a loop-mounted XFS of this size (e.g. 24g)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "checkpoint.json")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    found = subprocess.run(["findmnt", "-no", "FSTYPE", "-T", str(args.work)], capture_output=True, text=True)
    fs_type = found.stdout.strip()
    records = run_on(args.work / "state", fs_type or "work", args)
    if args.xfs_size:
        image, mount = mounted_xfs(args.work, args.xfs_size)
        try:
            records += run_on(mount / "state", "xfs (reflink, loop)", args, trim=mount)
        finally:
            subprocess.run(["umount", "-d", str(mount)], check=False)
            image.unlink(missing_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"params": int(args.params), "sub_group_size": int(args.sub_group_size), "chunk_elems": CHUNK,
            "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    args.out.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    print(table(records))


if __name__ == "__main__":
    main()
