"""plan_batch(..., window=W): valid full-window tasks, windowed loads, balance, KV bytes."""

from __future__ import annotations

import random

import numpy as np
import pytest

from scheduler import CostModel, Plan, plan_batch
from scheduler.bound import load_bound
from scheduler.cost import doc_pairs

COST = CostModel(num_heads_q=8, num_heads_kv=2, head_dim=64, dtype_bytes=2)


def _batch(rng, ranks):
    return [[rng.choice([1, 2, 3, rng.randint(1, 300), rng.randint(100, 4000), rng.randint(3000, 20000)])
             for _ in range(rng.randint(0, 6))] for _ in range(ranks)]


def _brute_coverage(plan, window):
    """Per document, how many tasks cover each (query, key) pair: must be the windowed mask."""
    for r, lens in enumerate(plan.doc_lens_per_rank):
        for d, l in enumerate(lens):
            if l > 600:
                continue
            count = np.zeros((l, l), dtype=np.int64)
            for tasks in plan.server_tasks:
                for t in tasks:
                    if (t.src_rank, t.doc_index) == (r, d):
                        i = np.arange(t.q_start, t.q_end)[:, None]
                        j = np.arange(t.kv_start, t.kv_end)[None, :]
                        count[t.q_start:t.q_end, t.kv_start:t.kv_end] += (j <= i) & (j > i - window)
            i, j = np.arange(l)[:, None], np.arange(l)[None, :]
            assert np.array_equal(count, ((j <= i) & (j > i - window)).astype(np.int64))


def _brute_kv_rows(plan):
    """KV rows per (rank, server): the union of each document's task key ranges there."""
    rows = np.zeros((plan.num_ranks, plan.num_servers), dtype=np.int64)
    for s, tasks in enumerate(plan.server_tasks):
        keys = {}
        for t in tasks:
            keys.setdefault((t.src_rank, t.doc_index), set()).update(range(t.kv_start, t.kv_end))
        for (r, _), ks in keys.items():
            rows[r, s] += len(ks)
    return rows


@pytest.mark.parametrize("seed", range(40))
def test_windowed_plans_are_valid_exact_and_balanced(seed):
    rng = random.Random(seed)
    mode = rng.choice(["inplace", "dedicated"])
    ranks = rng.randint(1, 8)
    servers = ranks if mode == "inplace" else rng.randint(1, 8)
    lens = _batch(rng, ranks)
    if not any(lens):
        lens[0] = [5]
    window = rng.choice([1, 7, 128, 4096, 10**6])
    ms = rng.choice([1, 16, 128])
    eps = rng.choice([0.0, 0.05, 0.2])
    plan = plan_batch(lens, servers, cost=COST, epsilon=eps, mode=mode, min_shard=ms, window=window)
    again = Plan(lens, servers, mode, COST, plan.server_tasks, eps, ms, window=window,
                 keep_activations=plan.keep_activations)  # full validation
    assert again == plan and Plan.from_msgpack(plan.to_msgpack()) == plan
    _brute_coverage(plan, window)
    total = sum(doc_pairs(l, window) for r in lens for l in r)
    loads = np.array(plan.server_loads()) / COST.flops_per_pair
    assert loads.sum() == pytest.approx(total, rel=1e-12)
    assert sum(plan.rank_loads()) / COST.flops_per_pair == pytest.approx(total, rel=1e-12)
    assert np.array_equal(plan.row_matrix[1], _brute_kv_rows(plan))
    # balance: never below the bound; above (1 + eps) x bound only by the largest piece a server
    # could not cut (a whole unsplittable document or 2 min_shard - 1 positions of a band)
    bound = load_bound(plan.doc_lens_flat, servers, ms, window)
    assert loads.max() >= bound.level * (1 - 1e-12)
    pieces = [doc_pairs(l, window) if (l + 1) // 2 < 2 * ms else (2 * ms - 1) * min(l + 1, 2 * window)
              for r in lens for l in r]
    assert loads.max() <= max((1 + eps) * bound.level, bound.mean + max(pieces)) * (1 + 1e-12)


def test_many_documents_reach_the_target():
    rng = random.Random(7)
    for window in (128, 4096):
        lens = [[rng.choice([rng.randint(1, 2000), rng.randint(8000, 60000)]) for _ in range(12)]
                for _ in range(16)]
        plan = plan_batch(lens, 16, cost=COST, epsilon=0.05, window=window)
        loads = np.array(plan.server_loads()) / COST.flops_per_pair
        assert loads.max() <= 1.05 * plan.load_bound().level * (1 + 1e-12)


def test_a_window_longer_than_every_document_plans_as_full_attention():
    rng = random.Random(3)
    lens = _batch(rng, 5)
    full = plan_batch(lens, 5, cost=COST, epsilon=0.05, min_shard=16)
    longest = max(max(r, default=1) for r in lens)
    windowed = plan_batch(lens, 5, cost=COST, epsilon=0.05, min_shard=16, window=longest)
    assert np.array_equal(full.task_array, windowed.task_array)
    assert windowed.server_loads() == full.server_loads() and windowed.comm_bytes() == full.comm_bytes()


def test_windowed_plan_moves_only_the_window():
    """One 65,536-token document over 8 servers: full causal shards need their whole prefix, a
    4,096 window only the window before each shard."""
    lens = [[65536], [], [], [], [], [], [], []]
    full = plan_batch(lens, 8, cost=COST, epsilon=0.05)
    windowed = plan_batch(lens, 8, cost=COST, epsilon=0.05, window=4096)
    fk, wk = full.comm_bytes()["forward"]["k"], windowed.comm_bytes()["forward"]["k"]
    per_row = COST.bytes_per_token("k")
    assert wk < fk / 3
    # each receiving server gets at most its shards plus W - 1 rows before each of them
    for s, tasks in enumerate(windowed.server_tasks):
        if s:
            assert windowed.row_matrix[1][0, s] <= sum(t.q_len + 4095 for t in tasks)
    assert windowed.imbalance()[1] <= 1.05 + 1e-9
    assert wk % per_row == 0


def test_bound_with_window_is_the_windowed_average_for_long_documents():
    b = load_bound([100000], 4, 128, 4096)
    assert b.total == doc_pairs(100000, 4096)
    assert b.piece == -(-doc_pairs(100000, 4096) // 4)
    assert load_bound([300], 4, 128, 4096) == load_bound([300], 4, 128)  # the window never bites


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="window must be a positive int"):
        plan_batch([[5]], 1, cost=COST, window=0)
    with pytest.raises(ValueError, match="window must be a positive int"):
        plan_batch([[5]], 1, cost=COST, window=3.0)


@pytest.mark.parametrize("lens,servers,mode,min_shard,window", [
    # documents a little longer than W: a band's inner positions hold fewer pairs than the most a
    # position holds (2 W), so filling the destination once left a remainder under min_shard
    ([[1077, 1487]], 3, "dedicated", 128, 1024),
    ([[133, 285], [], [], []], 4, "inplace", 16, 64)])
def test_windowed_plans_never_leave_a_shard_shorter_than_min_shard(lens, servers, mode, min_shard, window):
    cost = CostModel(num_heads_q=32, num_heads_kv=8, head_dim=128, dtype_bytes=2)
    plan = plan_batch(lens, servers, cost=cost, mode=mode, epsilon=0.0, min_shard=min_shard, window=window)
    split = {}
    for tasks in plan.server_tasks:
        for t in tasks:
            split.setdefault((t.src_rank, t.doc_index), []).append(t.q_end - t.q_start)
    shards = [n for (r, d), ns in split.items() if len(ns) > 1 for n in ns]
    assert shards and min(shards) >= min_shard  # documents were split, and no shard is a sliver
    assert Plan.from_msgpack(plan.to_msgpack()) == plan  # the receiving side's checks accept it
