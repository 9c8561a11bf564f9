"""The four systems the simulator compares, each a function of one step's batch.

Pure Python + numpy. Units: seconds, bytes, FLOPs, tokens. Used through
:func:`distca_sim.simulate.simulate`; see that module for the public API.

* ``packing`` — plain packing: every rank trains its own ``context``-token chunks; attention is
  local, so data-parallel ranks wait for the slowest and pipeline stages stall on heavy
  microbatches.
* ``per_doc_cp`` — per-document context parallelism over all ranks of a stage (DistCA §2.2;
  WLB-LLM §5): every document is cut into ``2·R`` head–tail shards, one pair per rank, so
  attention FLOPs are balanced, but every layer all-gathers every token's K and V (and
  reduce-scatters dK, dV in the backward pass), exposed. Computed analytically — the same shards as
  :func:`scheduler.baselines.per_doc_cp`, priced per shard with the profile table, without building
  a Plan (that takes seconds at 256 ranks).
* ``wlb_ideal`` — the paper's baseline (DistCA §6.1): WLB-LLM's variable-length packing of the
  whole step's documents into microbatches of ``cp`` ranks, balancing per-document time
  (``α·l² + β·l``) longest-first under a token cap set by GPU memory
  (:func:`scheduler.baselines.capped_lpt`, the packing of ``wlb_packing``), plus per-document CP
  inside each group. *Ideal*: packing is free and exact, and each CP member runs exactly ``1/cp``
  of every document at the whole document's kernel speed; the K/V all-gather is still paid. The
  best CP degree is chosen per configuration.
* ``distca`` — core attention disaggregation with in-place servers: every layer of every tick is
  planned by :func:`scheduler.plan_batch` over all ranks of all stages (ranks idle in a pipeline
  bubble serve CA-tasks, DistCA §4.1), priced per CA-task with the profile table, and run with
  ping-pong overlap (DistCA §4.2) by :func:`distca_sim.pipeline.run_rounds`. The planner balances
  FLOPs, or (``time_planner=True``) the seconds the same tables predict
  (:class:`scheduler.time_cost.TimeModel` of :meth:`Context.time_model`, DistCA §4.2). With kept
  activations a backward tick is not planned: each microbatch's backward runs where its forward
  tick put it (those servers hold its activations), pooled with other microbatches than then.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from scheduler import plan_batch
from scheduler.baselines import capped_lpt
from scheduler.config import resolve_min_shard
from scheduler.cost import RoundKind
from scheduler.time_cost import TimeModel

from .hardware import MEMORY_HEADROOM, GPUConfig, ModelConfig, attention_tables
from .network import (alltoall_seconds, p2p_seconds, plan_round_bytes, rank_nodes, ring_seconds,
                      tp_seconds_per_token)
from .pipeline import Round, pipeline_1f1b, run_rounds, tick_schedule

__all__ = ["Context", "RunResult", "cp_server_seconds", "run_packing",
           "run_per_doc_cp", "run_wlb_ideal", "run_distca"]


@dataclass
class RunResult:
    """Raw outcome of one system on one step (the simulator turns it into a SystemResult)."""

    step_time_s: float
    comm_exposed_s: float
    linear_s: np.ndarray       # per rank, seconds of linear compute (TP communication included)
    attention_s: np.ndarray    # per rank, seconds of core attention kernels
    comm_s: np.ndarray         # per rank, seconds its ports are busy with CA/CP traffic
    act_bytes: np.ndarray      # per rank, peak activation bytes per GPU
    details: dict
    held_bytes: np.ndarray | None = None  # per rank, peak bytes per GPU held for kept activations


class Context:
    """Per-token costs of one (model, GPU, parallel layout, recompute) combination.

    Attributes (seconds per token per layer on one GPU of a rank, TP communication included):
    ``lin_f``, ``lin_b`` forward / backward linear; ``head_f``, ``head_b`` LM head (last stage).
    """

    def __init__(self, model: ModelConfig, gpu: GPUConfig, tp: int, pp: int, dp: int,
                 microbatches: int, recompute: bool, min_shard: int | None):
        self.model, self.gpu = model, gpu
        self.tp, self.pp, self.dp, self.m = tp, pp, dp, microbatches
        self.recompute, self.min_shard = recompute, min_shard
        self.layers = model.num_layers // pp
        self.cost = model.cost_model(tp)
        self.fwd_table, self.bwd_table = attention_tables(gpu, self.cost)
        tp_comm = tp_seconds_per_token(model.hidden_size, tp, gpu)
        self.lin_f = model.linear_flops_per_token() / tp / gpu.linear_rate + tp_comm
        self.lin_b = 2 * model.linear_flops_per_token() / tp / gpu.linear_rate + tp_comm
        self.head_f = model.lm_head_flops_per_token() / tp / gpu.linear_rate
        self.head_b = 2 * self.head_f
        self.phi = model.qkv_fraction
        # K and V bytes of one token on one GPU (what a CP all-gather moves per token).
        self.kv_token_bytes = self.cost.bytes_per_token("k") + self.cost.bytes_per_token("v")
        # What a client saves per token and layer for core attention's backward alone, and does
        # not save when the servers keep the activations: Q, K, V and the LSE (the attention
        # output stays, as the input of the O projection).
        self.attention_saved_token_bytes = sum(self.cost.bytes_per_token(n) for n in ("q", "k", "v", "lse"))

    # ---- attention kernels ------------------------------------------------------------------
    def time_model(self) -> TimeModel:
        """The planner's time model of the tables this context prices attention with: forward and
        backward tables, ``call_s`` the GPU's kernel launch (a server's round pays one)."""
        model = self.__dict__.get("_time_model")
        if model is None:
            model = TimeModel(self.fwd_table, self.bwd_table, call_s=self.gpu.kernel_launch_s)
            self._time_model = model
        return model

    def plan_min_shard(self, time_planner: bool) -> int:
        """The planner's ``min_shard``: the one given, else 128 tokens for the FLOP planner and
        the table's choice for the time planner (:meth:`TimeModel.choose_min_shard`)."""
        return resolve_min_shard(self.min_shard, self.time_model() if time_planner else None)

    def doc_attention(self, lens) -> tuple[float, float]:
        """Forward and backward seconds of whole documents run locally (one fused call)."""
        l = np.asarray(lens, dtype=np.int64)
        if l.size == 0:
            return 0.0, 0.0
        launch = self.gpu.kernel_launch_s
        return (float(self.fwd_table.latencies(l, l).sum()) + launch,
                float(self.bwd_table.latencies(l, l).sum()) + launch)

    # ---- memory -------------------------------------------------------------------------------
    def states_bytes(self) -> float:
        """Weights (bf16) and fp32 gradients per model shard, Adam states over all ``dp`` ranks."""
        shard = self.model.num_params / (self.tp * self.pp)
        return shard * 6 + shard * 12 / self.dp

    def act_bytes_per_token(self, stage: int, keep_activations: bool = False) -> float:
        """Activation bytes per GPU per token of one microbatch, times the microbatches stage
        ``stage`` keeps alive under 1F1B (``min(p − s, m)``), plus the last stage's logits.
        ``keep_activations``: less :attr:`attention_saved_token_bytes` per layer (the servers hold
        those rows instead; distca counts them on the servers)."""
        m = self.model
        live = min(self.pp - stage, self.m)
        per_layer = m.activation_bytes_per_token_layer() / self.tp
        if keep_activations:
            per_layer -= self.attention_saved_token_bytes
        if self.recompute:  # full recompute stores each layer's (sequence-parallel) input only
            kept = 2 * m.hidden_size / self.tp * self.layers * live + per_layer
        else:
            kept = per_layer * self.layers * live
        if stage == self.pp - 1:
            kept += m.logits_bytes_per_token() / self.tp
        return kept

    def token_cap(self) -> int:
        """Most tokens per rank and microbatch that fit in memory on every stage."""
        free = self.gpu.hbm_bytes * MEMORY_HEADROOM - self.states_bytes()
        per = max(self.act_bytes_per_token(s) for s in range(self.pp))
        return max(0, int(free // per))


# ---- packing (no balancing) ----------------------------------------------------------------------
def _op_times(ctx: Context, tokens: float, attn_f: float, attn_b: float, comm_f: float,
              comm_b: float, stage: int) -> tuple[float, float]:
    """Seconds of one microbatch's forward and backward on one stage (sequential, no overlap)."""
    f = ctx.layers * (ctx.lin_f * tokens + attn_f + comm_f)
    b = ctx.layers * (ctx.lin_b * tokens + attn_b + comm_b)
    if ctx.recompute:
        b += ctx.layers * (ctx.lin_f * tokens + attn_f + comm_f)
    if stage == ctx.pp - 1:
        f += ctx.head_f * tokens
        b += ctx.head_b * tokens
    return f, b


def _p2p(ctx: Context, tokens: float, num_ranks: int) -> float:
    """Seconds of one stage-to-stage hop of ``tokens`` per rank (``num_ranks`` ranks a stage, rank
    ``s·R + d`` on the node of its first GPU): over NVLink only if no rank's next-stage peer is on
    another node; else InfiniBand, since the slowest hop paces every tick."""
    if ctx.pp == 1:
        return 0.0
    nodes = rank_nodes(ctx.pp * num_ranks, ctx.tp, ctx.gpu.gpus_per_node).reshape(ctx.pp, num_ranks)
    same = bool((nodes[1:] == nodes[:-1]).all())
    return p2p_seconds(int(tokens), ctx.model.hidden_size, ctx.tp, same, ctx.gpu)


class _Ledger:
    """Per-(stage, rank) busy seconds and activation bytes; rank ``s·R + d`` is rank ``d`` of
    stage ``s``, the numbering distca's ticks use."""

    def __init__(self, ctx: Context, ranks: int):
        self.ctx, self.R = ctx, ranks
        n = ctx.pp * ranks
        self.lin, self.attn, self.comm, self.act = (np.zeros(n) for _ in range(4))

    def add(self, members, tokens: float, attn_f, attn_b, comm_f: float = 0.0,
            comm_b: float = 0.0) -> None:
        """One microbatch of ``tokens`` per member on every stage; ``attn_*`` per member."""
        ctx, rec = self.ctx, 1.0 if self.ctx.recompute else 0.0
        for s in range(ctx.pp):
            idx = s * self.R + np.asarray(members)
            self.lin[idx] += ctx.layers * tokens * (ctx.lin_f + ctx.lin_b + rec * ctx.lin_f)
            if s == ctx.pp - 1:
                self.lin[idx] += tokens * (ctx.head_f + ctx.head_b)
            self.attn[idx] += ctx.layers * (np.asarray(attn_f) + attn_b + rec * np.asarray(attn_f))
            self.comm[idx] += ctx.layers * (comm_f + comm_b + rec * comm_f)
            self.act[idx] = np.maximum(self.act[idx], tokens * ctx.act_bytes_per_token(s))

    def result(self, step: float, step_no_comm: float, details: dict) -> "RunResult":
        return RunResult(step, step - step_no_comm, self.lin, self.attn, self.comm, self.act,
                         details)


def run_packing(ctx: Context, batch) -> RunResult:
    """Plain packing: ``batch[i][d]`` is the document list of microbatch ``i`` on rank ``d``."""
    m, R, p = ctx.m, ctx.dp, ctx.pp
    book = _Ledger(ctx, R)
    makespans = []
    for d in range(R):
        f, b = np.zeros((p, m)), np.zeros((p, m))
        for i in range(m):
            docs = batch[i][d]
            T = sum(docs)
            af, ab = ctx.doc_attention(docs)
            for s in range(p):
                f[s, i], b[s, i] = _op_times(ctx, T, af, ab, 0.0, 0.0, s)
            book.add([d], T, af, ab)
        T_max = max(sum(batch[i][d]) for i in range(m))
        makespans.append(pipeline_1f1b(f, b, _p2p(ctx, T_max, R))[0])
    return book.result(max(makespans), max(makespans), {})


# ---- per-document CP -----------------------------------------------------------------------------
def cp_server_seconds(lens, S: int, table) -> np.ndarray:
    """Per-server kernel seconds when every document is split head–tail over ``S`` servers.

    Document ``g`` of ``l`` tokens is folded into ``⌈l/2⌉`` positions and cut into ``S`` bands of
    near-equal width (the spare positions rotate with ``g``, as in
    :func:`scheduler.baselines.per_doc_cp`); band ``[a, b)`` is the head shard ``[a, b)`` plus the
    tail shard ``[max(l − b, b), l − a)`` (merged at the centre). Each shard is one CA-task priced
    by ``table`` (query rows, keys of its full prefix). Vectorised; no Plan is built.
    """
    l_all = np.asarray(lens, dtype=np.int64)
    out = np.zeros(S)
    j = np.arange(S)
    step = max(1, 2_000_000 // S)
    for lo in range(0, len(l_all), step):
        l = l_all[lo:lo + step, None]
        g = np.arange(lo, lo + len(l))[:, None]
        fold = (l + 1) // 2
        base, extra = fold // S, fold % S
        w = base + (((j[None, :] - g) % S) < extra)
        a = np.cumsum(w, axis=1) - w
        b = a + w
        t0 = np.maximum(l - b, b)
        merged = t0 == b
        valid = w > 0
        head_q = np.where(valid, np.where(merged, l - 2 * a, w), 0)
        head_kv = np.where(valid, np.where(merged, l - a, b), 0)
        tail = valid & ~merged
        tail_q = np.where(tail, l - a - t0, 0)
        tail_kv = np.where(tail, l - a, 0)
        out += table.latencies(head_q, head_kv).sum(axis=0)
        out += table.latencies(tail_q, tail_kv).sum(axis=0)
    return out


def _cp_gather(ctx: Context, tokens: float, members: int, spans: bool) -> tuple[float, float]:
    """Exposed seconds per layer of the CP K/V all-gather: forward gathers K, V; backward gathers
    them again and reduce-scatters dK, dV (WLB-LLM and Megatron's all-gather CP)."""
    if members <= 1:
        return 0.0, 0.0
    one = ctx.gpu.collective_latency_s + ring_seconds(tokens * ctx.kv_token_bytes, members,
                                                      spans, ctx.gpu)
    return one, 2 * one


def run_per_doc_cp(ctx: Context, batch) -> RunResult:
    """Per-document CP over all ``R`` ranks of each stage (one CP group, no data parallelism)."""
    m, R, p = ctx.m, ctx.dp, ctx.pp
    spans = len(set(rank_nodes(R, ctx.tp, ctx.gpu.gpus_per_node).tolist())) > 1
    f, b, f0, b0 = (np.zeros((p, m)) for _ in range(4))
    book = _Ledger(ctx, R)
    T_max = 0.0
    for i in range(m):
        docs = [x for d in range(R) for x in batch[i][d]]
        T = sum(docs) / R  # every member holds 1/R of every document
        T_max = max(T_max, T)
        sf = cp_server_seconds(docs, R, ctx.fwd_table) + ctx.gpu.kernel_launch_s
        sb = cp_server_seconds(docs, R, ctx.bwd_table) + ctx.gpu.kernel_launch_s
        gf, gb = _cp_gather(ctx, sum(docs), R, spans)
        for s in range(p):
            f[s, i], b[s, i] = _op_times(ctx, T, sf.max(), sb.max(), gf, gb, s)
            f0[s, i], b0[s, i] = _op_times(ctx, T, sf.max(), sb.max(), 0.0, 0.0, s)
        book.add(np.arange(R), T, sf, sb, gf, gb)
    hop = _p2p(ctx, T_max, R)
    return book.result(pipeline_1f1b(f, b, hop)[0], pipeline_1f1b(f0, b0, hop)[0], {"cp": R})


# ---- WLB-ideal -----------------------------------------------------------------------------------
def run_wlb_ideal(ctx: Context, batch, cp: int, cap_per_rank: int) -> RunResult:
    """WLB-ideal with CP degree ``cp`` (a divisor of the ranks per stage)."""
    m, R, p = ctx.m, ctx.dp, ctx.pp
    G = R // cp
    lens = np.array([x for i in range(m) for d in range(R) for x in batch[i][d]], dtype=np.int64)
    af_doc = ctx.fwd_table.latencies(lens, lens)
    ab_doc = ctx.bwd_table.latencies(lens, lens)
    rec = 1.0 if ctx.recompute else 0.0
    cost = (af_doc + ab_doc + rec * af_doc) + lens * (ctx.lin_f + ctx.lin_b + rec * ctx.lin_f)
    nominal = max(sum(batch[i][d]) for i in range(m) for d in range(R))
    cap = cp * max(cap_per_rank, nominal)
    bins = [lens[b].tolist() for b in capped_lpt(lens, cost, m * G, cap)]
    nodes = rank_nodes(R, ctx.tp, ctx.gpu.gpus_per_node)
    spans = any(len(set(nodes[g * cp:(g + 1) * cp].tolist())) > 1 for g in range(G))
    book = _Ledger(ctx, R)
    makespans, zero_spans = [], []
    for g in range(G):
        f, b, f0, b0 = (np.zeros((p, m)) for _ in range(4))
        for i in range(m):
            docs = np.asarray(bins[i * G + g], dtype=np.int64)
            T = docs.sum() / cp
            af = ab = 0.0
            if docs.size:  # ideal CP: each member runs exactly 1/cp of every document
                af = float(ctx.fwd_table.latencies(docs, docs).sum()) / cp + ctx.gpu.kernel_launch_s
                ab = float(ctx.bwd_table.latencies(docs, docs).sum()) / cp + ctx.gpu.kernel_launch_s
            gf, gb = _cp_gather(ctx, float(docs.sum()), cp, spans)
            for s in range(p):
                f[s, i], b[s, i] = _op_times(ctx, T, af, ab, gf, gb, s)
                f0[s, i], b0[s, i] = _op_times(ctx, T, af, ab, 0.0, 0.0, s)
            book.add(np.arange(g * cp, (g + 1) * cp), T, af, ab, gf, gb)
        hop = _p2p(ctx, max(sum(bins[i * G + g]) for i in range(m)) / cp, R)
        makespans.append(pipeline_1f1b(f, b, hop)[0])
        zero_spans.append(pipeline_1f1b(f0, b0, hop)[0])
    return book.result(max(makespans), max(zero_spans),
                       {"cp": cp, "token_cap_per_rank": int(cap // cp)})


# ---- distca --------------------------------------------------------------------------------------
_PLAN_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()
_PLAN_CACHE_SIZE = 4096
# Simulations may run in threads: a lookup's move to the end and another thread's eviction race
# (KeyError) unless the cache is touched under this lock.
_PLAN_LOCK = threading.Lock()
# The four all-to-alls of a step (keys of network.plan_round_bytes).
FWD_DISPATCH, FWD_RETURN = (RoundKind.FORWARD, "dispatch"), (RoundKind.FORWARD, "return")
BWD_DISPATCH, BWD_RETURN = (RoundKind.BACKWARD, "dispatch"), (RoundKind.BACKWARD, "return")


class _Placement(NamedTuple):
    """Where a tick's CA-tasks run: per task (``server``, source ``rank``, query length ``ql``,
    KV length ``kl``), and the rows each rank ships each server (``q_rows``, ``kv_rows``: int64
    ``[ranks, servers]``, :attr:`scheduler.tasks.Plan.row_matrix`), over one all-to-all group's
    ranks, or (stored between ticks) over all ranks of the pipeline."""

    server: np.ndarray
    rank: np.ndarray
    ql: np.ndarray
    kl: np.ndarray
    q_rows: np.ndarray
    kv_rows: np.ndarray

    def to_global(self, grp: np.ndarray, n: int, keep_ranks: np.ndarray) -> "_Placement":
        """The tasks and rows of the group's ranks ``keep_ranks`` (a bool mask over ``grp``), in
        pipeline-wide rank numbers (``grp[i]`` is the group's rank ``i``; ``n`` ranks in all)."""
        mine = keep_ranks[self.rank]
        q_rows, kv_rows = np.zeros((n, n), dtype=np.int64), np.zeros((n, n), dtype=np.int64)
        rows = grp[keep_ranks]
        q_rows[np.ix_(rows, grp)] = self.q_rows[keep_ranks]
        kv_rows[np.ix_(rows, grp)] = self.kv_rows[keep_ranks]
        return _Placement(grp[self.server[mine]], grp[self.rank[mine]], self.ql[mine],
                          self.kl[mine], q_rows, kv_rows)

    @staticmethod
    def in_group(parts: list["_Placement"], grp: np.ndarray) -> "_Placement":
        """Pipeline-wide placements ``parts`` joined and numbered by the group ``grp``'s ranks
        (every task's server and rank must be in the group)."""
        local = np.full(len(parts[0].q_rows), -1, dtype=np.int64)
        local[grp] = np.arange(len(grp))
        cat = [np.concatenate(x) for x in zip(*(p[:4] for p in parts))]
        server, rank = local[cat[0]], local[cat[1]]
        assert (server >= 0).all() and (rank >= 0).all(), "a kept task outside its group"
        q_rows = sum(p.q_rows for p in parts)[np.ix_(grp, grp)]
        kv_rows = sum(p.kv_rows for p in parts)[np.ix_(grp, grp)]
        return _Placement(server, rank, cat[2], cat[3], q_rows, kv_rows)


def _planned(docs_per_rank, cost, epsilon: float, min_shard: int, keep_activations: bool,
             time_model: TimeModel | None = None):
    """The :class:`_Placement` of a plan of ``docs_per_rank``, cached.

    The FLOP planner sees the cost model only through the ratio of query-row to KV-row bytes of a
    step (it ranks moves by FLOPs per byte; :meth:`~scheduler.cost.CostModel.step_row_bytes` with
    ``keep_activations``), so its plans are shared by every model with the same per-GPU head
    ratio; a time planner's plans (``time_model``) are cached per model object.
    """
    q, kv = cost.step_row_bytes(keep_activations)
    g = math.gcd(q, kv)
    key = (tuple(tuple(x) for x in docs_per_rank), q // g, kv // g, float(epsilon), min_shard,
           keep_activations, None if time_model is None else id(time_model))
    with _PLAN_LOCK:
        hit = _PLAN_CACHE.get(key)
        if hit is not None and hit[0] is time_model:  # an id reused by another model misses
            _PLAN_CACHE.move_to_end(key)
            return hit[1]
    # Planned outside the lock: other threads' lookups go on meanwhile (two threads may plan the
    # same batch, each once; the second entry replaces the first).
    plan = plan_batch([list(x) for x in docs_per_rank], len(docs_per_rank), cost=cost,
                      epsilon=epsilon, mode="inplace", min_shard=min_shard,
                      keep_activations=keep_activations, time_model=time_model)
    arr = plan.task_array
    q_rows, kv_rows = plan.row_matrix
    hit = _Placement(arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 4] - arr[:, 3], arr[:, 6].copy(),
                     q_rows, kv_rows)
    with _PLAN_LOCK:
        _PLAN_CACHE[key] = (time_model, hit)
        while len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
            _PLAN_CACHE.popitem(last=False)
    return hit


def _tick_group(ctx, placement: _Placement, docs, ranks, kind, last_stage_mask, ping_pong, keep):
    """Seconds of one tick for one all-to-all group of ranks, its CA-tasks run where
    ``placement`` says, with and without communication, and ``held[r, s]``: bytes server ``s``
    keeps of rank ``r``'s rows per layer (``keep``)."""
    S = len(docs)
    server, _, ql, kl, q_rows, kv_rows = placement
    ca_f = np.bincount(server, ctx.fwd_table.latencies(ql, kl), minlength=S)
    ca_b = np.bincount(server, ctx.bwd_table.latencies(ql, kl), minlength=S)
    nodes = rank_nodes(int(max(ranks)) + 1, ctx.tp, ctx.gpu.gpus_per_node)[ranks]
    mats = plan_round_bytes(q_rows, kv_rows, ctx.cost, keep_activations=keep)
    secs = {k: alltoall_seconds(v, nodes, ctx.gpu) for k, v in mats.items()}
    T = np.array([sum(x) for x in docs], dtype=float)
    lf, lb = ctx.lin_f * T, ctx.lin_b * T
    hf, hb = ctx.head_f * T * last_stage_mask, ctx.head_b * T * last_stage_mask
    lat, phi = ctx.gpu.collective_latency_s, ctx.phi

    def rounds(comm: bool):
        c = 1.0 if comm else 0.0
        fwd = dict(dispatch_bw_s=c * secs[FWD_DISPATCH][0], return_bw_s=c * secs[FWD_RETURN][0],
                   latency_s=c * lat)
        bwd = dict(dispatch_bw_s=c * secs[BWD_DISPATCH][0], return_bw_s=c * secs[BWD_RETURN][0],
                   latency_s=c * lat)
        out = []
        if kind == "F":
            for j in range(ctx.layers):
                out.append(Round(phi * lf if j == 0 else lf, ca_f, **fwd))
            return out, (1 - phi) * lf + hf
        for j in range(ctx.layers):
            if ctx.recompute:
                out.append(Round(phi * lf + (hb if j == 0 else phi * lb), ca_f, **fwd))
                out.append(Round((1 - phi) * (lf + lb), ca_b, **bwd))
            else:
                out.append(Round((1 - phi) * lb + hb if j == 0 else lb, ca_b, **bwd))
        return out, phi * lb

    launch = ctx.gpu.kernel_launch_s
    t, busy = run_rounds(*rounds(True), ping_pong=ping_pong, launch_s=launch)
    t0, _ = run_rounds(*rounds(False), ping_pong=ping_pong, launch_s=launch)
    n_f = ctx.layers if (kind == "F" or ctx.recompute) else 0
    n_b = 0 if kind == "F" else ctx.layers
    port = (n_f * (secs[FWD_DISPATCH][1] + secs[FWD_RETURN][1])
            + n_b * (secs[BWD_DISPATCH][1] + secs[BWD_RETURN][1]))
    if kind == "F":
        lin_busy = ctx.layers * lf + hf
    else:
        lin_busy = ctx.layers * (lb + (lf if ctx.recompute else 0.0)) + hb
    recv = mats[BWD_DISPATCH].sum(axis=0) - np.diag(mats[BWD_DISPATCH])
    off = {k: float(v.sum() - np.trace(v)) for k, v in mats.items()}
    moved = (n_f * (off[FWD_DISPATCH] + off[FWD_RETURN])
             + n_b * (off[BWD_DISPATCH] + off[BWD_RETURN])) * ctx.tp  # all tp GPU lanes
    hq, hkv = ctx.cost.held_row_bytes()  # Plan.held_bytes, split by the rank the rows came from
    held = q_rows * hq + kv_rows * hkv if keep else np.zeros_like(q_rows)
    return t, t0, lin_busy, busy - lin_busy, port, recv, moved, held


def run_distca(ctx: Context, batch, epsilon: float, *, ping_pong: bool = True,
               bubble_serving: bool = True, keep_activations: bool = True,
               time_planner: bool = False) -> RunResult:
    """distca with in-place servers; ``bubble_serving=False`` plans each stage on its own.

    ``time_planner``: plan each tick balancing the seconds of this context's own tables
    (:meth:`Context.time_model`; ε in those seconds) instead of FLOPs.

    ``keep_activations`` (as :func:`scheduler.plan_batch`): the backward rounds send dO only, the
    clients save no Q, K, V, LSE for core attention (:meth:`Context.act_bytes_per_token`) and each
    server holds what :meth:`Plan.held_bytes` says, per layer, from a microbatch's forward tick to
    its backward tick (with full recompute: one recomputed layer at a time, in the backward tick).
    ``held_bytes``: each rank's peak of those bytes, per GPU (``details["held_bytes_max"]``).
    Without recompute, a microbatch's backward tick then runs on the servers of its forward tick
    (planned with other pairs in a pipeline), not on a fresh plan of the backward tick."""
    m, R, p = ctx.m, ctx.dp, ctx.pp
    N = p * R
    step = step0 = moved = 0.0
    lin, attn, comm, recv, held_peak = (np.zeros(N) for _ in range(5))
    held_now: dict[tuple[int, int], np.ndarray] = {}  # (stage, microbatch) -> bytes held per rank
    # Kept activations pin a microbatch's backward rounds to the servers its forward rounds ran on
    # (they hold its Q, K, V, O, LSE): a backward tick runs the placements of its (stage,
    # microbatch) pairs' forward ticks, pooled with other pairs than now, not a fresh plan.
    pinned = keep_activations and not ctx.recompute
    forward_of: dict[tuple[int, int], _Placement] = {}  # (stage, microbatch) -> pipeline-wide
    stage_of = np.arange(N) // R
    for kind, active in tick_schedule(p, m):
        mb_of = dict(active)
        docs = [batch[mb_of[s]][d] if s in mb_of else [] for s in range(p) for d in range(R)]
        last = np.array([1.0 if s == p - 1 else 0.0 for s in range(p) for _ in range(R)])
        groups = [list(range(N))] if bubble_serving else [
            list(range(s * R, (s + 1) * R)) for s in sorted(mb_of)]
        t_tick = t0_tick = 0.0
        in_flight = np.zeros(N)  # a recomputed layer's rows, held during the backward tick
        for grp in groups:
            g = np.array(grp)
            gdocs = [docs[r] for r in grp]
            if kind == "B" and pinned:
                placement = _Placement.in_group(
                    [forward_of.pop(si) for si in active if stage_of[g[0]] <= si[0] <= stage_of[g[-1]]], g)
            else:
                placement = _planned(gdocs, ctx.cost, epsilon, ctx.plan_min_shard(time_planner),
                                     keep_activations, ctx.time_model() if time_planner else None)
            t, t0, lb, ab, port, rv, mv, held = _tick_group(
                ctx, placement, gdocs, g, kind, last[grp], ping_pong, keep_activations)
            if kind == "F" and pinned:  # kept until this microbatch's backward tick
                for s, i in active:
                    from_s = stage_of[grp] == s
                    if from_s.any():
                        forward_of[(s, i)] = placement.to_global(g, N, from_s)
                        held_now.setdefault((s, i), np.zeros(N))[grp] += ctx.layers * held[from_s].sum(axis=0)
            elif kind == "B" and ctx.recompute:
                in_flight[grp] = held.sum(axis=0)
            t_tick, t0_tick = max(t_tick, t), max(t0_tick, t0)
            lin[grp] += lb
            attn[grp] += ab
            comm[grp] += port
            recv[grp] = np.maximum(recv[grp], rv)
            moved += mv
        held_peak = np.maximum(held_peak, sum(held_now.values(), in_flight))
        if kind == "B":
            for s_i in active:
                held_now.pop(s_i, None)
        senders = [s for s in mb_of if (s < p - 1 if kind == "F" else s > 0)]
        hop = _p2p(ctx, max(sum(x) for x in docs), R) if senders else 0.0
        step += t_tick + hop
        step0 += t0_tick + hop
    tokens = np.array([max(sum(batch[i][d]) for i in range(m)) for s in range(p) for d in range(R)])
    act = np.array([tokens[s * R + d] * ctx.act_bytes_per_token(s, keep_activations)
                    for s in range(p) for d in range(R)]) + recv + held_peak
    return RunResult(step, step - step0, lin, attn, comm, act,
                     {"epsilon": float(epsilon), "planner": "time" if time_planner else "flops",
                      "min_shard": ctx.plan_min_shard(time_planner), "ping_pong": ping_pong,
                      "bubble_serving": bubble_serving, "keep_activations": keep_activations,
                      "ca_bytes_per_step": moved, "held_bytes_max": float(held_peak.max())},
                     held_peak)
