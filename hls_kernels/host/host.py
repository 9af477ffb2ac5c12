"""Run one SmartSSD update kernel through pyxrt and check it against a numpy reference.

Follows the Vitis/XRT example flow: device -> xclbin -> kernel -> bo(group_id) -> sync -> run.wait.
NOT RUN HERE: written against the documented pyxrt API (XRT 2.12+), without an FPGA or XRT to try it on.

    python host/host.py --xclbin build_dir.hw/smartinf.xclbin [--device 0] [--n 100003]

Emulation: `make run TARGET=sw_emu` sets XCL_EMULATION_MODE and runs this from build_dir.sw_emu/.
"""

from __future__ import annotations

import argparse
import math
import struct
import sys

import numpy as np


def f32_arg(x: float) -> int:
    """pyxrt's run.set_arg takes a bo or an int: pass a float scalar as its 32-bit pattern."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def padded(n: int, itemsize: int) -> int:
    per_beat = 64 // itemsize
    return max(1, -(-n // per_beat)) * per_beat


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns, round to nearest even (finite inputs)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--xclbin", required=True)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--n", type=int, default=100_003)
    parser.add_argument("--kernel", default="smartinf_adam_bf16")
    args = parser.parse_args()

    import pyxrt  # imported here so `--help` works without XRT

    device = pyxrt.device(args.device)
    xclbin = pyxrt.xclbin(args.xclbin)
    uuid = device.load_xclbin(xclbin)
    kernel = pyxrt.kernel(device, uuid, args.kernel, pyxrt.kernel.shared)

    n, rng = args.n, np.random.default_rng(0)
    master = rng.standard_normal(n).astype(np.float32)
    grad = rng.standard_normal(n).astype(np.float32) * 0.1
    lr, beta1, beta2, eps, wd, step = 1e-3, 0.9, 0.999, 1e-8, 0.01, 1

    def bo(nbytes: int, arg: int) -> pyxrt.bo:
        return pyxrt.bo(device, nbytes, pyxrt.bo.normal, kernel.group_id(arg))

    # argument order of smartinf_adam_<T>: master, exp_avg, exp_avg_sq, grad, param_out, n, scalars..., flags
    np32 = padded(n, 4)
    host = {
        0: np.zeros(np32, np.float32),
        1: np.zeros(np32, np.float32),
        2: np.zeros(np32, np.float32),
        3: np.zeros(padded(n, 2), np.uint16),
    }
    host[0][:n] = master
    host[3][:n] = bf16_bits(grad)
    bos = {i: bo(a.nbytes, i) for i, a in host.items()}
    bos[4] = bo(padded(n, 2) * 2, 4)
    for i, a in host.items():
        bos[i].write(a, 0)
        bos[i].sync(pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE, a.nbytes, 0)

    scalars = [1.0, 1.0 - lr * wd, 0.0, 1.0 - beta1, beta2, 1.0 - beta2, math.sqrt(1.0 - beta2**step), eps,
               -lr / (1.0 - beta1**step)]  # AdamW: decoupled decay
    flags = 1 << 2
    run = pyxrt.run(kernel)
    for i in range(5):
        run.set_arg(i, bos[i])
    run.set_arg(5, n)
    for j, s in enumerate(scalars):
        run.set_arg(6 + j, f32_arg(s))
    run.set_arg(6 + len(scalars), flags)
    run.start()
    run.wait()

    bos[0].sync(pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE, host[0].nbytes, 0)
    bos[4].sync(pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE, padded(n, 2) * 2, 0)
    got_master = np.frombuffer(bytes(bos[0].map()), dtype=np.float32)[:n]
    got_param = np.frombuffer(bytes(bos[4].map()), dtype=np.uint16)[:n]

    g = (host[3][:n].astype(np.uint32) << 16).view(np.float32)
    m = (1.0 - beta1) * g
    v = (1.0 - beta2) * g * g
    p = master * (1 - lr * wd) - lr / (1 - beta1**step) * m / (np.sqrt(v) / math.sqrt(1 - beta2**step) + eps)
    ok = np.allclose(got_master, p, rtol=1e-5, atol=1e-7) and np.array_equal(got_param, bf16_bits(got_master))
    print("TEST PASSED" if ok else "TEST FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
