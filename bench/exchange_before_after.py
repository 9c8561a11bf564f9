"""Round time and collectives per round over gloo: another checkout of distca (``--before-tree``,
e.g. a base commit) against this one, in the same run.

For every ``--context`` (tokens per rank) it runs ``bench/roundtrip.py`` (this tree's script) on
``--configs`` ``--runs`` times with the other tree's packages (``DISTCA_TREE``) and as often with
this tree's, in pairs: run ``j`` of context ``i`` starts with the before tree when ``i + j`` is even
and with this one otherwise, so within a context the order alternates (and a single run per
context still alternates across contexts), and pairs each run's Ray rows: ``total`` is the round
wall time the slowest client sees (ms, mean over measured steps), ``coll`` the all-to-all
collectives one client issues per round (counted at its process group), ``after/before`` the ratio
of the totals of one pair of runs. Per configuration the table shows the medians over the runs
and the spread of the per-run ratios (min, median, max): on a shared machine two runs of the same
tree differ by as much as the effect measured, and the spread is what says so. Default
configurations: 2 and 4 participants, both modes (in-place 2 and 4 clients; dedicated 1 client +
1 server and 2 + 2).

Usage::

    git worktree add /tmp/before <base commit>
    python bench/exchange_before_after.py --before-tree /tmp/before
    python bench/exchange_before_after.py --before-tree /tmp/before --contexts 4096 --layers 1 --steps 1
    python bench/exchange_before_after.py --before-tree /tmp/before --contexts 1024 --runs 4 --steps 6

Writes JSON to ``--json`` (default ``bench/results/exchange_before_after.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.report import finish  # noqa: E402

CONFIGS = ["inplace:2", "inplace:4", "dedicated:1:1", "dedicated:2:2"]


def run_roundtrip(tree: Path | None, configs: list[str], context: int, layers: int, steps: int) -> list[dict]:
    """``bench/roundtrip.py`` in a fresh process (from a scratch directory, so that no checkout's
    packages come first by accident), measuring ``tree`` (None: this one); its rows."""
    env = dict(os.environ)
    env.pop("DISTCA_TREE", None)
    if tree is not None:
        env["DISTCA_TREE"] = str(tree)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "roundtrip.json"
        cmd = [sys.executable, str(ROOT / "bench" / "roundtrip.py"), "--no-png", "--json", str(out),
               "--context", str(context), "--layers", str(layers), "--steps", str(steps),
               "--configs", *configs]
        subprocess.run(cmd, cwd=scratch, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["rows"]


def pair(before: list[dict], after: list[dict], context: int) -> list[dict]:
    """One row per configuration and round kind: the two trees' Ray totals and collectives of one
    pair of runs."""
    by_key = {(r["config"], r["round"]): r for r in before}
    rows = []
    for a in after:
        b = by_key[(a["config"], a["round"])]
        rows.append({"config": a["config"], "participants": a["participants"], "round": a["round"],
                     "tokens_per_rank": context,
                     "before_total_ms": b["ray_total_ms"], "after_total_ms": a["ray_total_ms"],
                     "before_collectives": b.get("ray_collectives_per_round"),
                     "after_collectives": a.get("ray_collectives_per_round"),
                     "before_a2a_ms": b["ray_all_to_all_ms"], "after_a2a_ms": a["ray_all_to_all_ms"],
                     "ratio": a["ray_total_ms"] / b["ray_total_ms"]})
    return rows


def combine(runs: list[list[dict]], firsts: list[str]) -> list[dict]:
    """One row per configuration and round kind over a context's pairs of runs (``firsts``: which
    tree started each pair): the medians of the totals, and the median, min and max of the per-run
    ratios, each run's pair kept (``runs``)."""
    rows = []
    for i, first in enumerate(runs[0]):
        same = [run[i] for run in runs]
        ratios = [r["ratio"] for r in same]
        row = {k: first[k] for k in ("config", "participants", "round", "tokens_per_rank")}
        for key in ("before_total_ms", "after_total_ms", "before_a2a_ms", "after_a2a_ms"):
            row[key] = statistics.median(r[key] for r in same)
        for key in ("before_collectives", "after_collectives"):  # a plan's count: the same every run
            row[key] = same[-1][key]
        row.update(ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                   runs=[dict(r, first=f) for r, f in zip(same, firsts)])
        rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    def num(x, fmt):
        return "-" if x is None else fmt.format(x)
    head = ["tokens/rank", "config", "P", "round", "runs", "before ms", "after ms", "after/before",
            "min", "max", "coll before", "coll after"]
    cells = [[str(r["tokens_per_rank"]), r["config"], str(r["participants"]), r["round"], str(len(r["runs"])),
              num(r["before_total_ms"], "{:.1f}"), num(r["after_total_ms"], "{:.1f}"), f"{r['ratio']:.2f}",
              f"{r['ratio_min']:.2f}", f"{r['ratio_max']:.2f}",
              num(r["before_collectives"], "{:.0f}"), num(r["after_collectives"], "{:.0f}")] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(c) for c in cells])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before-tree", type=Path, required=True, help="the other checkout (e.g. a git worktree)")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536], help="tokens per rank")
    p.add_argument("--configs", nargs="+", default=CONFIGS, metavar="MODE:CLIENTS[:SERVERS]")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--runs", type=int, default=2,
                   help="pairs of runs per context, alternating which tree starts a pair (default 2)")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "exchange_before_after.json")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    before_tree = args.before_tree.resolve()
    if not (before_tree / "distca_server").is_dir():
        raise ValueError(f"--before-tree {args.before_tree} holds no distca checkout (no distca_server/)")
    start = time.perf_counter()
    rows = []
    for i, context in enumerate(args.contexts):
        pairs, firsts = [], []
        for j in range(args.runs):
            # by run within the context, so both orders occur in every context with --runs >= 2
            before_first = (i + j) % 2 == 0
            trees = [before_tree, None] if before_first else [None, before_tree]
            got = {}
            for tree in trees:
                print(f"{context} tokens per rank, run {j + 1}/{args.runs}: {'before' if tree else 'after'} ...",
                      file=sys.stderr, flush=True)
                got[tree is None] = run_roundtrip(tree, args.configs, context, args.layers, args.steps)
            pairs.append(pair(got[False], got[True], context))
            firsts.append("before" if before_first else "after")
        rows += combine(pairs, firsts)
    headline = []
    for kind in ("forward", "backward"):
        sel = [r for r in rows if r["round"] == kind]
        headline.append(f"{kind}: after/before round time, median of {args.runs} run(s) per configuration "
                        f"{min(r['ratio'] for r in sel):.2f}-{max(r['ratio'] for r in sel):.2f}x (single runs "
                        f"{min(r['ratio_min'] for r in sel):.2f}-{max(r['ratio_max'] for r in sel):.2f}x); "
                        f"collectives per round {sorted({r['before_collectives'] for r in sel})} -> "
                        f"{sorted({r['after_collectives'] for r in sel})}")
    finish(lambda: print(render(rows)), headline, time.perf_counter() - start, args.json,
           {"before_tree": str(before_tree), "layers": args.layers, "steps": args.steps, "runs": args.runs,
            "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
