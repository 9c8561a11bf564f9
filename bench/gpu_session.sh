#!/usr/bin/env bash
# The GPU session of issue 10, stage by stage: run from the repository root on the lent GPU machine
# (the device tool copies the working tree there and collects $OUT). No Ray, no network: the
# machine's python3 has torch, triton, numpy, msgpack, pytest, hypothesis and matplotlib; nvshmem4py
# travels as a wheel in .whl/ (ignored by git; see /work/.library/device/README.md) and is
# installed into /tmp/site first when present (.whl/extra/cuda_core-*.whl too, only if the image's
# cuda.core is older than nvshmem4py needs).
#
#   bash bench/gpu_session.sh                     # all stages below, in this order
#   bash bench/gpu_session.sh env ktests kernels  # some of them
#
# Stages (each under its own time limit; one failing does not stop the next):
#   env        the device, torch, distca's backends, nvshmem4py's version
#   ktests     the gpu-marked kernel tests (torch_varlen / flash_attn against the references)
#   kernels    bench/gpu_kernels.py (fused shards, distca overhead, a measured ProfileTable)
#   ntests     the nvshmem-marked tests (the exchange against LocalTransport, attend over NVSHMEM
#              against the float64 reference, a dead or departed PE)
#   transport  bench/transport.py --transport nvshmem (against NCCL, or a device copy on one GPU)
#
# Files written to $OUT (default /tmp/distca_gpu_session; the device tool brings back 8 files at
# most, two folders deep): session.log (every stage's output), kernels.json, kernels.png,
# kernels_profile/<model>-tp<tp>/{forward,backward}.json, transport_nvshmem.json.
# Afterwards, on the development machine: copy them under bench/results/gpu/<device-name-slug>/
# (committed; .gitignore keeps that folder) and try
#   distca simulate --gpu h200 --attn-profile bench/results/gpu/<slug>/kernels_profile/llama3-8b-tp8
# Dry run on a CPU machine: PYTHON=.venv/bin/python GPU_KERNELS_ARGS="--device cpu --quick" \
#   OUT=/tmp/x bash bench/gpu_session.sh env ktests kernels
# Exit status: 1 if any stage failed (the log says why), else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/distca_gpu_session}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
LOG="$OUT/session.log"
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    # nvshmem4py wants cuda.core >= 0.5: the carried one only where the image's is older.
    if ls .whl/extra/cuda_core-*.whl >/dev/null 2>&1 && ! "$PY" -c '
import sys
from importlib.metadata import version
sys.exit(0 if tuple(int(x) for x in version("cuda-core").split(".")[:2]) >= (0, 5) else 1)'; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/extra/cuda_core-*.whl
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

# stage NAME TIMEOUT_S COMMAND...: run it under a time limit (a shell function: without one); its
# output to the terminal and appended to $LOG
stage() {
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    echo "== $name: $*" | tee -a "$LOG"
    if declare -F "$1" >/dev/null; then "$@"; else timeout -k 5 "$limit" "$@"; fi 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit status $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || status=1
}

env_info() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    "$PY" - <<'EOF'
import importlib.util, platform, torch
from importlib.metadata import PackageNotFoundError, version
from distca_server.kernels import available_backends
from distca_server.transport import nvshmem
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("varlen_attn", importlib.util.find_spec("torch.nn.attention.varlen") is not None,
      "flash_attn", importlib.util.find_spec("flash_attn") is not None,
      "ray", importlib.util.find_spec("ray") is not None)
for pkg in ("nvshmem4py-cu13", "nvidia-nvshmem-cu13", "cuda-core", "cuda-bindings", "cuda-pathfinder",
            "cupy-cuda13x"):
    try:
        print(pkg, version(pkg))
    except PackageNotFoundError:
        print(pkg, "not installed")
print("distca backends on cuda:", available_backends("cuda"), "nvshmem available:", nvshmem.available())
EOF
}

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs --tb=short)
[ $# -gt 0 ] || set -- env ktests kernels ntests transport
for s in "$@"; do
    case "$s" in
        env) stage env 60 env_info ;;
        ktests) stage ktests 120 "${PYTEST[@]}" -m gpu tests/unit/test_kernels.py tests/unit/test_kernels_window.py ;;
        # GPU_KERNELS_ARGS: e.g. "--device cpu --quick" for a dry run anywhere, or fewer repeats
        # shellcheck disable=SC2086
        kernels) stage kernels "${KERNELS_LIMIT:-240}" "$PY" bench/gpu_kernels.py --json "$OUT/kernels.json" \
                     ${GPU_KERNELS_ARGS:-} ;;
        ntests) stage ntests 180 "${PYTEST[@]}" -m nvshmem tests/unit/test_transport_nvshmem.py \
                    tests/unit/test_attend_transport.py ;;
        # shellcheck disable=SC2086
        transport) stage transport "${TRANSPORT_LIMIT:-150}" "$PY" bench/transport.py --transport nvshmem --procs 2 4 \
                       --max-size 1GiB --json "$OUT/transport_nvshmem.json" ${TRANSPORT_ARGS:-} ;;
        *) echo "unknown stage $s (env, ktests, kernels, ntests, transport)" >&2; status=1 ;;
    esac
done
exit $status
