"""causal_pairs and CostModel: FLOPs and bytes of CA-tasks, checked against brute force."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cost import (
    BACKWARD_FLOPS_FACTOR,
    KV_TENSORS,
    RoundKind,
    CostModel,
    causal_pairs,
    doc_pairs,
    window_arg,
    window_kv_start,
)


def brute_pairs(q_start, q_end, kv_start, kv_end, window=None):
    """Count (i, j) with j <= i (and j >= i - window + 1), positions in the document, straight
    from the definition."""
    n = 0
    for i in range(q_start, q_end):
        for j in range(kv_start, kv_end):
            if j <= i and (window is None or j >= i - window + 1):
                n += 1
    return n


@settings(max_examples=400, deadline=None)
@given(q_start=st.integers(0, 40), q_len=st.integers(0, 30),
       kv_start=st.integers(0, 40), kv_len=st.integers(0, 30),
       window=st.one_of(st.none(), st.integers(1, 45)))
def test_causal_pairs_matches_brute_force(q_start, q_len, kv_start, kv_len, window):
    got = causal_pairs(q_start, q_start + q_len, kv_start, kv_start + kv_len, window)
    assert got == brute_pairs(q_start, q_start + q_len, kv_start, kv_start + kv_len, window)
    assert isinstance(got, int)
    assert 0 <= got <= q_len * kv_len
    # the vectorised form is the same function
    arr = causal_pairs(*(np.array([x], dtype=np.int64) for x in (q_start, q_start + q_len, kv_start,
                                                                 kv_start + kv_len)), window)
    assert arr.tolist() == [got]


@pytest.mark.parametrize("q, kv", [
    ((0, 0), (0, 0)),      # both empty
    ((0, 5), (0, 0)),      # no keys
    ((3, 3), (0, 10)),     # no queries
    ((0, 10), (0, 4)),     # keys [0, 4): rows 0..3 see a prefix, the rest all four
    ((6, 10), (0, 10)),    # kv_end == q_end: the kernels' bottom-right alignment
    ((0, 10), (0, 1)),
    ((0, 1), (0, 1)),
    ((0, 7), (0, 7)),      # square: l (l + 1) / 2
    ((5, 7), (0, 7)),      # full-prefix shard
    ((2, 9), (4, 20)),     # keys past the queries see nothing
    ((10, 20), (0, 5)),    # every pair visible (a partial-KV block of the past)
])
@pytest.mark.parametrize("window", [None, 1, 3, 8, 100])
def test_causal_pairs_hand_cases(q, kv, window):
    assert causal_pairs(*q, *kv, window) == brute_pairs(*q, *kv, window)


def test_causal_pairs_closed_forms():
    for l in range(0, 50):
        assert causal_pairs(0, l, 0, l) == l * (l + 1) // 2 == doc_pairs(l)
        for w in (1, 5, 49, 50, 60):
            want = l * (l + 1) // 2 if l <= w else w * (w + 1) // 2 + (l - w) * w
            assert doc_pairs(l, w) == causal_pairs(0, l, 0, l, w) == want
    # full-prefix shard: sum_{t=q_start}^{q_end-1} (t + 1)
    for qs in range(0, 20):
        for qe in range(qs, 25):
            assert causal_pairs(qs, qe, 0, qe) == sum(t + 1 for t in range(qs, qe))
            # full-window shard: keys from max(0, q_start - W + 1), sum of min(t + 1, W)
            for w in (1, 4, 9):
                assert causal_pairs(qs, qe, window_kv_start(qs, w), qe, w) == sum(
                    min(t + 1, w) for t in range(qs, qe))
    # a window longer than the document changes nothing
    assert causal_pairs(3, 10, 0, 10, 10) == causal_pairs(3, 10, 0, 10, 4096) == causal_pairs(3, 10, 0, 10)
    # large values stay exact integers
    l = 10**7
    assert causal_pairs(0, l, 0, l) == l * (l + 1) // 2
    assert causal_pairs(0, l, 0, l, 4096) == 4096 * 4097 // 2 + (l - 4096) * 4096


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "7", [7]])
def test_window_validation(bad):
    with pytest.raises(ValueError, match="window must be a positive int"):
        window_arg(bad)
    with pytest.raises(ValueError, match="window must be a positive int"):
        causal_pairs(0, 4, 0, 4, bad)
    assert window_arg(None) is None and window_arg(np.int64(5)) == 5


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
