"""Per-participant plan parts: the descriptors the scheduler actor sends."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import CostModel, plan_batch
from scheduler.layout import client_layout, client_layout_from, server_layout, server_layout_from
from scheduler.parts import PlanPart, plan_part, plan_parts

COST = CostModel(4, 2, 16, 2)
batches = st.lists(st.lists(st.integers(1, 500), max_size=5), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(batches, st.sampled_from(["inplace", "dedicated"]), st.integers(1, 4))
def test_parts_round_trip_and_give_the_plans_layout(doc_lens, mode, servers):
    servers = len(doc_lens) if mode == "inplace" else servers
    plan = plan_batch(doc_lens, servers, cost=COST, mode=mode, min_shard=8)
    parts = plan_parts(plan, step=3, batch=1)
    assert len(parts) == plan.num_participants
    for part in parts:
        back = PlanPart.from_msgpack(part.to_msgpack())
        assert (back.step, back.batch, back.rank, back.server) == (3, 1, part.rank, part.server)
        assert np.array_equal(back.client_tasks, part.client_tasks)
        assert np.array_equal(back.server_tasks, part.server_tasks)
        if part.rank is not None:
            mine = client_layout_from(back.doc_lens, back.client_tasks, back.num_servers, back.rank)
            full = client_layout(plan, part.rank)
            assert all(np.array_equal(a, b) for a, b in zip(mine.q_index, full.q_index))
            assert all(np.array_equal(a, b) for a, b in zip(mine.kv_index, full.kv_index))
        if part.server is not None:
            mine = server_layout_from(back.server_tasks, back.num_ranks, back.server)
            full = server_layout(plan, part.server)
            assert mine.q_rows == full.q_rows and mine.kv_rows == full.kv_rows
            assert np.array_equal(mine.cu_seqlens_k, full.cu_seqlens_k)


def _mutations(part: PlanPart):
    obj = msgpack.unpackb(part.to_msgpack(), raw=False)

    def with_(**changes):
        o = dict(obj)
        o.update(changes)
        return msgpack.packb(o, use_bin_type=True)
    tasks = part.client_tasks.copy()
    gap = tasks.copy()
    gap[0, 4] -= 1
    gap[0, 6] -= 1
    yield "not valid msgpack", b"\xc1\xff"
    yield "map with keys", msgpack.packb([1, 2, 3])
    yield "distca.part v1", with_(version=2)
    yield "distca.part v1", with_(version=True)
    yield "mode", with_(mode="sideways")
    yield "participant", with_(participant=99)
    yield "rank", with_(rank=None)
    yield "int64 bytes", with_(doc_lens=b"\x01\x02")
    yield "rows of 7", with_(client_tasks=tasks.tobytes()[:-8])
    yield "cover each", with_(client_tasks=gap.astype("<i8").tobytes())
    yield "multiple of num_heads_kv", with_(cost=[4, 3, 16, 2])
    yield "positive ints", with_(doc_lens=np.array([0, 5], "<i8").tobytes())


@pytest.mark.parametrize("fragment,data", list(_mutations(plan_part(
    plan_batch([[300, 40], [7]], 2, cost=COST, mode="inplace", min_shard=8), 0))))
def test_malformed_parts_raise_value_error(fragment, data):
    with pytest.raises(ValueError, match=fragment):
        PlanPart.from_msgpack(data)


def test_bit_flips_never_raise_anything_but_value_error():
    rng = random.Random(0)
    good = plan_part(plan_batch([[300, 40, 3], [700]], 3, cost=COST, mode="dedicated", min_shard=8), 4).to_msgpack()
    for _ in range(500):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        try:
            PlanPart.from_msgpack(bytes(data))
        except ValueError:
            pass
