"""Planner scaling benchmark: planning time against the number of documents, corners included.

Issue 9 found in-place batches where one rank holds many small documents quadratic (2,000
64-token documents took 8.6 s, 10,000 one-token documents 176 s). This prints, for each scenario
and size, the planning time (``plan_batch``, ε = 0.05, ``min_shard`` 128, Llama-3-8B attention
shape) and the time per document, and checks a budget: planning is near-linear in documents when
the time per document at the largest size is at most ``--max-growth`` (default 3) times that at the
smallest (a quadratic planner grows by the size ratio, 32 over the default sizes).

Scenarios (``N`` documents):

- ``one rank, 64-token docs``: in-place, 8 servers, rank 0 holds ``N`` documents of 64 tokens;
- ``one rank, 1-token docs``: the same with one-token documents;
- ``one rank, mixed lengths``: in-place, 64 servers, rank 0 holds ``N`` lengths drawn uniformly
  from 1..3000 (seed 0);
- ``dedicated, 64-token docs``: the first batch in dedicated mode over 8 servers;
- ``pretrain trace``: :func:`~distca_sim.workloads.sample_batch` at 128K tokens per rank, the
  ranks (= servers) grown with ``N`` (``N`` is then the documents the sampler drew).

Also timed: the two corners the issue measured (``corners`` in the JSON).

Times are CPU seconds of the planning call (``time.process_time``: a busy machine does not
inflate them), the best of ``--repeats`` runs; wall seconds are stored too.

Usage::

    python bench/planner_scaling.py           # N = 1,000 ... 32,000
    python bench/planner_scaling.py --quick   # N = 500 ... 4,000

Writes JSON to ``--json`` (default ``bench/results/planner_scaling.json``).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scheduler import CostModel, plan_batch  # noqa: E402
from distca_sim.workloads import sample_batch  # noqa: E402
from bench.report import finish  # noqa: E402

COST = CostModel(num_heads_q=32, num_heads_kv=8, head_dim=128, dtype_bytes=2)
SIZES = (1000, 2000, 4000, 8000, 16000, 32000)
QUICK_SIZES = (500, 1000, 2000, 4000)
EPSILON, MIN_SHARD, TOKENS = 0.05, 128, 131072


def one_rank(n: int, length: int, servers: int) -> list[list[int]]:
    return [[length] * n] + [[] for _ in range(servers - 1)]


def mixed(n: int, servers: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randint(1, 3000) for _ in range(n)]] + [[] for _ in range(servers - 1)]


def trace_batch(n: int) -> list[list[int]]:
    """A Pretrain batch at 128K tokens per rank with about ``n`` documents (ranks = n / 10)."""
    ranks = max(2, round(n / 9.6))
    return sample_batch("pretrain", ranks, TOKENS, seed=0, step=0)


SCENARIOS = (  # (name, mode, batch for n)
    ("one rank, 64-token docs", "inplace", lambda n: one_rank(n, 64, 8)),
    ("one rank, 1-token docs", "inplace", lambda n: one_rank(n, 1, 8)),
    ("one rank, mixed lengths", "inplace", lambda n: mixed(n, 64)),
    ("dedicated, 64-token docs", "dedicated", lambda n: [[64] * n]),
    ("pretrain trace", "inplace", trace_batch),
)


CORNERS = (  # (name, batch, seconds the issue measured before)
    ("2,000 64-token documents on one rank of 8", lambda: one_rank(2000, 64, 8), 8.6),
    ("10,000 one-token documents on one rank of 8", lambda: one_rank(10000, 1, 8), 176.0),
)


def time_plan(batch, mode: str, repeats: int) -> tuple[float, float, object]:
    """Best CPU and wall seconds of ``repeats`` planning calls, and the plan."""
    servers = len(batch) if mode == "inplace" else 8
    cpu, wall = math.inf, math.inf
    plan = None
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        plan = plan_batch(batch, servers, cost=COST, epsilon=EPSILON, mode=mode, min_shard=MIN_SHARD)
        cpu = min(cpu, time.process_time() - c0)
        wall = min(wall, time.perf_counter() - w0)
    return cpu, wall, plan


def run(sizes, repeats: int, log) -> list[dict]:
    rows = []
    for name, mode, make in SCENARIOS:
        first = None
        prev = None
        for n in sizes:
            batch = make(n)
            docs = sum(len(x) for x in batch)
            cpu, wall, plan = time_plan(batch, mode, repeats)
            per_doc = cpu / docs * 1e6
            first = per_doc if first is None else first
            row = {"scenario": name, "mode": mode, "num_docs": docs, "servers": plan.num_servers,
                   "cpu_s": cpu, "wall_s": wall, "us_per_doc": per_doc,
                   "per_doc_vs_smallest": per_doc / first,
                   "exponent": (math.log(cpu / prev[1]) / math.log(docs / prev[0])
                                if prev and cpu > 0 and prev[1] > 0 and docs > prev[0] else None),
                   "imbalance_after": plan.imbalance()[1]}
            rows.append(row)
            prev = (docs, cpu)
            log(f"{name:26s} {docs:7,d} docs: {cpu * 1e3:8.1f} ms cpu ({per_doc:6.1f} us/doc)")
    return rows


def render(rows) -> str:
    cols = [("scenario", "scenario", "{}"), ("mode", "mode", "{}"), ("docs", "num_docs", "{:,}"),
            ("servers", "servers", "{}"), ("cpu ms", "cpu_s", "ms"), ("wall ms", "wall_s", "ms"),
            ("us/doc", "us_per_doc", "{:.1f}"), ("vs smallest", "per_doc_vs_smallest", "{:.2f}"),
            ("exponent", "exponent", "exp"), ("imb after", "imbalance_after", "{:.3f}")]

    def cell(r, key, fmt):
        v = r[key]
        if fmt == "ms":
            return f"{v * 1e3:,.1f}"
        if fmt == "exp":
            return "-" if v is None else f"{v:.2f}"
        return fmt.format(v)
    cells = [[cell(r, k, f) for _, k, f in cols] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _, _) in enumerate(cols)]
    out = ["  ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, ((h, _, _), w) in enumerate(zip(cols, widths))),
           "  ".join("-" * w for w in widths)]
    for r, c in zip(rows, cells):
        out.append("  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))))
    return "\n".join(out)


def verdicts(rows, max_growth: float) -> tuple[list[str], dict]:
    lines, result = [], {}
    for name, _, _ in SCENARIOS:
        mine = [r for r in rows if r["scenario"] == name]
        growth = mine[-1]["per_doc_vs_smallest"]
        size_ratio = mine[-1]["num_docs"] / mine[0]["num_docs"]
        ok = growth <= max_growth
        result[name] = {"growth": growth, "size_ratio": size_ratio, "meets": ok}
        lines.append(f"{name}: time per document x{growth:.2f} from {mine[0]['num_docs']:,} to "
                     f"{mine[-1]['num_docs']:,} documents (x{size_ratio:.0f} documents); "
                     f"{'meets' if ok else 'MISSES'} the near-linear budget (<= x{max_growth:g})")
    return lines, result


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N = 500 ... 4,000, one run each (CI smoke)")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "planner_scaling.json")
    p.add_argument("--repeats", type=int, default=3, help="runs per size; the best is reported")
    p.add_argument("--max-growth", type=float, default=3.0,
                   help="budget: time per document at the largest size over that at the smallest")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    repeats = 1 if args.quick else args.repeats

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    start = time.perf_counter()
    rows = run(sizes, repeats, log)
    lines, result = verdicts(rows, args.max_growth)
    corners = []
    for name, make, before in CORNERS:
        cpu, wall, _ = time_plan(make(), "inplace", repeats)
        corners.append({"case": name, "cpu_s": cpu, "wall_s": wall, "issue_s": before})
        lines.append(f"{name}: {cpu * 1e3:.0f} ms cpu ({wall * 1e3:.0f} ms wall; the issue measured {before:g} s)")
    finish(lambda: print(render(rows)), lines, time.perf_counter() - start, args.json, {
        "benchmark": "planner_scaling", "cost_model": COST.to_dict(), "epsilon": EPSILON,
        "min_shard": MIN_SHARD, "sizes": list(sizes), "repeats": repeats, "quick": args.quick,
        "max_growth": args.max_growth, "rows": rows, "scenarios": result, "corners": corners,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
