"""The all-to-all layout derived from a plan."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import CostModel, plan_batch
from scheduler.layout import client_layout, concat_ranges, server_layout

COST = CostModel(4, 2, 16, 2)


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 6)), max_size=8))
def test_concat_ranges_matches_python(pairs):
    starts = [s for s, _ in pairs]
    lengths = [n for _, n in pairs]
    want = [x for s, n in pairs for x in range(s, s + n)]
    assert concat_ranges(starts, lengths).tolist() == want


batches = st.lists(st.lists(st.integers(1, 400), max_size=6), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(batches, st.sampled_from(["inplace", "dedicated"]), st.integers(1, 5),
       st.sampled_from([0.0, 0.05, 0.2]))
def test_layouts_are_consistent(doc_lens, mode, servers, epsilon):
    if mode == "inplace":
        servers = len(doc_lens)
    plan = plan_batch(doc_lens, servers, cost=COST, epsilon=epsilon, mode=mode, min_shard=8)
    clients = [client_layout(plan, r) for r in range(plan.num_ranks)]
    for r, lay in enumerate(clients):
        rows = np.concatenate(lay.q_index) if lay.q_index else np.zeros(0, dtype=np.int64)
        assert sorted(rows.tolist()) == list(range(sum(doc_lens[r])))  # each local row sent once
        for kv in lay.kv_index:  # deduplicated: no KV row twice to one server
            assert len(set(kv.tolist())) == len(kv)
    q_rows, kv_rows = plan.row_matrix
    for s in range(servers):
        lay = server_layout(plan, s)
        assert lay.q_rows == [clients[r].q_rows[s] for r in range(plan.num_ranks)] == q_rows[:, s].tolist()
        assert lay.kv_rows == [clients[r].kv_rows[s] for r in range(plan.num_ranks)] == kv_rows[:, s].tolist()
        assert lay.cu_seqlens_q[-1] == sum(lay.q_rows)
        if lay.kv_gather is None:
            assert lay.cu_seqlens_k[-1] == sum(lay.kv_rows)
        else:
            assert len(lay.kv_gather) == lay.cu_seqlens_k[-1]
            assert lay.kv_gather.max() < sum(lay.kv_rows)


def test_layout_rejects_out_of_range():
    plan = plan_batch([[5], [7]], 2, cost=COST)
    with pytest.raises(ValueError, match="rank 2"):
        client_layout(plan, 2)
    with pytest.raises(ValueError, match="server -1"):
        server_layout(plan, -1)
