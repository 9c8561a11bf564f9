"""Part-cutting benchmark: how long the scheduler takes to cut a plan into per-participant parts,
beside how long it takes to make the plan, in the same run.

For each number of in-place servers (= client ranks), one Pretrain batch is drawn with
``sample_batch("pretrain", servers, tokens, seed=0, step=0)`` and planned with
``plan_batch(..., epsilon=0.05, mode="inplace", min_shard=128)`` for Llama-3-8B attention
(``CostModel(32, 8, 128, 2)``). Then every participant's part is cut three ways:

- ``old cut``: the previous code path, kept here only as the baseline: per participant, mask the
  whole task array (``arr[arr[:, 1] == rank]``, ``arr[arr[:, 0] == server]``) and build the part
  with the validating public constructor (every part re-checked).
- ``cut``: :func:`scheduler.parts.plan_parts`: one stable sort by rank, ``np.searchsorted``
  boundaries, slices, no re-validation (the plan was validated).
- ``cut+enc``: ``plan_parts`` plus ``to_msgpack()`` of every part: what the scheduler does per
  batch (the ``distca_cut_ms`` metric).

Beside them, ``bytes ms``: ``Plan.comm_bytes()`` and ``Plan.held_bytes()`` of a freshly decoded copy
of the plan (their row counts are cached on a plan, so each timed run gets a new copy): what the
scheduler's record of every plan computes.

Times are medians of ``--repeats`` rounds after one warm-up round (``time.perf_counter``); each
round runs, in turn, ``old cut``, ``plan_batch``, ``cut``, ``cut+enc`` and ``bytes ms`` once (the cut
right after planning, as the scheduler runs them), so every ratio (``cut/plan``: the median cut
over the median ``plan_batch`` call of the same rounds) divides times taken side by side. Every
run also checks that the new parts encode to exactly the bytes of the old ones. Target:
cutting all parts takes at most 25% of ``plan_batch``'s own time at 1024 servers x 128K tokens per
rank.

Usage::

    python bench/parts.py            # 64, 256, 1024 servers x 128K tokens per rank
    python bench/parts.py --quick    # 16 and 64 servers x 32K tokens, one timed run

Writes JSON to ``--json`` (default ``bench/results/parts.json``).
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

from scheduler import CostModel, Plan, plan_batch  # noqa: E402
from scheduler.parts import PlanPart, plan_parts  # noqa: E402
from scheduler.tasks import participant_roles  # noqa: E402
from bench.report import finish  # noqa: E402

from distca_sim.workloads import sample_batch  # noqa: E402

COST = CostModel(num_heads_q=32, num_heads_kv=8, head_dim=128, dtype_bytes=2)
TRACE, EPSILON, MIN_SHARD = "pretrain", 0.05, 128
SERVERS, TOKENS = (64, 256, 1024), 131072
QUICK_SERVERS, QUICK_TOKENS = (16, 64), 32768
HEADLINE_SERVERS, TARGET = 1024, 0.25


def old_cut(plan, step: int, batch: int) -> list[PlanPart]:
    """The previous path (baseline only): one full scan of the task array per participant, and the
    validating constructor for every part."""
    arr = plan.task_array
    parts = []
    for p in range(plan.num_participants):
        rank, server = participant_roles(plan.mode, plan.num_ranks, p)
        parts.append(PlanPart(
            step=step, batch=batch, mode=plan.mode, num_ranks=plan.num_ranks, num_servers=plan.num_servers,
            cost=plan.cost, participant=p, rank=rank, server=server,
            doc_lens=list(plan.doc_lens_per_rank[rank]) if rank is not None else [],
            client_tasks=arr[arr[:, 1] == rank] if rank is not None else arr[:0],
            server_tasks=arr[arr[:, 0] == server] if server is not None else arr[:0],
            window=plan.window, keep_activations=plan.keep_activations))
    return parts


def timed_rounds(calls: dict, repeats: int, warmup: bool) -> tuple[dict, dict, dict]:
    """Time ``calls`` (name -> ``make``, where ``make()``, untimed, returns the function to time)
    in rounds: each round runs every call once, in order; ``repeats`` rounds after one warm-up round
    if ``warmup``. Returns ``(last result, median ms, every timed ms)``, each by name.

    Why rounds: timed in blocks (one call's runs, then the next's), the load of a shared machine
    changed between blocks, and five runs of one tree read cut/plan 0.20-0.63 at 1024 servers; in
    rounds the calls share the load, and fourteen runs read 0.31-0.44."""
    results, times = {}, {name: [] for name in calls}
    for i in range(repeats + bool(warmup)):
        for name, make in calls.items():
            fn = make()
            t0 = time.perf_counter()
            results[name] = fn()
            elapsed = (time.perf_counter() - t0) * 1e3
            if i or not warmup:
                times[name].append(elapsed)
    return results, {name: statistics.median(v) for name, v in times.items()}, times


def bench_config(servers: int, tokens: int, repeats: int, warmup: bool) -> dict:
    batch = sample_batch(TRACE, servers, tokens, seed=0, step=0)

    def make_plan():
        return plan_batch(batch, servers, cost=COST, epsilon=EPSILON, mode="inplace", min_shard=MIN_SHARD)
    plan = make_plan()
    whole = plan.to_msgpack()

    def accounting(fresh):  # a freshly decoded copy: a plan caches its row counts
        return lambda: (fresh.comm_bytes(), fresh.held_bytes())
    results, ms, runs = timed_rounds({
        "old_cut": lambda: lambda: old_cut(plan, 3, 1),
        "plan": lambda: make_plan,
        "cut": lambda: lambda: plan_parts(plan, 3, 1),
        "cut_encode": lambda: lambda: [p.to_msgpack() for p in plan_parts(plan, 3, 1)],
        "bytes": lambda: accounting(Plan.from_msgpack(whole)),
    }, repeats, warmup)
    old, new, enc = results["old_cut"], results["cut"], results["cut_encode"]
    plan_ms, old_ms, cut_ms, enc_ms, bytes_ms = (ms[k] for k in ("plan", "old_cut", "cut", "cut_encode", "bytes"))
    old_bytes = [p.to_msgpack() for p in old]
    if old_bytes != [p.to_msgpack() for p in new] or old_bytes != enc:
        raise AssertionError(f"{servers} servers: the one-pass parts differ from the validated ones")
    return {
        "trace": TRACE, "mode": "inplace", "servers": servers, "tokens_per_rank": tokens,
        "num_docs": sum(len(x) for x in batch), "num_tasks": int(len(plan.task_array)),
        "participants": plan.num_participants, "part_bytes": sum(len(b) for b in enc),
        "plan_ms": plan_ms, "old_cut_ms": old_ms, "cut_ms": cut_ms, "cut_encode_ms": enc_ms,
        "cut_vs_plan": cut_ms / plan_ms, "cut_encode_vs_plan": enc_ms / plan_ms,
        "old_cut_vs_plan": old_ms / plan_ms, "speedup": old_ms / cut_ms,
        "bytes_ms": bytes_ms, "bytes_vs_plan": bytes_ms / plan_ms,
        "runs_ms": runs,
    }


COLUMNS = [  # (header, key, format)
    ("servers", "servers", "{}"), ("tok/rank", "tokens_per_rank", "tok"), ("tasks", "num_tasks", "{:,}"),
    ("parts KiB", "part_bytes", "kib"), ("plan ms", "plan_ms", "{:,.1f}"), ("old cut ms", "old_cut_ms", "{:,.1f}"),
    ("cut ms", "cut_ms", "{:,.2f}"), ("cut+enc ms", "cut_encode_ms", "{:,.2f}"),
    ("old/plan", "old_cut_vs_plan", "{:.2f}"), ("cut/plan", "cut_vs_plan", "{:.3f}"),
    ("cut+enc/plan", "cut_encode_vs_plan", "{:.3f}"), ("speedup", "speedup", "{:,.0f}x"),
    ("bytes ms", "bytes_ms", "{:,.2f}"), ("bytes/plan", "bytes_vs_plan", "{:.3f}"),
]


def _cell(row, key, fmt) -> str:
    if fmt == "tok":
        return f"{row[key] // 1024}K"
    if fmt == "kib":
        return f"{row[key] / 1024:,.0f}"
    return fmt.format(row[key])


def render_table(rows) -> str:
    headers = [h for h, _, _ in COLUMNS]
    cells = [[_cell(r, k, f) for _, k, f in COLUMNS] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def headline(rows) -> list[str]:
    lines = [f"{TRACE}, in-place, CostModel{tuple(COST.to_wire())}, eps={EPSILON}, min_shard={MIN_SHARD}; "
             f"new parts checked byte-equal to the validated ones"]
    top = [r for r in rows if r["servers"] == HEADLINE_SERVERS]
    for r in top:
        verdict = "meets" if r["cut_vs_plan"] <= TARGET else "MISSES"
        lines.append(f"{r['servers']} servers x {r['tokens_per_rank'] // 1024}K: cutting all parts "
                     f"{r['cut_ms']:.2f} ms = {100 * r['cut_vs_plan']:.1f}% of plan_batch's {r['plan_ms']:.1f} ms "
                     f"({verdict} the {100 * TARGET:.0f}% target; was {r['old_cut_ms']:.0f} ms = "
                     f"{r['old_cut_vs_plan']:.1f}x); with encoding {r['cut_encode_ms']:.2f} ms = "
                     f"{100 * r['cut_encode_vs_plan']:.1f}%")
    if not top:
        lines.append(f"({HEADLINE_SERVERS} servers not in this run)")
    return lines


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="16 and 64 servers x 32K tokens, one timed run (CI smoke)")
    p.add_argument("--servers", nargs="+", type=int, help="override the server counts")
    p.add_argument("--tokens", type=int, help="override the tokens per rank")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed rounds (every call once each) after a warm-up round; medians are reported")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "parts.json",
                   help="where to write the results (default: bench/results/parts.json)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    servers = args.servers or (QUICK_SERVERS if args.quick else SERVERS)
    tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    repeats, warmup = (1, False) if args.quick else (args.repeats, True)
    start = time.perf_counter()
    rows = []
    for s in servers:
        t0 = time.perf_counter()
        rows.append(bench_config(s, tokens, repeats, warmup))
        print(f"{s:5d} servers x {tokens // 1024}K: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    finish(lambda: print(render_table(rows)), headline(rows), time.perf_counter() - start, args.json, {
        "benchmark": "parts", "trace": TRACE, "cost_model": COST.to_dict(), "epsilon": EPSILON,
        "min_shard": MIN_SHARD, "mode": "inplace", "quick": args.quick, "repeats": repeats,
        "warmup": warmup, "seed": 0, "step": 0, "target_cut_vs_plan": TARGET, "rows": rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
