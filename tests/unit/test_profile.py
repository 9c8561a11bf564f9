"""ProfileTable: grid lookup, bilinear interpolation, saturation past the grid, floor below it."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_sim.profile import ProfileTable
from scheduler.cost import CostModel, causal_pairs

Q = [128, 256, 512]
KV = [512, 1024, 2048]
LAT = [[1.0, 2.0, 4.0],
       [3.0, 5.0, 9.0],
       [6.0, 10.0, 20.0]]


@pytest.fixture
def table():
    return ProfileTable(q_lens=Q, kv_lens=KV, latency_s=LAT, meta={"device": "test"})


def work(q, kv):
    return causal_pairs(kv - q, kv, 0, kv)


def test_exact_at_grid_points(table):
    for i, q in enumerate(Q):
        for j, kv in enumerate(KV):
            assert table.latency(q, kv) == LAT[i][j]
    grid_q, grid_kv = np.meshgrid(Q, KV, indexing="ij")
    np.testing.assert_array_equal(table.latencies(grid_q, grid_kv), np.array(LAT))


def test_bilinear_midpoint_by_hand(table):
    # q=192 is halfway 128..256, kv=768 is halfway 512..1024: mean of the four corners.
    assert table.latency(192, 768) == pytest.approx((1.0 + 2.0 + 3.0 + 5.0) / 4)
    # q=384 (w=0.5 in 256..512), kv=1536 (w=0.5 in 1024..2048): (5 + 9 + 10 + 20) / 4 = 11.
    assert table.latency(384, 1536) == pytest.approx(11.0)
    # A quarter of the way along kv only: 1 + 0.25 * (2 - 1).
    assert table.latency(128, 640) == pytest.approx(1.25)
    # A point off-centre in both: q=160 (wq=0.25), kv=896 (wk=0.75).
    wq, wk = 0.25, 0.75
    want = (1 - wq) * ((1 - wk) * 1.0 + wk * 2.0) + wq * ((1 - wk) * 3.0 + wk * 5.0)
    assert table.latency(160, 896) == pytest.approx(want)
    assert float(table.latencies(160, 896)) == pytest.approx(want)


def test_saturation_past_grid_is_pair_ratio(table):
    # kv past the grid, q on it.
    assert table.latency(512, 8192) == pytest.approx(20.0 * work(512, 8192) / work(512, 2048))
    assert table.latency(256, 4096) == pytest.approx(9.0 * work(256, 4096) / work(256, 2048))
    # Both past the grid.
    assert table.latency(1024, 4096) == pytest.approx(20.0 * work(1024, 4096) / work(512, 2048))
    # q past the grid, kv inside it (interpolated at q=512, kv=1536: 15).
    assert table.latency(1024, 1536) == pytest.approx(15.0 * work(1024, 1536) / work(512, 1536))
    # The vectorised path agrees.
    got = table.latencies([512, 256, 1024, 1024], [8192, 4096, 4096, 1536])
    want = [table.latency(512, 8192), table.latency(256, 4096), table.latency(1024, 4096),
            table.latency(1024, 1536)]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_work_closed_form_matches_causal_pairs():
    from distca_sim.profile import _work_np

    qs, kvs = np.meshgrid(np.arange(0, 40), np.arange(0, 40), indexing="ij")
    want = np.array([[causal_pairs(k - q, k, 0, k) for k in range(40)] for q in range(40)])
    np.testing.assert_array_equal(_work_np(qs, kvs), want)


def test_work_past_int64_products_is_rounded_not_wrapped(table):
    """Above 2**31 tokens q·kv leaves int64: the pairs were wrapped (negative seconds for a
    2**33-token document's plan, found by a review); now float64, within its rounding."""
    from distca_sim.profile import _work_np

    for q, kv in ((2**32, 2**32), (2**31 + 1, 2**40), (3, 2**62), (2**62, 2**62)):
        want = float(causal_pairs(kv - q, kv, 0, kv))
        assert _work_np(np.array([q]), np.array([kv]))[0] == pytest.approx(want, rel=1e-15)
    for L in (2**32, 2**40):
        assert table.latencies([L], [L])[0] == pytest.approx(table.latency(L, L), rel=1e-12)
    with pytest.raises(ValueError, match=r"q_lens must hold integers \(int64\), got dtype float64 values \[1.e\+30\]"):
        table.latencies([1e30], [1e30])  # was cast, wrapped, and named as a negative length


def test_floor_below_grid_no_scaling_down(table):
    assert table.latency(1, 1) == 1.0
    assert table.latency(64, 512) == 1.0          # q below the grid: clamped to 128
    assert table.latency(128, 200) == 1.0         # kv below the grid: clamped to 512
    assert table.latency(16, 1024) == 2.0
    # q below the grid and kv past it: floor on q, saturation on kv from the floored point.
    assert table.latency(16, 4096) == pytest.approx(4.0 * work(128, 4096) / work(128, 2048))


def test_zero_query_rows_cost_nothing(table):
    assert table.latency(0, 0) == 0.0
    assert table.latency(0, 5000) == 0.0
    np.testing.assert_array_equal(table.latencies([0, 0], [0, 100]), [0.0, 0.0])


def test_single_point_grid():
    t = ProfileTable(q_lens=[256], kv_lens=[256], latency_s=[[2e-3]])
    assert t.latency(100, 200) == 2e-3
    assert t.latency(256, 256) == 2e-3
    assert t.latency(512, 512) == pytest.approx(2e-3 * work(512, 512) / work(256, 256))


@st.composite
def monotone_tables(draw):
    nq = draw(st.integers(1, 4))
    nk = draw(st.integers(1, 4))
    q = sorted(draw(st.sets(st.integers(1, 4096), min_size=nq, max_size=nq)))
    kv = sorted(draw(st.sets(st.integers(1, 4096), min_size=nk, max_size=nk)))
    # No subnormal increments: no latency is 1e-313 s, and interpolating such values loses the
    # relative precision the comparisons below ask for (a run drew one and failed at 4e-11).
    inc = draw(st.lists(st.lists(st.floats(0, 1, allow_subnormal=False), min_size=nk, max_size=nk),
                        min_size=nq, max_size=nq))
    # Cumulative sums along both axes give a table non-decreasing in q and in kv.
    lat = np.cumsum(np.cumsum(np.array(inc), axis=0), axis=1)
    return ProfileTable(q_lens=q, kv_lens=kv, latency_s=lat.tolist())


@settings(max_examples=150, deadline=None)
@given(t=monotone_tables(), a=st.integers(1, 10000), b=st.integers(1, 10000),
       c=st.integers(1, 10000))
def test_monotone_table_gives_monotone_latency(t, a, b, c):
    q, kv_lo, kv_hi = sorted((a, b, c))
    # Non-decreasing in kv at fixed q, and in q at fixed kv.
    assert t.latency(q, kv_lo) <= t.latency(q, kv_hi) * (1 + 1e-12)
    q_lo, q_hi, kv = sorted((a, b, c))
    assert t.latency(q_lo, kv) <= t.latency(q_hi, kv) * (1 + 1e-12)
    # The vectorised path gives the same values.
    got = t.latencies([q, q_lo, q_hi], [kv_hi, kv, kv])
    want = [t.latency(q, kv_hi), t.latency(q_lo, kv), t.latency(q_hi, kv)]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


def test_json_round_trip(tmp_path, table):
    path = tmp_path / "profile.json"
    table.to_json(path)
    back = ProfileTable.from_json(path)
    assert back == table
    assert back.meta == {"device": "test"}
    import json

    assert set(json.loads(path.read_text())) == {"q_lens", "kv_lens", "latency_s", "meta"}
    assert ProfileTable.from_dict(table.to_dict()) == table


def test_from_flops():
    cost = CostModel(num_heads_q=32, num_heads_kv=8, head_dim=128)
    t = ProfileTable.from_flops(1e15, 1e-5, [128, 1024], [1024, 4096], cost)
    for i, q in enumerate(t.q_lens):
        for j, kv in enumerate(t.kv_lens):
            want = 1e-5 + cost.task_flops(kv - q, kv, 0, kv) / 1e15
            assert t.latency_s[i][j] == pytest.approx(want)
    assert t.meta["source"] == "analytic"
    assert ProfileTable.from_dict(t.to_dict()) == t
    with pytest.raises(ValueError, match="rate_flops_per_s"):
        ProfileTable.from_flops(0, 1e-5, [128], [128], cost)
    with pytest.raises(ValueError, match="overhead_s"):
        ProfileTable.from_flops(1e15, -1.0, [128], [128], cost)
    with pytest.raises(ValueError, match="CostModel"):
        ProfileTable.from_flops(1e15, 0.0, [128], [128], "cost")


@pytest.mark.parametrize("kwargs, match", [
    (dict(q_lens=[256, 128], kv_lens=[512], latency_s=[[1.0], [1.0]]), "strictly increasing.*256.*128"),
    (dict(q_lens=[128, 128], kv_lens=[512], latency_s=[[1.0], [1.0]]), "strictly increasing"),
    (dict(q_lens=[0, 128], kv_lens=[512], latency_s=[[1.0], [1.0]]), "positive.*0"),
    (dict(q_lens=[128.0], kv_lens=[512], latency_s=[[1.0]]), "non-int.*128.0"),
    (dict(q_lens=[True], kv_lens=[512], latency_s=[[1.0]]), "non-int"),
    (dict(q_lens=[], kv_lens=[512], latency_s=[]), "empty"),
    (dict(q_lens=[128], kv_lens=[512, 1024], latency_s=[[1.0]]), r"shape \[1\]\[2\]"),
    (dict(q_lens=[128, 256], kv_lens=[512], latency_s=[[1.0]]), r"shape \[2\]\[1\]"),
    (dict(q_lens=[128], kv_lens=[512], latency_s=[[-1.0]]), r"q=128, kv=512.*-1.0"),
    (dict(q_lens=[128], kv_lens=[512], latency_s=[[math.nan]]), "nan"),
    (dict(q_lens=[128], kv_lens=[512], latency_s=[[math.inf]]), "inf"),
    (dict(q_lens=[128], kv_lens=[512], latency_s=[["1"]]), "'1'"),
    (dict(q_lens=[2**63], kv_lens=[2**63 + 1], latency_s=[[1.0]]), r"q_lens must be at most 2\*\*63 - 1, got \[9223372036854775808\]"),
    (dict(q_lens=[128], kv_lens=[2**64], latency_s=[[1.0]]), r"kv_lens must be at most 2\*\*63 - 1"),
    (dict(q_lens=[128], kv_lens=[512], latency_s=[[10**400]]), r"q=128, kv=512\): 1000000000"),  # past float64
    (dict(q_lens=[128], kv_lens=[512], latency_s=[[1.0]], meta=[]), "meta"),
])
def test_invalid_table_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ProfileTable(**kwargs)


def test_invalid_lookup_raises(table):
    with pytest.raises(ValueError, match="q_len=600 > kv_len=500"):
        table.latency(600, 500)
    with pytest.raises(ValueError, match="-1"):
        table.latency(-1, 10)
    with pytest.raises(ValueError, match="ints"):
        table.latency(1.5, 10)
    with pytest.raises(ValueError, match="q_len=7, kv_len=3"):
        table.latencies([1, 7], [5, 3])
    with pytest.raises(ValueError, match=">= 0"):
        table.latencies([-2], [5])
    with pytest.raises(ValueError, match="integers"):
        table.latencies([1.5], [5])
    with pytest.raises(ValueError, match="missing keys"):
        ProfileTable.from_dict({"q_lens": [1]})
