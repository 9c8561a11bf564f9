"""Where the training demo's workers compute: the device, the precision and the Ray resources.

The CPU demo (``make demo``) runs every Ray Train worker on a share of a CPU in float32, gradients
averaged over gloo, attention moved by the job's default transport (``torch_dist``). The GPU path
(``make demo-gpu``) puts the scheduler actor and W in-place clients (the Ray Train workers, each
also an attention server) on **one** GPU::

    python examples/train_llama.py --device cuda --dtype bfloat16 --transport nvshmem ...

- ``--device cuda``: each worker asks Ray for ``--gpus-per-worker`` of a GPU (default ``1 / W``,
  so W workers share one card); the scheduler actor takes none.
- ``--dtype bfloat16``: the forward runs under ``torch.autocast(dtype=bfloat16)`` (matrix products
  and attention in bf16: distca's Hugging Face adapter casts q, k, v to the autocast dtype; the
  loss in float32), weights and AdamW stay float32.
- ``--transport nvshmem``: the distca job moves rows between the processes through an NVSHMEM
  symmetric heap (several PEs may share one GPU). NCCL refuses two ranks on one device, so when
  workers share a GPU, DDP's gradients go over gloo (which takes CUDA tensors) as on the CPU.

The same flags with ``--device cpu --transport shm`` (``--dtype float32`` or ``bfloat16``) are the
CPU-testable twin of that path (``tests/integration/test_train_llama_device.py``): a one-sided
transport between the worker processes, the same batch placement, autocast and timing code.

Imports torch only: nothing here needs a GPU, Ray or NVSHMEM to import.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

import torch

DEVICES = ("cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Which transport can carry which device's tensors (scheduler.checks.TRANSPORTS): shm moves CPU
# tensors, nvshmem CUDA tensors, torch_dist both (gloo on CPU, NCCL on GPU: one GPU per rank).
TRANSPORT_DEVICES = {"torch_dist": ("cpu", "cuda"), "shm": ("cpu",), "nvshmem": ("cuda",)}


def gpu_holders(cfg) -> int:
    """Processes of a run that each hold a share of a GPU: the Train workers, plus dedicated servers
    of a distca run (in place, the workers serve; the scheduler actor never takes a GPU)."""
    dedicated = cfg.attention == "distca" and cfg.mode == "dedicated"
    return cfg.workers + (cfg.servers if dedicated else 0)


def gpu_share(cfg) -> float | None:
    """Each GPU holder's ``num_gpus``: ``cfg.gpus_per_worker``, or by default an equal share of one
    GPU (rounded down to Ray's 1e-4 resolution). None on the CPU."""
    if cfg.device != "cuda":
        return None
    if cfg.gpus_per_worker is not None:
        return float(cfg.gpus_per_worker)
    return math.floor(1e4 / gpu_holders(cfg)) / 1e4


def config_problems(cfg) -> list[str]:
    """What is wrong with a TrainConfig's device, dtype, transport and GPU share (each message names
    the value); empty when nothing is."""
    from scheduler.checks import TRANSPORTS
    problems = []
    if cfg.device not in DEVICES:
        problems.append(f"device={cfg.device!r} (cpu or cuda)")
    if cfg.dtype not in DTYPES:
        problems.append(f"dtype={cfg.dtype!r} ({' or '.join(DTYPES)})")
    if cfg.transport not in TRANSPORTS:
        problems.append(f"transport={cfg.transport!r} (one of {', '.join(TRANSPORTS)})")
    elif cfg.device in DEVICES and cfg.device not in TRANSPORT_DEVICES[cfg.transport]:
        problems.append(f"transport={cfg.transport!r} cannot move {cfg.device} tensors (device={cfg.device!r}; "
                        f"{cfg.transport} carries {' and '.join(TRANSPORT_DEVICES[cfg.transport])} tensors)")
    g = cfg.gpus_per_worker
    if g is not None:
        if cfg.device != "cuda":
            problems.append(f"gpus_per_worker={g!r} needs device='cuda' (device={cfg.device!r})")
        elif isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1 or not math.isfinite(g):
            problems.append(f"gpus_per_worker={g!r} (a share of one GPU: 0 < gpus_per_worker <= 1)")
        elif g < 1 and round(g, 4) != g:
            problems.append(f"gpus_per_worker={g!r} (Ray takes GPU fractions to 4 decimals)")
    return problems


def check_gpus(cfg, cluster_gpus: float) -> None:
    """Refuse a GPU run the Ray cluster cannot place (before any actor starts).

    Raises:
        ValueError: no GPU in the cluster, or ``gpus_per_worker`` times the GPU holders exceeds the
            cluster's GPUs (naming both).
    """
    if cfg.device != "cuda":
        return
    share, holders = gpu_share(cfg), gpu_holders(cfg)
    if cluster_gpus <= 0:
        raise ValueError("device='cuda' but the Ray cluster has no GPU (is CUDA visible here?)")
    if share * holders > cluster_gpus + 1e-9:
        raise ValueError(f"gpus_per_worker={share:g} x {holders} GPU holders = {share * holders:g} GPUs, "
                         f"but the Ray cluster has {cluster_gpus:g}")


def worker_resources(cfg, cluster_cpus: float) -> tuple[bool, dict]:
    """``(use_gpu, resources_per_worker)`` for Ray Train's ``ScalingConfig``: a share of a CPU each
    (so W workers fit beside the job's actors on a small machine), and on the GPU a share of it."""
    resources = {"CPU": min(1.0, cluster_cpus / (2 * cfg.workers))}
    if cfg.device == "cuda":
        resources["GPU"] = gpu_share(cfg)
    return cfg.device == "cuda", resources


def server_options(cfg) -> dict:
    """Ray options of dedicated attention servers: no CPU reserved, and their GPU share on a GPU."""
    share = gpu_share(cfg)
    return {"num_cpus": 0} if share is None else {"num_cpus": 0, "num_gpus": share}


def torch_config(cfg):
    """Ray Train's ``TorchConfig`` for a GPU run (None on the CPU: Train's default, gloo). Workers
    that share a GPU average gradients over gloo: NCCL refuses two ranks on one device."""
    if cfg.device != "cuda":
        return None
    from ray.train.torch import TorchConfig
    share = gpu_share(cfg)
    return TorchConfig(backend="gloo" if share < 1 else "nccl")


def worker_device(cfg) -> torch.device:
    """This Train worker's device: the CPU, or the GPU Ray Train assigned it."""
    if cfg.device == "cpu":
        return torch.device("cpu")
    from ray.train.torch import get_device
    return get_device()


def to_device(batch: dict, device: torch.device) -> dict:
    """A collated batch on ``device`` (its tensors moved; other values as they are)."""
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def autocast(cfg, device: torch.device):
    """The forward's precision context: bf16 autocast for ``dtype="bfloat16"``, else nothing."""
    if cfg.dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[cfg.dtype])


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a host clock read after it times the phase."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def transport_used(client) -> str | None:
    """What moved this distca client's rows in its current group epoch: the transport's class and,
    for a symmetric heap, the heap's (``"RoutedTransport/ShmHeap"``; NVSHMEM's heap, reused across
    group epochs, shows as ``".../HeapLease"``);
    None without a client or group. Read from the client's runtime: a diagnostic for the run's
    metrics, so a test or a GPU session can see which transport really ran."""
    member = getattr(getattr(client, "_runtime", None), "member", None)
    transport = getattr(member, "transport", None)
    if transport is None:
        return None
    heap = getattr(transport, "heap", None)
    return type(transport).__name__ + ("" if heap is None else f"/{type(heap).__name__}")


def round_counts(client) -> tuple[int, int] | None:
    """``(rounds, header rounds)`` this distca client ran in its current group epoch: every round,
    and those that exchanged the round header (an in-place round skips it once its routes are
    installed, ``GroupMember._tagged_round``); None without a client or group. A diagnostic for
    the run's metrics, as :func:`transport_used`."""
    member = getattr(getattr(client, "_runtime", None), "member", None)
    if getattr(member, "transport", None) is None:
        return None
    return member.rounds_done, member.rounds_done - member.tagged_rounds


# The environment a GPU run's workers need, unless the caller set it (bench/gpu_session.sh sets the
# same): several PEs on one GPU run NVSHMEM in its limited multi-process-per-GPU mode, where the
# heap's NVLS (multicast) set-up calls a barrier that exits the process, and distca uses no
# multicast; a participant's held stream waits need hardware queues of their own
# (distca_server/transport/memop_stream.py warns below 5).
GPU_WORKER_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}


def worker_env(cfg) -> dict[str, str]:
    """Environment variables for the job's Ray workers: :data:`GPU_WORKER_ENV` on a CUDA run (the
    caller's own values win), nothing on the CPU."""
    if cfg.device != "cuda":
        return {}
    return {name: os.environ.get(name, value) for name, value in GPU_WORKER_ENV.items()}


def run_facts(device: torch.device) -> dict:
    """What really ran, for the run's metrics: ``kernel``, the attention backend ``"auto"`` picks
    on ``device`` (distca's servers and local attention both take it, so both runs use the same
    kernel), and ``nvshmem_init_status`` (NVSHMEM's init status by name, e.g. ``STATUS_LIMITED_MPG``)
    once this process started NVSHMEM, else None. Starts nothing."""
    from distca_server.kernels import get_backend
    nvshmem = sys.modules.get("distca_server.transport.nvshmem")  # loaded only by an NVSHMEM run
    rt = getattr(nvshmem, "_RUNTIME", None)
    return {"kernel": get_backend("auto", device).name,
            "nvshmem_init_status": getattr(rt, "init_status", None)}


def device_name() -> str:
    """The GPU's name where one is visible, else ``"cpu"`` (for the run's summary)."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
