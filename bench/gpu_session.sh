#!/usr/bin/env bash
# The GPU session of issues 10 and 22, stage by stage: run from the repository root on the lent GPU
# machine (the device tool copies the working tree there and collects $OUT). No network: the
# machine's python3 has torch, triton, numpy, msgpack, pytest, hypothesis, matplotlib, transformers,
# pandas, pyarrow; nvshmem4py and Ray travel as wheels (ignored by git: add /.whl/ and /.carry/ to
# .git/info/exclude; see /work/.library/device/README.md) and are installed into /tmp/site first
# when present (extra/cuda_core-*.whl too, only if the image's cuda.core is older than nvshmem4py
# needs). Ray Train (the `train` stage) also imports pydantic and colorful, which the image lacks;
# build everything with, from the project root on the development machine:
#   bash ../shared/gpu/carry_wheels.sh .whl pydantic==2.14.4 pydantic-core==2.50.5 \
#       annotated-types==0.8.0 typing-inspection==0.4.5 colorful==0.5.8 nvidia-cudnn-frontend==1.32.0
#   python bench/carry_wheels.py pack .whl .carry/wheels.tar.xz   # about 2.5 min
# Measured 2026-11-28: those wheels are 59.3 MiB, packed 31.3 MiB; with the tracked tree (4.2 MiB)
# a call carries 35.5 of its 64 MiB. This script rebuilds the wheels from the pack when .carry/
# holds one (3.7 s on the development machine), else installs .whl/*.whl as they are (63.5 MiB
# with the tree: no room to grow).
#
#   BUDGET_S=560 bash bench/gpu_session.sh        # every stage, most wanted first, in one call
# (the device tool's run: command "BUDGET_S=560 bash bench/gpu_session.sh", carry [".carry"],
# timeout_s 600; afterwards unpack results.tar as said below)
#   bash bench/gpu_session.sh env ktests kernels  # some of them
#
# One device call: 15 minutes of device time a session, a machine's start included, and 10
# minutes a call, so the whole session is one call of the default order under BUDGET_S (seconds
# from the script's start, wheels' install included): a stage starts only with >= 30 s of the
# budget left, and runs under the smaller of its limit and what is left, so the script ends by
# itself, with everything packed, before the call's limit. Default order (the issues' priority:
# the device-driven exchange and the whole job first, then the kernels' numbers, then the rest;
# the whole job before the multi-process exchange, which would otherwise leave it ~100 s of its
# 240 s if both exchange stages ran to their limits):
#   env mps inproc train transport kernels host backends ktests pingpong dead graphs ngraphs tagged ntests
#
# Stages (each under its own time limit; one failing does not stop the next):
#   mps        whether the CUDA MPS control daemon starts here (nvidia-cuda-mps-control -d) and a
#              CUDA client runs under it; reported either way, stopped afterwards (issue 22)
#   env        the device, torch, distca's backends, nvshmem4py's version
#   ktests     the gpu-marked tests: kernels (torch_varlen / flash_attn against the references),
#              rounds on the GPU (lock-step local participants; stream ordering of rounds), stream
#              memory operations and captured exchanges (CUDA graphs) of in-process participants
#   kernels    bench/gpu_kernels.py (fused shards, a measured ProfileTable, then distca overhead: the
#              backends stage reads the tables; the JSON is rewritten after every row, so a stage
#              stopped at its limit keeps what finished)
#   backends   bench/gpu_backends.py (issue 21): every backend here against torch's FA2 (TFLOP/s,
#              32/8/128 and 64/8/128, 8K-128K), each one's fused shards, and DistCAClient.local(4)
#              planned by the FLOP and the time planner (this session's table when the kernels
#              stage wrote it): each server's measured kernel time, max/mean. BACKENDS_LIMIT
#              (default 200 s), BACKENDS_ARGS appended
#   ntests     the nvshmem-marked tests (the exchange against LocalTransport, attend over NVSHMEM
#              against the float64 reference, a dead or departed PE, two group epochs on one
#              NVSHMEM world and heap)
#   transport  bench/transport.py --transport nvshmem: host-driven and device-driven exchanges
#              (against NCCL, or a device copy on one GPU)
#   inproc     bench/transport.py --transport local --device cuda: 2 and 4 participants of one
#              process over plain device buffers, device-driven (stream memory operations) against
#              host-driven and the in-process copy (exchange_us_64KiB_2pe in its JSON's summary)
#   graphs     bench/transport.py with captured exchanges (issue 22 item 4), in-process participants
#              (CUDA graphs of stream memory operations): the host's time to queue a device-driven
#              exchange against a replay (exchange_host_us_64KiB_2pe_graphed); apart from inproc, so
#              that a capture failing on this GPU costs inproc nothing
#   ngraphs    the same over 2 NVSHMEM PEs (CUDA graphs of NVSHMEM's on-stream calls)
#   dead       bench/dead_peer.py --transport nvshmem: a PE exits mid-run; seconds until the others
#              raise DistCAError (dead_pe_error_s)
#   host       bench/host_path.py on this machine's CPU (a few seconds): distca's own host time per
#              replayed layer, to set beside the same benchmark on the development machine
#              (host_path.json); then with --device cuda, the recordings CUDA graphs replayed for
#              real, 8 layers a step, the CUDA calls included, and where that time goes (cProfile,
#              --profile 20: host_path_cuda.json), beside the kernels stage's
#              host_us_per_layer_graphed (one layer of 8K tokens)
#   pingpong   bench/pingpong.py: two nano-batches per layer over 2 in-process participants,
#              against one after the other and against the signal-only control (the paper's Fig. 11)
#   train      `make demo-gpu`'s run (issue 22 item 5: the Makefile's DEMO_GPU_ARGS): Ray Train, the
#              scheduler actor and 2 in-place clients sharing the GPU, NVSHMEM, a 23 M-parameter
#              Llama in bf16, 16K tokens per rank, 20 steps with distca and again with local
#              attention; fails unless the first 10 losses agree to bf16 rounding. TRAIN_LIMIT
#              (default 240 s) bounds it; TRAIN_ARGS are appended (later flags win)
#   tagged     bench/tagged_rounds.py --device cuda: two in-place Ray jobs over NVSHMEM side by
#              side (2 clients each, all four sharing the GPU), the round header in every round
#              against tagged rounds (the header only where a plan's routes install): step time and
#              the host time of an attend (tagged_step_ratio_2clients). TAGGED_LIMIT (default 150 s)
#              bounds it; TAGGED_ARGS are appended
#
# Files: the stages write into $RES (default /tmp/distca_gpu_results): kernels.json, kernels.png,
# kernels_profile/<model>-tp<tp>/{forward,backward}.json, backends.json, backends.png, transport_nvshmem.json,
# transport_local.json, transport_local_graph.json, transport_nvshmem_graph.json,
# tagged_rounds.json, dead_peer_nvshmem.json, pingpong.json, host_path.json, host_path_cuda.json, train.json (loss agreement, step time
# and tokens/s of both runs: train_loss_max_rel_diff_10_steps, train_tokens_per_s_distca,
# train_tokens_per_s_local, the transport, kernel and NVSHMEM status that ran, step 0's loss and
# gradient-norm differences, ...), train_metrics_{distca,local}.json (every step's record),
# train_loss.png, train_ray_logs.txt / tagged_ray_logs.txt (the tails
# of Ray's own logs, only when that stage failed), and at the end summary.json
# (bench/gpu_summary.py). The device tool brings back 8 files at most per call, so after every
# stage $RES is packed into $OUT/results.tar (a call cut short still brings back every finished
# stage's files); $OUT (default /tmp/distca_gpu_session) also holds session.log (every stage's
# output) and summary.json.
# Afterwards, on the development machine: unpack results.tar under
# bench/results/gpu/<device-name-slug>/ with session.log beside it (committed; .gitignore keeps
# that folder) and try
#   distca simulate --gpu h200 --attn-profile bench/results/gpu/<slug>/kernels_profile/llama3-8b-tp8
# Dry run on a CPU machine: PYTHON=.venv/bin/python GPU_KERNELS_ARGS="--device cpu --quick" \
#   OUT=/tmp/x bash bench/gpu_session.sh env ktests kernels
# and of the train stage (the same code path on the CPU, shared-memory transport, a tiny model):
#   PYTHON=.venv/bin/python OUT=/tmp/x TRAIN_ARGS="--device cpu --transport shm --dtype float32 \
#   --layers 2 --hidden 64 --heads 4 --kv-heads 2 --context 512 --steps 3 --min-shard 32" \
#   bash bench/gpu_session.sh mps train
# Exit status: 1 if any stage failed (the log says why), else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/distca_gpu_session}
RES=${RES:-/tmp/distca_gpu_results}
PY=${PYTHON:-python3}
# A warm machine keeps /tmp between calls: this call's results only (KEEP_RES=1 keeps the last's)
[ "${KEEP_RES:-0}" = 1 ] || rm -rf "$RES"
mkdir -p "$OUT" "$RES"
LOG="$OUT/session.log"
status=0
DEADLINE=$((SECONDS + ${BUDGET_S:-1000000}))
# The carried wheels: .carry/wheels.tar.xz (bench/carry_wheels.py pack: about half the bytes) is
# rebuilt into wheels first; else the wheels in .whl/ as they are. Installed into $SITE (default
# /tmp/site). Logged as the stage "wheels" (session.log and summary.json's stages): the device
# tool's output_tail keeps only the last 12,000 characters, so a failed install would otherwise
# leave no reason behind.
SITE=${SITE:-/tmp/site}
WHEELS_DIR=${WHEELS_DIR:-/tmp/distca_wheels}
WHEELS=
wheels_t0=$SECONDS
wheels_rc=0
if [ -f .carry/wheels.tar.xz ]; then
    echo "== wheels: unpacking .carry/wheels.tar.xz into $WHEELS_DIR" | tee -a "$LOG"
    rm -rf "$WHEELS_DIR"
    "$PY" bench/carry_wheels.py unpack .carry/wheels.tar.xz "$WHEELS_DIR" 2>&1 >/dev/null | tee -a "$LOG"
    wheels_rc=${PIPESTATUS[0]}
    [ "$wheels_rc" -eq 0 ] && WHEELS=$WHEELS_DIR
elif ls .whl/*.whl >/dev/null 2>&1; then
    WHEELS=.whl
else  # no Ray, no nvshmem4py: most stages will fail
    echo "== wheels: skipped, none carried (no .carry/wheels.tar.xz, no .whl/*.whl)" | tee -a "$LOG"
fi
if [ -n "$WHEELS" ]; then
    echo "== wheels: installing $(ls "$WHEELS"/*.whl | wc -l) wheels into $SITE" | tee -a "$LOG"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl 2>&1 | tee -a "$LOG"
    wheels_rc=${PIPESTATUS[0]}
    if [ "$wheels_rc" -ne 0 ]; then
        # pip installs all of them or none: one bad wheel must not cost the others (Ray, nvshmem4py)
        echo "== wheels: pip failed ($wheels_rc); installing them one by one" | tee -a "$LOG"
        for w in "$WHEELS"/*.whl; do
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
                "$w" 2>&1 | tee -a "$LOG"
            [ "${PIPESTATUS[0]}" -eq 0 ] || echo "== wheels: FAILED $(basename "$w")" | tee -a "$LOG"
        done
    fi
    [ -d "$SITE" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    # nvshmem4py wants cuda.core >= 0.5: the carried one only where the image's is older.
    if ls "$WHEELS"/extra/cuda_core-*.whl >/dev/null 2>&1 && ! "$PY" -c '
import sys
from importlib.metadata import version
sys.exit(0 if tuple(int(x) for x in version("cuda-core").split(".")[:2]) >= (0, 5) else 1)'; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$WHEELS"/extra/cuda_core-*.whl 2>&1 | tee -a "$LOG"
        [ "${PIPESTATUS[0]}" -eq 0 ] || wheels_rc=1
    fi
fi
if [ -n "$WHEELS" ] || [ "$wheels_rc" -ne 0 ]; then
    echo "== wheels: exit status $wheels_rc after $((SECONDS - wheels_t0)) s" | tee -a "$LOG"
    [ "$wheels_rc" -eq 0 ] || status=1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# In-process participants hold stream waits on streams of their own (a communication, a force and
# a replay stream each): past CUDA_DEVICE_MAX_CONNECTIONS (default 8) streams share hardware
# queues, where one held wait could hold a peer's work (transport/memop_stream.py).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
# Several PEs on one GPU run NVSHMEM in its limited multi-process-per-GPU mode, where its
# collective barrier exits the process; the heap's NVLS (multicast) set-up calls it. distca uses
# no multicast, so a session turns it off rather than risk every NVSHMEM stage.
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}

# $RES into $OUT/results.tar, replacing the last one whole (a call cut short brings back a whole tar)
pack() {
    tar -C "$RES" -cf "$OUT/results.tar.part" . && mv -f "$OUT/results.tar.part" "$OUT/results.tar"
}

# stage NAME TIMEOUT_S COMMAND...: run it under a time limit, cut to what is left of BUDGET_S (a
# shell function gets it as STAGE_LIMIT); its output to the terminal and appended to $LOG; then pack
stage() {
    local name=$1 limit=$2 t0=$SECONDS left=$((DEADLINE - SECONDS - 10))
    shift 2
    if [ "$left" -lt 30 ]; then
        echo "== $name: skipped, $((DEADLINE - SECONDS)) s of BUDGET_S left" | tee -a "$LOG"
        status=1
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
    echo "== $name (limit $limit s): $*" | tee -a "$LOG"
    if declare -F "$1" >/dev/null; then STAGE_LIMIT=$limit "$@"; else timeout -k 5 "$limit" "$@"; fi 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit status $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || status=1
    pack
}

env_info() {  # a shell function runs without the stage's timeout: each command has its own
    timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    timeout 35 "$PY" - <<'EOF'
import importlib.util, platform, torch
from importlib.metadata import PackageNotFoundError, version
from distca_server.kernels import available_backends
from distca_server.transport import nvshmem
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("varlen_attn", importlib.util.find_spec("torch.nn.attention.varlen") is not None,
      "flash_attn", "flash_attn" in available_backends("cuda"),
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

# Whether the MPS control daemon starts here and a CUDA client runs under it. Its pipe and log
# folders are private to this stage (CUDA_MPS_PIPE_DIRECTORY), so no other stage's process connects
# to it; it is stopped (quit, killed if it outlives that) before the stage ends. A shell function
# runs without the stage's timeout, so its own timeouts (10 + 40 + 5 + 10 s, 2 s of sleeps) keep it
# inside the stage's 90 s.
mps_check() {
    if ! command -v nvidia-cuda-mps-control >/dev/null; then
        echo "mps: nvidia-cuda-mps-control is not on PATH: MPS cannot be used here"
        return 0
    fi
    local dir=/tmp/distca_mps rc
    mkdir -p "$dir/pipe" "$dir/log"
    export CUDA_MPS_PIPE_DIRECTORY="$dir/pipe" CUDA_MPS_LOG_DIRECTORY="$dir/log"
    # stdio not inherited: a daemon left holding this stage's pipe to tee would hang the session
    timeout 10 nvidia-cuda-mps-control -d </dev/null >"$dir/start.out" 2>&1
    rc=$?
    sed 's/^/mps: -d said: /' "$dir/start.out"
    if [ "$rc" -ne 0 ]; then
        echo "mps: nvidia-cuda-mps-control -d failed (exit status $rc): MPS is not available here"
    else
        sleep 1
        echo "mps: the control daemon started"
        timeout 40 "$PY" -c '
import torch
x = torch.arange(4.0, device="cuda")
print("mps: a CUDA client ran under it:", (x * 2).sum().item() == 12.0, torch.cuda.get_device_name(0))'
        echo "mps: client exit status $? (124: it hung)"
        echo get_server_list | timeout 5 nvidia-cuda-mps-control | sed 's/^/mps: server /'
        echo quit | timeout 10 nvidia-cuda-mps-control
        sleep 1
        pgrep -f 'nvidia-cuda-mps-(control|server)' >/dev/null  # -f: the names exceed 15 characters
        case $? in
            0) echo "mps: an MPS daemon is STILL RUNNING after quit (killed, so later stages run without it):"
               pgrep -af 'nvidia-cuda-mps-(control|server)'; pkill -f 'nvidia-cuda-mps-(control|server)' ;;
            1) echo "mps: stopped" ;;
            *) echo "mps: quit sent; whether it stopped is unknown (no pgrep)" ;;
        esac
    fi
    tail -n 20 "$dir/log/control.log" 2>/dev/null | sed 's/^/mps: control.log: /'
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    return 0
}

# The tails of the newest Ray session's logs into $RES/<name>_ray_logs.txt, and the lines of them
# that name errors into the log: train_llama.py and tagged_rounds.py start Ray with
# log_to_driver=False, so what a dying worker printed (NVSHMEM's own messages included) is only there.
ray_logs() {
    local name=$1 dir=${RAY_TMPDIR:-/tmp/ray}/session_latest/logs out="$RES/$1_ray_logs.txt" f
    if [ ! -d "$dir" ]; then
        echo "$name: no Ray logs under $dir"
        return 0
    fi
    : > "$out"
    for f in $(ls -t "$dir"/*.err "$dir"/worker-*.out "$dir"/raylet.out 2>/dev/null | head -n 60); do
        [ -s "$f" ] && { echo "---- $(basename "$f")"; grep -av '^\[state-dump\]' "$f" | tail -n 40; } >> "$out"
    done
    echo "$name: tails of Ray's logs in $(basename "$out") ($(wc -c < "$out") bytes); lines naming errors:"
    grep -aiE "error|exception|traceback|nvshmem|killed|died|signal|abort" "$out" | tail -n 40
    return 0
}

# `make demo-gpu`'s run, its run folders outside $RES (Ray Train checkpoints are large and many), its
# summary and loss plot into $RES. SIGINT at the limit: the command's own cleanup stops the Ray
# instance it started (no `ray stop`, which would end every Ray process of the machine).
train_run() {
    local runs=/tmp/distca_train_runs args rc
    args=$(sed -n 's/^DEMO_GPU_ARGS := //p' Makefile)
    if [ -z "$args" ]; then
        echo "train: no DEMO_GPU_ARGS line in the Makefile"
        return 2
    fi
    if ! "$PY" -c 'import ray.train.torch, transformers' 2>&1 | tail -n 3; then
        echo "train: Ray Train or transformers cannot be imported (carry Ray and the wheels the header names)"
        return 2
    fi
    rm -rf "$runs"
    # shellcheck disable=SC2086
    timeout -s INT -k 30 "${STAGE_LIMIT:-${TRAIN_LIMIT:-240}}" "$PY" examples/train_llama.py $args --runs-dir "$runs" \
        --summary-json "$RES/train.json" ${TRAIN_ARGS:-}
    rc=$?
    [ "$rc" -eq 0 ] || ray_logs train
    cp "$runs/demo-gpu/loss.png" "$RES/train_loss.png" 2>/dev/null
    # every step's record of both runs (transport, kernel, NVSHMEM status, phase times per step)
    cp "$runs/demo-gpu/metrics.json" "$RES/train_metrics_distca.json" 2>/dev/null
    cp "$runs/demo-gpu-local/metrics.json" "$RES/train_metrics_local.json" 2>/dev/null
    [ -f "$RES/train.json" ] && "$PY" -c '
import json, sys
s = json.load(open(sys.argv[1]))
keys = [k for k in s if k.startswith(("train_loss_max_rel", "train_tokens_per_s", "train_step_time_s",
                                       "train_loss_rtol", "train_rounds_per_step", "train_header_rounds",
                                       "train_step0_", "train_transport_used", "train_kernel", "train_nvshmem"))]
show = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
print("train:", "; ".join(f"{k} {show(s[k])}" for k in keys), "; agree", s.get("train_loss_agree"))' "$RES/train.json"
    return $rc
}

# bench/host_path.py on the CPU, then on the GPU where there is one (a dry run has none), each
# under what is left of the stage's limit
host_run() {
    local t0=$SECONDS rc left
    timeout -k 5 "${STAGE_LIMIT:-60}" "$PY" bench/host_path.py --json "$RES/host_path.json"
    rc=$?
    if ! timeout 30 "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
        echo "host: no CUDA device here, host_path.py --device cuda not run"
        return $rc
    fi
    left=$(( ${STAGE_LIMIT:-60} - (SECONDS - t0) ))
    [ "$left" -ge 5 ] || left=5
    timeout -k 5 "$left" "$PY" bench/host_path.py --device cuda --profile 20 --json "$RES/host_path_cuda.json" || rc=$?
    return $rc
}

# bench/tagged_rounds.py: two in-place Ray jobs over NVSHMEM; Ray's logs kept when it fails
tagged_run() {
    local rc
    # shellcheck disable=SC2086
    timeout -k 5 "${STAGE_LIMIT:-${TAGGED_LIMIT:-150}}" "$PY" bench/tagged_rounds.py --device cuda --dtype bfloat16 \
        --clients 2 --context 8192 16384 --layers 8 --steps 3 --json "$RES/tagged_rounds.json" ${TAGGED_ARGS:-}
    rc=$?
    [ "$rc" -eq 0 ] || ray_logs tagged
    return $rc
}

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs --tb=short)
[ $# -gt 0 ] || set -- env mps inproc train transport kernels host backends ktests pingpong dead graphs ngraphs tagged ntests
for s in "$@"; do
    case "$s" in
        mps) stage mps 90 mps_check ;;
        env) stage env 60 env_info ;;
        ktests) stage ktests 200 "${PYTEST[@]}" -m gpu tests/unit/test_kernels.py tests/unit/test_kernels_window.py \
                    tests/unit/test_kernels_cudnn.py tests/unit/test_gpu_rounds.py tests/unit/test_memop_stream.py \
                    tests/unit/test_exchange_graph.py tests/unit/test_graphed_rounds.py tests/unit/test_round_tags.py \
                    tests/unit/test_kernels_fa4.py ;;
        # GPU_KERNELS_ARGS: e.g. "--device cpu --quick" for a dry run anywhere, or fewer repeats
        # shellcheck disable=SC2086
        kernels) stage kernels "${KERNELS_LIMIT:-240}" "$PY" bench/gpu_kernels.py --json "$RES/kernels.json" \
                     ${GPU_KERNELS_ARGS:-} ;;
        # every backend against torch's FA2, each one's fused shards, the plan run with both planners
        # (issue 21), the time planner on this session's table when the kernels stage wrote it whole
        backends)
            prof=()
            [ -f "$RES/kernels_profile/llama3-8b-tp8/backward.json" ] && prof=(--attn-profile "$RES/kernels_profile/llama3-8b-tp8")
            # shellcheck disable=SC2086
            stage backends "${BACKENDS_LIMIT:-200}" "$PY" bench/gpu_backends.py --json "$RES/backends.json" "${prof[@]}" \
                ${BACKENDS_ARGS:-} ;;
        ntests) stage ntests 180 "${PYTEST[@]}" -m nvshmem tests/unit/test_transport_nvshmem.py \
                    tests/unit/test_attend_transport.py tests/unit/test_nvshmem_stream.py tests/unit/test_nvshmem_epochs.py ;;
        # shellcheck disable=SC2086
        transport) stage transport "${TRANSPORT_LIMIT:-150}" "$PY" bench/transport.py --transport nvshmem --procs 2 4 \
                       --max-size 1GiB --graph off --json "$RES/transport_nvshmem.json" ${TRANSPORT_ARGS:-} ;;
        # in-process participants over plain device buffers (issue 22 item 2a): device-driven
        # (stream memory operations) against host-driven exchanges and the in-process copy
        # shellcheck disable=SC2086
        inproc) stage inproc "${INPROC_LIMIT:-120}" "$PY" bench/transport.py --transport local --device cuda \
                    --procs 2 4 --max-size 1GiB --graph off --json "$RES/transport_local.json" ${INPROC_ARGS:-} ;;
        # captured exchanges (issue 22 item 4), apart: a capture that fails on this GPU must not
        # cost the stages above their numbers
        graphs) stage graphs "${GRAPHS_LIMIT:-90}" "$PY" bench/transport.py --transport local --device cuda \
                    --procs 2 4 --max-size 16MiB --json "$RES/transport_local_graph.json" ;;
        ngraphs) stage ngraphs "${GRAPHS_LIMIT:-90}" "$PY" bench/transport.py --transport nvshmem --procs 2 \
                     --max-size 16MiB --json "$RES/transport_nvshmem_graph.json" ;;
        dead) stage dead 60 "$PY" bench/dead_peer.py --transport nvshmem --procs 2 3 --timeout 2 \
                  --json "$RES/dead_peer_nvshmem.json" ;;
        pingpong) stage pingpong 120 "$PY" bench/pingpong.py --device cuda --json "$RES/pingpong.json" ;;
        host) stage host 60 host_run ;;
        train) stage train "${TRAIN_LIMIT:-240}" train_run ;;
        tagged) stage tagged "${TAGGED_LIMIT:-150}" tagged_run ;;
        *) echo "unknown stage $s (mps, env, ktests, kernels, host, backends, ntests, transport, inproc, graphs, ngraphs, dead, pingpong, train, tagged)" >&2
           status=1 ;;
    esac
done
# issue 22's summary keys from whatever ran (null with a reason for the rest) and each stage's
# outcome (from the log), beside the log
cp "$LOG" "$RES/session.log"
"$PY" bench/gpu_summary.py "$RES" 2>&1 | tee -a "$LOG"
cp "$RES/summary.json" "$OUT/summary.json" 2>/dev/null
cp "$LOG" "$RES/session.log"
pack
exit $status
