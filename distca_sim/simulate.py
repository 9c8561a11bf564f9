"""Cluster-scale step-time simulator: does core attention disaggregation pay off on a cluster?

Pure Python + numpy (no torch, no ray). Units: seconds, bytes, FLOPs, tokens; throughput in
tokens per second over the whole cluster.

One call, :func:`simulate`, models one training step of a Llama-style model on ``gpus`` GPUs laid
out as ``tp × dp × pp`` (tensor parallel inside a node, ``dp`` ranks per pipeline stage, ``pp``
stages, ``microbatches`` per step), on a batch drawn from the Pretrain or ProLong trace
(:func:`distca_sim.workloads.sample_batch`: every rank gets ``context`` tokens per microbatch), and
compares in one run:

* ``distca`` — in-place core attention servers planned by :func:`scheduler.plan_batch` for each ε
  in ``epsilons`` (named ``"distca eps=0.05"``; with ``planner="time"`` or ``"both"``, the time
  planner's are ``"distca-time eps=0.05"``: it balances the seconds of the same tables the
  simulation prices with);
* ``wlb_ideal`` — the paper's baseline: WLB-LLM variable-length packing plus per-document CP,
  idealised, at its best CP degree;
* ``per_doc_cp`` — per-document CP over all ranks of a stage;
* ``packing`` — plain packing, no balancing.

Per rank it computes linear time (GEMMs and tensor-parallel communication), attention time (the
profile table applied to each CA-task the rank runs), communication time and how much of it stays
exposed (ping-pong nano-batches for distca, DistCA §4.2), activation memory, and the step time:
the slowest data-parallel rank, or a 1F1B pipeline with stage imbalance; distca serves CA-tasks
from ranks idle in pipeline bubbles (DistCA §4.1). The model and its sources are documented in
:mod:`distca_sim.hardware` (costs, memory, GPU presets), :mod:`distca_sim.network` (links),
:mod:`distca_sim.pipeline` (schedules) and :mod:`distca_sim.systems` (systems).

What is not modelled: the data-parallel gradient reduce-scatter / all-gather (the same for every
system, overlapped with the backward pass by Megatron's distributed optimizer), optimizer step
time, kernel interference between overlapped communication and compute, and WLB-LLM's deferral of
outlier documents to later steps.

Example::

    from distca_sim.simulate import simulate, ParallelConfig, Workload
    cmp = simulate("llama3-8b", "h200", ParallelConfig.from_gpus(64, tp=8),
                   Workload("pretrain", 131072), epsilons=(0.05,))
    print(cmp.table())
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from scheduler.baselines import capped_lpt
from scheduler.checks import at_least, boolean, is_finite_number

from .hardware import GPUS, MEMORY_HEADROOM, MODELS, GPUConfig, ModelConfig, get_gpu, get_model
from .systems import Context, RunResult, run_distca, run_packing, run_per_doc_cp, run_wlb_ideal
from .workloads import TRACE_NAMES, sample_batch

__all__ = ["simulate", "packing_imbalance", "ParallelConfig", "Workload", "SystemResult",
           "Comparison",
           "ModelConfig", "GPUConfig", "MODELS", "GPUS", "get_model", "get_gpu", "SYSTEMS"]

SYSTEMS = ("distca", "wlb_ideal", "per_doc_cp", "packing")
GIB = 2 ** 30


@dataclass(frozen=True)
class ParallelConfig:
    """How the GPUs are laid out: ``gpus = tp · dp · pp``.

    Args:
        tp: tensor-parallel GPUs per rank (inside one node).
        dp: ranks per pipeline stage (data-parallel ranks; distca's attention servers are ranks).
        pp: pipeline stages (``pp = 1``: no pipeline).
        microbatches: microbatches per step, each ``context`` tokens per rank.

    Raises:
        ValueError: a non-positive or non-int size.
    """

    tp: int = 8
    dp: int = 1
    pp: int = 1
    microbatches: int = 1

    def __post_init__(self) -> None:
        for f in ("tp", "dp", "pp", "microbatches"):
            at_least(f, getattr(self, f))

    @property
    def gpus(self) -> int:
        return self.tp * self.dp * self.pp

    @classmethod
    def from_gpus(cls, gpus: int, tp: int = 8, pp: int = 1,
                  microbatches: int | None = None) -> "ParallelConfig":
        """``dp = gpus / (tp · pp)``; ``microbatches`` defaults to ``2·pp`` with a pipeline,
        else 1.

        Raises:
            ValueError: ``gpus`` not a multiple of ``tp · pp``.
        """
        for name, v in (("gpus", gpus), ("tp", tp), ("pp", pp)):
            at_least(name, v)
        if gpus % (tp * pp):
            raise ValueError(f"gpus={gpus} is not a multiple of tp*pp={tp * pp}")
        m = microbatches if microbatches is not None else (2 * pp if pp > 1 else 1)
        return cls(tp=tp, dp=gpus // (tp * pp), pp=pp, microbatches=m)

    def check(self, model: ModelConfig, gpu: GPUConfig) -> None:
        """Raise ``ValueError`` listing every way this layout does not fit ``model`` on ``gpu``."""
        bad = []
        if self.tp > gpu.gpus_per_node or gpu.gpus_per_node % self.tp:
            bad.append(f"tp={self.tp} must divide the {gpu.gpus_per_node} GPUs of a node")
        if model.num_heads % self.tp:
            bad.append(f"tp={self.tp} must divide num_heads={model.num_heads}")
        if model.num_kv_heads % self.tp and self.tp % model.num_kv_heads:
            bad.append(f"tp={self.tp} and num_kv_heads={model.num_kv_heads} "
                       "must divide one another")
        if model.num_layers % self.pp:
            bad.append(f"pp={self.pp} must divide num_layers={model.num_layers}")
        if bad:
            raise ValueError("bad parallel layout: " + "; ".join(bad))


@dataclass(frozen=True)
class Workload:
    """One step's batch: ``microbatches × dp`` chunks of ``context`` tokens drawn from a length
    trace by :func:`distca_sim.workloads.sample_batch` (every pipeline stage sees the same ones).

    Args:
        dataset: ``"pretrain"`` or ``"prolong"``.
        context: tokens per rank and microbatch (also the longest document, the packer's cut).
        seed, step: which sampled stream and which step of it.

    Raises:
        ValueError: an unknown dataset, ``context < 16`` or a negative seed / step.
    """

    dataset: str = "pretrain"
    context: int = 131072
    seed: int = 0
    step: int = 0

    def __post_init__(self) -> None:
        if self.dataset not in TRACE_NAMES:
            raise ValueError(f"unknown dataset {self.dataset!r}; expected one of {TRACE_NAMES}")
        at_least("context", self.context, 16)
        at_least("seed", self.seed, 0)
        at_least("step", self.step, 0)

    def batch(self, par: ParallelConfig) -> list[list[list[int]]]:
        """``batch[i][d]``: document lengths of microbatch ``i`` on rank ``d`` (each sums to
        ``context``). Every pipeline stage sees the same microbatch."""
        chunks = sample_batch(self.dataset, par.dp * par.microbatches, self.context,
                              seed=self.seed, step=self.step)
        return [chunks[i * par.dp:(i + 1) * par.dp] for i in range(par.microbatches)]


@dataclass
class SystemResult:
    """One system's simulated step.

    Attributes:
        system: ``"distca eps=0.05"``, ``"wlb_ideal"``, ``"per_doc_cp"`` or ``"packing"``.
        step_time_s: seconds of one step.
        tokens_per_step: tokens trained per step (the same for every system).
        throughput_tokens_s: ``tokens_per_step / step_time_s``, whole cluster.
        linear_s, attention_s, comm_s: the busiest rank's seconds per step of linear compute
            (TP communication included), attention kernels, and CA/CP traffic on its ports.
        comm_exposed_s: step time minus the same schedule with free CA/CP communication.
        idle_fraction: ``1 − mean(rank compute) / step_time``: GPU time lost to waiting.
        memory_bytes: peak bytes on the fullest GPU (model states + activations + CA buffers).
        memory_divergence: max / mean activation bytes over ranks (1.0 = balanced memory).
        fits: ``memory_bytes`` within the usable HBM.
        details: system knobs (``epsilon``, ``cp``, ...).
        per_rank: per-rank arrays ``linear_s``, ``attention_s``, ``comm_s``, ``act_bytes`` and
            ``held_bytes`` (distca with kept activations: the peak bytes per GPU its server
            holds between a layer's forward and backward rounds, part of ``act_bytes``; else 0).
    """

    system: str
    step_time_s: float
    tokens_per_step: int
    throughput_tokens_s: float
    linear_s: float
    attention_s: float
    comm_s: float
    comm_exposed_s: float
    idle_fraction: float
    memory_bytes: float
    memory_divergence: float
    fits: bool
    details: dict = field(default_factory=dict)
    per_rank: dict = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        """JSON-ready dict (without ``per_rank``)."""
        d = {k: getattr(self, k) for k in ("system", "step_time_s", "tokens_per_step",
                                           "throughput_tokens_s", "linear_s", "attention_s",
                                           "comm_s", "comm_exposed_s", "idle_fraction",
                                           "memory_bytes", "memory_divergence", "fits")}
        d["details"] = dict(self.details)
        return d


@dataclass
class Comparison:
    """All systems on one configuration; ``results`` in the order simulated."""

    model: ModelConfig
    gpu: GPUConfig
    parallel: ParallelConfig
    workload: Workload
    recompute: bool
    results: list[SystemResult]

    def get(self, system: str) -> SystemResult:
        """The result named ``system``; ``"distca"`` means the fastest distca ε (of either planner),
        ``"distca-flops"`` / ``"distca-time"`` the fastest of one planner.

        Raises:
            KeyError: no such system in this comparison.
        """
        if system in ("distca", "distca-flops", "distca-time"):
            prefix = {"distca": "distca", "distca-flops": "distca eps=", "distca-time": "distca-time "}[system]
            cands = [r for r in self.results if r.system.startswith(prefix)]
            if cands:
                return min(cands, key=lambda r: r.step_time_s)
        for r in self.results:
            if r.system == system:
                return r
        raise KeyError(f"no system {system!r}; have {[r.system for r in self.results]}")

    def speedup(self, system: str = "distca", baseline: str = "wlb_ideal") -> float:
        """Throughput of ``system`` over ``baseline`` (> 1: ``system`` is faster)."""
        return self.get(system).throughput_tokens_s / self.get(baseline).throughput_tokens_s

    def table(self) -> str:
        """Plain aligned text: one row per system."""
        has_wlb = any(r.system == "wlb_ideal" for r in self.results)
        head = ["system", "step s", "tokens/s", "vs WLB", "linear s", "attn s", "comm s",
                "exposed s", "idle %", "mem GiB", "fits", "notes"]
        rows = []
        for r in self.results:
            notes = ", ".join(f"{k}={v}" for k, v in r.details.items() if k in ("cp", "epsilon"))
            if r.details.get("keep_activations") is not None:
                notes += (f", kept, held {r.details['held_bytes_max'] / GIB:.1f} GiB"
                          if r.details["keep_activations"] else ", stateless")
            vs = f"{r.throughput_tokens_s / self.get('wlb_ideal').throughput_tokens_s:.3f}" \
                if has_wlb else "-"
            rows.append([r.system, f"{r.step_time_s:.3f}", f"{r.throughput_tokens_s:,.0f}", vs,
                         f"{r.linear_s:.3f}", f"{r.attention_s:.3f}", f"{r.comm_s:.3f}",
                         f"{r.comm_exposed_s:.3f}", f"{100 * r.idle_fraction:.1f}",
                         f"{r.memory_bytes / GIB:.1f}", "yes" if r.fits else "NO", notes])
        p, w = self.parallel, self.workload
        title = (f"{self.model.name} on {p.gpus}x {self.gpu.name} (tp={p.tp} dp={p.dp} pp={p.pp} "
                 f"microbatches={p.microbatches}), {w.dataset} {w.context // 1024}K tokens/rank, "
                 f"recompute={'full' if self.recompute else 'none'}")
        return title + "\n" + format_table(head, rows)


def format_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Aligned plain-text table: text columns left-aligned, the rest right-aligned."""
    cols = list(zip(head, *rows)) if rows else [(h,) for h in head]
    widths = [max(len(str(x)) for x in c) for c in cols]
    numeric = [all(_numeric(x) for x in c[1:]) and len(c) > 1 for c in cols]

    def fmt(row):
        return "  ".join(str(x).rjust(w) if n else str(x).ljust(w)
                         for x, w, n in zip(row, widths, numeric)).rstrip()
    lines = [fmt(head), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def _numeric(x) -> bool:
    s = str(x).replace(",", "").replace("%", "").replace("x", "").strip()
    try:
        float(s)
        return True
    except ValueError:
        return s in ("-", "")


def _check_epsilons(epsilons) -> tuple[float, ...]:
    if isinstance(epsilons, str) or not isinstance(epsilons, Iterable):  # a str's characters are no ε
        raise ValueError(f"epsilons must be a sequence of numbers, got {epsilons!r}")
    eps = tuple(epsilons)
    bad = [e for e in eps if not is_finite_number(e) or e < 0]
    if not eps or bad:
        raise ValueError(f"epsilons must be finite numbers >= 0, got {list(eps)}")
    return tuple(float(e) for e in eps)


def _check_batch(batch, par: ParallelConfig) -> list[list[list[int]]]:
    """Validate an explicit ``batch[i][d]`` of document lengths (positive ints)."""
    try:
        out = [[[int(l) for l in docs] for docs in mb] for mb in batch]
        ok = all(isinstance(l, (int, np.integer)) and not isinstance(l, bool) and l > 0
                 for mb in batch for docs in mb for l in docs)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError("batch must be microbatches x ranks lists of positive int "
                         "document lengths")
    if len(out) != par.microbatches or any(len(mb) != par.dp for mb in out):
        raise ValueError(f"batch must hold {par.microbatches} microbatches of {par.dp} ranks, got "
                         f"{[len(mb) for mb in out]}")
    if sum(sum(x) for mb in out for x in mb) == 0:
        raise ValueError("batch holds no tokens")
    return out


def simulate(model: ModelConfig | str, gpu: GPUConfig | str, parallel: ParallelConfig,
             workload: Workload, *, systems: Iterable[str] = SYSTEMS,
             epsilons: Sequence[float] = (0.05,), ping_pong: bool = True,
             bubble_serving: bool = True, recompute: str = "auto", keep_activations: bool = True,
             cp_degrees: Sequence[int] | None = None, min_shard: int | None = None,
             batch: Sequence[Sequence[Sequence[int]]] | None = None, planner: str = "flops") -> Comparison:
    """Simulate one training step of every system in ``systems`` on the same batch.

    Args:
        model: a :class:`ModelConfig` or preset name (``llama3-8b``, ``llama-34b``).
        gpu: a :class:`GPUConfig` or preset name (``h100``, ``h200``).
        parallel: the GPU layout.
        workload: dataset, tokens per rank, seed and step.
        systems: any of ``distca``, ``wlb_ideal``, ``per_doc_cp``, ``packing``.
        epsilons: distca's imbalance tolerances; one result per ε.
        ping_pong: distca overlaps communication with two nano-batches (else sequential).
        bubble_serving: distca pools CA-tasks over all pipeline stages in each tick, so ranks in a
            bubble serve busy ones (else each stage balances over its own ranks only).
        recompute: activation recomputation for all systems: ``"none"``, ``"full"`` or ``"auto"``
            (full only when plain packing's activations do not fit in memory).
        keep_activations: distca's servers keep each layer's activations from its forward round
            to its backward round, which then sends dO only (as :func:`scheduler.plan_batch`);
            False: stateless servers, every backward round resends Q, K, V, O and LSE.
        cp_degrees: CP degrees WLB-ideal may use (default: powers of two dividing ``dp``).
        min_shard: the planner's smallest shard, tokens (None: 128 for the FLOP planner, the
            table's choice for the time planner, :meth:`scheduler.time_cost.TimeModel.choose_min_shard`).
        planner: distca's planner: ``"flops"`` (balance FLOPs), ``"time"`` (balance the seconds the
            simulation's own attention tables predict; named ``"distca-time eps=…"``) or ``"both"``.
        batch: explicit documents instead of sampling: ``batch[i][d]`` lists the document lengths
            of microbatch ``i`` on rank ``d`` (``microbatches × dp`` lists; a list may be empty).

    Returns:
        A :class:`Comparison`.

    Raises:
        ValueError: an unknown model, GPU, system or dataset; ``systems`` or ``epsilons`` given
            as one str; a layout that does not fit the model; bad ε, CP degrees, recompute mode,
            ``ping_pong``, ``bubble_serving``, ``keep_activations`` (bools) or ``planner``.
    """
    for flag, value in (("ping_pong", ping_pong), ("bubble_serving", bubble_serving),
                        ("keep_activations", keep_activations)):
        boolean(flag, value)
    model = get_model(model) if isinstance(model, str) else model
    gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if not isinstance(model, ModelConfig) or not isinstance(gpu, GPUConfig):
        raise ValueError("model and gpu must be ModelConfig / GPUConfig or preset names")
    if not isinstance(parallel, ParallelConfig) or not isinstance(workload, Workload):
        raise ValueError("parallel and workload must be ParallelConfig and Workload")
    parallel.check(model, gpu)
    if isinstance(systems, str) or not isinstance(systems, Iterable):  # a str's characters are no names
        raise ValueError(f"systems must be a sequence of names from {SYSTEMS}, got {systems!r}")
    systems = tuple(systems)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise ValueError(f"unknown systems {unknown}; choose from {SYSTEMS}")
    eps = _check_epsilons(epsilons)
    if min_shard is not None:
        at_least("min_shard", min_shard)
    if planner not in ("flops", "time", "both"):
        raise ValueError(f"planner must be 'flops', 'time' or 'both', got {planner!r}")
    R = parallel.dp
    cps = tuple(cp_degrees) if cp_degrees is not None else tuple(
        c for c in (2 ** k for k in range(int(math.log2(R)) + 1)) if R % c == 0)
    if not cps or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 or R % c for c in cps):
        raise ValueError(f"cp_degrees must be positive divisors of dp={R}, got {cp_degrees}")

    args = dict(model=model, gpu=gpu, tp=parallel.tp, pp=parallel.pp, dp=R,
                microbatches=parallel.microbatches, min_shard=min_shard)
    if recompute not in ("auto", "none", "full"):
        raise ValueError(f"recompute must be 'auto', 'none' or 'full', got {recompute!r}")
    rec = recompute == "full"
    batch = workload.batch(parallel) if batch is None else _check_batch(batch, parallel)
    if recompute == "auto":
        biggest = max(sum(x) for mb in batch for x in mb)
        rec = Context(**args, recompute=False).token_cap() < biggest
    ctx = Context(**args, recompute=rec)
    tokens = sum(sum(x) for mb in batch for x in mb)
    states = ctx.states_bytes()
    usable = gpu.hbm_bytes * MEMORY_HEADROOM

    def result(name: str, run: RunResult) -> SystemResult:
        busy = run.linear_s + run.attention_s
        act = np.asarray(run.act_bytes, dtype=float)
        mem = states + float(act.max())
        return SystemResult(
            system=name, step_time_s=float(run.step_time_s), tokens_per_step=tokens,
            throughput_tokens_s=float(tokens / run.step_time_s),
            linear_s=float(run.linear_s.max()), attention_s=float(run.attention_s.max()),
            comm_s=float(np.max(run.comm_s)), comm_exposed_s=max(0.0, float(run.comm_exposed_s)),
            idle_fraction=max(0.0, 1.0 - float(busy.mean()) / run.step_time_s),
            memory_bytes=mem,
            memory_divergence=float(act.max() / act.mean()) if act.mean() else 1.0,
            fits=bool(mem <= usable),
            details={**run.details, "recompute": "full" if rec else "none"},
            per_rank={"linear_s": run.linear_s, "attention_s": run.attention_s,
                      "comm_s": run.comm_s, "act_bytes": act,
                      "held_bytes": np.zeros_like(act) if run.held_bytes is None else run.held_bytes})

    results = []
    for name in systems:
        if name == "distca":
            for timed in {"flops": (False,), "time": (True,), "both": (False, True)}[planner]:
                for e in eps:
                    run = run_distca(ctx, batch, e, ping_pong=ping_pong, bubble_serving=bubble_serving,
                                     keep_activations=keep_activations, time_planner=timed)
                    results.append(result(f"distca{'-time' if timed else ''} eps={e:g}", run))
        elif name == "wlb_ideal":
            cap = ctx.token_cap()
            runs = [run_wlb_ideal(ctx, batch, c, cap) for c in cps]
            results.append(result("wlb_ideal", min(runs, key=lambda r: r.step_time_s)))
        elif name == "per_doc_cp":
            results.append(result("per_doc_cp", run_per_doc_cp(ctx, batch)))
        else:
            results.append(result("packing", run_packing(ctx, batch)))
    return Comparison(model, gpu, parallel, workload, rec, results)


def packing_imbalance(model: ModelConfig | str, gpu: GPUConfig | str, workload: Workload, *,
                      tp: int = 8, dp: int = 8, steps: int = 1) -> dict:
    """Data-parallel imbalance of fixed- vs variable-length packing (DistCA §2.2, Fig. 4).

    For ``steps`` consecutive batches of ``dp`` ranks × ``workload.context`` tokens, each rank's
    compute time is ``Σ_docs layers · (linear(l) + attention(l)) + LM head``, forward and
    backward (:class:`~distca_sim.systems.Context` rates, no recomputation).

    * fixed-length packing: the ranks keep their chunks; idle fraction ``1 − mean / max``;
    * variable-length packing: the step's documents re-packed longest-first to the rank with the
      least time, with no token cap (what balancing compute alone does to memory); its idle
      fraction and its memory divergence ``max / mean`` tokens per rank (activation memory is
      proportional to tokens).

    Returns the means over steps: ``idle_packing``, ``idle_varlen``, ``memory_divergence_varlen``,
    plus ``throughput_packing`` and ``throughput_varlen`` (tokens/s of compute alone).

    Raises:
        ValueError: bad model, GPU, sizes or workload.
    """
    model = get_model(model) if isinstance(model, str) else model
    gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
    at_least("steps", steps)
    ParallelConfig(tp=tp, dp=dp).check(model, gpu)
    ctx = Context(model=model, gpu=gpu, tp=tp, pp=1, dp=dp, microbatches=1, recompute=False,
                  min_shard=128)
    acc = {k: 0.0 for k in ("idle_packing", "idle_varlen", "memory_divergence_varlen",
                            "throughput_packing", "throughput_varlen")}
    for step in range(steps):
        chunks = sample_batch(workload.dataset, dp, workload.context, seed=workload.seed,
                              step=workload.step + step)
        lens = np.array([x for c in chunks for x in c], dtype=np.int64)
        owner = np.repeat(np.arange(dp), [len(c) for c in chunks])
        attn = ctx.fwd_table.latencies(lens, lens) + ctx.bwd_table.latencies(lens, lens)
        per_doc = (ctx.layers * (lens * (ctx.lin_f + ctx.lin_b) + attn)
                   + lens * (ctx.head_f + ctx.head_b))
        fixed = np.bincount(owner, per_doc, minlength=dp)
        bins = capped_lpt(lens, per_doc, dp, float("inf"))
        var = np.array([sum(per_doc[b].tolist()) for b in bins])
        toks = np.array([sum(lens[b].tolist()) for b in bins], dtype=float)
        total = float(lens.sum())
        acc["idle_packing"] += 1 - fixed.mean() / fixed.max()
        acc["idle_varlen"] += 1 - var.mean() / var.max()
        acc["memory_divergence_varlen"] += toks.max() / toks.mean()
        acc["throughput_packing"] += total / fixed.max()
        acc["throughput_varlen"] += total / var.max()
    return {k: v / steps for k, v in acc.items()}
