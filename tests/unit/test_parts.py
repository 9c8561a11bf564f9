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
from scheduler.tasks import participant_roles

COST = CostModel(4, 2, 16, 2)
batches = st.lists(st.lists(st.integers(1, 500), max_size=5), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(batches, st.sampled_from(["inplace", "dedicated"]), st.integers(1, 4), st.sampled_from([None, 1, 7, 64]))
def test_parts_round_trip_and_give_the_plans_layout(doc_lens, mode, servers, window):
    servers = len(doc_lens) if mode == "inplace" else servers
    plan = plan_batch(doc_lens, servers, cost=COST, mode=mode, min_shard=8, window=window)
    parts = plan_parts(plan, step=3, batch=1)
    assert [part.participant for part in parts] == list(range(plan.num_participants))
    for part in parts:  # the one-pass cut gives what cutting each part alone gives
        alone = plan_part(plan, part.participant, step=3, batch=1)
        assert (part.rank, part.server) == participant_roles(mode, plan.num_ranks, part.participant)
        assert part.to_msgpack() == alone.to_msgpack()
        assert all(part.doc_lens is not lens for lens in plan.doc_lens_per_rank)  # its own copy
        back = PlanPart.from_msgpack(part.to_msgpack())
        assert (back.step, back.batch, back.rank, back.server) == (3, 1, part.rank, part.server)
        assert back.window == window
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
    yield "distca.part v2", with_(version=1)
    yield "distca.part v2", with_(version=True)
    yield "keep_activations", with_(keep_activations=1)
    yield "window", with_(window=0)
    yield "window", with_(window="7")
    yield "not a CA-task", with_(window=1)  # tasks cut with no window
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


def test_a_part_names_at_most_as_many_servers_as_a_plan_may_have():
    from scheduler.checks import MAX_SERVERS
    part = plan_part(plan_batch([[300, 40], [7]], 2, cost=COST, mode="dedicated", min_shard=8), 0)
    obj = msgpack.unpackb(part.to_msgpack(), raw=False)
    for servers in (MAX_SERVERS + 1, (1 << 40) - 1):  # a receiver would build layouts of that many
        with pytest.raises(ValueError, match="num_servers"):
            PlanPart.from_msgpack(msgpack.packb(dict(obj, num_servers=servers), use_bin_type=True))
        with pytest.raises(ValueError, match="num_servers"):
            PlanPart(**dict(part.__dict__, num_servers=servers))


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


# ---- one-pass cut without re-validation ---------------------------------------------------------------
def _validated(plan, p, step, batch):
    """Participant p's part the slow way: mask the task array, then the validating constructor."""
    from scheduler.tasks import participant_roles
    rank, server = participant_roles(plan.mode, plan.num_ranks, p)
    arr = plan.task_array
    return PlanPart(step=step, batch=batch, mode=plan.mode, num_ranks=plan.num_ranks,
                    num_servers=plan.num_servers, cost=plan.cost, participant=p, rank=rank, server=server,
                    doc_lens=list(plan.doc_lens_per_rank[rank]) if rank is not None else [],
                    client_tasks=arr[arr[:, 1] == rank] if rank is not None else arr[:0],
                    server_tasks=arr[arr[:, 0] == server] if server is not None else arr[:0],
                    window=plan.window, keep_activations=plan.keep_activations)


@settings(max_examples=60, deadline=None)
@given(batches, st.sampled_from(["inplace", "dedicated"]), st.integers(1, 5), st.integers(0, 9),
       st.sampled_from([None, 1, 7, 128]))
def test_one_pass_cut_equals_the_validated_cut(doc_lens, mode, servers, step, window):
    servers = len(doc_lens) if mode == "inplace" else servers
    plan = plan_batch(doc_lens, servers, cost=COST, mode=mode, min_shard=8, window=window)
    parts = plan_parts(plan, step, 1)
    assert [p.participant for p in parts] == list(range(plan.num_participants))
    for p, part in enumerate(parts):
        want = _validated(plan, p, step, 1)  # passes every check of the public constructor
        single = plan_part(plan, p, step, 1)
        for got in (part, single):
            for name in ("step", "batch", "mode", "num_ranks", "num_servers", "cost", "participant",
                         "rank", "server", "doc_lens", "window"):
                assert getattr(got, name) == getattr(want, name), name
            assert got.client_tasks.dtype == np.int64 and got.client_tasks.shape[1:] == (7,)
            assert np.array_equal(got.client_tasks, want.client_tasks)
            assert np.array_equal(got.server_tasks, want.server_tasks)
            assert got.to_msgpack() == want.to_msgpack()
            # a part shares rows with the plan: it must not be able to change them
            assert not got.client_tasks.flags.writeable and not got.server_tasks.flags.writeable


def test_cut_skips_validation_but_decoding_does_not(monkeypatch):
    plan = plan_batch([[300, 40], [7]], 2, cost=COST, mode="inplace", min_shard=8)
    calls = []
    real = PlanPart.__post_init__
    monkeypatch.setattr(PlanPart, "__post_init__", lambda self: (calls.append(1), real(self)))
    parts = plan_parts(plan)
    plan_part(plan, 1)
    assert calls == []
    for part in parts:
        PlanPart.from_msgpack(part.to_msgpack())
    assert len(calls) == len(parts)


@pytest.mark.parametrize("args, match", [((2,), r"participant must be an int in \[0, 1\], got 2"),
                                         ((-1,), "got -1"), ((True,), "got True"),
                                         ((0, -1), "step must be an int"), ((0, 0, 1.5), "batch must be an int")])
def test_plan_part_rejects(args, match):
    plan = plan_batch([[300, 40], [7]], 2, cost=COST, mode="inplace", min_shard=8)
    with pytest.raises(ValueError, match=match):
        plan_part(plan, *args)


def test_plan_parts_rejects_a_non_plan():
    with pytest.raises(ValueError, match="plan must be a Plan, got dict"):
        plan_parts({})


def test_constructor_converts_numpy_ints_and_rejects_bools():
    part = plan_part(plan_batch([[300, 40], [7]], 2, cost=COST, mode="inplace", min_shard=8), 1)
    fields = {k: getattr(part, k) for k in ("mode", "num_ranks", "num_servers", "cost", "participant", "rank",
                                            "server", "doc_lens", "client_tasks", "server_tasks")}
    again = PlanPart(step=np.int64(4), batch=np.int32(1), **fields)
    assert type(again.step) is int and type(again.batch) is int
    assert PlanPart.from_msgpack(again.to_msgpack()).step == 4
    with pytest.raises(ValueError, match="step must be an int"):
        PlanPart(step=True, batch=0, **fields)


def test_at_rebinds_a_part_to_another_step_sharing_its_tasks():
    from scheduler import CostModel, plan_batch
    plan = plan_batch([[300, 7], [2, 3]], 2, cost=CostModel(4, 2, 8, 2), mode="inplace", min_shard=1)
    part = plan_parts(plan, step=1, batch=0)[0]
    later = part.at(7, 2)
    assert (later.step, later.batch, part.step, part.batch) == (7, 2, 1, 0)
    assert later.client_tasks is part.client_tasks and later.server_tasks is part.server_tasks
    cut = plan_parts(plan, step=7, batch=2)[0]
    for name, value in vars(cut).items():  # the same as cutting the part for that step
        assert np.array_equal(getattr(later, name), value) if isinstance(value, np.ndarray) \
            else getattr(later, name) == value, name
    with pytest.raises(ValueError, match="step"):
        part.at(-1, 0)
