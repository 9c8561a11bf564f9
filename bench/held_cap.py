"""What a held-bytes cap costs: balance, bytes and planning time of capped plans, beside the uncapped
plan of the same batch in the same run.

With kept activations (the default) each server holds ``Plan.held_bytes()`` per layer; the planner
balances FLOPs, so the fullest server holds 1.4-2.5x the mean. ``plan_batch(...,
max_held_bytes_per_server=cap)`` caps it. For each trace, mode and number of servers, one batch of
``--tokens`` per rank (``sample_batch(trace, servers, tokens, seed=0, step=0)``) is planned at
ε = 0.05, ``min_shard`` 128, Llama-3-8B attention (``CostModel(32, 8, 128, 2)``), without a cap and
with a cap of each ``--caps`` multiple of the uncapped plan's mean held bytes.

Columns: ``held max/mean`` (of the plan, over the uncapped mean), ``max/mean FLOPs`` (balance),
``bytes vs free`` (forward+backward bytes over the uncapped plan's), ``plan ms`` (median of
``--repeats``) and ``ms vs free`` (over the uncapped plan's time). A cap the planner cannot keep is
a row marked ``refused`` with plan_batch's message.

Usage::

    python bench/held_cap.py            # both traces and modes, 128 and 1024 servers, caps 1.5 and 1.25
    python bench/held_cap.py --quick    # 32 servers, 32K tokens per rank

Writes JSON to ``--json`` (default ``bench/results/held_cap.json``).
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

from bench.report import finish  # noqa: E402
from distca_sim.workloads import sample_batch  # noqa: E402
from scheduler import CostModel, plan_batch  # noqa: E402

TRACES, MODES = ("pretrain", "prolong"), ("inplace", "dedicated")
SERVERS, QUICK_SERVERS = (128, 1024), (32,)
TOKENS, QUICK_TOKENS = 131072, 32768
CAPS = (1.5, 1.25)
EPSILON, MIN_SHARD = 0.05, 128
COST = CostModel(num_heads_q=32, num_heads_kv=8, head_dim=128, dtype_bytes=2)


def _timed_plan(batch, servers, mode, cap, repeats):
    times, plan = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = plan_batch(batch, servers, cost=COST, epsilon=EPSILON, mode=mode, min_shard=MIN_SHARD,
                          max_held_bytes_per_server=cap)
        times.append((time.perf_counter() - t0) * 1e3)
    return plan, statistics.median(times)


def _total(plan) -> int:
    comm = plan.comm_bytes()
    return comm["forward"]["total"] + comm["backward"]["total"]


def bench_config(trace, mode, servers, tokens, caps, repeats) -> list[dict]:
    batch = sample_batch(trace, servers, tokens, seed=0, step=0)
    free, free_ms = _timed_plan(batch, servers, mode, None, repeats)
    held = free.held_bytes()
    mean = sum(held) / len(held)
    base = {"trace": trace, "mode": mode, "servers": servers, "tokens_per_rank": tokens}
    rows = [dict(base, cap_x_mean=None, refused=None, held_max_x_mean=max(held) / mean,
                 imbalance=free.imbalance()[1], bytes_vs_free=1.0, plan_ms=free_ms, ms_vs_free=1.0)]
    for factor in caps:
        row = dict(base, cap_x_mean=factor, refused=None)
        try:
            plan, ms = _timed_plan(batch, servers, mode, int(factor * mean), repeats)
        except ValueError as exc:  # a cap no plan (or this planner) keeps
            rows.append(dict(row, refused=str(exc)))
            continue
        rows.append(dict(row, held_max_x_mean=max(plan.held_bytes()) / mean, imbalance=plan.imbalance()[1],
                         bytes_vs_free=_total(plan) / _total(free), plan_ms=ms, ms_vs_free=ms / free_ms))
    return rows


def render(rows) -> str:
    head = ("trace", "mode", "servers", "cap", "held max/mean", "max/mean FLOPs", "bytes vs free", "plan ms",
            "ms vs free")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        cap = "none" if r["cap_x_mean"] is None else f"{r['cap_x_mean']:.2f}x mean"
        cells = [r["trace"], r["mode"], str(r["servers"]), cap]
        if r["refused"]:
            cells += ["refused"] + [""] * 4
        else:
            cells += [f"{r['held_max_x_mean']:.2f}", f"{r['imbalance']:.3f}", f"{r['bytes_vs_free']:.3f}",
                      f"{r['plan_ms']:.1f}", f"{r['ms_vs_free']:.1f}"]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def headline(rows, caps) -> list[str]:
    lines = []
    for factor in caps:
        done = [r for r in rows if r["cap_x_mean"] == factor and not r["refused"]]
        refused = sum(1 for r in rows if r["cap_x_mean"] == factor and r["refused"])
        if done:
            balanced = sum(r["imbalance"] <= 1 + EPSILON + 1e-9 for r in done)
            lines.append(f"cap {factor}x the mean held bytes: {balanced} of {len(done)} plans reach "
                         f"max/mean <= {1 + EPSILON} (worst {max(r['imbalance'] for r in done):.3f}); "
                         f"planning {min(r['ms_vs_free'] for r in done):.1f}-"
                         f"{max(r['ms_vs_free'] for r in done):.1f}x the uncapped time"
                         + (f"; {refused} refused" if refused else ""))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="32 servers x 32K tokens per rank, one timed run")
    ap.add_argument("--servers", nargs="+", type=int, help="override the server counts")
    ap.add_argument("--caps", nargs="+", type=float, default=list(CAPS), help="caps as multiples of the mean")
    ap.add_argument("--repeats", type=int, default=3, help="plan_batch calls timed per plan (median)")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "held_cap.json")
    args = ap.parse_args(argv)
    if args.repeats < 1 or any(c <= 0 for c in args.caps):
        ap.error("--repeats must be >= 1 and --caps > 0")
    servers = args.servers or (QUICK_SERVERS if args.quick else SERVERS)
    tokens, repeats = (QUICK_TOKENS, 1) if args.quick else (TOKENS, args.repeats)
    start = time.perf_counter()
    rows = []
    for trace in TRACES:
        for mode in MODES:
            for s in servers:
                rows.extend(bench_config(trace, mode, s, tokens, args.caps, repeats))
                print(f"  {trace} {mode} {s} servers done", file=sys.stderr, flush=True)
    finish(lambda: print(render(rows)), headline(rows, args.caps), time.perf_counter() - start, args.json,
           {"benchmark": "held_cap", "epsilon": EPSILON, "min_shard": MIN_SHARD, "cost": COST.to_dict(),
            "quick": args.quick, "repeats": repeats, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
