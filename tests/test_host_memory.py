"""Host memory of the update path is a fixed buffer pool: it does not grow with the model or over steps."""

from __future__ import annotations

import gc

import lightning as L
import psutil
import pytest
from helpers.launch import python, worker_env
from helpers.models import LMModule, adamw_factory, fit

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.zero.host_heap import return_free_heap


class RssProbe(L.Callback):
    """Samples the RSS after each batch, with freed memory given back first: a block a step frees but the allocator
    keeps (glibc's arenas, Python's garbage not yet collected) is noise; what a step keeps alive is not."""

    def __init__(self) -> None:
        self.samples: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, *_: object) -> None:
        gc.collect()
        return_free_heap()
        self.samples.append(psutil.Process().memory_info().rss)
        self.pool_bytes = trainer.strategy.backend.buffer_bytes


adamw = adamw_factory(lr=1e-3)


def test_update_path_memory_is_flat_while_state_grows_4x(tmp_path):
    results = {}
    for dim in (128, 256):  # 4x the parameters of the matrices
        probe = RssProbe()
        (tmp_path / str(dim)).mkdir()
        strategy = SmartInfinityStrategy(
            storage_paths=[tmp_path / str(dim)], sub_group_size=1 << 16, chunk_size=1 << 14, buffer_count=3
        )
        trainer, _ = fit(
            LMModule(adamw, dim=dim, layers=4), strategy, steps=8, precision="bf16-mixed", callbacks=[probe]
        )
        backend = trainer.strategy.smart_update.backend
        state_bytes = sum(s.layout.file_bytes for s in backend.shards)
        growth = max(probe.samples[2:]) - probe.samples[1]  # after the first steps have warmed allocators up
        results[dim] = (state_bytes, probe.pool_bytes, growth)

    (small_state, small_pool, small_growth), (big_state, big_pool, big_growth) = results[128], results[256]
    assert big_state > 3.5 * small_state
    assert big_pool == small_pool == (3 * 3 + 1) * (1 << 14) * 4  # (buffers x (master, m, v) + grad chunk) x fp32
    # RSS does not grow over steps for either size (allowance for allocator noise, far below one state copy).
    assert small_growth < 16 * 2**20, results
    assert big_growth < 16 * 2**20, results
    assert big_growth < big_state / 4, results


HEAP_PROBE = """
import ctypes
import torch
from helpers.models import LMModule, adamw_factory, fit
from lightning_smartinf import SmartInfinityStrategy

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def own_mapping(nbytes):
    before = libc.mallinfo2().hblkhd  # bytes in mappings of their own
    block = torch.ones(nbytes, dtype=torch.uint8)
    return libc.mallinfo2().hblkhd - before >= nbytes

torch.ones(16 << 20, dtype=torch.uint8)  # made and freed: glibc now keeps blocks below 16 MiB on its heap
print(own_mapping(2 << 20))
strategy = SmartInfinityStrategy(storage_paths=[{storage!r}], sub_group_size=1 << 16, offload_parameters=True)
fit(LMModule(adamw_factory(lr=1e-3), dim=64, layers=2), strategy, steps=1, precision="bf16-mixed")
print(own_mapping(2 << 20))
"""


@pytest.mark.slow
def test_large_host_blocks_are_mappings_given_back_when_freed(tmp_path, free_port):
    """glibc raises its mmap threshold as large blocks are freed and keeps later layer-sized blocks on a heap whose
    holes stay in the RSS; from set-up on, the strategy gives every block of 1 MiB or more a mapping of its own."""
    script = HEAP_PROBE.format(storage=str(tmp_path))
    env = worker_env(MASTER_PORT=str(free_port()))
    env.pop("MALLOC_MMAP_THRESHOLD_", None)  # a user's own threshold is left alone
    out = python("-c", script, env=env, timeout=300)
    assert out.stdout.split()[-2:] == ["False", "True"], out.stdout
