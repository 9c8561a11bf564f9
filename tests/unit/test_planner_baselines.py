"""The baselines (no_balance, per_doc_cp, wlb_packing): valid plans, their loads and bytes, and
plan_batch against per_doc_cp on a skewed batch. Strategies and checks come from test_planner.py.
"""

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from test_planner import (COST, FPP, batches, check_comm, check_coverage, event, examples,
                          rank_flops, step_bytes, total_flops)

from scheduler import PlanConfig, plan_batch
from scheduler.baselines import no_balance, per_doc_cp, wlb_packing
from scheduler.cost import KEPT_TENSORS, RoundKind


# ---- baselines -----------------------------------------------------------------------------------
@settings(max_examples=examples(240), deadline=None)
@given(args=batches())
def test_baselines_are_valid_plans(args):
    lens, S, mode = args["doc_lens_per_rank"], args["num_servers"], args["mode"]
    nb = no_balance(lens, S, cost=COST, mode=mode)
    check_coverage(nb, lens)
    check_comm(nb)
    assert sum(nb.server_loads()) == total_flops(lens)
    if mode == "inplace":
        assert step_bytes(nb) == 0
        assert nb.server_loads() == rank_flops(lens)
    else:
        assert nb.comm_bytes()["forward"]["q"] == sum(map(sum, lens)) * COST.bytes_per_token("q")

    cp = per_doc_cp(lens, S, cost=COST, mode=mode)
    check_coverage(cp, lens)
    check_comm(cp)
    loads = cp.server_loads()
    assert sum(loads) == total_flops(lens)
    if loads and sum(loads):
        mean = sum(loads) / S
        # each document is at most one folded token ((l + 1) pairs) off its fair share per server
        slack = FPP * sum(l + 1 for r in lens for l in r)
        assert max(loads) <= mean + slack

    if mode == "inplace":
        wlb = wlb_packing(lens, S, cost=COST)
        check_wlb(lens, wlb)


def test_wlb_packing_empty_batch():
    plan = wlb_packing([[], []], 2, cost=COST)
    assert plan.server_tasks == [[], []]


def check_wlb(lens, wlb):
    check_coverage(wlb)
    assert step_bytes(wlb) == 0
    assert Counter(l for r in wlb.doc_lens_per_rank for l in r) == Counter(l for r in lens for l in r)
    assert len(wlb.doc_lens_per_rank) == len(lens)
    cap = max(sum(r) for r in lens)
    for packed in wlb.doc_lens_per_rank:
        if sum(packed) > cap:
            # Over the cap only when no rank had room: the fallback put one last (shortest)
            # document on the rank with the fewest tokens, which was below the cap.
            event("wlb: token cap exceeded by the fallback")
            assert sum(packed) - min(packed) < cap, (packed, cap)


def test_per_doc_cp_balances_long_documents():
    rng = random.Random(5)
    for S in (1, 3, 8, 12):
        lens = [[rng.randint(20_000, 60_000) for _ in range(rng.randint(0, 4))] for _ in range(S)]
        lens[0].append(50_001)
        plan = per_doc_cp(lens, S, cost=COST)
        check_comm(plan)
        assert plan.imbalance()[1] <= 1.001
        # every document of >= S folded tokens has a shard on every server
        for tasks in plan.server_tasks:
            assert len({(t.src_rank, t.doc_index) for t in tasks}) == sum(map(len, lens))


@pytest.mark.parametrize("mode", ["inplace", "dedicated"])
def test_baselines_keep_activations(mode):
    # A baseline made with keep_activations=True counts the kept bytes (Plan.comm_bytes): the same
    # tasks and forward round; a backward round that sends dO (no merged O and LSE: every task has
    # its full key prefix) instead of resending q, k, v, out and lse, and returns the same dQ, dK,
    # dV. Its default is plan_batch's, so default baselines compare with a default plan_batch plan.
    lens = [[6000, 300, 17], [900, 1000], [129, 4096, 5]]
    S = 3 if mode == "inplace" else 4
    makers = {"no_balance": lambda **kw: no_balance(lens, S, cost=COST, mode=mode, **kw),
              "per_doc_cp": lambda **kw: per_doc_cp(lens, S, cost=COST, mode=mode, **kw)}
    if mode == "inplace":
        makers["wlb_packing"] = lambda **kw: wlb_packing(lens, S, cost=COST, **kw)
    default = plan_batch(lens, S, cost=COST, mode=mode).keep_activations
    assert default is PlanConfig.keep_activations
    for name, make in makers.items():
        kept, stateless = make(keep_activations=True), make(keep_activations=False)
        assert make().keep_activations is default, name
        assert (kept.keep_activations, stateless.keep_activations) == (True, False), name
        assert kept.server_tasks == stateless.server_tasks, name
        check_comm(kept)  # row counts recomputed from the tasks, kept tensor set
        check_comm(stateless)
        k, s = kept.comm_bytes(), stateless.comm_bytes()
        assert k["forward"] == s["forward"], name
        kb, sb = k["backward"], s["backward"]
        assert set(kb) == {*RoundKind.BACKWARD.tensors_with(True), "total"}, name
        assert kb["out"] == kb["lse"] == 0, name
        assert all(kb[n] == sb[n] for n in ("dout", "dq", "dk", "dv")), name
        assert kb["total"] == sb["total"] - sum(sb[n] for n in KEPT_TENSORS), name
        assert stateless.held_bytes() == [0] * S and sum(kept.held_bytes()) > 0, name
        if mode == "dedicated":  # every row moves: dO is one Q-sized row per token
            assert kb["dout"] == sum(map(sum, lens)) * COST.bytes_per_token("dout"), name
            assert kb["total"] < sb["total"], name


def test_wlb_packing_hand_cases():
    # equal documents: re-packing keeps every rank at the cap and balances exactly
    lens = [[1000, 1000], [1000, 1000], [1000, 1000]]
    plan = wlb_packing(lens, 3, cost=COST)
    assert [sum(x) for x in plan.doc_lens_per_rank] == [2000] * 3
    assert plan.imbalance() == (1.0, 1.0)
    # skewed: long documents spread out, token counts stay within the cap
    lens = [[4000, 4000], [1000] * 8, [1000] * 8, [500] * 16]
    plan = wlb_packing(lens, 4, cost=COST)
    check_wlb(lens, plan)
    assert all(sum(x) <= 8000 for x in plan.doc_lens_per_rank)
    assert max(plan.server_loads()) < max(rank_flops(lens))
    with pytest.raises(ValueError, match="token_cap"):
        wlb_packing(lens, 4, cost=COST, token_cap=0)
    # greedy packing can miss a feasible packing: the fallback then exceeds the cap by one doc
    lens = [[5, 5], [5, 5], [4, 4, 2]]
    plan = wlb_packing(lens, 3, cost=COST)
    check_wlb(lens, plan)
    assert sorted(sum(x) for x in plan.doc_lens_per_rank) == [9, 10, 11]


# ---- comparative -------------------------------------------------------------------------------------
@pytest.mark.parametrize("keep", [False, True])
def test_skewed_batch_plan_batch_beats_per_doc_cp(keep):
    # both plans with the same keep_activations: it changes what the backward round sends
    rng = random.Random(7)
    num_ranks = 8
    lens = [[60_000, 2_000, 1_000, 500, 36]]
    for _ in range(num_ranks - 1):
        docs = []
        while sum(docs) < 60_000:
            docs.append(rng.randint(64, 2_000))
        lens.append(docs)
    plan = plan_batch(lens, num_ranks, cost=COST, epsilon=0.05, keep_activations=keep)
    cp = per_doc_cp(lens, num_ranks, cost=COST, keep_activations=keep)
    check_coverage(plan)
    assert plan.imbalance()[0] > 3
    assert plan.imbalance()[1] <= 1.05
    assert step_bytes(plan) < step_bytes(cp)
    assert step_bytes(plan) < 0.25 * step_bytes(cp)  # the point of the planner

