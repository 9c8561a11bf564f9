#!/usr/bin/env bash
# The GPU session of issue 10, stage by stage: run from the repository root on the lent GPU machine
# (the device tool copies the working tree there and collects $OUT). No Ray, no install: the
# machine's python3 has torch, triton, numpy, msgpack, pytest, hypothesis and matplotlib.
#
#   bash bench/gpu_session.sh env tests   # ~3 min: the device, torch, distca's backends; the gpu-marked tests
#   bash bench/gpu_session.sh kernels     # ~3-6 min: bench/gpu_kernels.py, full sizes (shards, overhead, profile)
#   bash bench/gpu_session.sh transport   # NVSHMEM vs NCCL/copy (bench/transport.py, when present)
#
# One device call per line above (each stays inside the tool's 10 minutes a command and its 8 files
# back from $OUT). Files written to $OUT (default /tmp/distca_gpu_session):
#   env:       env.log
#   tests:     tests.log
#   kernels:   kernels.log, kernels.json, kernels.png,
#              kernels_profile/<model>-tp<tp>/{forward,backward}.json (llama3-8b:8 and llama-34b:8)
#   transport: transport.log, transport_nvshmem.json
# Afterwards, on the development machine: copy kernels.json/.png and kernels_profile/ under
# bench/results/gpu/<device-name-slug>/ (committed; .gitignore keeps that folder), and try
#   distca simulate --gpu h100 --attn-profile bench/results/gpu/<slug>/kernels_profile/llama3-8b-tp8
# Dry run on a CPU machine: PYTHON=.venv/bin/python GPU_KERNELS_ARGS="--device cpu --quick" \
#   OUT=/tmp/x bash bench/gpu_session.sh tests kernels
# Exit status: 1 if any stage failed (its log says why), else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/distca_gpu_session}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
status=0

# stage NAME TIMEOUT_S COMMAND...: run it with a time limit (a shell function: without), its output to the terminal and $OUT/NAME.log
stage() {
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    if declare -F "$1" >/dev/null; then "$@"; else timeout "$limit" "$@"; fi 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit status $rc"
    [ "$rc" -eq 0 ] || status=1
}

env_info() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    "$PY" - <<'EOF'
import importlib.util, platform, torch
from distca_server.kernels import available_backends
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("varlen_attn", importlib.util.find_spec("torch.nn.attention.varlen") is not None,
      "flash_attn", importlib.util.find_spec("flash_attn") is not None,
      "ray", importlib.util.find_spec("ray") is not None)
print("distca backends on cuda:", available_backends("cuda"))
EOF
}

[ $# -gt 0 ] || set -- env tests kernels
for s in "$@"; do
    case "$s" in
        env) stage env 120 env_info ;;
        tests) stage tests 480 "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs \
                   tests/unit/test_kernels.py tests/integration/test_bench_gpu_kernels.py ;;
        # GPU_KERNELS_ARGS: extra arguments, e.g. "--device cpu --quick" for a dry run anywhere
        # shellcheck disable=SC2086
        kernels) stage kernels 570 "$PY" bench/gpu_kernels.py --json "$OUT/kernels.json" ${GPU_KERNELS_ARGS:-} ;;
        transport)
            if [ -f bench/transport.py ]; then
                # NVSHMEM needs nvshmem4py (not in the image): carry its wheels as .whl and install
                # them first (see /work/.library/device/README.md), e.g. PYTHONPATH=/tmp/site:...
                stage transport 570 "$PY" bench/transport.py --transport nvshmem --procs 2 4 \
                    --max-size 1GiB --json "$OUT/transport_nvshmem.json"
            else
                echo "== transport: bench/transport.py is not in this tree; skipped"
            fi ;;
        *) echo "unknown stage $s (env, tests, kernels, transport)" >&2; status=1 ;;
    esac
done
exit $status
