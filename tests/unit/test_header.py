"""The round header's checks (no Ray): every participant of a round exchanges the round and its
claims (plan id, bytes per peer and direction, task digests) over the in-process transport, then
checks them. Parts that disagree are refused by both ends of the disagreeing pair before any byte
moves; parts that agree pass; clients that disagree on the round are refused by everyone.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from distca_server.header import RoundHeader, check_claims, claims, common_header, exchange_header
from distca_server.kernels import get_backend
from distca_server.participant import Participant
from distca_server.transport.local import LocalGroup
from distca_server.wire import RowFormat
from scheduler import CostModel, plan_batch
from scheduler.cost import RoundKind
from scheduler.parts import PlanPart, plan_identity, plan_parts

COST = CostModel(4, 2, 16, 4)
FMT = RowFormat(COST, torch.float32)


def _parts(lens, servers, mode="dedicated", step=3, batch=0):
    plan = plan_batch(lens, servers, cost=COST, epsilon=0.05, mode=mode, min_shard=8)
    return plan_parts(plan, step, batch, plan_identity(plan.to_msgpack(), step, batch))


def _forged(part: PlanPart, **changes) -> PlanPart:
    """A copy of ``part`` with fields replaced, through the validating constructor (what a
    well-formed but lying descriptor decodes to)."""
    fields = {k: getattr(part, k) for k in ("step", "batch", "mode", "num_ranks", "num_servers", "cost",
                                           "participant", "rank", "server", "doc_lens", "client_tasks",
                                           "server_tasks", "plan_id")}
    fields.update(changes)
    return PlanPart.from_msgpack(PlanPart(**fields).to_msgpack())


def _round(parts, kind=RoundKind.FORWARD, headers=None):
    """Every participant's header exchange and checks in a thread; returns each one's error
    message (None if it passed) and the common header it read."""
    backend = get_backend("reference", "cpu")
    participants = [Participant(p, FMT, backend, "cpu") for p in parts]
    num_clients = parts[0].num_ranks
    group = LocalGroup(len(parts), timeout_s=20)
    out: list = [None] * len(parts)

    def body(i):
        p = participants[i]
        header = None
        if p.rank is not None:
            header = (headers or {}).get(i) or RoundHeader(3, 0, 0, kind, torch.float32, 0.25, p.part.plan_id)
        try:
            rows = exchange_header(group.endpoint(i), header, claims(p, kind) if header else None)
            common = common_header(rows, num_clients)
            check_claims(common, rows, p, i)
            out[i] = (None, common)
        except ValueError as exc:
            out[i] = (str(exc), None)
    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(parts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _errors(results):
    return {i: msg for i, (msg, _) in enumerate(results) if msg is not None}


@pytest.mark.parametrize("mode, lens, servers", [("dedicated", [[100, 28], [50, 7, 300]], 2),
                                                 ("inplace", [[100, 28], [50, 7, 300], [1]], 3)])
@pytest.mark.parametrize("kind", list(RoundKind))
def test_parts_of_one_plan_pass(mode, lens, servers, kind):
    results = _round(_parts(lens, servers, mode), kind)
    assert _errors(results) == {}
    common = results[-1][1]
    assert (common.step, common.batch, common.kind, common.dtype) == (3, 0, kind, torch.float32)
    assert common.plan_id == _parts(lens, servers, mode)[0].plan_id != 0


def test_header_round_trips_a_64_bit_plan_id():
    h = RoundHeader(7, 1, 12, RoundKind.BACKWARD, torch.bfloat16, 0.125, (1 << 64) - 5)
    assert RoundHeader.decode(h.values()) == h
    assert h.describe() == "step 7 batch 1 round 12 (backward, bfloat16)"


def test_a_task_ten_rows_too_long_on_a_server_is_refused_by_both_ends():
    parts = _parts([[100, 28], [50]], 1)
    st = parts[2].server_tasks.copy()
    st[0, 4] += 10  # q_end and kv_end of rank 0's first task: 10 more rows than rank 0 sends
    st[0, 6] += 10
    parts[2] = _forged(parts[2], server_tasks=st)
    errors = _errors(_round(parts))
    assert set(errors) == {2}  # dedicated: the server holds both sides of the pair
    assert "participant 2 (server 0) expects" in errors[2] and "from participant 0 (rank 0), which sends" in errors[2]


def test_a_huge_task_is_refused_before_anything_is_allocated():
    parts = _parts([[100, 28], [50]], 1)
    st = parts[2].server_tasks.copy()
    st[-1, 4] = st[-1, 6] = 1 << 20
    parts[2] = _forged(parts[2], server_tasks=st)
    errors = _errors(_round(parts))
    assert set(errors) == {2} and "expects" in errors[2]


def test_merged_documents_with_the_same_sizes_are_refused():
    """Rank 0's documents of 100 and 28 tokens merged into one of 128 on the server: the same
    byte counts, silently wrong attention; the task digests differ."""
    parts = _parts([[100, 28], [50]], 1)
    st = parts[2].server_tasks
    assert st[:2, 1:5].tolist() == [[0, 0, 0, 100], [0, 1, 0, 28]]
    merged = np.concatenate([[[0, 0, 0, 0, 128, 0, 128]], st[2:]]).astype(np.int64)
    parts[2] = _forged(parts[2], server_tasks=merged)
    errors = _errors(_round(parts))
    assert set(errors) == {2}
    assert "CA-tasks between participant 2 (server 0) and participant 0 (rank 0) differ" in errors[2]


def test_another_servers_part_and_another_plans_part_are_refused():
    parts = _parts([[100, 28], [50, 7, 300]], 2)
    swapped = list(parts)
    swapped[2] = parts[3]
    errors = _errors(_round(swapped))
    assert 2 in errors and "world rank 2 holds the part of participant 3 (server 1)" in errors[2]
    other = _parts([[100, 28], [50, 7, 300]], 2, step=4)
    mixed = list(parts)
    mixed[3] = other[3]
    errors = _errors(_round(mixed))
    assert set(errors) == {3} and "holds the part of step 4 batch 0" in errors[3]


def test_inplace_a_lying_client_part_is_refused_by_both_ends():
    parts = _parts([[100, 28], [50, 7, 300], [1]], 3, "inplace")
    liar = 1
    ct = parts[liar].client_tasks.copy()
    moved = np.flatnonzero(ct[:, 0] != liar)
    assert len(moved), "the plan should move some of rank 1's rows"
    i = moved[0]
    victim = int(ct[i, 0])
    ct[i, 0] = (victim + 1) % 3 if (victim + 1) % 3 != liar else (victim + 2) % 3  # tasks sent elsewhere
    order = np.lexsort((ct[:, 3], ct[:, 2], ct[:, 1], ct[:, 0]))
    parts[liar] = _forged(parts[liar], client_tasks=ct[order])
    errors = _errors(_round(parts))
    assert liar in errors and victim in errors


def test_clients_that_disagree_on_the_round_are_refused_by_everyone():
    parts = _parts([[100, 28], [50]], 1)
    pid = parts[0].plan_id
    headers = {0: RoundHeader(3, 0, 0, RoundKind.FORWARD, torch.bfloat16, 0.25, pid),
               1: RoundHeader(3, 0, 0, RoundKind.FORWARD, torch.float16, 0.25, pid)}
    errors = _errors(_round(parts, headers=headers))
    assert set(errors) == {0, 1, 2}
    assert len(set(errors.values())) == 1
    assert "rank 0: step 3 batch 0 round 0 (forward, bfloat16); rank 1: step 3 batch 0 round 0 (forward, float16)" \
        in errors[0]


def test_header_round_trips_the_kept_round_key():
    h = RoundHeader(7, 1, 12, RoundKind.BACKWARD, torch.float32, 0.125, 99, kept=4)
    assert RoundHeader.decode(h.values()) == h and h.kept == 4
    assert h.describe() == "step 7 batch 1 round 12 (backward, kept 4, float32)"
    assert RoundHeader.decode(RoundHeader(7, 1, 3, RoundKind.FORWARD, torch.float32, 0.1).values()).kept == -1


def test_a_part_that_does_not_keep_activations_is_refused_in_the_backward_round():
    """Kept activations change what a backward round dispatches (dO only): a server part cut
    from a stateless plan disagrees with its clients' byte counts before any byte moves."""
    parts = _parts([[100, 28], [50]], 1)
    assert all(p.keep_activations for p in parts)
    parts[2] = _forged(parts[2])  # the same tasks, keep_activations=False
    assert _errors(_round(parts, RoundKind.FORWARD)) == {}  # the forward round is the same
    errors = _errors(_round(parts, RoundKind.BACKWARD))
    assert 2 in errors and "expects" in errors[2]


@pytest.mark.parametrize("mode,servers", [("dedicated", 3), ("inplace", 4)])
@pytest.mark.parametrize("kind", list(RoundKind))
def test_parts_of_a_kept_partial_kv_plan_pass(mode, servers, kind):
    """A kept plan whose shards are split on the key axis: the kept backward round also moves
    the split rows' merged O and LSE, and every end claims the same bytes for them."""
    lens = [[1500, 20, 7]] + [[] for _ in range(servers - 1)] if mode == "inplace" else [[1500, 20, 7]]
    plan = plan_batch(lens, servers, cost=COST, mode=mode, min_shard=300, partial_kv=True)
    assert plan.keep_activations and plan.comm_bytes()["backward"]["out"] > 0
    parts = plan_parts(plan, 3, 0, plan_identity(plan.to_msgpack(), 3, 0))
    assert _errors(_round(parts, kind)) == {}
    # Column 2: bytes each participant claims to send each peer in the dispatch (self excluded).
    participants = [Participant(p, FMT, get_backend("reference", "cpu"), "cpu") for p in parts]
    sent = sum(int(np.delete(claims(p, kind)[:, 2], i).sum()) for i, p in enumerate(participants))
    comm = plan.comm_bytes()[kind.value]
    assert sent == sum(comm[n] for n in kind.dispatch_with(True) + kind.split_dispatch_with(True))


def test_clients_disagreeing_only_in_the_scale_are_told_it():
    """Two clients whose next rounds differ only in a field the short description leaves out (the
    softmax scale) see it named, not two identical descriptions."""
    a = RoundHeader(3, 0, 1, RoundKind.FORWARD, torch.float64, 0.25, 7)
    b = RoundHeader(3, 0, 1, RoundKind.FORWARD, torch.float64, 0.125, 7)
    rows = np.array([a.values(), b.values()], dtype=np.int64)
    with pytest.raises(ValueError, match=r"rank 0: .*softmax_scale 0\.25.*; rank 1: .*softmax_scale 0\.125"):
        common_header(rows, 2)
    other = RoundHeader(3, 0, 2, RoundKind.FORWARD, torch.float64, 0.25, 7)  # differs in what is shown
    with pytest.raises(ValueError) as err:
        common_header(np.array([a.values(), other.values()], dtype=np.int64), 2)
    assert "softmax_scale" not in str(err.value) and "round 2" in str(err.value)
