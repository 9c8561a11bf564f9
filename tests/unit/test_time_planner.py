"""The time planner: plan_batch with a TimeModel (scheduler/time_cost.py, scheduler/time_refine.py).

Seeded random batches (odd lengths, 1-token documents, empty ranks, both modes, windows): every
plan is a valid Plan covering every pair exactly once, its predicted most loaded server is at or
below the FLOP plan it refines (the FLOP planner's at ε = 0) and at or below ``max((1 + ε) · level_s,
the FLOP plan's at ε)`` (under a KV budget or held-bytes cap: against the FLOP plans that meet
it; the budget and cap hold wherever the FLOP planner keeps them), no time model gives today's plan; bad tables and settings raise ValueError
naming the value; the min_shard rule. Nothing here depends on timing.
"""

from __future__ import annotations

import argparse
import json
import random
import warnings
from pathlib import Path

import numpy as np
import pytest

from scheduler import ConfigError, CostModel, Plan, PlanConfig, plan_batch
from scheduler.config import DEFAULT_MIN_SHARD
from scheduler.cost import causal_pairs, doc_pairs
from scheduler.profile import ProfileTable
from scheduler.time_cost import TimeModel

ROOT = Path(__file__).resolve().parents[2]
H200_8B = ROOT / "distca_sim" / "data" / "profiles" / "h200" / "llama3-8b-tp8"
SHIPPED = sorted(p.parent for p in (ROOT / "distca_sim" / "data" / "profiles").glob("*/*/forward.json"))
MODEL = TimeModel.from_dir(H200_8B)
COST = MODEL.cost  # the shape the tables were measured for (4/1/128, bf16)


def random_batch(rng: random.Random, mode: str, window_choices=(None,)):
    ranks = rng.randint(1, 10)
    lens = []
    for _ in range(ranks):
        if rng.random() < 0.15:
            lens.append([])  # an empty rank
            continue
        docs = []
        for _ in range(rng.randint(1, 12)):
            u = rng.random()
            if u < 0.15:
                docs.append(1)
            elif u < 0.4:
                docs.append(2 * rng.randint(0, 1500) + 1)  # odd
            elif u < 0.9:
                docs.append(rng.randint(1, 6000))
            else:
                docs.append(rng.randint(6000, 40000))
        lens.append(docs)
    servers = ranks if mode == "inplace" else rng.randint(1, 12)
    return dict(lens=lens, servers=servers, mode=mode, window=rng.choice(window_choices),
                epsilon=rng.choice([0.0, 0.05, 0.2]), min_shard=rng.choice([1, 16, 128]))


def revalidated(plan: Plan) -> Plan:
    """The plan rebuilt through Plan's validating constructor (coverage, shards, min_shard)."""
    return Plan(plan.doc_lens_per_rank, plan.num_servers, plan.mode, plan.cost, plan.server_tasks,
                epsilon=plan.epsilon, min_shard=plan.min_shard, keep_activations=plan.keep_activations,
                window=plan.window)


def check_pairs(plan: Plan) -> None:
    """Every document's tasks hold exactly its pairs (each pair once: Plan's tiling check plus this)."""
    arr = plan.task_array
    gid = plan.doc_offsets[arr[:, 1]] + arr[:, 2]
    pairs = causal_pairs(arr[:, 3], arr[:, 4], arr[:, 5], arr[:, 6], plan.window)
    got = np.bincount(gid, pairs, minlength=len(plan.doc_lens_flat))
    want = doc_pairs(plan.doc_lens_flat, plan.window)
    np.testing.assert_array_equal(got, want)


def seconds(plan: Plan, model: TimeModel = MODEL) -> float:
    """The plan's predicted most loaded server, seconds."""
    return float(model.server_seconds(plan.task_array, plan.num_servers, plan.window).max())


def level_s(plan: Plan) -> float:
    return MODEL.bound(plan.doc_lens_flat, plan.num_servers, plan.min_shard, plan.window).level_s


def keeps_the_guarantee(lens, servers, **kw) -> tuple[Plan, Plan]:
    """The time plan and the FLOP plan at the same ε; asserts the guarantee (scheduler.planner
    ``_time_plan``): at most the FLOP plan at ε = 0 (the one it refines), and at most
    ``max((1 + ε) · level_s, the FLOP plan's at ε)`` (within float rounding of the sums' order)."""
    timed = plan_batch(lens, servers, time_model=MODEL, **kw)
    flop = plan_batch(lens, servers, **kw)
    flop0 = plan_batch(lens, servers, **dict(kw, epsilon=0.0))
    assert seconds(timed) <= seconds(flop0)
    assert seconds(timed) <= max((1 + kw["epsilon"]) * level_s(timed), seconds(flop)) * (1 + 1e-9)
    return timed, flop


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("mode", ["inplace", "dedicated"])
def test_random_batches_valid_and_keep_the_guarantee(seed, mode):
    rng = random.Random(seed * 2 + (mode == "dedicated"))
    b = random_batch(rng, mode, window_choices=(None, None, 64, 1024))
    kw = dict(cost=COST, epsilon=b["epsilon"], mode=mode, min_shard=b["min_shard"], window=b["window"])
    timed, _ = keeps_the_guarantee(b["lens"], b["servers"], **kw)
    assert timed.min_shard == b["min_shard"] and timed.epsilon == b["epsilon"]
    revalidated(timed)
    check_pairs(timed)


def test_random_batches_rarely_above_the_flop_plan_at_eps():
    """Measured, not guaranteed: the time plan at ε is at or below the FLOP plan at ε on all but
    one of these 80 batches (seed 33, dedicated: 5 servers, 8 documents; the time plan ends at
    0.98 · level_s, inside its tolerance, the FLOP plan at 0.95 · level_s: the level is not a lower
    bound, TimeModel.bound)."""
    above = []
    for seed in range(40):
        for mode in ("inplace", "dedicated"):
            rng = random.Random(seed * 2 + (mode == "dedicated"))
            b = random_batch(rng, mode, window_choices=(None, None, 64, 1024))
            kw = dict(cost=COST, epsilon=b["epsilon"], mode=mode, min_shard=b["min_shard"], window=b["window"])
            if seconds(plan_batch(b["lens"], b["servers"], time_model=MODEL, **kw)) > seconds(
                    plan_batch(b["lens"], b["servers"], **kw)):
                above.append((seed, mode))
    assert above == [(33, "dedicated")]


@pytest.mark.parametrize("dataset", ["pretrain", "prolong"])
@pytest.mark.parametrize("mode", ["inplace", "dedicated"])
def test_trace_batches_reach_the_level(dataset, mode):
    """The default ε: the time planner aims at the level and lands within 2.5% of it on these
    batches (1.007-1.024; the FLOP planner at ε = 0.05: 1.05-1.09), below the FLOP plan at ε."""
    from distca_sim.workloads import sample_batch
    batch = sample_batch(dataset, 32, 131072, seed=1, step=0)
    servers = 32 if mode == "inplace" else 24
    timed, flop = keeps_the_guarantee(batch, servers, cost=COST, mode=mode, epsilon=PlanConfig.epsilon)
    revalidated(timed)
    check_pairs(timed)
    assert seconds(timed) <= seconds(flop)
    assert seconds(timed) <= 1.03 * level_s(timed)


def test_a_miss_refines_the_flop_plan_at_eps_too(monkeypatch):
    """ε bounds what the time planner accepts: above (1 + ε) · level_s (three equal unsplittable
    documents on two servers: the best plan is 4/3 of the level) it refines the FLOP plan at ε as
    well; within it, the FLOP plan at ε = 0 alone."""
    import scheduler.planner as planner
    asked = []
    real = planner._flop_tasks
    monkeypatch.setattr(planner, "_flop_tasks", lambda batch, bound, eps, *a: asked.append(eps) or real(batch, bound, eps, *a))
    timed, flop = keeps_the_guarantee([[200, 200, 200]], 2, cost=COST, mode="dedicated", epsilon=0.05, min_shard=128)
    assert asked[:2] == [0.0, 0.05] and seconds(timed) <= seconds(flop)
    asked.clear()
    plan_batch(sample_trace(), 8, cost=COST, epsilon=0.05, time_model=MODEL)
    assert asked == [0.0]


def sample_trace():
    from distca_sim.workloads import sample_batch
    return sample_batch("pretrain", 8, 131072, seed=2, step=0)


def test_partial_kv_and_held_cap_keep_the_guarantee():
    rng = random.Random(7)
    lens = [[rng.randint(1, 30000) for _ in range(6)] for _ in range(6)]
    for kw in (dict(partial_kv=True), dict(max_held_bytes_per_server=10**12)):
        timed, _ = keeps_the_guarantee(lens, 6, cost=COST, min_shard=128, epsilon=0.05, **kw)
        revalidated(timed)
        check_pairs(timed)


@pytest.mark.parametrize("lens, servers, epsilon, min_shard", [
    ([[2331]], 12, 0.01, 128),
    ([[], [158, 1, 154473, 111173], [170, 2325]], 14, 0.05, 7)])
def test_partial_kv_keeps_the_guarantee_where_the_key_splits_differ(lens, servers, epsilon, min_shard):
    """The FLOP plan at ε = 0 splits key blocks towards the mean, the time plan towards
    (1 + ε) · mean, so it split less and ended above the FLOP plan at ε = 0 (1.8% on the first
    batch, found by a review): the time planner now also weighs the mean's splits and the FLOP
    plans' own. Each of the 34B table's batches broke the guarantee before."""
    model = TimeModel.from_dir(ROOT / "distca_sim" / "data" / "profiles" / "h100" / "llama-34b-tp8")
    kw = dict(cost=model.cost, mode="dedicated", min_shard=min_shard, partial_kv=True)
    timed = plan_batch(lens, servers, time_model=model, epsilon=epsilon, **kw)
    for eps in (0.0, epsilon):
        flop = plan_batch(lens, servers, epsilon=eps, **kw)
        assert seconds(timed, model) <= seconds(flop, model)
    revalidated(timed)
    check_pairs(timed)


def kv_most(plan: Plan) -> int:
    return int(plan.row_matrix[1].sum(axis=0).max())


def test_partial_kv_keeps_the_kv_budget_the_flop_planner_meets():
    """``max_kv_rows_per_server`` holds for the time planner wherever the FLOP planner meets it:
    the unsplit time plan, which never had the budget applied, won on predicted seconds before
    (the first batch: 22,780 KV rows on a server, budget 14,755; found by a review), and the
    budget now ranks first among the partial-KV step's candidates."""
    rng = random.Random(11)
    kw = dict(cost=COST, mode="dedicated", epsilon=0.05, min_shard=128, partial_kv=True)
    batches = [([[12631, 6124, 10756]], 4, 14755)]
    for _ in range(40):  # budgets below what the unbudgeted plan needs
        lens = [[rng.randint(1, 20000) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 2))]
        servers = rng.randint(2, 6)
        batches.append((lens, servers, int(kv_most(plan_batch(lens, servers, **kw)) * rng.uniform(0.6, 0.95))))
    kept = 0
    for lens, servers, budget in batches:
        flop = plan_batch(lens, servers, max_kv_rows_per_server=budget, **kw)
        if kv_most(flop) > budget:
            continue  # best effort: the FLOP planner could not meet it either
        timed = plan_batch(lens, servers, time_model=MODEL, max_kv_rows_per_server=budget, **kw)
        assert kv_most(timed) <= budget, (lens, servers, budget, timed.row_matrix[1].sum(axis=0))
        revalidated(timed)
        kept += 1
    assert kept >= 15  # the sweep tests something


@pytest.mark.parametrize("lens, servers, budget, cap", [
    ([[1820, 10650, 3407]], 5, 9058, 12823280), ([[6512, 12913, 18537, 18705]], 4, 22722, 41422265)])
def test_a_held_cap_with_a_kv_budget_plans_wherever_the_flop_planner_does(lens, servers, budget, cap):
    """The held-bytes cap is a hard limit and the KV budget best effort: the time planner filters
    by the cap first, and adds the FLOP plan at ε when no candidate meets both, so it raises
    only where the FLOP planner does (both batches raised: found by a review)."""
    kw = dict(cost=COST, mode="dedicated", epsilon=0.2, min_shard=128, partial_kv=True, keep_activations=True,
              max_kv_rows_per_server=budget, max_held_bytes_per_server=cap)
    flop = plan_batch(lens, servers, **kw)
    timed = plan_batch(lens, servers, time_model=MODEL, **kw)
    assert max(timed.held_bytes()) <= cap
    assert kv_most(timed) <= max(budget, kv_most(flop))
    revalidated(timed)


def test_no_time_model_is_todays_plan():
    rng = random.Random(3)
    for mode in ("inplace", "dedicated"):
        b = random_batch(rng, mode)
        default = plan_batch(b["lens"], b["servers"], cost=COST, mode=mode)
        explicit = plan_batch(b["lens"], b["servers"], cost=COST, mode=mode, min_shard=DEFAULT_MIN_SHARD)
        by_config = plan_batch(b["lens"], b["servers"], cost=COST, config=PlanConfig(mode=mode))
        assert default == explicit == by_config
        assert default.min_shard == DEFAULT_MIN_SHARD == 128


def test_empty_and_tiny_batches():
    for lens, S, mode in (([[], []], 2, "inplace"), ([[1]], 3, "dedicated"), ([[1, 1, 1], []], 2, "inplace")):
        plan = plan_batch(lens, S, cost=COST, mode=mode, time_model=MODEL)
        revalidated(plan)


# ---- the time model ------------------------------------------------------------------------------
def test_band_seconds_are_their_shards_seconds():
    l, a, b = np.array([1001, 1000, 5000, 7]), np.array([0, 100, 300, 0]), np.array([501, 200, 2500, 2])
    got = MODEL.band_seconds(l, a, b)
    t0 = np.maximum(l - b, b)
    head_end = np.where(t0 == b, l - a, b)
    want = MODEL.task_seconds(a, head_end, 0, head_end)
    want = want + np.where(t0 == b, 0.0, MODEL.task_seconds(t0, l - a, 0, l - a))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert MODEL.band_seconds(np.array([10]), np.array([3]), np.array([3]))[0] == 0.0


def test_task_seconds_match_the_tables_for_plain_tasks():
    q, kv = np.array([128, 300, 5000]), np.array([128, 4000, 20000])
    want = MODEL.forward.latencies(q, kv) + MODEL.backward.latencies(q, kv)
    np.testing.assert_allclose(MODEL.task_seconds(kv - q, kv, 0, kv), want, rtol=1e-12)


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_tables_cut_ratio(folder):
    """TimeModel.bound's level is a lower bound up to the table's cut ratio rho (its docstring):
    on the shipped tables even cuts into 2-64 bands of 1K-256K-token documents take at least
    0.8 of the whole document's seconds."""
    model = TimeModel.from_dir(folder)
    for l in (1024, 2048, 4099, 8192, 32768, 131072, 262144):
        whole = model.whole_seconds([l])[0]
        c = (l + 1) // 2
        for k in (2, 3, 4, 16, 64):
            cuts = np.linspace(0, c, k + 1).astype(np.int64)
            pieces = model.band_seconds(np.full(k, l), cuts[:-1], cuts[1:]).sum()
            assert pieces >= 0.8 * whole, (folder, l, k)


def test_min_shard_choice():
    for folder in SHIPPED:
        assert TimeModel.from_dir(folder).choose_min_shard() == 256, folder
    # constant throughput: every tile multiple reaches it, so one tile
    cost = CostModel(num_heads_q=4, num_heads_kv=1, head_dim=128, dtype_bytes=2)
    grid = [128, 256, 512, 1024, 4096]
    flat = ProfileTable.from_flops(1e14, 0.0, grid, grid, cost)
    assert TimeModel(flat, flat).choose_min_shard() == 128
    # a large per-task overhead: only wide shards come near the saturated throughput
    slow = ProfileTable.from_flops(1e14, 2e-4, grid, grid, cost)
    m = TimeModel(slow, slow)
    chosen = m.choose_min_shard(0.65)
    assert chosen > 128 and chosen % 128 == 0
    assert m.choose_min_shard(0.99) >= chosen
    # what plan_batch uses: the chosen value when none is given, the caller's otherwise
    assert plan_batch([[5000, 3000], []], 2, cost=COST, time_model=MODEL).min_shard == 256
    assert plan_batch([[5000, 3000], []], 2, cost=COST, time_model=MODEL, min_shard=64).min_shard == 64
    assert plan_batch([[5000, 3000], []], 2, cost=COST).min_shard == 128
    assert PlanConfig(attn_profile=str(H200_8B)).resolved_min_shard() == 256
    assert PlanConfig().resolved_min_shard() == 128


def test_min_shard_choice_on_odd_tables():
    """Tables the validator accepts: no query length at or below the longest keys (numpy's
    "zero-size array" escaped), a zero-second cell (a divide-by-zero warning, its shard taken as
    infinitely fast)."""
    wide = ProfileTable(q_lens=[2048, 4096], kv_lens=[128, 1024], latency_s=[[1e-6, 2e-6], [1e-6, 2e-6]])
    assert TimeModel(wide, wide).choose_min_shard() % 128 == 0
    zero = ProfileTable(q_lens=[128, 1024], kv_lens=[128, 1024], latency_s=[[1e-6, 0.0], [0.0, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TimeModel(zero, zero).choose_min_shard() == 128  # nothing to compare: one tile
    free = ProfileTable(q_lens=[128], kv_lens=[128], latency_s=[[0.0]])
    assert TimeModel(free, free).choose_min_shard() == 128


# ---- bad input -----------------------------------------------------------------------------------
def test_bad_time_models_name_the_value(tmp_path):
    with pytest.raises(ValueError, match="forward must be a ProfileTable, got str"):
        TimeModel("nope", MODEL.backward)
    with pytest.raises(ValueError, match=r"task_s \(seconds\) must be a finite number >= 0, got -1"):
        TimeModel(MODEL.forward, MODEL.backward, task_s=-1)
    with pytest.raises(ValueError, match="call_s .* got nan"):
        TimeModel(MODEL.forward, MODEL.backward, call_s=float("nan"))
    other = ProfileTable(q_lens=[128], kv_lens=[128], latency_s=[[1e-5]],
                         meta={"cost": {"num_heads_q": 8, "num_heads_kv": 1, "head_dim": 128, "dtype_bytes": 2}})
    with pytest.raises(ValueError, match="backward table for .*'num_heads_q': 8"):
        TimeModel(MODEL.forward, other)
    for shape in ({"num_heads_q": 4, "head_dim": 128}, "x", dict(MODEL.cost.to_dict(), heads=4)):
        odd = ProfileTable(q_lens=[128], kv_lens=[128], latency_s=[[1e-5]], meta={"cost": shape})
        with pytest.raises(ValueError, match=r"meta\['cost'\] must be a CostModel's fields .* got"):
            TimeModel(odd, odd)  # was a TypeError at the first plan
    huge = ProfileTable(q_lens=[128], kv_lens=[128], latency_s=[[1e308]])
    with pytest.raises(ValueError, match=r"forward \+ backward seconds at \(q=128, kv=128\) exceed float64"):
        TimeModel(huge, huge)
    with pytest.raises(ValueError, match="fraction must be a number in \\(0, 1\\], got 0"):
        MODEL.choose_min_shard(fraction=0)
    with pytest.raises(ValueError, match="tile must be a positive int, got 0"):
        MODEL.choose_min_shard(tile=0)
    with pytest.raises(ValueError, match="no backward.json"):
        (tmp_path / "forward.json").write_text((H200_8B / "forward.json").read_text())
        TimeModel.from_dir(tmp_path)
    (tmp_path / "backward.json").write_text(json.dumps({"q_lens": [2, 1], "kv_lens": [1], "latency_s": [[0], [0]]}))
    with pytest.raises(ValueError, match="backward.json: q_lens must be strictly increasing"):
        TimeModel.from_dir(tmp_path)
    with pytest.raises(ValueError, match="'/no/such/folder': not a folder"):
        TimeModel.from_dir("/no/such/folder")


def test_tables_with_zero_second_cells_plan_without_numpy_warnings():
    """Valid tables whose cells are 0 s (or whose kv grid is one point, so every band saturates)
    made the refinement's position guesses divide by zero and cast inf to int64 (numpy
    RuntimeWarnings, errors under ``-W error``; found by a review); the guesses are now clipped
    first, and the plans keep the guarantee."""
    cost = CostModel(num_heads_q=4, num_heads_kv=1, head_dim=128, dtype_bytes=2)
    cases = [
        (TimeModel(ProfileTable([128], [8, 64, 512], [[0.0, 0.0007935923124103451, 0.0]]),
                   ProfileTable([4096], [8192], [[0.0]])),
         [[465, 1, 9483, 119, 64, 61, 13], [17, 28, 12945, 2429, 3, 75, 2], []], 9, "dedicated", 0.05, 1),
        (TimeModel(ProfileTable([256, 4096, 20000], [64], [[0.001], [0.001], [0.001]]),
                   ProfileTable([64, 128, 4096, 20000], [8], [[0.009481389064445], [0.0], [0.007576717537515791], [0.0]]),
                   call_s=0.001),
         [[38546], []], 2, "inplace", 1.0, 128)]
    for model, lens, servers, mode, epsilon, min_shard in cases:
        kw = dict(cost=cost, mode=mode, min_shard=min_shard)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            timed = plan_batch(lens, servers, epsilon=epsilon, time_model=model, **kw)
        revalidated(timed)
        check_pairs(timed)
        assert seconds(timed, model) <= seconds(plan_batch(lens, servers, epsilon=0.0, **kw), model)


def test_bad_plan_settings_name_the_value():
    with pytest.raises(ConfigError, match="attn_profile='/no/such/folder'"):
        PlanConfig(attn_profile="/no/such/folder")
    with pytest.raises(ConfigError, match="attn_profile must be a folder path .* got 3"):
        PlanConfig(attn_profile=3)
    with pytest.raises(ValueError, match="time_model must be a scheduler.time_cost.TimeModel, got str"):
        plan_batch([[10]], 1, cost=COST, time_model="h200")
    with pytest.raises(ValueError, match="not both"):
        plan_batch([[10]], 1, cost=COST, time_model=MODEL, attn_profile=str(H200_8B))
    big = CostModel(num_heads_q=32, num_heads_kv=8, head_dim=128, dtype_bytes=2)
    with pytest.raises(ValueError, match="measured for the attention shape .*'num_heads_q': 4"):
        plan_batch([[10]], 1, cost=big, time_model=MODEL)


def test_attn_profile_travels_in_the_config_and_the_flag():
    from distca_cli.flags import add_config_flags, config_from_args
    config = PlanConfig(attn_profile=str(H200_8B), mode="dedicated")
    assert PlanConfig.from_dict(config.to_dict()) == config
    by_config = plan_batch([[9000, 300], [40]], 3, cost=COST, config=config)
    by_model = plan_batch([[9000, 300], [40]], 3, cost=COST, mode="dedicated", time_model=MODEL)
    assert by_config == by_model and by_config.min_shard == 256
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    job = config_from_args(parser.parse_args(["--attn-profile", str(H200_8B)]))
    assert job.plan.attn_profile == str(H200_8B) and job.plan.min_shard is None


def test_refinement_moves_work_on_most_random_batches():
    """The property tests above are not vacuous: the time plan differs from the FLOP plan at ε = 0
    (the one it refines) on most of their batches."""
    moved = 0
    for seed in range(20):
        for mode in ("inplace", "dedicated"):
            rng = random.Random(seed * 2 + (mode == "dedicated"))
            b = random_batch(rng, mode, window_choices=(None, None, 64, 1024))
            kw = dict(cost=COST, epsilon=b["epsilon"], mode=mode, min_shard=b["min_shard"], window=b["window"])
            flop0 = plan_batch(b["lens"], b["servers"], **dict(kw, epsilon=0.0))
            timed = plan_batch(b["lens"], b["servers"], time_model=MODEL, **kw)
            moved += not np.array_equal(flop0.task_array, timed.task_array)
    assert moved >= 20


# ---- the simulator -------------------------------------------------------------------------------
def test_simulator_runs_both_planners():
    from distca_sim.hardware import get_gpu, load_attention_profile
    from distca_sim.simulate import ParallelConfig, Workload, simulate
    gpu = get_gpu("h200").with_tables(*load_attention_profile(H200_8B, COST))
    cmp = simulate("llama3-8b", gpu, ParallelConfig.from_gpus(64, tp=8), Workload("pretrain", 131072),
                   systems=("distca", "wlb_ideal"), epsilons=(0.05,), planner="both")
    flops, timed = cmp.get("distca-flops"), cmp.get("distca-time")
    assert (flops.system, timed.system) == ("distca eps=0.05", "distca-time eps=0.05")
    assert flops.details["planner"] == "flops" and flops.details["min_shard"] == 128
    assert timed.details["planner"] == "time" and timed.details["min_shard"] == 256
    assert cmp.get("distca").step_time_s == min(flops.step_time_s, timed.step_time_s)
    with pytest.raises(ValueError, match="planner must be 'flops', 'time' or 'both', got 'fast'"):
        simulate("llama3-8b", gpu, ParallelConfig.from_gpus(64, tp=8), Workload("pretrain", 131072),
                 systems=("distca",), planner="fast")


def test_band_kv_rows_array_is_band_kv_rows_elementwise():
    """The time refinement's vectorised KV-row count equals the greedy's scalar one."""
    from scheduler.bands import band_kv_rows, band_kv_rows_array
    rng = np.random.default_rng(7)
    for window in (1, 3, 64, 1000):
        l = rng.integers(1, 400, 300)
        c = (l + 1) // 2
        a = (rng.random(300) * c).astype(np.int64)
        b = a + 1 + (rng.random(300) * (c - a)).astype(np.int64)
        b = np.minimum(b, c)
        want = [band_kv_rows(int(x), int(y), int(z), window) for x, y, z in zip(l, a, b)]
        assert band_kv_rows_array(l, a, b, window).tolist() == want
