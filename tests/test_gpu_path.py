"""Defects of the CUDA path that a CPU run would hide, each shown on the CPU.

DeepSpeed's CPU accelerator makes pinning a no-op and its threads have no device to pick, so these tests give the CPU
what CUDA would do: an accelerator whose ``pin_memory`` refuses meta tensors and records who pinned what, and threads
that report the device they were bound to. The two-rank overflow and the two-GPU check's layout run as checks of the
GPU suite on two gloo ranks (``tests/cuda/test_gpu.py``).
"""

from __future__ import annotations

import functools
import inspect

import lightning as L
import pytest
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from helpers.models import LMModule, adamw_factory, fit
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.overrides import TorchFunctionMode

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.activations import SavedTensorOffloader
from lightning_smartinf.core.accelerator import PinnedRing, bind_thread, thread_device
from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.io.direct import StateFile, ThreadedIO
from lightning_smartinf.core.rules import Adam, StepParams
from lightning_smartinf.core.settings import check_accelerator_budget
from lightning_smartinf.devices.cpu import CpuBackend

DIM = 512  # the MLP weights' partitions reach DeepSpeed's 1 MiB and go to storage


adamw = adamw_factory()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("offload_parameters", "gradient_buffer"),
    [("storage", "host"), (True, "accelerator")],
    ids=["gradients-in-a-file", "gradients-on-the-accelerator"],
)
def test_deepspeed_never_pins_a_gradient_buffer_we_replace(
    tmp_path, monkeypatch, offload_parameters, gradient_buffer
) -> None:
    """CUDA refuses to pin a meta tensor, which is what ZeRO's gradient buffer is when it goes to a file; and a buffer
    we replace would stay page-locked for nothing. The accelerator here pins as CUDA does."""
    pinned_by: list[str] = []

    def pin_like_cuda(self, tensor, make_copy=True, match_shape=True):  # noqa: ANN001, ANN202
        if tensor.device.type == "meta":
            raise RuntimeError("cannot pin 'meta' memory")  # what `Tensor.pin_memory` raises under CUDA
        pinned_by.append(inspect.stack()[1].function)
        return tensor

    monkeypatch.setattr(CPU_Accelerator, "pin_memory", pin_like_cuda)
    trainer, params = fit(
        LMModule(adamw, dim=DIM),
        SmartInfinityStrategy(
            storage_paths=[tmp_path],
            offload_parameters=offload_parameters,
            gradient_buffer=gradient_buffer,
            sub_group_size=400_000,
        ),
        steps=2,
        precision="bf16-true",
    )
    assert all(torch.isfinite(p).all() for p in params.values())
    assert "_setup_for_real_optimizer" not in pinned_by, pinned_by  # the only place ZeRO pins its gradient buffer
    optimizer = trainer.strategy.deepspeed_engine.optimizer
    assert (optimizer.gradient_file is not None) == (offload_parameters == "storage")
    # ZeRO's fp16 overflow check ORs `isinf(buffer).any()` into a flag in place: a buffer on another device (the GPU
    # under CUDA) takes the flag along, or the first fp16 step meets a host flag and a GPU buffer.
    elsewhere = torch.zeros(optimizer.grad_partitions_flat_buffer.numel(), device="meta")
    optimizer._replace_gradient_buffer(elsewhere)
    assert optimizer.inf_or_nan_tracker.device == elsewhere.device


class LinkCopies(TorchFunctionMode):
    """Bytes ZeRO's ``partition_grads`` moves between the accelerator and a host gradient buffer, counted on the CPU.

    The host buffer is told apart by its storage: a copy into it from anything else is device-to-host; a copy out
    of it, or ``.to(device)`` of it, host-to-device, and gives a tensor of its own (on the CPU ``.to("cpu")`` would
    return the buffer itself, and ZeRO's add on the accelerator would then land in the host buffer uncounted).
    """

    def __init__(self, buffer: torch.Tensor) -> None:
        super().__init__()
        self.host = buffer.untyped_storage().data_ptr()
        self.to_host = self.to_device = 0

    def in_host(self, value: object) -> bool:
        return isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == self.host

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            if self.in_host(dst) and not self.in_host(src):
                self.to_host += dst.numel() * dst.element_size()
            elif self.in_host(src) and not self.in_host(dst):
                self.to_device += src.numel() * src.element_size()
        elif func is torch.Tensor.to and self.in_host(args[0]):
            targets = [*args[1:], kwargs.get("device")]
            if any(isinstance(t, torch.device) or (isinstance(t, str) and t != "") for t in targets):
                self.to_device += args[0].numel() * args[0].element_size()
                return args[0].clone()
        return func(*args, **kwargs)


class CountLinkCopies(L.Callback):
    """Per optimizer step and micro-batch: the bytes of gradient partitions the step reduced (``reduced``) and what
    crossed the link each way while ZeRO put them in its host buffer (``to_host``, ``to_device``).

    Within ``partition_grads`` the accelerator answers as CUDA would: the host buffer is not on it. ``stock``: run
    DeepSpeed's own ``partition_grads`` instead of the strategy's."""

    def __init__(self, stock: bool = False) -> None:
        self.stock = stock
        self.moved: dict[tuple[int, int], dict[str, int]] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        optimizer = trainer.strategy.deepspeed_engine.optimizer
        buffer = optimizer.grad_partitions_flat_buffer
        accelerator = get_accelerator()
        partition_grads = (
            functools.partial(DeepSpeedZeroOptimizer_Stage3.partition_grads, optimizer)
            if self.stock
            else optimizer.partition_grads
        )

        def counted(params, grad_partitions):  # noqa: ANN001, ANN202 - ZeRO's, counted
            mode = LinkCopies(buffer)
            accelerator.on_accelerator = lambda tensor: not mode.in_host(tensor)
            try:
                with mode:
                    result = partition_grads(params, grad_partitions)
            finally:
                del accelerator.on_accelerator
            key = (trainer.global_step, optimizer.micro_step_id)
            moved = self.moved.setdefault(key, {"reduced": 0, "to_host": 0, "to_device": 0})
            moved["reduced"] += sum(p.numel() for p in grad_partitions) * buffer.element_size()
            moved["to_host"] += mode.to_host
            moved["to_device"] += mode.to_device
            return result

        optimizer.partition_grads = counted


def test_accumulating_into_host_memory_moves_each_micro_batch_no_more_than_it_must(tmp_path) -> None:
    """Four micro-batches into pinned host memory (``gradient_buffer="host"``), fp32 accumulation: each micro-batch's
    partitions cross to the host once; a micro-batch after a step's first also brings the partial sum over to add to
    (ZeRO adds on the accelerator). DeepSpeed's own code also copies the first micro-batch's partitions back to the
    accelerator, for a norm only the last micro-batch takes: that copy is gone, and the training is the same."""
    params = {}
    for stock in (True, False):
        counter = CountLinkCopies(stock=stock)
        strategy = SmartInfinityStrategy(
            storage_paths=[tmp_path / str(stock)], gradient_buffer="host", sub_group_size=3000
        )
        trainer, params[stock] = fit(
            LMModule(adamw), strategy, steps=2, accumulate=4, precision="bf16-mixed", callbacks=[counter]
        )
        assert trainer.strategy.deepspeed_engine.optimizer.grad_partitions_flat_buffer.dtype == torch.float32
        assert sorted(counter.moved) == [(step, micro) for step in range(2) for micro in range(4)]
        for (_, micro), moved in counter.moved.items():
            reduced = moved["reduced"]
            assert reduced > 0
            assert moved["to_host"] == reduced, (stock, micro, moved)
            back = reduced if micro > 0 or stock else 0
            assert moved["to_device"] == back, (stock, micro, moved)
    assert all(torch.equal(params[False][name], params[True][name]) for name in params[True])


class RecordingIO(ThreadedIO):
    """Real ``pread``/``pwrite``; records the device each calling thread was bound to."""

    def __init__(self, seen: list[tuple[str, torch.device | None]]) -> None:
        super().__init__(block_size=4096, queue_depth=2)
        self.seen = seen

    def read(self, file: StateFile, buf: torch.Tensor, offset: int) -> None:
        self.seen.append(("read", thread_device()))
        super().read(file, buf, offset)

    def write(self, file: StateFile, buf: torch.Tensor, offset: int) -> None:
        self.seen.append(("write", thread_device()))
        super().write(file, buf, offset)


class RecordingAdam(Adam):
    """Adam that records the device of the thread that updates."""

    def apply(self, master, grad, states, hp) -> None:  # noqa: ANN001
        SEEN.append(("update", thread_device()))
        super().apply(master, grad, states, hp)


SEEN: list[tuple[str, torch.device | None]] = []


@pytest.fixture
def bound_to_a_device():
    """This thread bound to a device (here the CPU; a rank's GPU in training), unbound afterwards."""
    device = torch.device("cpu", 0)
    bind_thread(device)
    yield device
    bind_thread(None)


def test_every_thread_of_a_device_runs_on_the_device_of_the_thread_that_built_it(tmp_path, bound_to_a_device) -> None:
    """Reader, writer and update threads: a CUDA call on any of them goes to this rank's GPU, never GPU 0."""
    SEEN.clear()
    seen: list[tuple[str, torch.device | None]] = []
    backend = CpuBackend([tmp_path / "csd0"], chunk_elems=1024, buffer_count=4, io_factory=lambda: RecordingIO(seen))
    try:
        backend.open([ShardSpec(0, 4096, RecordingAdam(decoupled_weight_decay=True))])
        backend.initialize(0, torch.randn(4096))
        backend.wait()
        out = torch.empty(4096)
        backend.result(backend.submit(0, torch.randn(4096), StepParams(step=1, lr=1e-2), out))
        backend.wait()
    finally:
        backend.close()
    kinds = {kind for kind, _ in [*seen, *SEEN]}
    assert kinds == {"read", "write", "update"}, kinds
    assert {device for _, device in [*seen, *SEEN]} == {bound_to_a_device}, [*seen, *SEEN]


def test_activation_offload_threads_run_on_the_device_of_each_tensor(tmp_path) -> None:
    """One pool serves every tensor: each write and read binds its thread to the tensor's own device first."""
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(3)))
    offloader = SavedTensorOffloader([tmp_path], threshold_bytes=1024, keep_last=0).attach(model)
    bound: set[torch.device | None] = set()
    write, read = offloader._write, offloader._read

    def recording(task):  # noqa: ANN001, ANN202
        def run(rec):  # noqa: ANN001, ANN202
            try:
                return task(rec)
            finally:
                bound.add(thread_device())

        return run

    offloader._write, offloader._read = recording(write), recording(read)
    try:
        with offloader:
            loss = model(torch.randn(8, 256)).square().mean()
            offloader.settle_writes()
            loss.backward()
        assert offloader.stats.bytes_read > 0
    finally:
        offloader.close()
    assert bound == {torch.device("cpu")}, bound


def test_an_accelerator_budget_is_checked_on_the_rank_device_at_set_up() -> None:
    """The strategy's settings never ask a GPU for its free memory (they are made before Lightning picks the rank's
    GPU); set-up asks the rank's own device."""
    check_accelerator_budget(None, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"`state_accelerator_budget=1024` keeps optimizer state in GPU memory, but"):
        check_accelerator_budget(1024, torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(MisconfigurationException, match="CUDA is not available here"):
            SmartInfinityStrategy(state_accelerator_budget="1GiB")


def test_the_pinned_ring_moves_every_piece_in_order_and_its_fence_covers_them(tmp_path) -> None:
    """Many more pieces than slots, into the same destination twice: every value of the later copy lands, and a fence
    taken after a piece was queued completes only once it has (the ring's one thread moves pieces in order)."""
    ring = PinnedRing(slots=2, slot_bytes=4096)  # 1024 fp32 elements a piece
    destination = torch.zeros(10_000)
    first, second = torch.randn(10_000), torch.randn(10_000)
    ring.copy(destination, first)
    ring.copy(destination, second)
    ring.fence().synchronize()
    torch.testing.assert_close(destination, second, rtol=0, atol=0)
    ring.copy(destination[:3], torch.ones(3))
    ring.flush()
    assert destination[:3].tolist() == [1.0, 1.0, 1.0]
    ring.close()
