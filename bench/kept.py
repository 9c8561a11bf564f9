"""Kept activations vs stateless servers: bytes by round and tensor, balance, plan time and held
memory, on the same batches.

For each trace (Pretrain, ProLong) and number of servers (= client ranks, in-place mode; and
dedicated servers, one per rank), one batch of ``--tokens`` per rank is drawn with
:func:`distca_sim.workloads.sample_batch` (seed 0, step 0) and planned twice with ``plan_batch``
at ε = 0.05, ``min_shard=128``: ``keep_activations=False`` (every backward round resends Q, K,
V, O and LSE) and ``keep_activations=True`` (the servers keep them; the backward round sends dO
only). Cost model: Llama-3-8B attention per GPU, ``CostModel(32, 8, 128, dtype_bytes=2)``.

Columns (one layer; a step moves and holds this once per layer):
- ``fwd GiB`` / ``bwd GiB``: ``plan.comm_bytes()`` totals of the forward and backward rounds, and
  the backward round by tensor (``q+k+v+out+lse`` resent, ``dout``, ``dq``, ``dk+dv``).
- ``f+b vs stateless``: forward + backward bytes as a fraction of the stateless plan's.
- ``imb``: max/mean attention FLOPs over servers; ``plan ms``: median of ``--repeats`` calls.
- ``held max`` / ``held mean``: :meth:`Plan.held_bytes` per server, MiB, i.e. what each server
  keeps per layer from forward to backward (0 when stateless), and ``own``: the client rank's own
  Q, K, V, O, LSE rows, which a stateless client keeps for autograd instead (MiB per rank).

Usage::

    python bench/kept.py            # both traces, 128-1024 servers, 128K tokens per rank
    python bench/kept.py --quick    # 128 and 256 servers

Writes JSON to ``--json`` (default ``bench/results/kept.json``).
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

from scheduler import CostModel, plan_batch  # noqa: E402
from distca_sim.workloads import sample_batch  # noqa: E402
from bench.report import finish  # noqa: E402

TRACES = ("pretrain", "prolong")
SERVERS = (128, 256, 512, 1024)
QUICK_SERVERS = (128, 256)
EPSILON, MIN_SHARD = 0.05, 128
COST = CostModel(num_heads_q=32, num_heads_kv=8, head_dim=128, dtype_bytes=2)
GIB, MIB = 2 ** 30, 2 ** 20


def _plan(batch, servers, mode, keep, repeats):
    times, plan = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = plan_batch(batch, servers, cost=COST, epsilon=EPSILON, mode=mode, min_shard=MIN_SHARD,
                          keep_activations=keep)
        times.append(time.perf_counter() - t0)
    return plan, statistics.median(times) * 1e3


def bench_config(trace, servers, mode, tokens, repeats) -> list[dict]:
    batch = sample_batch(trace, servers, tokens, seed=0, step=0)
    hq, hkv = COST.held_row_bytes()
    rows = []
    for keep in (False, True):
        plan, ms = _plan(batch, servers, mode, keep, repeats)
        comm = plan.comm_bytes()
        bwd = comm["backward"]
        held = plan.held_bytes()
        rows.append({
            "trace": trace, "servers": servers, "mode": mode, "tokens_per_rank": tokens,
            "keep_activations": keep, "comm_bytes": comm,
            "forward_bytes": comm["forward"]["total"], "backward_bytes": bwd["total"],
            "backward_resent_bytes": sum(bwd.get(n, 0) for n in ("q", "k", "v", "out", "lse")),
            "imbalance": plan.imbalance()[1], "plan_ms": ms,
            "held_max_bytes": max(held), "held_mean_bytes": sum(held) / len(held),
            "own_rows_bytes_per_rank": max(sum(x) for x in batch) * (hq + hkv),
        })
    stateless = rows[0]["forward_bytes"] + rows[0]["backward_bytes"]
    for r in rows:
        r["vs_stateless"] = (r["forward_bytes"] + r["backward_bytes"]) / stateless if stateless else 1.0
    return rows


def render(rows) -> str:
    head = ("trace", "mode", "servers", "kept", "fwd GiB", "bwd GiB", "resent", "dout", "dq", "dk+dv",
            "f+b vs stateless", "imb", "plan ms", "held max MiB", "held mean MiB", "own MiB")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        b = r["comm_bytes"]["backward"]
        lines.append(" | ".join([
            r["trace"], r["mode"], str(r["servers"]), "yes" if r["keep_activations"] else "no",
            f"{r['forward_bytes'] / GIB:.1f}", f"{r['backward_bytes'] / GIB:.1f}",
            f"{r['backward_resent_bytes'] / GIB:.1f}", f"{b['dout'] / GIB:.1f}", f"{b['dq'] / GIB:.1f}",
            f"{(b['dk'] + b['dv']) / GIB:.1f}", f"{r['vs_stateless']:.3f}", f"{r['imbalance']:.3f}",
            f"{r['plan_ms']:.1f}", f"{r['held_max_bytes'] / MIB:.0f}", f"{r['held_mean_bytes'] / MIB:.0f}",
            f"{r['own_rows_bytes_per_rank'] / MIB:.0f}"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="128 and 256 servers only")
    ap.add_argument("--tokens", type=int, default=131072, help="tokens per rank")
    ap.add_argument("--repeats", type=int, default=3, help="plan_batch calls timed per config")
    ap.add_argument("--modes", default="inplace,dedicated")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "kept.json")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    rows = []
    for trace in TRACES:
        for mode in args.modes.split(","):
            for servers in (QUICK_SERVERS if args.quick else SERVERS):
                rows.extend(bench_config(trace, servers, mode, args.tokens, args.repeats))
                print(f"  {trace} {mode} {servers} servers done", file=sys.stderr, flush=True)
    kept = [r for r in rows if r["keep_activations"]]
    headline = [f"kept activations: forward+backward bytes {min(r['vs_stateless'] for r in kept):.3f}-"
                f"{max(r['vs_stateless'] for r in kept):.3f}x the stateless plan's at eps={EPSILON}, "
                f"{args.tokens // 1024}K tokens/rank; held per layer per server at most "
                f"{max(r['held_max_bytes'] for r in kept) / MIB:.0f} MiB"]
    finish(lambda: print(render(rows)), headline, time.perf_counter() - start, args.json,
           {"epsilon": EPSILON, "min_shard": MIN_SHARD, "cost": COST.to_dict(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
