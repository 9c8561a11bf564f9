"""One definition of what moves (scheduler/comm_layout.py): every pair of participants agrees on
the bytes between them, receive offsets follow the segment layout, and the participants' bytes add
up to the plan's own count (``Plan.comm_bytes``), over random plans of both modes."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler import CostModel, plan_batch
from scheduler.comm_layout import KV, Q, SPLIT, comm_layout, part_rows, row_class
from scheduler.cost import RoundKind
from scheduler.parts import plan_identity, plan_parts


def _random_plan(seed: int, mode: str, keep: bool, partial_kv: bool, window):
    rng = np.random.default_rng(seed)
    ranks = int(rng.integers(1, 5))
    servers = ranks if mode == "inplace" else int(rng.integers(1, 4))
    lens = []
    for _ in range(ranks):  # odd lengths, 1-token documents, an empty rank now and then
        n = int(rng.integers(0, 5))
        lens.append([int(x) for x in rng.choice([1, 2, 7, 33, 129, 500, 1200], size=n)])
    if not any(lens):
        lens[0] = [17]
    cost = CostModel(int(rng.choice([2, 4, 8])), 2, 16, 2)
    plan = plan_batch(lens, servers, cost=cost, epsilon=0.05, mode=mode, min_shard=8, window=window,
                      keep_activations=keep, partial_kv=partial_kv)
    parts = plan_parts(plan, 3, 0, plan_identity(plan.to_msgpack(), 3, 0))
    return plan, parts


CASES = [(seed, mode, keep, partial, window) for seed in range(12) for mode in ("inplace", "dedicated")
         for keep, partial, window in ((True, False, None), (False, False, None), (True, True, None),
                                       (False, False, 64))]


@pytest.mark.parametrize("seed, mode, keep, partial_kv, window", CASES)
def test_pairs_agree_and_bytes_add_up_to_the_plan(seed, mode, keep, partial_kv, window):
    plan, parts = _random_plan(seed, mode, keep, partial_kv, window)
    rows = [part_rows(p) for p in parts]
    P = len(parts)
    for kind in RoundKind:
        lays = [comm_layout(r, kind, plan.cost.bytes_per_token, keep) for r in rows]
        names, back = lays[0].names, lays[0].back
        for i in range(P):
            for j in range(P):  # i's dispatch to j is what j expects from i; j's return to i likewise
                assert (lays[i].send_splits[:, j] == lays[j].recv_splits[:, i]).all(), (kind, i, j)
                assert (lays[j].ret_send_splits[:, i] == lays[i].ret_recv_splits[:, j]).all(), (kind, i, j)
            lay = lays[i]
            assert (lay.send_splits[:, i] == 0).all() and (lay.recv_splits[:, i] == 0).all()
            # sender p's bytes land after the head and the senders before it
            ends = lay.recv_offsets + lay.recv_splits
            assert (lay.recv_offsets[:, 0] == lay.heads).all()
            assert (ends[:, :-1] == lay.recv_offsets[:, 1:]).all()
            assert (ends[:, -1] == lay.heads + lay.recv_splits.sum(axis=1)).all()
            if rows[i].server is None:
                assert not lay.recv_splits.any() and not lay.heads.any() and not lay.ret_send_splits.any()
            if rows[i].rank is None:
                assert not lay.send_splits.any() and not lay.ret_recv_splits.any()
        # what crosses the network, tensor by tensor, is the plan's own count
        want = plan.comm_bytes()[kind.value]
        for t, name in enumerate(names):
            assert sum(int(lay.send_splits[t].sum()) for lay in lays) == want[name], (kind, name)
        for t, name in enumerate(back):
            if name not in names:
                assert sum(int(lay.ret_send_splits[t].sum()) for lay in lays) == want[name], (kind, name)


@pytest.mark.parametrize("seed, mode", [(s, m) for s in range(8) for m in ("inplace", "dedicated")])
def test_rows_cover_each_clients_tokens(seed, mode):
    plan, parts = _random_plan(seed, mode, True, False, None)
    for part in parts:
        r = part_rows(part)
        if r.rank is None:
            assert r.num_tokens == 0 and not r.client_rows.any()
            continue
        # without partial-KV tasks every query row goes to exactly one server
        q = np.sort(np.concatenate([r.q_send, r.q_own]))
        assert (q == np.arange(part.num_tokens)).all()
        assert int(r.client_rows[Q].sum()) == len(r.q_send) and int(r.client_rows[KV].sum()) == len(r.kv_send)
        assert not r.client_rows[SPLIT].any() and len(r.merged_rows) == 0
        if r.server is not None:
            lay = r.server_layout
            assert int(lay.cu_seqlens_q[-1]) == int(r.server_rows[Q].sum() + r.head_rows[Q])


def test_row_classes():
    assert [row_class(n) for n in ("q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv")] == [
        Q, KV, KV, Q, Q, Q, Q, KV, KV]
    assert row_class("out", ("out", "lse")) == SPLIT and row_class("k", ("out", "lse")) == KV
