"""Network model of the step-time simulator: who sits in which node, and how long bytes take.

Pure Python + numpy. Units: bytes, seconds.

Layout. A *rank* is one tensor-parallel group of ``tp`` GPUs (the unit that holds a chunk of
tokens); GPUs are numbered in Megatron-LM's order, tensor-parallel fastest, then context-parallel,
data-parallel and pipeline stage (``--order tp-cp-dp-pp``), so rank ``ρ`` owns GPUs
``[ρ·tp, (ρ+1)·tp)`` and node ``⌊ρ·tp / gpus_per_node⌋``. GPU ``i`` of one rank exchanges core
attention rows with GPU ``i`` of another (each holds the same heads), so a rank-to-rank byte count
computed with the per-GPU :class:`~scheduler.cost.CostModel` is what each of the ``tp`` GPU pairs
moves in parallel.

Links. Every GPU has an NVLink port into the node's NVSwitch and its own InfiniBand NIC; both are
full duplex. An all-to-all finishes when its most loaded port finishes: for each rank the bytes it
sends and receives inside its node over NVLink, and across nodes over InfiniBand, divided by the
effective bandwidth (:class:`~distca_sim.hardware.GPUConfig`), maximised over ranks and port
kinds. Ring collectives (all-gather, reduce-scatter) move ``(n − 1)/n`` of the gathered data through
every member's port (Patarasuk & Yuan 2009; NCCL's ring algorithm), at the slowest link of the ring.
"""

from __future__ import annotations

import numpy as np

from scheduler.cost import KV_TENSORS, CostModel, RoundKind
from .hardware import DTYPE_BYTES, GPUConfig

__all__ = ["rank_nodes", "alltoall_seconds", "plan_round_bytes", "ring_seconds",
           "tp_seconds_per_token", "p2p_seconds"]


def rank_nodes(num_ranks: int, tp: int, gpus_per_node: int) -> np.ndarray:
    """Node index of each rank (its first GPU), int64 ``[num_ranks]``."""
    return (np.arange(num_ranks, dtype=np.int64) * tp) // gpus_per_node


def alltoall_seconds(send: np.ndarray, nodes: np.ndarray,
                     gpu: GPUConfig) -> tuple[float, np.ndarray]:
    """Bandwidth seconds of one all-to-all, and each rank's own port-busy seconds.

    Args:
        send: ``[R, R]`` bytes rank ``r`` sends rank ``s`` (per GPU lane; the diagonal is ignored).
        nodes: node of each rank (:func:`rank_nodes`).

    Returns ``(seconds, per_rank_seconds)``; the latency of the call is not included.
    """
    send = np.array(send, dtype=np.float64, copy=True)
    np.fill_diagonal(send, 0.0)
    same = nodes[:, None] == nodes[None, :]
    nv = np.where(same, send, 0.0)
    ib = send - nv
    per_rank = np.maximum.reduce([nv.sum(1) / gpu.nvlink_eff, nv.sum(0) / gpu.nvlink_eff,
                                  ib.sum(1) / gpu.ib_eff, ib.sum(0) / gpu.ib_eff])
    return float(per_rank.max()) if per_rank.size else 0.0, per_rank


def _tensor_bytes(cost: CostModel, names) -> tuple[int, int]:
    """Bytes per query row and per KV row of the tensors ``names``."""
    q = sum(cost.bytes_per_token(n) for n in names if n not in KV_TENSORS)
    kv = sum(cost.bytes_per_token(n) for n in names if n in KV_TENSORS)
    return q, kv


def plan_round_bytes(q_rows: np.ndarray, kv_rows: np.ndarray, cost: CostModel, *,
                     keep_activations: bool) -> dict[tuple[RoundKind, str], np.ndarray]:
    """``[R, R]`` bytes of the four all-to-alls of a step, from a plan's ``row_matrix``.

    ``q_rows[r, s]`` / ``kv_rows[r, s]`` are the query / KV rows rank ``r`` ships to server ``s``
    (:attr:`scheduler.tasks.Plan.row_matrix`, in-place: ``s`` is a rank). Returns send matrices
    (``[sender, receiver]``) keyed ``(round kind, "dispatch" | "return")``: each round's
    :meth:`~scheduler.cost.RoundKind.dispatch_with` ``(keep_activations)`` tensors go rank ->
    server (with kept activations the backward round sends dO only), its
    :attr:`~scheduler.cost.RoundKind.returns` server -> rank. Off the diagonal these sum to
    ``Plan.comm_bytes()`` of a plan with the same ``keep_activations``.
    """
    q = q_rows.astype(np.float64)
    kv = kv_rows.astype(np.float64)
    out = {}
    for kind in RoundKind:
        dq, dkv = _tensor_bytes(cost, kind.dispatch_with(keep_activations))
        rq, rkv = _tensor_bytes(cost, kind.returns)
        out[(kind, "dispatch")] = q * dq + kv * dkv
        out[(kind, "return")] = (q * rq + kv * rkv).T
    return out


def ring_seconds(bytes_total: float, members: int, spans_nodes: bool, gpu: GPUConfig) -> float:
    """Bandwidth seconds of a ring all-gather (or reduce-scatter) of ``bytes_total`` over
    ``members`` GPUs: each moves ``(n − 1)/n · bytes_total`` through its slowest ring link."""
    if members <= 1 or bytes_total <= 0:
        return 0.0
    bw = gpu.ib_eff if spans_nodes else gpu.nvlink_eff
    return (members - 1) / members * bytes_total / bw


def tp_seconds_per_token(hidden: int, tp: int, gpu: GPUConfig) -> float:
    """Exposed tensor-parallel communication of one layer's forward pass, per token of the rank.

    Megatron-LM with sequence parallelism does two all-gathers and two reduce-scatters of the
    ``[tokens, h]`` activations per layer and pass (Korthikanti et al., MLSys'23, §4.2.2: the same
    volume as the two all-reduces of plain tensor parallelism); the backward pass moves the same.
    Assumed not overlapped with compute (Megatron's default without ``--tp-comm-overlap``).
    """
    if tp == 1:
        return 0.0
    return 4 * ring_seconds(hidden * DTYPE_BYTES, tp, tp > gpu.gpus_per_node, gpu)


def p2p_seconds(tokens: int, hidden: int, tp: int, same_node: bool, gpu: GPUConfig) -> float:
    """Seconds to send one microbatch's activations to the next pipeline stage: ``tokens · h``
    bf16 values split over the ``tp`` GPUs by sequence parallelism, each GPU over its own port."""
    if tokens <= 0:
        return 0.0
    bw = gpu.nvlink_eff if same_node else gpu.ib_eff
    return gpu.collective_latency_s + tokens * hidden * DTYPE_BYTES / tp / bw
