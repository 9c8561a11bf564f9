"""causal_pairs and CostModel: FLOPs and bytes of CA-tasks, checked against brute force."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cost import (
    BACKWARD_FLOPS_FACTOR,
    KV_TENSORS,
    RoundKind,
    CostModel,
    causal_pairs,
)


def brute_pairs(q_start, q_end, kv_start, kv_end):
    """Count (i, j) with the bottom-right rule, straight from its definition."""
    q_len, kv_len = q_end - q_start, kv_end - kv_start
    n = 0
    for i in range(q_start, q_end):
        for j in range(kv_start, kv_end):
            if j - kv_start <= (i - q_start) + (kv_len - q_len):
                n += 1
    return n


@settings(max_examples=400, deadline=None)
@given(q_start=st.integers(0, 40), q_len=st.integers(0, 30),
       kv_start=st.integers(0, 40), kv_len=st.integers(0, 30))
def test_causal_pairs_matches_brute_force(q_start, q_len, kv_start, kv_len):
    got = causal_pairs(q_start, q_start + q_len, kv_start, kv_start + kv_len)
    assert got == brute_pairs(q_start, q_start + q_len, kv_start, kv_start + kv_len)
    assert isinstance(got, int)
    assert 0 <= got <= q_len * kv_len


@pytest.mark.parametrize("q, kv", [
    ((0, 0), (0, 0)),      # both empty
    ((0, 5), (0, 0)),      # no keys
    ((3, 3), (0, 10)),     # no queries
    ((0, 10), (0, 4)),     # q_len > kv_len: the first 6 rows see nothing
    ((0, 10), (0, 1)),
    ((0, 1), (0, 1)),
    ((0, 7), (0, 7)),      # square: l (l + 1) / 2
    ((5, 7), (0, 7)),      # full-prefix shard
    ((2, 9), (4, 20)),     # arbitrary offsets
])
def test_causal_pairs_hand_cases(q, kv):
    assert causal_pairs(*q, *kv) == brute_pairs(*q, *kv)


def test_causal_pairs_closed_forms():
    for l in range(0, 50):
        assert causal_pairs(0, l, 0, l) == l * (l + 1) // 2
    # full-prefix shard: sum_{t=q_start}^{q_end-1} (t + 1)
    for qs in range(0, 20):
        for qe in range(qs, 25):
            assert causal_pairs(qs, qe, 0, qe) == sum(t + 1 for t in range(qs, qe))
    # q_len > kv_len: only the last kv_len rows see keys
    assert causal_pairs(0, 10, 0, 4) == 1 + 2 + 3 + 4
    # large values stay exact integers
    l = 10**7
    assert causal_pairs(0, l, 0, l) == l * (l + 1) // 2


def test_causal_pairs_negative_range():
    with pytest.raises(ValueError, match="negative range"):
        causal_pairs(5, 4, 0, 4)
    with pytest.raises(ValueError, match="negative range"):
        causal_pairs(0, 4, 3, 2)


# ---- CostModel ----------------------------------------------------------------------------------
LLAMA8B = dict(num_heads_q=32, num_heads_kv=8, head_dim=128, dtype_bytes=2)


def test_flops_per_pair():
    assert CostModel(**LLAMA8B).flops_per_pair == 4 * 128 * 32
    assert CostModel(num_heads_q=3, num_heads_kv=1, head_dim=5).flops_per_pair == 60


@settings(max_examples=200, deadline=None)
@given(hq=st.sampled_from([1, 2, 4, 6, 32]), hd=st.integers(1, 256),
       qs=st.integers(0, 100), ql=st.integers(0, 100), ks=st.integers(0, 100), kl=st.integers(0, 100))
def test_task_flops(hq, hd, qs, ql, ks, kl):
    cost = CostModel(num_heads_q=hq, num_heads_kv=1, head_dim=hd)
    fwd = cost.task_flops(qs, qs + ql, ks, ks + kl)
    bwd = cost.task_flops(qs, qs + ql, ks, ks + kl, backward=True)
    assert isinstance(fwd, float)
    assert fwd == 4 * hd * hq * causal_pairs(qs, qs + ql, ks, ks + kl)
    assert bwd == pytest.approx(2.5 * fwd, rel=1e-15)
    assert BACKWARD_FLOPS_FACTOR == 2.5


def test_doc_flops():
    cost = CostModel(**LLAMA8B)
    for l in (1, 2, 3, 127, 128, 4097):
        assert cost.doc_flops(l) == 4 * 128 * 32 * l * (l + 1) // 2
        assert cost.doc_flops(l, backward=True) == 2.5 * cost.doc_flops(l)


@pytest.mark.parametrize("dtype_bytes, lse", [(1, 4), (2, 4), (4, 4), (8, 8)])
def test_bytes_per_token(dtype_bytes, lse):
    cost = CostModel(num_heads_q=12, num_heads_kv=4, head_dim=64, dtype_bytes=dtype_bytes)
    assert cost.lse_bytes == lse
    q_row = 12 * 64 * dtype_bytes
    kv_row = 4 * 64 * dtype_bytes
    expect = {"q": q_row, "out": q_row, "dout": q_row, "dq": q_row,
              "k": kv_row, "v": kv_row, "dk": kv_row, "dv": kv_row, "lse": 12 * lse}
    assert set(expect) == set(RoundKind.BACKWARD.tensors)
    for name, n in expect.items():
        assert cost.bytes_per_token(name) == n, name
        assert isinstance(cost.bytes_per_token(name), int)
    assert KV_TENSORS == {"k", "v", "dk", "dv"}
    # step_row_bytes sums one forward and one backward round
    q_step = sum(expect[n] for n in RoundKind.FORWARD.tensors + RoundKind.BACKWARD.tensors if n not in KV_TENSORS)
    kv_step = sum(expect[n] for n in RoundKind.FORWARD.tensors + RoundKind.BACKWARD.tensors if n in KV_TENSORS)
    assert cost.step_row_bytes() == (q_step, kv_step)


@pytest.mark.parametrize("name", ["Q", "o", "dlse", "", "kv", None])
def test_bytes_per_token_unknown(name):
    with pytest.raises(ValueError, match="unknown tensor"):
        CostModel(**LLAMA8B).bytes_per_token(name)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_heads_q=0, num_heads_kv=1, head_dim=8), "num_heads_q"),
    (dict(num_heads_q=4, num_heads_kv=-1, head_dim=8), "num_heads_kv"),
    (dict(num_heads_q=4, num_heads_kv=2, head_dim=0), "head_dim"),
    (dict(num_heads_q=4, num_heads_kv=2, head_dim=8, dtype_bytes=0), "dtype_bytes"),
    (dict(num_heads_q=4, num_heads_kv=2, head_dim=8, dtype_bytes=3), "dtype_bytes"),
    (dict(num_heads_q=4, num_heads_kv=2, head_dim=8, dtype_bytes=16), "dtype_bytes"),
    (dict(num_heads_q=4.0, num_heads_kv=2, head_dim=8), "num_heads_q"),
    (dict(num_heads_q=True, num_heads_kv=1, head_dim=8), "num_heads_q"),
    (dict(num_heads_q=4, num_heads_kv=2, head_dim="8"), "head_dim"),
    (dict(num_heads_q=32, num_heads_kv=7, head_dim=128), "not a multiple"),
    (dict(num_heads_q=4, num_heads_kv=8, head_dim=128), "not a multiple"),
])
def test_cost_model_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CostModel(**kwargs)


def test_cost_model_is_frozen_and_round_trips_dict():
    cost = CostModel(**LLAMA8B)
    assert CostModel(**cost.to_dict()) == cost
    with pytest.raises(AttributeError):
        cost.head_dim = 64  # frozen dataclass
