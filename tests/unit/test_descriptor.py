"""The descriptor envelope (scheduler/descriptor.py) and the plan's wire format on it: round trips,
Plan's refusals of bad arguments, version and count checks, many ranks and long documents; the shared
argument checks (scheduler/checks.py). The base plans and map helpers here are shared with
test_descriptor_malformed.py (1,000 malformed messages, bit-flip fuzzing)."""

import math
import os
import time

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import CATask, CostModel, Plan, plan_batch
from scheduler.baselines import no_balance, per_doc_cp, wlb_packing

SCALE = float(os.environ.get("DISTCA_HYPOTHESIS_SCALE", "1"))
COST = CostModel(num_heads_q=32, num_heads_kv=8, head_dim=128, dtype_bytes=2)
I64 = np.dtype("<i8")
KEYS = ("format", "version", "mode", "num_servers", "epsilon", "min_shard", "window", "keep_activations",
        "cost",
        "doc_counts", "doc_lens", "task_counts", "tasks")


def examples(n):
    return max(1, int(n * SCALE))


# ---- round trips ------------------------------------------------------------------------------
LENGTH = st.one_of(st.integers(1, 3), st.integers(1, 400), st.integers(1, 5000))


@st.composite
def plans(draw):
    num_ranks = draw(st.integers(1, 10))
    lens = draw(st.lists(st.lists(LENGTH, max_size=12), min_size=num_ranks, max_size=num_ranks))
    mode = draw(st.sampled_from(["inplace", "dedicated"]))
    servers = num_ranks if mode == "inplace" else draw(st.integers(1, 10))
    cost = draw(st.sampled_from([COST, CostModel(num_heads_q=6, num_heads_kv=3, head_dim=5, dtype_bytes=8),
                                 CostModel(num_heads_q=1, num_heads_kv=1, head_dim=1, dtype_bytes=1)]))
    kind = draw(st.sampled_from(["plan_batch", "no_balance", "per_doc_cp", "wlb_packing"]))
    if kind == "plan_batch":
        eps = draw(st.one_of(st.sampled_from([0.0, 0.05, 0.2]),
                             st.floats(0, 10, allow_nan=False, allow_infinity=False)))
        return plan_batch(lens, servers, cost=cost, epsilon=eps, mode=mode,
                          min_shard=draw(st.sampled_from([1, 16, 128])),
                          window=draw(st.sampled_from([None, None, 1, 7, 128, 4096])))
    if kind == "no_balance":
        return no_balance(lens, servers, cost=cost, mode=mode)
    if kind == "per_doc_cp":
        return per_doc_cp(lens, servers, cost=cost, mode=mode)
    if not any(lens):  # wlb_packing rejects a batch with no documents (see test_planner_baselines.py)
        lens[0].append(1)
    return wlb_packing(lens, num_ranks, cost=cost)


@settings(max_examples=examples(300), deadline=None)
@given(plan=plans())
def test_round_trip(plan):
    data = plan.to_msgpack()
    assert isinstance(data, bytes)
    back = Plan.from_msgpack(data)
    assert back == plan
    assert back.server_tasks == plan.server_tasks
    assert back.epsilon == plan.epsilon and back.cost == plan.cost
    assert all(type(t) is CATask for tasks in back.server_tasks for t in tasks)
    assert back.to_msgpack() == data
    # bytearray and memoryview are accepted too
    assert Plan.from_msgpack(bytearray(data)) == plan
    assert Plan.from_msgpack(memoryview(data)) == plan


def test_round_trip_large_plan():
    rng = np.random.default_rng(0)
    lens = [rng.integers(1, 20_000, size=rng.integers(0, 40)).tolist() for _ in range(64)]
    for plan in (plan_batch(lens, 64, cost=COST), per_doc_cp(lens, 64, cost=COST)):
        assert Plan.from_msgpack(plan.to_msgpack()) == plan


# ---- base plans and map helpers (shared with test_descriptor_malformed.py) -------------------------
def base_plans():
    rng = np.random.default_rng(42)
    out = [
        plan_batch([[3000, 17, 1], [], [5, 900]], 3, cost=COST, epsilon=0.0, min_shard=16),
        plan_batch([[2000, 3], [1]], 4, cost=COST, epsilon=0.05, mode="dedicated", min_shard=1),
        per_doc_cp([[300, 7], [41]], 3, cost=COST, mode="dedicated"),
        no_balance([[5, 6], [7], [8, 9, 10]], 3, cost=CostModel(num_heads_q=6, num_heads_kv=3,
                                                               head_dim=5, dtype_bytes=8)),
        wlb_packing([[100, 100, 3], [1000], [50]], 3, cost=COST),
    ]
    lens = [rng.integers(1, 3000, size=rng.integers(1, 6)).tolist() for _ in range(6)]
    out.append(plan_batch(lens, 6, cost=COST, epsilon=0.0, min_shard=8))
    for p in out:
        assert p.task_array.size > 0
    return out


def decode_map(plan):
    return msgpack.unpackb(plan.to_msgpack(), raw=False)


def pack(obj):
    return msgpack.packb(obj, use_bin_type=True)


def ints(obj, key):
    return np.frombuffer(obj[key], dtype=I64).copy()


def put(obj, key, arr):
    obj[key] = np.asarray(arr, dtype=I64).tobytes()
    return obj


def tasks_of(obj):
    return ints(obj, "tasks").reshape(-1, 6)  # src_rank, doc, q_start, q_end, kv_start, kv_end


# ---- Plan constructed directly ---------------------------------------------------------------------
def T(*x):
    return CATask(*x)


GOOD = dict(doc_lens_per_rank=[[4], [3]], num_servers=2, mode="inplace", cost=COST,
            server_tasks=[[T(0, 0, 0, 4, 0, 4)], [T(1, 0, 0, 3, 0, 3)]])


@pytest.mark.parametrize("change, match", [
    (dict(mode="foo"), "mode"),
    (dict(cost="llama"), "cost"),
    (dict(num_servers=0), "num_servers"),
    (dict(num_servers=True), "num_servers"),
    (dict(num_servers=2.0), "num_servers"),
    (dict(num_servers=3, server_tasks=[[], [], []]), "inplace"),
    (dict(epsilon=-0.1), "epsilon"),
    (dict(epsilon=math.nan), "epsilon"),
    (dict(epsilon=math.inf), "epsilon"),
    (dict(epsilon="0"), "epsilon"),
    (dict(doc_lens_per_rank=[]), "non-empty"),
    (dict(doc_lens_per_rank="ab"), "non-empty"),
    (dict(doc_lens_per_rank=[[4], [0]]), r"rank 1"),
    (dict(doc_lens_per_rank=[[4], [-3]]), r"-3"),
    (dict(doc_lens_per_rank=[[4], [3.0]]), r"rank 1"),
    (dict(doc_lens_per_rank=[[4], [True]]), r"rank 1"),
    (dict(doc_lens_per_rank=[[4], 3]), r"doc_lens_per_rank\[1\]"),
    (dict(doc_lens_per_rank=[[4], [2**70]]), r"rank 1"),
    (dict(server_tasks=[[T(0, 0, 0, 4, 0, 4)]]), "one list per server"),
    (dict(server_tasks="xy"), "one list per server"),
    (dict(server_tasks=[[T(0, 0, 0, 4, 0, 4)], T(1, 0, 0, 3, 0, 3)]), "six ints"),
    (dict(server_tasks=[[T(0, 0, 0, 4, 0, 4)], 5]), "not a list"),
    (dict(server_tasks=[[(0, 0, 0, 4, 0)], [T(1, 0, 0, 3, 0, 3)]]), "six ints"),
    (dict(server_tasks=[[(0, 0, 0, 4.0, 0, 4)], [T(1, 0, 0, 3, 0, 3)]]), "six ints"),
    (dict(server_tasks=[[(0, 0, 0, 4, 0, 2**63)], [T(1, 0, 0, 3, 0, 3)]]), "int64"),
    (dict(server_tasks=[[T(0, 0, 0, 4, 0, 4)], [T(2, 0, 0, 3, 0, 3)]]), "src_rank"),
    (dict(server_tasks=[[T(0, 0, 0, 4, 0, 4)], [T(-1, 0, 0, 3, 0, 3)]]), "src_rank"),
    (dict(server_tasks=[[T(0, 0, 0, 4, 0, 4)], [T(1, 1, 0, 3, 0, 3)]]), "does not have"),
    (dict(server_tasks=[[T(0, 0, 0, 4, 0, 4)], [T(1, 0, 0, 3, 1, 3)]]), "tile its keys"),
    (dict(server_tasks=[[T(0, 0, 0, 4, 0, 4)], [T(1, 0, 0, 3, 0, 2)]]), "tile its keys"),
    (dict(server_tasks=[[T(0, 0, 0, 5, 0, 5)], [T(1, 0, 0, 3, 0, 3)]]), "not a CA-task inside"),
    (dict(server_tasks=[[T(0, 0, 2, 2, 0, 2)], [T(1, 0, 0, 3, 0, 3)]]), "not a CA-task inside"),
    (dict(server_tasks=[[T(0, 0, 0, 4, 0, 3)], [T(1, 0, 0, 3, 0, 4)]]), "not a CA-task inside"),
    # partial-KV: keys of one shard split with a gap, with an overlap, or past the diagonal
    (dict(server_tasks=[[T(0, 0, 0, 4, 0, 1)], [T(0, 0, 0, 4, 2, 4), T(1, 0, 0, 3, 0, 3)]]),
     "tile its keys"),
    (dict(server_tasks=[[T(0, 0, 0, 4, 0, 2)], [T(0, 0, 0, 4, 1, 4), T(1, 0, 0, 3, 0, 3)]]),
     "tile its keys"),
    (dict(server_tasks=[[T(0, 0, 2, 4, 0, 2), T(0, 0, 0, 2, 0, 2)], [T(0, 0, 2, 4, 2, 4), T(1, 0, 0, 3, 0, 3)]],
          min_shard=2), None),
    (dict(server_tasks=[[T(0, 0, 2, 4, 0, 1), T(0, 0, 0, 2, 0, 2)], [T(0, 0, 2, 4, 1, 4), T(1, 0, 0, 3, 0, 3)]],
          min_shard=2), "key pieces shorter than min_shard=2"),
    (dict(server_tasks=[[T(0, 0, 0, 4, 0, 4)], [T(0, 0, 0, 2, 0, 2), T(1, 0, 0, 3, 0, 3)]]),
     "query ranges overlap without being equal"),
    (dict(server_tasks=[[T(0, 0, 0, 4, 0, 4)], []]), "no task"),
    (dict(server_tasks=[[T(0, 0, 0, 4, 0, 4)], [T(1, 0, 1, 3, 0, 3)]]), "does not start at 0"),
    (dict(server_tasks=[[T(0, 0, 0, 2, 0, 2)], [T(1, 0, 0, 3, 0, 3)]]), "stop before the end"),
    (dict(server_tasks=[[T(0, 0, 0, 2, 0, 2), T(0, 0, 3, 4, 0, 4)], [T(1, 0, 0, 3, 0, 3)]]),
     "overlapping or missing"),
    (dict(server_tasks=[[T(0, 0, 0, 3, 0, 3)], [T(0, 0, 2, 4, 0, 4), T(1, 0, 0, 3, 0, 3)]]),
     "overlapping or missing"),
    (dict(server_tasks=[[T(0, 0, 0, 4, 0, 4)], [T(0, 0, 0, 4, 0, 4), T(1, 0, 0, 3, 0, 3)]]),
     "tile its keys"),
    (dict(server_tasks=[[T(0, 0, 0, 1, 0, 1)], [T(0, 0, 1, 4, 0, 4), T(1, 0, 0, 3, 0, 3)]], min_shard=2),
     r"shorter than min_shard=2: \(rank 0, doc 0\)"),
    # a CATask holding a float or a str was truncated by the int64 cast (found by a review)
    (dict(server_tasks=[[T(0, 0, 0, 4.7, 0, 4)], [T(1, 0, 0, 3, 0, 3)]]), "six ints"),
    (dict(server_tasks=[[T(0, 0, 0, 4, 0, "4")], [T(1, 0, 0, 3, 0, 3)]]), "six ints"),
    (dict(min_shard=0), "min_shard"),
    (dict(min_shard=True), "min_shard"),
    (dict(min_shard=2**63), r"min_shard must be a positive int at most 2\*\*63 - 1"),  # was kept, then refused by from_msgpack
    (dict(window=2**63), "window must be a positive int up to 2"),
    (dict(window=0), "window must be a positive int"),
    (dict(window=2.5), "window must be a positive int"),
    (dict(window=True), "window must be a positive int"),
    # window 2: the shard [2, 3) needs keys [1, 3), not the prefix [0, 3)
    (dict(server_tasks=[[T(0, 0, 0, 4, 0, 4)], [T(1, 0, 0, 2, 0, 2), T(1, 0, 2, 3, 0, 3)]], window=2),
     "tile its keys"),
    (dict(doc_lens_per_rank=[[2**62, 2**62], [3]]), r"rank 0: documents of 9223372036854775808 tokens"),
])
def test_plan_rejects(change, match):
    """Every bad argument, task set or window is a ValueError naming it."""
    Plan(**GOOD)  # the unchanged arguments are valid
    if match is None:  # a valid variation (a shard split on the key axis)
        plan = Plan(**{**GOOD, **change})
        assert Plan.from_msgpack(plan.to_msgpack()) == plan
        return
    with pytest.raises(ValueError, match=match):
        Plan(**{**GOOD, **change})


def test_plan_sorts_tasks_into_wire_order():
    tasks = [[T(1, 0, 0, 3, 0, 3), T(0, 0, 2, 4, 0, 4)], [T(0, 0, 0, 2, 0, 2)]]
    plan = Plan(doc_lens_per_rank=[[4], [3]], num_servers=2, mode="dedicated", cost=COST,
                server_tasks=tasks)
    assert plan.server_tasks[0] == [T(0, 0, 2, 4, 0, 4), T(1, 0, 0, 3, 0, 3)]
    assert Plan.from_msgpack(plan.to_msgpack()) == plan


# ---- type-strict version and overflow-proof counts ----------------------------------------------
@pytest.mark.parametrize("version", [True, 1, 2, 3.0])
def test_version_must_be_the_int_3(version):
    """Version 2 added ``min_shard``, version 3 ``window`` and ``keep_activations``; an older plan
    (or a float or bool 3) is refused."""
    obj = decode_map(base_plans()[0])
    obj["version"] = version
    with pytest.raises(ValueError):
        Plan.from_msgpack(pack(obj))


def test_counts_that_overflow_int64_are_rejected():
    plan = Plan(doc_lens_per_rank=[[9], [], [9]], num_servers=1, mode="dedicated", cost=COST,
                server_tasks=[[T(0, 0, 0, 9, 0, 9), T(2, 0, 0, 9, 0, 9)]])
    obj = decode_map(plan)
    # three ranks claiming 2^63-1, 2^63-1 and 3 documents: the int64 sum wraps to 1
    put(obj, "doc_counts", [2**63 - 1, 2**63 - 1, 3])
    put(obj, "doc_lens", [9])
    with pytest.raises(ValueError):
        Plan.from_msgpack(pack(obj))


# ---- the one envelope, shared by Plan and PlanPart ------------------------------------------------------
def test_plan_and_part_share_the_envelope():
    from scheduler import descriptor
    from scheduler.parts import PlanPart, plan_part
    plan = base_plans()[0]
    part = plan_part(plan, 0)
    for data, other in ((plan.to_msgpack(), PlanPart.from_msgpack), (part.to_msgpack(), Plan.from_msgpack)):
        obj = msgpack.unpackb(data, raw=False)
        assert (obj["format"], obj["version"]) in (("distca.plan", 3), ("distca.part", 2))
        with pytest.raises(ValueError, match="must be a map with keys"):
            other(data)  # one kind of descriptor is never read as the other
    for decode, what in ((Plan.from_msgpack, "plan"), (PlanPart.from_msgpack, "part")):
        with pytest.raises(ValueError, match=f"{what} descriptor must be bytes, got str"):
            decode("abc")
        with pytest.raises(ValueError, match=f"{what} descriptor is not valid msgpack: ExtraData"):
            decode((plan if what == "plan" else part).to_msgpack() + b"\x00")
    obj = decode_map(plan)
    obj["cost"] = [4, 3, 8, 2]
    with pytest.raises(ValueError, match=r"field 'cost': num_heads_q=4 is not a multiple of num_heads_kv=3"):
        Plan.from_msgpack(pack(obj))
    assert obj.keys() == set(KEYS) and len(descriptor.int_bin([1, 2])) == 16


def test_size_limit_before_unpacking(monkeypatch):
    from scheduler import descriptor
    data = base_plans()[0].to_msgpack()
    monkeypatch.setattr(descriptor, "MAX_BYTES", len(data) - 1)
    with pytest.raises(ValueError, match=f"plan descriptor of {len(data)} bytes exceeds {len(data) - 1}"):
        Plan.from_msgpack(data)


# ---- the shared argument checks ------------------------------------------------------------------
def test_checks():
    from scheduler.checks import (bad_lengths, finite_nonnegative, int_in_range, is_int, is_number,
                                  positive_int)
    assert all(is_int(x) for x in (0, -3, np.int64(5), np.uint8(1), 2**70))
    assert not any(is_int(x) for x in (True, np.bool_(False), 1.0, "1", None, np.float32(2)))
    assert all(is_number(x) for x in (0, 1.5, np.float32(2), np.int16(3), math.inf))
    assert not any(is_number(x) for x in (True, "1", None, [1]))
    assert positive_int("n", np.int64(3)) == 3 and type(positive_int("n", np.int64(3))) is int
    for bad in (0, -1, True, 1.0, "2"):
        with pytest.raises(ValueError, match=f"n must be a positive int, got {bad!r}"):
            positive_int("n", bad)
    assert int_in_range("k", 5, 0, 5) == 5
    with pytest.raises(ValueError, match=r"k must be an int in \[0, 4\], got 5"):
        int_in_range("k", 5, 0, 4)
    assert finite_nonnegative("eps", 0) == 0.0
    for bad in (-0.1, math.nan, math.inf, True, "0.1", None):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            finite_nonnegative("eps", bad)
    # the fast path (all plain ints) and the slow path agree on what is a token count
    assert bad_lengths([]) == [] and bad_lengths([1, 2**63 - 1]) == [] and bad_lengths((3, np.int64(4))) == []
    assert bad_lengths([3, 0, -2, 2**63, 2.0, True, "4", None, np.int32(-1)]) == [0, -2, 2**63, 2.0, True, "4",
                                                                                  None, np.int32(-1)]


# ---- many ranks, long documents -------------------------------------------------------------------
def test_decode_is_vectorised_over_ranks():
    """A million ranks, nearly all empty: decoding has no Python loop over ranks (it took 7.3 s)."""
    small = plan_batch([[300, 5], [41], [7]], 4, cost=COST, mode="dedicated", min_shard=16)
    obj = decode_map(small)
    ranks = 1_000_000
    counts = np.zeros(ranks, dtype=np.int64)
    counts[[0, 500_000, ranks - 1]] = [2, 1, 1]
    tasks = tasks_of(obj)
    tasks[:, 0] = np.array([0, 500_000, ranks - 1])[tasks[:, 0]]  # ranks 0, 1, 2 -> spread out
    put(obj, "doc_counts", counts)
    put(obj, "tasks", tasks)
    data = pack(obj)
    start = time.process_time()  # CPU time: a busy machine cannot fail it
    plan = Plan.from_msgpack(data)
    elapsed = time.process_time() - start
    assert elapsed < 1.0, elapsed  # about 0.02 s; the per-rank loop took 7.3 s
    assert plan.num_ranks == ranks and plan.num_participants == ranks + 4
    assert np.array_equal(plan.doc_counts, counts) and plan.doc_lens_flat.tolist() == [300, 5, 41, 7]
    assert Plan.from_msgpack(plan.to_msgpack()) == plan
    assert plan.server_loads() == small.server_loads()
    # a bad length on the last rank is found and named as quickly
    put(obj, "doc_lens", [300, 5, 41, 0])
    data = pack(obj)
    start = time.process_time()  # CPU time, as above: a busy machine cannot fail it
    with pytest.raises(ValueError, match=r"rank 999999: document lengths must be positive ints, got \[0\]"):
        Plan.from_msgpack(data)
    assert time.process_time() - start < 1.0


def test_long_documents_round_trip_with_exact_loads():
    """Documents past 3e9 tokens: pairs pass int64, and the decoded plan's loads stay right."""
    big = 4_000_000_000
    plan = plan_batch([[big], [], [5]], 3, cost=COST, epsilon=0.1, min_shard=128)
    back = Plan.from_msgpack(plan.to_msgpack())
    assert back == plan
    loads = back.server_loads()
    exact = (big * (big + 1) // 2 + 15) * COST.flops_per_pair
    assert min(loads) > 0 and sum(loads) == pytest.approx(exact, rel=1e-12)
    assert back.imbalance()[1] <= 1.1 * (1 + 1e-9)


def test_rank_token_totals_must_fit_int64():
    plan = Plan(doc_lens_per_rank=[[9], [9]], num_servers=2, mode="inplace", cost=COST,
                server_tasks=[[T(0, 0, 0, 9, 0, 9)], [T(1, 0, 0, 9, 0, 9)]])
    obj = decode_map(plan)
    put(obj, "doc_counts", [1, 2])
    put(obj, "doc_lens", [9, 2**62, 2**62])
    put(obj, "tasks", [[0, 0, 0, 9, 0, 9], [1, 0, 0, 2**62, 0, 2**62], [1, 1, 0, 2**62, 0, 2**62]])
    put(obj, "task_counts", [1, 2])
    with pytest.raises(ValueError, match="rank 1: documents of 9223372036854775808 tokens in all"):
        Plan.from_msgpack(pack(obj))
    with pytest.raises(ValueError, match="rank 1: documents of"):
        plan_batch([[9], [2**62, 2**62]], 2, cost=COST)


def test_windowed_plan_round_trip_and_window_in_the_descriptor():
    plan = Plan(doc_lens_per_rank=[[4], [3]], num_servers=2, mode="inplace", cost=COST, window=2,
                server_tasks=[[T(0, 0, 0, 4, 0, 4)], [T(1, 0, 0, 2, 0, 2), T(1, 0, 2, 3, 1, 3)]])
    obj = decode_map(plan)
    assert obj["window"] == 2 and obj["version"] == 3
    back = Plan.from_msgpack(plan.to_msgpack())
    assert back == plan and back.window == 2
    # the same tasks without the window: plans differ, and the descriptor refuses the pair
    obj["window"] = None
    with pytest.raises(ValueError, match="tile its keys"):
        Plan.from_msgpack(pack(obj))
