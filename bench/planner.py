"""Planner benchmark: balance, bytes moved and planning time on real length traces.

For each trace (Pretrain, ProLong), number of servers (= client ranks, in-place mode) and tokens
per rank, one batch is drawn with :func:`distca_sim.workloads.sample_batch` (seed 0, step 0) and
planned by every system:

- ``plan_batch`` (the communication-aware greedy planner) at ε = 0, 0.05, 0.1, ``min_shard=128``;
- the baselines ``no_balance``, ``per_doc_cp`` and ``wlb_packing`` (:mod:`scheduler.baselines`).

Every system's plan is made with the same ``keep_activations`` (:data:`KEEP_ACTIVATIONS`,
``plan_batch``'s default): it sets what the backward round sends (dO alone when kept, or Q, K, V,
O, LSE and dO again when stateless), so a ratio of two systems' bytes compares like with like only
when both plans were made with the same value.

Cost model: Llama-3-8B attention per GPU, ``CostModel(num_heads_q=32, num_heads_kv=8,
head_dim=128, dtype_bytes=2)``.

Columns:
- ``imb before``: max/mean attention FLOPs over ranks of the input batch with no balancing (the
  same for every system; for ``wlb_packing`` ``plan.imbalance()[0]`` would describe the re-packed
  batch, so the input's value is reported instead).
- ``imb after``: ``plan.imbalance()[1]``, max/mean over servers under the plan.
- ``Q MiB`` / ``KV MiB`` / ``total MiB``: bytes moved off-rank by one forward plus one backward
  round (``plan.comm_bytes()``, kept activations), Q-type = q, out, lse, dout, dq; KV-type = k, v,
  dk, dv.
- ``vs CP``: total bytes as a fraction of ``per_doc_cp``'s total for the same batch (both plans
  with :data:`KEEP_ACTIVATIONS`).
- ``plan ms``: median wall time (``time.perf_counter``) of the planning call, Plan construction and
  validation included, over ``--repeats`` runs after one warm-up run (``--quick``: a single run).
  A call whose warm-up takes longer than ``--slow-s`` seconds is timed by that run alone.
- ``tasks``: CA-tasks in the plan.

Targets (issue 9): at 128K tokens per rank, ε = 0.05, both traces, ``plan_batch`` takes at most
8 ms at 256 servers and 30 ms at 1024. Each is timed beside ``no_balance`` on the same batch, the
two calls alternating (``--repeats`` pairs after a warm-up pair), and reported as wall-clock
median and best, CPU-time median (``time.process_time``, which other processes on a busy machine
do not inflate) and the multiple of ``no_balance``'s median (stored as ``targets`` in the JSON).

Named cases (issue 9): one 65,536-token document over 256 servers, one 2,048-token document over
16 servers (ε = 0.05) and ``[[3001]] + [[1]] * 15`` over 16 servers (ε = 0.5), dedicated and
in-place: the lower bound on max/mean (:func:`scheduler.bound.load_bound`), the target
``(1 + ε) · bound`` and what ``plan_batch`` reaches (``named_cases`` in the JSON).

Plan variants (issue 14; ``variants`` in the JSON): on the same batch, ``plan_batch`` at ε = 0.05
with full-prefix stateless tasks (``partial_kv=False, keep_activations=False``, the baseline),
kept activations (``keep_activations=True``, the default), partial-KV tasks (``partial_kv=True``,
stateless) and both; 128K tokens per rank, 128-1024 servers, both traces, in-place and dedicated
(one server per rank). Columns (one layer; a step moves and holds this once per layer):
``fwd GiB`` / ``bwd GiB`` the rounds' ``plan.comm_bytes()`` totals, the backward round by tensor
(``resent`` = q+k+v+out+lse sent again, ``dout``, ``dq``, ``dk+dv``), ``vs stateless`` forward +
backward bytes over the stateless plan's, ``imb`` max/mean FLOPs over servers, ``plan ms``,
``held max`` / ``held mean`` :meth:`Plan.held_bytes` per server (MiB; 0 when stateless). A
combination ``plan_batch`` refuses is a row marked ``refused`` with its message.

Also timed: :func:`~distca_sim.workloads.sample_batch` itself at 256 ranks × 512K tokens (Pretrain),
ms per call over 5 successive steps after a first call that samples and caches the stream (target:
under 50 ms per call); printed under the table and stored as ``sample_batch`` in the JSON.

Usage::

    python bench/planner.py            # full grid, a few minutes on 2 cores
    python bench/planner.py --quick    # 8 and 32 servers, 64K and 128K tokens (variants: 32 and
                                       # 128 servers), one timing run
    python bench/planner.py --targets-only   # the planning-time targets and named cases alone
    python bench/planner.py --variants-only  # the plan variants alone

Writes JSON to ``--json`` (default ``bench/results/planner.json``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scheduler import CostModel, PlanConfig, plan_batch  # noqa: E402
from scheduler.cost import KEPT_TENSORS, KV_TENSORS  # noqa: E402
from scheduler.baselines import no_balance, per_doc_cp, wlb_packing  # noqa: E402
from distca_sim.workloads import sample_batch  # noqa: E402
from bench.report import finish  # noqa: E402

TRACES = ("pretrain", "prolong")
SERVERS = (8, 32, 128, 256)
TOKENS = (65536, 131072, 524288)
QUICK_SERVERS = (8, 32)
QUICK_TOKENS = (65536, 131072)
EPSILONS = (0.0, 0.05, 0.1)
MIN_SHARD = 128
COST = CostModel(num_heads_q=32, num_heads_kv=8, head_dim=128, dtype_bytes=2)
MIB = 2 ** 20
TARGETS = ((256, 8.0), (1024, 30.0))  # (servers, ms) at TARGET_TOKENS per rank, ε = TARGET_EPSILON
TARGET_TOKENS, TARGET_EPSILON = 131072, 0.05
NAMED_CASES = (  # (name, doc_lens_per_rank of rank 0.., servers, ε)
    ("one 65,536-token document, 256 servers", [[65536]], 256, 0.05),
    ("one 2,048-token document, 16 servers", [[2048]], 16, 0.05),
    ("[[3001]] + [[1]] * 15, 16 servers", [[3001]] + [[1]] * 15, 16, 0.5),
)
SAMPLE_RANKS, SAMPLE_TOKENS, SAMPLE_STEPS, SAMPLE_TARGET_MS = 256, 524288, 5, 50.0
SLOW_CONFIG_S = 30.0
VARIANTS = (  # (name, partial_kv, keep_activations); the first is the baseline of "vs stateless"
    ("stateless", False, False), ("kept", False, True), ("partial-KV", True, False), ("both", True, True))
VARIANT_SERVERS, QUICK_VARIANT_SERVERS = (128, 256, 512, 1024), (32, 128)
VARIANT_TOKENS, VARIANT_EPSILON, VARIANT_MODES = 131072, 0.05, ("inplace", "dedicated")
GIB = 2 ** 30
# The grid's and the targets' plans, plan_batch's and the baselines' alike: their bytes are divided
# by one another ("vs CP"), so they must describe the same servers (kept or stateless).
KEEP_ACTIVATIONS = PlanConfig.keep_activations


def systems():
    """(name, epsilon or None, planning call) for every system, in table order."""
    out = []
    for eps in EPSILONS:
        out.append((f"plan_batch eps={eps:g}", eps,
                    lambda b, s, eps=eps: plan_batch(b, s, cost=COST, epsilon=eps, mode="inplace",
                                                     min_shard=MIN_SHARD, keep_activations=KEEP_ACTIVATIONS)))
    keep = KEEP_ACTIVATIONS
    out.append(("no_balance", None, lambda b, s: no_balance(b, s, cost=COST, mode="inplace", keep_activations=keep)))
    out.append(("per_doc_cp", None, lambda b, s: per_doc_cp(b, s, cost=COST, mode="inplace", keep_activations=keep)))
    out.append(("wlb_packing", None, lambda b, s: wlb_packing(b, s, cost=COST, keep_activations=keep)))
    return out


def input_imbalance(batch) -> float:
    loads = [sum(l * (l + 1) // 2 for l in lens) for lens in batch]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def time_plan(fn, repeats: int, warmup: bool, slow_s: float):
    """Run ``fn``; return (plan, median seconds, list of timed seconds, wall seconds)."""
    start = time.perf_counter()
    t0 = time.perf_counter()
    plan = fn()
    first = time.perf_counter() - t0
    times = []
    if not warmup or first > slow_s:
        times = [first]
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return plan, statistics.median(times), times, time.perf_counter() - start


def time_sample_batch() -> dict:
    """ms per :func:`sample_batch` call at ``SAMPLE_RANKS`` × ``SAMPLE_TOKENS`` (Pretrain): the first
    call (sampling and caching the stream) and the mean of ``SAMPLE_STEPS`` successive steps."""
    t0 = time.perf_counter()
    sample_batch("pretrain", SAMPLE_RANKS, SAMPLE_TOKENS, seed=0, step=0)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for step in range(1, SAMPLE_STEPS + 1):
        batch = sample_batch("pretrain", SAMPLE_RANKS, SAMPLE_TOKENS, seed=0, step=step)
    per_call = (time.perf_counter() - t0) / SAMPLE_STEPS
    assert len(batch) == SAMPLE_RANKS and all(sum(c) == SAMPLE_TOKENS for c in batch)
    return {"ranks": SAMPLE_RANKS, "tokens_per_rank": SAMPLE_TOKENS, "steps": SAMPLE_STEPS,
            "first_call_ms": first * 1e3, "ms_per_call": per_call * 1e3,
            "target_ms": SAMPLE_TARGET_MS}


def bench_config(trace, servers, tokens, repeats, warmup, slow_s, log):
    batch = sample_batch(trace, servers, tokens, seed=0, step=0)
    before = input_imbalance(batch)
    rows = []
    for name, eps, call in systems():
        plan, median_s, times, wall_s = time_plan(lambda: call(batch, servers), repeats, warmup,
                                                  slow_s)
        if plan.keep_activations is not KEEP_ACTIVATIONS:  # "vs CP" would mix kept and stateless bytes
            raise AssertionError(f"{name}: keep_activations={plan.keep_activations}, the grid's is "
                                 f"{KEEP_ACTIVATIONS}")
        comm = plan.comm_bytes()
        q_bytes = sum(b for k in ("forward", "backward") for n, b in comm[k].items()
                      if n != "total" and n not in KV_TENSORS)
        kv_bytes = sum(comm[k].get(n, 0) for k in ("forward", "backward") for n in KV_TENSORS)
        total = comm["forward"]["total"] + comm["backward"]["total"]
        assert total == q_bytes + kv_bytes
        rows.append({
            "trace": trace,
            "servers": servers,
            "tokens_per_rank": tokens,
            "system": name,
            "epsilon": eps,
            "keep_activations": plan.keep_activations,
            "num_docs": sum(len(x) for x in batch),
            "imbalance_before": before,
            "imbalance_after": plan.imbalance()[1],
            "q_bytes": q_bytes,
            "kv_bytes": kv_bytes,
            "total_bytes": total,
            "q_mib": q_bytes / MIB,
            "kv_mib": kv_bytes / MIB,
            "total_mib": total / MIB,
            "plan_ms": median_s * 1e3,
            "plan_ms_runs": [t * 1e3 for t in times],
            "wall_s": wall_s,
            "num_tasks": int(len(plan.task_array)),
            "tasks_moved": plan.tasks_moved(),
        })
        if wall_s > SLOW_CONFIG_S:
            log(f"  note: {trace} {servers} servers x {tokens} tokens, {name}: {wall_s:.1f} s "
                f"(> {SLOW_CONFIG_S:.0f} s for this config)")
    cp_total = next(r["total_bytes"] for r in rows if r["system"] == "per_doc_cp")
    for r in rows:
        r["total_vs_per_doc_cp"] = r["total_bytes"] / cp_total if cp_total else float("nan")
    return rows


def bench_targets(traces, repeats: int, log) -> list[dict]:
    """``plan_batch`` (ε = 0.05) beside ``no_balance`` at the target sizes, alternating calls."""
    rows = []
    for trace in traces:
        for servers, target_ms in TARGETS:
            batch = sample_batch(trace, servers, TARGET_TOKENS, seed=0, step=0)
            calls = {
                "plan_batch": lambda: plan_batch(batch, servers, cost=COST, epsilon=TARGET_EPSILON,
                                                 mode="inplace", min_shard=MIN_SHARD,
                                                 keep_activations=KEEP_ACTIVATIONS),
                "no_balance": lambda: no_balance(batch, servers, cost=COST, mode="inplace",
                                                 keep_activations=KEEP_ACTIVATIONS),
            }
            wall = {name: [] for name in calls}
            cpu = {name: [] for name in calls}
            plan = calls["plan_batch"]()
            calls["no_balance"]()
            for _ in range(repeats):
                for name, call in calls.items():
                    w0, c0 = time.perf_counter(), time.process_time()
                    call()
                    cpu[name].append((time.process_time() - c0) * 1e3)
                    wall[name].append((time.perf_counter() - w0) * 1e3)
            med = {name: statistics.median(v) for name, v in wall.items()}
            row = {
                "trace": trace, "servers": servers, "tokens_per_rank": TARGET_TOKENS,
                "epsilon": TARGET_EPSILON, "num_docs": sum(len(x) for x in batch),
                "target_ms": target_ms,
                "plan_ms": med["plan_batch"], "plan_best_ms": min(wall["plan_batch"]),
                "plan_cpu_ms": statistics.median(cpu["plan_batch"]),
                "no_balance_ms": med["no_balance"], "no_balance_best_ms": min(wall["no_balance"]),
                "no_balance_cpu_ms": statistics.median(cpu["no_balance"]),
                "multiple_of_no_balance": med["plan_batch"] / med["no_balance"],
                "imbalance_after": plan.imbalance()[1],
                "bound_ratio": plan.load_bound().ratio(),
                "plan_ms_runs": wall["plan_batch"], "no_balance_ms_runs": wall["no_balance"],
            }
            row["meets"] = row["plan_ms"] <= target_ms
            row["meets_cpu"] = row["plan_cpu_ms"] <= target_ms
            rows.append(row)
            log(f"target {trace:8s} {servers:4d} servers: plan {row['plan_ms']:.1f} ms "
                f"(cpu {row['plan_cpu_ms']:.1f}), no_balance {row['no_balance_ms']:.1f} ms")
    return rows


def bench_named_cases() -> list[dict]:
    """Bound against achieved max/mean on the issue's small cases, both modes."""
    rows = []
    for name, lens, servers, eps in NAMED_CASES:
        for mode in ("dedicated", "inplace"):
            batch = lens + [[] for _ in range(servers - len(lens))] if mode == "inplace" else lens
            start = time.perf_counter()
            plan = plan_batch(batch, servers, cost=COST, epsilon=eps, mode=mode, min_shard=MIN_SHARD)
            elapsed = time.perf_counter() - start
            bound = plan.load_bound()
            after = plan.imbalance()[1]
            rows.append({"case": name, "mode": mode, "servers": servers, "epsilon": eps,
                         "bound_ratio": bound.ratio(), "target_ratio": (1 + eps) * bound.ratio(),
                         "achieved_ratio": after, "plan_ms": elapsed * 1e3,
                         "meets": after <= (1 + eps) * bound.ratio() * (1 + 1e-12)})
    return rows


def bench_variants(trace, servers, mode, repeats, warmup, slow_s) -> list[dict]:
    """The :data:`VARIANTS` of ``plan_batch`` on one batch (see the module doc); a refused
    combination is a row with ``refused`` = the ValueError's message and no numbers."""
    batch = sample_batch(trace, servers, VARIANT_TOKENS, seed=0, step=0)
    hq, hkv = COST.held_row_bytes()
    rows = []
    for name, partial, keep in VARIANTS:
        row = {"trace": trace, "servers": servers, "mode": mode, "tokens_per_rank": VARIANT_TOKENS,
               "epsilon": VARIANT_EPSILON, "variant": name, "partial_kv": partial,
               "keep_activations": keep, "refused": None}
        rows.append(row)
        try:
            plan, median_s, times, _ = time_plan(
                lambda: plan_batch(batch, servers, cost=COST, epsilon=VARIANT_EPSILON, mode=mode,
                                   min_shard=MIN_SHARD, partial_kv=partial, keep_activations=keep),
                repeats, warmup, slow_s)
        except ValueError as exc:
            row["refused"] = str(exc)
            continue
        comm, held = plan.comm_bytes(), plan.held_bytes()
        bwd = comm["backward"]
        row.update({
            "comm_bytes": comm, "forward_bytes": comm["forward"]["total"], "backward_bytes": bwd["total"],
            "total_bytes": comm["forward"]["total"] + bwd["total"],
            "fwd_gib": comm["forward"]["total"] / GIB, "bwd_gib": bwd["total"] / GIB,
            "resent_gib": sum(bwd.get(n, 0) for n in KEPT_TENSORS) / GIB, "dout_gib": bwd["dout"] / GIB,
            "dq_gib": bwd["dq"] / GIB, "dkdv_gib": (bwd["dk"] + bwd["dv"]) / GIB,
            "imbalance": plan.imbalance()[1], "plan_ms": median_s * 1e3,
            "plan_ms_runs": [t * 1e3 for t in times], "num_tasks": int(len(plan.task_array)),
            "held_bytes": held, "held_max_mib": max(held) / MIB, "held_mean_mib": sum(held) / len(held) / MIB,
            # what a stateless client keeps of its own rows for autograd instead (the largest rank)
            "own_rows_mib_per_rank": max(sum(x) for x in batch) * (hq + hkv) / MIB,
        })
    base = rows[0].get("total_bytes")
    for r in rows:
        if r["refused"] is None:
            r["vs_stateless"] = r["total_bytes"] / base if base else 1.0
    return rows


VARIANT_COLUMNS = [("trace", "trace", "{}"), ("mode", "mode", "{}"), ("servers", "servers", "{}"),
                   ("variant", "variant", "{}"), ("fwd GiB", "fwd_gib", "{:,.1f}"),
                   ("bwd GiB", "bwd_gib", "{:,.1f}"), ("resent", "resent_gib", "{:,.1f}"),
                   ("dout", "dout_gib", "{:,.1f}"), ("dq", "dq_gib", "{:,.1f}"),
                   ("dk+dv", "dkdv_gib", "{:,.1f}"), ("vs stateless", "vs_stateless", "{:.3f}"),
                   ("imb", "imbalance", "{:.3f}"), ("plan ms", "plan_ms", "{:.2f}"),
                   ("held max MiB", "held_max_mib", "{:,.0f}"), ("held mean MiB", "held_mean_mib", "{:,.0f}")]


def variants_headline(rows) -> list[str]:
    """One line per variant: its bytes over the stateless plan's and its balance, or its refusal."""
    lines = []
    for name, _, _ in VARIANTS[1:]:
        done = [r for r in rows if r["variant"] == name and r["refused"] is None]
        refused = sorted({r["refused"] for r in rows if r["variant"] == name and r["refused"]})
        if done:
            lines.append(f"plan variant {name}: forward+backward bytes {min(r['vs_stateless'] for r in done):.3f}-"
                         f"{max(r['vs_stateless'] for r in done):.3f} x the stateless plan's, max/mean "
                         f"{max(r['imbalance'] for r in done):.3f} at most, held per layer per server at most "
                         f"{max(r['held_max_mib'] for r in done):,.0f} MiB ({len(done)} configs)")
        lines += [f"plan variant {name}: refused in {sum(r['refused'] == m for r in rows)} configs: {m}"
                  for m in refused]
    return lines


def render_small(rows, columns) -> str:
    """Plain aligned text of ``rows`` for ``columns`` = [(header, key, format)]; a value a row
    lacks (or holds as None) shows as ``-``."""
    cells = [["-" if r.get(key) is None else fmt.format(r[key]) for _, key, fmt in columns]
             for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _, _) in enumerate(columns)]
    lines = ["  ".join(h.rjust(w) for (h, _, _), w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(cell, widths)) for cell in cells]
    return "\n".join(lines)


TARGET_COLUMNS = [("trace", "trace", "{}"), ("servers", "servers", "{}"), ("docs", "num_docs", "{:,}"),
                  ("plan ms", "plan_ms", "{:.2f}"), ("best", "plan_best_ms", "{:.2f}"),
                  ("cpu ms", "plan_cpu_ms", "{:.2f}"), ("no_balance ms", "no_balance_ms", "{:.2f}"),
                  ("x no_balance", "multiple_of_no_balance", "{:.2f}"), ("target ms", "target_ms", "{:g}"),
                  ("imb after", "imbalance_after", "{:.3f}")]
NAMED_COLUMNS = [("case", "case", "{}"), ("mode", "mode", "{}"), ("eps", "epsilon", "{:g}"),
                 ("bound", "bound_ratio", "{:.3f}"), ("target", "target_ratio", "{:.3f}"),
                 ("achieved", "achieved_ratio", "{:.3f}"), ("plan ms", "plan_ms", "{:.2f}")]


COLUMNS = [  # (header, key, format)
    ("trace", "trace", "{}"),
    ("servers", "servers", "{}"),
    ("tok/rank", "tokens_per_rank", "tok"),
    ("system", "system", "{}"),
    ("imb before", "imbalance_before", "{:.3f}"),
    ("imb after", "imbalance_after", "{:.3f}"),
    ("Q MiB", "q_mib", "{:,.1f}"),
    ("KV MiB", "kv_mib", "{:,.1f}"),
    ("total MiB", "total_mib", "{:,.1f}"),
    ("vs CP", "total_vs_per_doc_cp", "{:.3f}"),
    ("plan ms", "plan_ms", "{:,.2f}"),
    ("tasks", "num_tasks", "{:,}"),
]


def _cell(row, key, fmt):
    value = row[key]
    if fmt == "tok":
        return f"{value // 1024}K"
    return fmt.format(value)


def render_table(rows) -> str:
    """Plain aligned text (numbers right-aligned)."""
    headers = [h for h, _, _ in COLUMNS]
    cells = [[_cell(r, k, f) for _, k, f in COLUMNS] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]
    left = {"trace", "system"}

    def line(values):
        return "  ".join(v.ljust(w) if COLUMNS[i][1] in left else v.rjust(w)
                         for i, (v, w) in enumerate(zip(values, widths)))
    out = [line(headers), "  ".join("-" * w for w in widths)]
    prev = None
    for r, c in zip(rows, cells):
        key = (r["trace"], r["servers"], r["tokens_per_rank"])
        if prev is not None and key != prev:
            out.append("")
        prev = key
        out.append(line(c))
    return "\n".join(out)


def print_table(rows) -> None:
    if not rows:
        return
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(render_table(rows))
        return
    table = Table(show_lines=False)
    for header, key, _ in COLUMNS:
        table.add_column(header, justify="left" if key in ("trace", "system") else "right")
    def key(r):
        return (r["trace"], r["servers"], r["tokens_per_rank"])
    for i, r in enumerate(rows):
        last_of_config = i + 1 < len(rows) and key(rows[i + 1]) != key(r)
        table.add_row(*[_cell(r, k, f) for _, k, f in COLUMNS], end_section=last_of_config)
    Console(width=200).print(table)


def headline(rows, sampling: dict, targets: list[dict], named: list[dict]) -> list[str]:
    verdict = "meets" if sampling["ms_per_call"] < sampling["target_ms"] else "MISSES"
    lines = [f"sample_batch at {sampling['ranks']} ranks x {sampling['tokens_per_rank'] // 1024}K "
             f"tokens: {sampling['ms_per_call']:.2f} ms per call (first call "
             f"{sampling['first_call_ms']:.0f} ms; {verdict} the "
             f"{sampling['target_ms']:g} ms target)"]
    for r in targets:
        verdict = "meets" if r["meets"] else "MISSES"
        cpu = "meets" if r["meets_cpu"] else "misses"
        lines.append(f"plan_batch eps={r['epsilon']:g} at {r['servers']} servers x "
                     f"{r['tokens_per_rank'] // 1024}K tokens ({r['trace']}): {r['plan_ms']:.1f} ms median "
                     f"(best {r['plan_best_ms']:.1f}, cpu {r['plan_cpu_ms']:.1f}) = "
                     f"{r['multiple_of_no_balance']:.2f} x no_balance ({r['no_balance_ms']:.1f} ms); "
                     f"{verdict} the {r['target_ms']:g} ms target (cpu time {cpu} it)")
    if named:
        met = sum(r["meets"] for r in named)
        lines.append(f"named cases: {met} of {len(named)} reach (1 + eps) x the lower bound")
    if not rows:
        return lines
    names = list(dict.fromkeys(r["system"] for r in rows))
    parts = []
    for name in names:
        vals = [r["imbalance_after"] for r in rows if r["system"] == name]
        parts.append(f"{name} {statistics.fmean(vals):.3f}")
    lines.append("mean imbalance after: " + ", ".join(parts))
    before = [r["imbalance_before"] for r in rows if r["system"] == names[0]]
    lines.append(f"mean imbalance before (input batches): {statistics.fmean(before):.3f}")
    slow = [r for r in rows if r["wall_s"] > SLOW_CONFIG_S]
    for r in slow:
        lines.append(f"slow config (> {SLOW_CONFIG_S:.0f} s): {r['trace']} {r['servers']} x "
                     f"{r['tokens_per_rank'] // 1024}K {r['system']}: {r['wall_s']:.1f} s")
    return lines


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="8 and 32 servers, 64K and 128K tokens per rank (plan variants: 32 and 128 "
                        "servers), one timing run (CI smoke)")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "planner.json",
                   help="where to write the results (default: bench/results/planner.json)")
    p.add_argument("--traces", nargs="+", choices=TRACES, default=list(TRACES))
    p.add_argument("--servers", nargs="+", type=int, help="override the server counts")
    p.add_argument("--tokens", nargs="+", type=int, help="override the tokens per rank")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed runs after the warm-up run; the median is reported (default 5)")
    p.add_argument("--targets-only", action="store_true",
                   help="only the planning-time targets and the named cases, not the grid")
    p.add_argument("--variants-only", action="store_true",
                   help="only the plan variants (stateless, kept, partial-KV, both), not the grid")
    p.add_argument("--variant-servers", nargs="+", type=int,
                   help="override the plan variants' server counts")
    p.add_argument("--slow-s", type=float, default=10.0,
                   help="a call whose warm-up run takes longer is timed by that run alone")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.targets_only and args.variants_only:
        p.error("--targets-only and --variants-only exclude each other")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    servers = args.servers or (QUICK_SERVERS if args.quick else SERVERS)
    tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    repeats, warmup = (1, False) if args.quick else (args.repeats, True)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    rows = []
    start = time.perf_counter()
    sampling = time_sample_batch()
    targets = bench_targets(args.traces, 3 if args.quick else max(args.repeats, 9), log) \
        if not args.variants_only else []
    named = bench_named_cases() if not args.variants_only else []
    variants = []
    for trace in args.traces if not args.targets_only else ():
        for mode in VARIANT_MODES:
            for s in args.variant_servers or (QUICK_VARIANT_SERVERS if args.quick else VARIANT_SERVERS):
                t0 = time.perf_counter()
                variants.extend(bench_variants(trace, s, mode, repeats, warmup, args.slow_s))
                log(f"variants {trace:8s} {mode:9s} {s:4d} servers: {time.perf_counter() - t0:6.1f} s")
    for trace in args.traces if not (args.targets_only or args.variants_only) else ():
        for s in servers:
            for t in tokens:
                t0 = time.perf_counter()
                rows.extend(bench_config(trace, s, t, repeats, warmup, args.slow_s, log))
                log(f"{trace:8s} {s:4d} servers x {t // 1024:4d}K tokens: "
                    f"{time.perf_counter() - t0:6.1f} s")
    elapsed = time.perf_counter() - start

    def show():
        print_table(rows)
        if targets:
            print()
            print(f"planning time at the targets (in-place, eps={TARGET_EPSILON:g}, "
                  f"{TARGET_TOKENS // 1024}K tokens per rank; ms; median of alternating runs):")
            print(render_small(targets, TARGET_COLUMNS))
        if named:
            print()
            print("named cases: lower bound on max/mean, target (1 + eps) x bound, achieved max/mean:")
            print(render_small(named, NAMED_COLUMNS))
        if variants:
            print()
            print(f"plan variants (plan_batch eps={VARIANT_EPSILON:g}, {VARIANT_TOKENS // 1024}K tokens "
                  f"per rank; bytes of one layer's forward + backward round, GiB; held per layer, MiB):")
            print(render_small([dict(r, variant=f"{r['variant']} (refused)") if r["refused"] else r
                                for r in variants], VARIANT_COLUMNS))

    lines = headline(rows, sampling, targets, named) + variants_headline(variants)
    finish(show, lines, elapsed, args.json, {
        "benchmark": "planner",
        "cost_model": COST.to_dict(),
        "min_shard": MIN_SHARD,
        "mode": "inplace",
        "keep_activations": KEEP_ACTIVATIONS,
        "quick": args.quick,
        "repeats": repeats,
        "warmup": warmup,
        "seed": 0,
        "step": 0,
        "rows": rows,
        "sample_batch": sampling,
        "targets": targets,
        "named_cases": named,
        "variants": variants,
        "variant_settings": {"epsilon": VARIANT_EPSILON, "tokens_per_rank": VARIANT_TOKENS,
                             "modes": list(VARIANT_MODES), "variants": [list(v) for v in VARIANTS]},
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
