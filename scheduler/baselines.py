"""Plans to compare the planner against, all returning :class:`~scheduler.tasks.Plan`.

- :func:`no_balance`: every rank computes its own documents (plain packing, no CAD).
- :func:`per_doc_cp`: every document split head–tail over all servers, the per-document context
  parallelism of WLB-LLM and Megatron CP (DistCA §2.2): perfectly balanced, heavy on KV traffic.
- :func:`wlb_packing`: WLB-LLM style variable-length packing: documents re-packed across ranks by
  attention workload under a per-rank token cap, longest first (DistCA §2.2, WLB-LLM §4).
- :func:`capped_lpt`: the capped longest-processing-time packing behind ``wlb_packing``, also used
  by the simulator's WLB-ideal baseline (``distca_sim.systems``).

Each plan takes ``keep_activations`` (default :class:`~scheduler.config.PlanConfig`'s, as
:func:`scheduler.plan_batch`): it changes the baseline's :meth:`~scheduler.tasks.Plan.comm_bytes`
and :meth:`~scheduler.tasks.Plan.held_bytes`, not its tasks, so a baseline's bytes compare with a
``plan_batch`` plan's only when both were made with the same value.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from .cost import CostModel
from .bands import band_shards
from .config import PlanConfig
from .planner import validate_plan_args
from .tasks import CATask, Plan


def _home_server(rank: int, num_ranks: int, num_servers: int) -> int:
    return rank if num_ranks == num_servers else rank % num_servers


def no_balance(doc_lens_per_rank, num_servers: int, *, cost: CostModel, mode: str = "inplace",
               keep_activations: bool = PlanConfig.keep_activations) -> Plan:
    """Each rank's documents on its own server (``rank % num_servers`` in dedicated mode).
    ``keep_activations``: as :func:`scheduler.plan_batch` (see the module doc).

    Raises:
        ValueError: as :func:`scheduler.plan_batch`.
    """
    validate_plan_args(doc_lens_per_rank, num_servers, cost, 0.0, mode, 1)
    tasks = [[] for _ in range(num_servers)]
    for r, lens in enumerate(doc_lens_per_rank):
        server = _home_server(r, len(doc_lens_per_rank), num_servers)
        tasks[server].extend(CATask(r, i, 0, l, 0, l) for i, l in enumerate(lens))
    return Plan(doc_lens_per_rank=[list(x) for x in doc_lens_per_rank], num_servers=num_servers,
                mode=mode, cost=cost, server_tasks=tasks, keep_activations=keep_activations)


def per_doc_cp(doc_lens_per_rank, num_servers: int, *, cost: CostModel, mode: str = "inplace",
               keep_activations: bool = PlanConfig.keep_activations) -> Plan:
    """Every document split into ``num_servers`` head–tail bands, one per server.

    Server ``j`` runs the ``j``-th band from the outside in (head shard ``j`` and tail shard
    ``2·S - 1 - j`` of the usual CP layout); widths differ by at most one folded token, the spare
    tokens rotating with the document index so no server always gets them. Documents with fewer
    folded tokens than servers use only the first servers. Each server receives the KV prefix
    its shards need (from half to all of the document); a ring or all-gather CP moves the whole
    document to every server, so these bytes are a lower bound on such implementations.
    ``keep_activations``: as :func:`scheduler.plan_batch` (see the module doc); every task has its
    full key prefix, so a kept backward round sends dO alone, no merged O and LSE.

    Raises:
        ValueError: as :func:`scheduler.plan_batch`.
    """
    validate_plan_args(doc_lens_per_rank, num_servers, cost, 0.0, mode, 1)
    S = num_servers
    tasks = [[] for _ in range(S)]
    gid = 0
    for r, lens in enumerate(doc_lens_per_rank):
        for i, l in enumerate(lens):
            fold = (l + 1) // 2
            base, extra = divmod(fold, S)
            a = 0
            for j in range(S):
                w = base + (1 if (j - gid) % S < extra else 0)
                if w == 0:
                    continue
                for qs, qe in band_shards(l, a, a + w):
                    tasks[j].append(CATask(r, i, qs, qe, 0, qe))
                a += w
            gid += 1
    return Plan(doc_lens_per_rank=[list(x) for x in doc_lens_per_rank], num_servers=S,
                mode=mode, cost=cost, server_tasks=tasks, keep_activations=keep_activations)


def wlb_packing(doc_lens_per_rank, num_servers: int, *, cost: CostModel,
                token_cap: int | None = None,
                keep_activations: bool = PlanConfig.keep_activations) -> Plan:
    """Re-pack whole documents across ranks to balance attention work (inplace only).

    Documents, longest first, go to the rank with the least attention work among those whose
    token count stays within ``token_cap`` (default: the largest rank's token count in the input);
    if none has room, to the rank with the fewest tokens. The re-packing happens at data loading,
    so the returned plan describes the *re-packed* batch (its ``doc_lens_per_rank`` differ from the
    input) and moves no attention bytes; what it costs instead is unequal tokens per rank, i.e.
    unequal linear work and activation memory. ``keep_activations``: as :func:`scheduler.plan_batch`
    (see the module doc; here it changes only :meth:`~scheduler.tasks.Plan.held_bytes`).

    Raises:
        ValueError: as :func:`scheduler.plan_batch`, or ``token_cap`` not positive.
    """
    validate_plan_args(doc_lens_per_rank, num_servers, cost, 0.0, "inplace", 1)
    R = num_servers
    if token_cap is not None and (not isinstance(token_cap, int) or isinstance(token_cap, bool)
                                  or token_cap <= 0):
        raise ValueError(f"token_cap must be a positive int, got {token_cap!r}")
    cap = token_cap if token_cap is not None else max(sum(x) for x in doc_lens_per_rank)
    docs = [l for lens in doc_lens_per_rank for l in lens]
    bins = capped_lpt(docs, [l * (l + 1) // 2 for l in docs], R, cap)  # work: attention pairs
    packed = [[docs[g] for g in b] for b in bins]
    tasks = [[CATask(r, i, 0, l, 0, l) for i, l in enumerate(lens)] for r, lens in enumerate(packed)]
    return Plan(doc_lens_per_rank=packed, num_servers=R, mode="inplace", cost=cost, server_tasks=tasks,
                keep_activations=keep_activations)


def capped_lpt(sizes: Sequence[int], costs: Sequence[float], num_bins: int,
               cap: float) -> list[list[int]]:
    """Capped longest-processing-time packing (WLB-LLM's variable-length packing).

    Items, most expensive first (ties: lower index first), each go to the bin with the least total
    cost among those whose size stays within ``cap`` after adding the item; if no bin has room, to
    the bin with the smallest size (ties: lower bin). Deterministic.

    Args:
        sizes: size of each item (tokens of a document), ints.
        costs: cost of each item (any unit: attention pairs, seconds), same length as ``sizes``.
        num_bins: bins to fill (ranks, microbatch groups), ``>= 1``.
        cap: most size per bin (``float("inf")``: uncapped).

    Returns:
        For each bin, the indices of its items in the order they were placed.

    Raises:
        ValueError: ``num_bins`` not a positive int, or ``sizes`` and ``costs`` differ in length.
    """
    if not isinstance(num_bins, (int, np.integer)) or isinstance(num_bins, bool) or num_bins < 1:
        raise ValueError(f"num_bins must be a positive int, got {num_bins!r}")
    cost_arr = np.asarray(costs)
    if len(sizes) != len(cost_arr):
        raise ValueError(f"sizes and costs differ in length: {len(sizes)} != {len(cost_arr)}")
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    filled = [0] * num_bins
    heap = [(0, k) for k in range(num_bins)]  # (total cost, bin)
    for g in np.argsort(-cost_arr, kind="stable").tolist():
        size, c = int(sizes[g]), cost_arr[g].item()
        skipped = []
        while heap and filled[heap[0][1]] + size > cap:
            skipped.append(heapq.heappop(heap))
        if heap:
            load, k = heapq.heappop(heap)
        else:  # nobody has room: the bin with the smallest size takes it
            k = min(range(num_bins), key=lambda x: (filled[x], x))
            load = next(ld for ld, kk in skipped if kk == k)
            skipped = [(ld, kk) for ld, kk in skipped if kk != k]
        bins[k].append(g)
        filled[k] += size
        heapq.heappush(heap, (load + c, k))
        for item in skipped:
            heapq.heappush(heap, item)
    return bins
