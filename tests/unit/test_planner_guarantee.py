"""plan_batch's balance guarantee on seeded adversarial batches (issue 23, defect 10).

The batches are those of ``bench/planner_guarantee.py`` (one generator, loaded from the script),
the same the planner docstring's measured miss rate is stated for. Loads are causal pairs
(attention FLOPs over ``CostModel.flops_per_pair``, a constant, so every ratio is one of FLOPs).
"""

import importlib.util
import sys
from pathlib import Path

import numpy as np

import scheduler.planner
from scheduler import Plan

ROOT = Path(__file__).resolve().parents[2]
# What the planner docstring states, guarantee (b): misses of (1 + eps) max(mean, bound) on the
# bench's default run (seed 0, 2,000 batches).
BATCHES, SEED = 2000, 0
STATED_MISSES = 27


def _bench():
    name = "bench_planner_guarantee"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "planner_guarantee.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_stated_rate_is_the_docstrings():
    assert f"{STATED_MISSES} of {BATCHES:,}" in " ".join(scheduler.planner.__doc__.split())


def _valid(args, plan):
    """The plan re-validated by :class:`Plan` (every causal pair once, ``min_shard``), canonical."""
    again = Plan(args["doc_lens_per_rank"], args["num_servers"], args["mode"], plan.cost, plan.server_tasks,
                 epsilon=args["epsilon"], min_shard=args["min_shard"], window=args.get("window"))
    assert np.array_equal(again.task_array, plan.task_array)
    assert again.server_loads() == plan.server_loads()


def _check(batches, stated_misses):
    bench = _bench()
    rows = []
    for args in batches:
        plan = bench.plan(args)
        _valid(args, plan)
        assert bench.plan(args) == plan  # deterministic
        rows.append(bench.measure(args, plan))
    # Where the planner misses its target it is no worse than plain LPT over whole documents
    # (guaranteed above 1.01 max(mean, bound), planner doc (h); on these batches at every miss).
    # Within the target it may stay above LPT: it keeps the plan that moves fewer bytes.
    worse = [(i, r["ratio"], r["lpt_ratio"], r["target_ratio"]) for i, r in enumerate(rows)
             if r["miss"] and r["vs_lpt"] > 1 + 1e-9]
    assert not worse, worse[:10]
    misses = sum(r["miss"] for r in rows)
    assert misses <= stated_misses, (misses, stated_misses)


def test_never_worse_than_lpt_and_misses_at_most_the_stated_rate():
    """The bench's default run: the fallback runs on the batches the first runs miss by more than
    1% (most of the 87 misses before issue 23), so its starts are exercised and re-validated."""
    _check(_bench().adversarial_batches(BATCHES, SEED), STATED_MISSES)


def test_windowed_batches():
    """The same generator under sliding windows: valid plans, never worse than LPT on a miss, and
    at most the misses measured with the fallback (11 of these 300; 22 without it)."""
    batches = _bench().adversarial_batches(300, SEED + 1)
    for i, args in enumerate(batches):
        args["window"] = (64, 300, 1024, 4096)[i % 4]
    _check(batches, 11)
