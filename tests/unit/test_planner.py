"""plan_batch: property tests (hypothesis) and hand cases, and the shared strategies and checks.

Every check recomputes what it asserts from the plan's tasks with its own code (the bottom-right
causal mask, loads, bytes), independent of the Plan's validation and derived arrays. The
baselines (test_planner_baselines.py) and the lower bound (test_planner_bound.py) are tested in
their own files, which import these strategies and checks from here.
"""

import heapq
import os
import random
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import event as _event
from hypothesis import strategies as st

from scheduler import CATask, CostModel, plan_batch
from scheduler.baselines import no_balance

# Scale every max_examples, e.g. DISTCA_HYPOTHESIS_SCALE=20 for a deep run.
SCALE = float(os.environ.get("DISTCA_HYPOTHESIS_SCALE", "1"))


def examples(n):
    return max(1, int(n * SCALE))


COST = CostModel(num_heads_q=32, num_heads_kv=8, head_dim=128, dtype_bytes=2)
FPP = 4 * 128 * 32
SMALL_DOC = 300  # documents up to this length get the full (query, key) count matrix

# ---- strategies ------------------------------------------------------------------------------
LENGTH = st.one_of(
    st.integers(1, 3),                               # tiny
    st.integers(1, 300),
    st.integers(0, 2499).map(lambda x: 2 * x + 1),   # odd
    st.integers(1, 5000),
)


@st.composite
def batches(draw, max_ranks=12, max_docs=20, length=LENGTH, modes=("inplace", "dedicated"),
            min_shards=(1, 16, 128)):
    num_ranks = draw(st.integers(1, max_ranks))
    doc_lens = draw(st.lists(st.lists(length, max_size=max_docs), min_size=num_ranks,
                             max_size=num_ranks))
    mode = draw(st.sampled_from(modes))
    num_servers = num_ranks if mode == "inplace" else draw(st.integers(1, 12))
    epsilon = draw(st.one_of(st.sampled_from([0.0, 0.05, 0.2]),
                             st.floats(0.0, 1.0, allow_nan=False, allow_infinity=False)))
    min_shard = draw(st.sampled_from(min_shards))
    return dict(doc_lens_per_rank=doc_lens, num_servers=num_servers, mode=mode,
                epsilon=epsilon, min_shard=min_shard)


def run(args):
    return plan_batch(args["doc_lens_per_rank"], args["num_servers"], cost=COST,
                      epsilon=args["epsilon"], mode=args["mode"], min_shard=args["min_shard"])


def event(label):
    """hypothesis.event, also callable from plain (seeded) tests."""
    try:
        _event(label)
    except Exception:  # outside a hypothesis test
        pass


# ---- independent checks ------------------------------------------------------------------------
def tasks_by_doc(plan):
    """{(rank, doc): [(server, CATask), ...]} straight from server_tasks."""
    out = defaultdict(list)
    for s, tasks in enumerate(plan.server_tasks):
        for t in tasks:
            assert isinstance(t, CATask)
            out[(t.src_rank, t.doc_index)].append((s, t))
    return out


def pair_counts(l, tasks):
    """[l, l] matrix: how many tasks compute (query i, key j), by the bottom-right rule."""
    counts = np.zeros((l, l), dtype=np.int64)
    for t in tasks:
        q_len, kv_len = t.q_end - t.q_start, t.kv_end - t.kv_start
        i = np.arange(t.q_start, t.q_end)[:, None]
        j = np.arange(t.kv_start, t.kv_end)[None, :]
        counts[t.q_start:t.q_end, t.kv_start:t.kv_end] += (
            (j - t.kv_start) <= (i - t.q_start) + (kv_len - q_len))
    return counts


def check_coverage(plan, doc_lens_per_rank=None):
    """Every causal pair of every document computed exactly once (see module docstring)."""
    doc_lens_per_rank = plan.doc_lens_per_rank if doc_lens_per_rank is None else doc_lens_per_rank
    assert len(plan.server_tasks) == plan.num_servers
    by_doc = tasks_by_doc(plan)
    expected = {(r, i) for r, lens in enumerate(doc_lens_per_rank) for i in range(len(lens))}
    assert set(by_doc) == expected
    for (r, i), entries in by_doc.items():
        l = doc_lens_per_rank[r][i]
        tasks = sorted((t for _, t in entries), key=lambda t: t.q_start)
        pos = 0
        for t in tasks:
            assert t.q_start == pos and t.q_end > t.q_start, (r, i, tasks)
            assert t.kv_start == 0 and t.kv_end == t.q_end, t
            pos = t.q_end
        assert pos == l, (r, i, l, tasks)
        if l <= SMALL_DOC:
            np.testing.assert_array_equal(pair_counts(l, tasks), np.tri(l, dtype=np.int64))


def total_flops(doc_lens_per_rank):
    return sum(4 * COST.head_dim * COST.num_heads_q * l * (l + 1) // 2
               for lens in doc_lens_per_rank for l in lens)


def rank_flops(doc_lens_per_rank):
    return [sum(FPP * l * (l + 1) // 2 for l in lens) for lens in doc_lens_per_rank]


def lpt_loads(doc_lens_per_rank, num_servers):
    """Dedicated mode's initial placement: longest first, to the least-loaded server."""
    docs = sorted(((l, g) for g, l in enumerate(x for lens in doc_lens_per_rank for x in lens)),
                  key=lambda t: (-t[0], t[1]))
    heap = [(0, s) for s in range(num_servers)]
    loads = [0] * num_servers
    for l, _ in docs:
        load, s = heapq.heappop(heap)
        loads[s] = load + FPP * l * (l + 1) // 2
        heapq.heappush(heap, (loads[s], s))
    return loads


def quantum(doc_lens_per_rank, min_shard):
    """Largest indivisible piece of work (FLOPs) the planner may have to move."""
    q = 0
    for lens in doc_lens_per_rank:
        for l in lens:
            if (l + 1) // 2 < 2 * min_shard:
                q = max(q, FPP * l * (l + 1) // 2)
            else:
                q = max(q, min_shard * (l + 1) * FPP)
    return q


def expected_comm(plan):
    """comm_bytes recomputed from the tasks: Q rows per task, KV rows once per (server, doc)."""
    def off(server, rank):
        return plan.mode == "dedicated" or server != rank

    q_rows = 0
    kv_end = {}
    for s, tasks in enumerate(plan.server_tasks):
        for t in tasks:
            if off(s, t.src_rank):
                q_rows += t.q_end - t.q_start
                key = (s, t.src_rank, t.doc_index)
                kv_end[key] = max(kv_end.get(key, 0), t.kv_end)
    return q_rows, sum(kv_end.values())


def check_comm(plan):
    q_rows, kv_rows = expected_comm(plan)
    cost = plan.cost
    comm = plan.comm_bytes()
    fwd_names = ("q", "k", "v", "out", "lse")
    # kept activations: the backward round sends dO, plus O and LSE for the query rows of split
    # tasks only, of which these plans (partial_kv=False) have none
    bwd_names = (("dout", "out", "lse", "dq", "dk", "dv") if plan.keep_activations
                 else ("q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv"))
    for kind, names in (("forward", fwd_names), ("backward", bwd_names)):
        assert set(comm[kind]) == set(names) | {"total"}
        for n in names:
            rows = kv_rows if n in ("k", "v", "dk", "dv") else q_rows
            if kind == "backward" and plan.keep_activations and n in ("out", "lse"):
                rows = 0
            assert comm[kind][n] == rows * cost.bytes_per_token(n), (kind, n)
        assert comm[kind]["total"] == sum(comm[kind][n] for n in names)
    return q_rows, kv_rows


def step_bytes(plan):
    comm = plan.comm_bytes()
    return comm["forward"]["total"] + comm["backward"]["total"]


# ---- properties of plan_batch --------------------------------------------------------------------
@settings(max_examples=examples(450), deadline=None)
@given(args=batches())
def test_every_causal_pair_covered_once(args):
    plan = run(args)
    check_coverage(plan, args["doc_lens_per_rank"])
    assert plan.doc_lens_per_rank == args["doc_lens_per_rank"]
    assert plan.mode == args["mode"] and plan.num_servers == args["num_servers"]


@settings(max_examples=examples(450), deadline=None)
@given(args=batches())
def test_loads_conserved_and_max_never_worse(args):
    plan = run(args)
    lens = args["doc_lens_per_rank"]
    loads = plan.server_loads()
    assert len(loads) == args["num_servers"]
    assert sum(loads) == total_flops(lens)
    # loads recomputed from the tasks
    mine = [sum(FPP * (t.q_end - t.q_start) * (t.q_start + t.q_end + 1) // 2 for t in tasks)
            for tasks in plan.server_tasks]
    assert loads == mine
    if args["mode"] == "inplace":
        assert max(loads) <= max(rank_flops(lens))
        assert plan.rank_loads() == rank_flops(lens)
    else:
        assert max(loads) <= max(lpt_loads(lens, args["num_servers"]))


def check_balance(args, plan):
    loads = plan.server_loads()
    total = sum(loads)
    if total == 0:
        event("balance: empty batch")
        return False
    mean = total / args["num_servers"]
    eps = args["epsilon"]
    if quantum(args["doc_lens_per_rank"], args["min_shard"]) <= eps * mean:
        event("balance: guarantee applies")
        if max(rank_flops(args["doc_lens_per_rank"])) > (1 + eps) * mean or args["mode"] == "dedicated":
            event("balance: guarantee applies and balancing was needed")
        assert max(loads) <= (1 + eps) * mean * (1 + 1e-9), (max(loads) / mean, eps)
        return True
    event("balance: pieces too coarse for the guarantee")
    return False


@settings(max_examples=examples(450), deadline=None)
@given(args=batches())
def test_balance_guarantee(args):
    check_balance(args, run(args))


LONG = st.one_of(st.integers(1500, 5000), st.integers(1, 3), st.integers(4, 200))


@settings(max_examples=examples(300), deadline=None)
@given(args=batches(max_docs=6, length=LONG, min_shards=(1, 16)))
def test_balance_guarantee_long_documents(args):
    """Few long documents and small shards: the regime where the guarantee applies."""
    check_balance(args, run(args))


def test_balance_guarantee_applies_often():
    """Seeded skewed batches: the guarantee's condition must hold (and balancing be needed) in
    most of them, so the property above is really exercised."""
    rng = random.Random(1234)
    applied = needed = 0
    n = 120
    for _ in range(n):
        num_ranks = rng.randint(4, 12)
        lens = [[rng.choice([rng.randint(2000, 5000), rng.randint(1, 3), rng.randint(4, 400)])
                 for _ in range(rng.randint(0, 8))] for _ in range(num_ranks)]
        lens[rng.randrange(num_ranks)].append(rng.randint(4000, 5000))  # at least one long doc
        mode = rng.choice(["inplace", "dedicated"])
        args = dict(doc_lens_per_rank=lens, mode=mode,
                    num_servers=num_ranks if mode == "inplace" else rng.randint(2, 12),
                    epsilon=rng.choice([0.05, 0.1, 0.2, rng.uniform(0.02, 0.5)]),
                    min_shard=rng.choice([1, 16]))
        plan = run(args)
        if check_balance(args, plan):
            applied += 1
            needed += plan.imbalance()[0] > 1 + args["epsilon"]
    assert applied >= 0.7 * n, applied
    assert needed >= 0.4 * n, needed


@settings(max_examples=examples(180), deadline=None)
@given(args=batches())
def test_deterministic(args):
    a, b = run(args), run(args)
    assert a == b
    assert a.to_msgpack() == b.to_msgpack()
    # the input is not modified
    assert a.doc_lens_per_rank == args["doc_lens_per_rank"]


@settings(max_examples=examples(450), deadline=None)
@given(args=batches())
def test_min_shard(args):
    plan = run(args)
    ms = args["min_shard"]
    for (r, i), entries in tasks_by_doc(plan).items():
        l = args["doc_lens_per_rank"][r][i]
        if l < ms or (l + 1) // 2 < 2 * ms:  # too short to split (planner docstring, (c))
            assert len(entries) == 1, (l, ms, entries)
        if len(entries) > 1:
            event("min_shard: a document was split")
            for _, t in entries:
                assert t.q_end - t.q_start >= ms, (l, ms, entries)


@settings(max_examples=examples(450), deadline=None)
@given(args=batches())
def test_comm_bytes_recomputed(args):
    plan = run(args)
    q_rows, kv_rows = check_comm(plan)
    if args["mode"] == "inplace":
        # an unsplit document that stays home moves nothing
        moved = {(t.src_rank, t.doc_index) for s, ts in enumerate(plan.server_tasks)
                 for t in ts if s != t.src_rank}
        if not moved:
            assert q_rows == kv_rows == 0
            assert step_bytes(plan) == 0
    else:
        assert q_rows == sum(map(sum, args["doc_lens_per_rank"]))


def test_comm_bytes_hand_case():
    # rank 0: one 1000-token document, rank 1: nothing; eps 0 splits it in half by FLOPs.
    plan = plan_batch([[1000], []], 2, cost=COST, epsilon=0.0, min_shard=1)
    check_coverage(plan)
    loads = plan.server_loads()
    assert loads[0] == loads[1] == FPP * 1000 * 1001 // 4
    moved = plan.server_tasks[1]
    assert len(moved) >= 1 and all(t.src_rank == 0 for t in moved)
    q_rows = sum(t.q_len for t in moved)
    kv_rows = max(t.kv_end for t in moved)
    comm = plan.comm_bytes()
    assert comm["forward"]["q"] == q_rows * 32 * 128 * 2
    assert comm["forward"]["k"] == kv_rows * 8 * 128 * 2
    assert comm["forward"]["lse"] == q_rows * 32 * 4
    assert comm["backward"]["dk"] == kv_rows * 8 * 128 * 2
    assert plan.imbalance() == (2.0, 1.0)


# ---- hand cases ------------------------------------------------------------------------------------
def test_single_document_single_server():
    plan = plan_batch([[10]], 1, cost=COST)
    assert plan.server_tasks == [[CATask(0, 0, 0, 10, 0, 10)]]
    assert plan.imbalance() == (1.0, 1.0)
    assert step_bytes(plan) == 0
    dedicated = plan_batch([[10]], 1, cost=COST, mode="dedicated")
    assert dedicated.server_tasks == [[CATask(0, 0, 0, 10, 0, 10)]]
    assert dedicated.comm_bytes()["forward"]["q"] == 10 * COST.bytes_per_token("q")


def test_empty_ranks_and_empty_batch():
    plan = plan_batch([[], []], 2, cost=COST)
    assert plan.server_tasks == [[], []]
    assert plan.server_loads() == [0.0, 0.0]
    assert plan.imbalance() == (1.0, 1.0)
    assert step_bytes(plan) == 0
    plan = plan_batch([[], [7, 1, 1], []], 3, cost=COST, epsilon=0.0, min_shard=1)
    check_coverage(plan)


def test_one_document_fills_the_batch():
    plan = plan_batch([[40_000], [], [], []], 4, cost=COST, epsilon=0.05, min_shard=128)
    check_coverage(plan)
    before, after = plan.imbalance()
    assert before == 4.0 and after <= 1.05
    check_comm(plan)


def test_tiny_documents_never_split():
    lens = [[1] * 50 + [2, 3], [1], [3, 3, 3], []]
    plan = plan_batch(lens, 4, cost=COST, epsilon=0.0, min_shard=1)
    check_coverage(plan)
    assert all(t.q_start == 0 and t.q_end == lens[t.src_rank][t.doc_index]
               for ts in plan.server_tasks for t in ts)


def test_large_epsilon_moves_nothing():
    lens = [[3000, 5], [17], [1, 1, 1]]
    plan = plan_batch(lens, 3, cost=COST, epsilon=1e6)
    assert plan.server_tasks == no_balance(lens, 3, cost=COST).server_tasks
    assert step_bytes(plan) == 0


# ---- argument validation ----------------------------------------------------------------------------
@pytest.mark.parametrize("lens, servers, kwargs, match", [
    ([[5, -1]], 1, {}, r"-1"),
    ([[0]], 1, {}, r"\[0\]"),
    ([[4], [3, 0]], 2, {}, r"rank 1.*\[0\]"),
    ([[2.5]], 1, {}, r"2\.5"),
    ([["3"]], 1, {}, r"'3'"),
    ([[True]], 1, {}, r"True"),
    ([[None]], 1, {}, r"None"),
    ([[4], [5]], 3, {}, r"num_servers=3"),
    ([[4], [5]], 1, {"mode": "inplace"}, r"num_servers=1"),
    ([[4]], 1, {"mode": "foo"}, r"'foo'"),
    ([[4]], 1, {"mode": None}, r"None"),
    ([[4]], 1, {"epsilon": -0.1}, r"-0\.1"),
    ([[4]], 1, {"epsilon": float("nan")}, r"nan"),
    ([[4]], 1, {"epsilon": float("inf")}, r"inf"),
    ([[4]], 1, {"epsilon": "0.05"}, r"'0\.05'"),
    ([[4]], 1, {"min_shard": 0}, r"min_shard.*0"),
    ([[4]], 1, {"min_shard": -3}, r"-3"),
    ([[4]], 1, {"min_shard": 1.5}, r"1\.5"),
    ([[4]], 1, {"min_shard": 2**63}, r"min_shard must be a positive int at most 2\*\*63 - 1"),  # was OverflowError
    ([[4]], 1, {"window": 2**63}, r"window must be a positive int up to 2\*\*63 - 1"),
    ([[4]], 0, {"mode": "dedicated"}, r"num_servers.*0"),
    ([[4]], 2.0, {"mode": "dedicated"}, r"2\.0"),
    ([[4]], 2**20 + 1, {"mode": "dedicated"}, r"num_servers must be an int in \[1, 1048576\], got 1048577"),
    ([[4]], 1, {"cost": "llama"}, r"str"),
    ([], 1, {}, r"non-empty"),
])
def test_plan_batch_rejects(lens, servers, kwargs, match):
    kwargs = {"cost": COST, **kwargs}
    with pytest.raises(ValueError, match=match):
        plan_batch(lens, servers, **kwargs)


@pytest.mark.parametrize("lens", [[5], [None], [[3], 7]])
def test_plan_batch_rejects_non_list_rank(lens):
    with pytest.raises(ValueError):
        plan_batch(lens, len(lens), cost=COST)
