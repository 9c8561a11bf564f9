"""The data path of one plan's rounds (participants over the in-process transport), against the
float64 reference: every rank's outputs and gradients, the bytes each participant sent, which rows
are copied at all, and buffers that last across rounds.

Plans are random: odd lengths, 1-token documents, ranks without documents, GQA, both modes,
1-5 servers, min_shard down to 1 so documents split into many shards (repeated KV rows on a
server and on a client).
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from distca_server.kernels import get_backend
from distca_server.participant import Participant
from distca_server.refs import attend_with_grads_ref
from distca_server.transport.local import LocalGroup
from distca_server.wire import RowFormat
from scheduler import CostModel, plan_batch
from scheduler.parts import plan_parts


def _random_batch(rng: random.Random, num_ranks: int) -> list[list[int]]:
    per_rank = []
    for _ in range(num_ranks):
        if rng.random() < 0.2:
            per_rank.append([])  # a rank without documents
            continue
        per_rank.append([rng.choice([1, 1, 2, 3, rng.randint(4, 60), rng.randint(60, 300)])
                         for _ in range(rng.randint(1, 5))])
    if not any(per_rank):
        per_rank[0] = [rng.randint(1, 200)]
    return per_rank


def _run_rounds(plan, fmt, inputs, scale, rounds=2, group=None):
    """Every participant in a thread: ``rounds`` x (forward, backward) on the same inputs. Returns
    per rank (out, dq, dk, dv) of the last round, the participants and the group."""
    backend = get_backend("reference", "cpu")
    parts = plan_parts(plan)
    participants = [Participant(p, fmt, backend, "cpu") for p in parts]
    group = group or LocalGroup(len(participants), timeout_s=20)
    results, errors = [None] * len(participants), []

    def body(i):
        p = participants[i]
        t = group.endpoint(i)
        try:
            for n in range(rounds):  # a kept-activation plan keeps round n's rows under key n
                keep = n if p.keep_activations else None
                if p.rank is None:
                    p.forward(t, None, None, None, scale, keep=keep)
                    if keep is None:
                        p.backward(t, None, None, None, None, None, None, scale)
                    else:
                        p.backward_kept(t, None, scale, kept=keep)
                    continue
                q, k, v, dout = inputs[p.rank]
                out, lse = p.forward(t, q, k, v, scale, keep=keep)
                if keep is None:
                    dq, dk, dv = p.backward(t, q, k, v, out, lse, dout, scale)
                else:
                    dq, dk, dv = p.backward_kept(t, dout, scale, kept=keep)
                results[i] = (out, dq, dk, dv)
        except BaseException as exc:  # reported below
            group.abort(i, repr(exc))
            errors.append(exc)
    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(participants))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    by_rank = {p.rank: r for p, r in zip(participants, results) if p.rank is not None}
    return by_rank, participants, group


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_rounds_match_the_reference_and_the_plans_bytes(seed, keep):
    rng = random.Random(seed)
    mode = rng.choice(["inplace", "dedicated"])
    num_servers = rng.randint(1, 5)
    num_ranks = num_servers if mode == "inplace" else rng.randint(1, 4)
    hkv = rng.choice([1, 2, 4])
    hq, d = hkv * rng.choice([1, 2, 4]), rng.choice([4, 8])
    batch = _random_batch(rng, num_ranks)
    cost = CostModel(hq, hkv, d, 8)
    plan = plan_batch(batch, num_servers, cost=cost, epsilon=rng.choice([0.0, 0.1]), mode=mode,
                      min_shard=rng.choice([1, 2, 16]), keep_activations=keep)
    g = torch.Generator().manual_seed(seed)
    inputs = []
    for lens in batch:
        T = sum(lens)
        inputs.append([torch.randn(T, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)])
    scale = d ** -0.5
    by_rank, participants, _ = _run_rounds(plan, RowFormat(cost, torch.float64), inputs, scale)

    for r, lens in enumerate(batch):
        if not lens:
            assert all(t.shape[0] == 0 for t in by_rank[r])
            continue
        q, k, v, dout = inputs[r]
        want = attend_with_grads_ref(q, k, v, lens, dout, scale)
        for got, ref in zip(by_rank[r], want):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)

    # What crossed between participants is exactly what the plan says moves off-rank (2 rounds).
    comm = plan.comm_bytes()
    sent: dict[tuple[str, str], int] = {}
    for p in participants:
        for key, n in p.traffic.items():
            sent[key] = sent.get(key, 0) + n
    for kind, per_tensor in comm.items():
        for name, n in per_tensor.items():
            if name != "total":
                assert sent.get((kind, name), 0) == 2 * n, (kind, name)


def test_one_inplace_server_copies_nothing_and_buffers_last_across_rounds():
    batch = [[5, 1, 130, 17]]
    cost = CostModel(4, 2, 8, 8)
    plan = plan_batch(batch, 1, cost=cost, mode="inplace", min_shard=1)
    g = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(153, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4)]]
    by_rank, (p,), group = _run_rounds(plan, RowFormat(cost, torch.float64), inputs, 0.3)
    assert p.inputs_home and p.results_home
    assert p.traffic == {}
    # Nothing was gathered or received: the transport's buffers never held a byte.
    endpoint = group.endpoint(0)
    assert endpoint._buffers.reserved_bytes() == 0
    # The server keeps the caller's q, k, v themselves, and the caller's out and lse are the very
    # tensors the kernel wrote (the ones the server keeps): no copy on either side of the kernel.
    q, k, v, dout = inputs[0]
    out, lse = p.forward(endpoint, q, k, v, 0.3, keep=7)
    kept, _ = p.kept[7]
    assert [kept[n].data_ptr() for n in ("q", "k", "v", "out", "lse")] == [
        t.data_ptr() for t in (q, k, v, out, lse)]
    grads = p.backward_kept(endpoint, dout, 0.3, kept=7)
    assert endpoint._buffers.reserved_bytes() == 0 and p.traffic == {}
    want = attend_with_grads_ref(q, k, v, batch[0], dout, 0.3)
    for got, ref in zip((out, *grads), want):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)

    # Two servers: rows move; each participant's two buffers are allocated once and reused.
    plan = plan_batch([[300, 7], [2, 3]], 2, cost=cost, mode="inplace", epsilon=0.0, min_shard=1)
    inputs = [[torch.randn(sum(lens), h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4)]
              for lens in plan.doc_lens_per_rank]
    _, participants, group = _run_rounds(plan, RowFormat(cost, torch.float64), inputs, 0.3, rounds=1)
    assert any(p.traffic for p in participants)
    ptrs = [{k: b.data_ptr() for k, b in group.endpoint(i)._buffers._buffers.items()} for i in range(2)]
    assert all(set(x) <= {"client", "server"} for x in ptrs) and any(ptrs)
    _run_rounds(plan, RowFormat(cost, torch.float64), inputs, 0.3, rounds=2, group=group)
    assert ptrs == [{k: b.data_ptr() for k, b in group.endpoint(i)._buffers._buffers.items()}
                    for i in range(2)]


def test_rebound_participants_share_the_layout_and_nothing_else():
    cost = CostModel(4, 2, 8, 8)
    plan = plan_batch([[300, 7], [2, 3]], 2, cost=cost, mode="inplace", epsilon=0.0, min_shard=1)
    backend, fmt = get_backend("reference", "cpu"), RowFormat(cost, torch.float64)
    first = [Participant(p, fmt, backend, "cpu") for p in plan_parts(plan, 0, 0)]
    g = torch.Generator().manual_seed(3)
    inputs = [[torch.randn(sum(lens), h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4)]
              for lens in plan.doc_lens_per_rank]
    # The first participants ran a round and keep its activations.
    group = LocalGroup(2, timeout_s=20)
    in_threads = [threading.Thread(target=lambda i=i: first[i].forward(group.endpoint(i), *inputs[i][:3], 0.3,
                                                                        keep=0)) for i in range(2)]
    for t in in_threads:
        t.start()
    for t in in_threads:
        t.join(30)
    assert all(p.kept for p in first) and any(p.traffic for p in first)
    later = [p.rebound(part) for p, part in zip(first, plan_parts(plan, 5, 1))]
    for a, b in zip(first, later):
        assert b.part.step == 5 and b.part.batch == 1
        assert b.q_send_idx is a.q_send_idx and b.executor is a.executor  # built once
        assert b.kept == {} and b.traffic == {} and b.released == ""  # state of its own
        assert a.kept  # the earlier step's activations are untouched
    other = plan_batch([[300, 8], [2, 3]], 2, cost=cost, mode="inplace", epsilon=0.0, min_shard=1)
    with pytest.raises(ValueError, match="not participant 0's part of the same plan"):
        first[0].rebound(plan_parts(other, 1, 0)[0])


def test_a_participant_alone_in_its_group_never_exchanges():
    cost = CostModel(4, 2, 8, 8)
    plan = plan_batch([[5, 1, 130, 17]], 1, cost=cost, mode="inplace", min_shard=1)
    group = LocalGroup(1, timeout_s=20)
    calls = []
    endpoint = group.endpoint(0)
    endpoint.exchange = lambda *a, **kw: calls.append(a)  # would record any exchange
    g = torch.Generator().manual_seed(1)
    inputs = [[torch.randn(153, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4)]]
    for keep in (True, False):
        plan = plan_batch([[5, 1, 130, 17]], 1, cost=cost, mode="inplace", min_shard=1, keep_activations=keep)
        by_rank, _, _ = _run_rounds(plan, RowFormat(cost, torch.float64), inputs, 0.3, group=group)
        want = attend_with_grads_ref(*inputs[0][:3], [5, 1, 130, 17], inputs[0][3], 0.3)
        for got, ref in zip(by_rank[0], want):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    assert calls == []
