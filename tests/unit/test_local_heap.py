"""``DistCAClient.local`` over the in-process symmetric heap (transport/local_heap.py): the one-sided
protocol between participants of one process, device-driven once a plan's routes are installed
(issue 22 item 2(a); on the CPU here, each PE's stream a thread).

Checked against the float64 reference over random batches (odd lengths, 1-token documents, GQA),
both modes, kept and stateless activations; a participant that fails fails the round with its own
error, and the next round runs exact on a new group.
"""

from __future__ import annotations

import random

import pytest
import torch

from distca_client import DistCAClient
from distca_server.refs import attend_with_grads_ref
from distca_server.transport.local_heap import HeapGroup, LocalHeap
from scheduler.config import JobConfig, PlanConfig

HEAP = 32 << 20


def batch(seed: int, tokens: int = 400) -> list[int]:
    rng = random.Random(seed)
    lens = [1, 1]
    while sum(lens) < tokens:
        lens.append(rng.choice([1, 2, 7, 33, 129, 250]))
    rng.shuffle(lens)
    return lens


def client(servers: int, mode: str = "inplace", keep: bool = True, **job):
    ranks = servers if mode == "inplace" else 2
    config = JobConfig(servers=servers, transport="shm", heap_bytes=HEAP, timeout_s=job.pop("timeout_s", 30.0),
                       plan=PlanConfig(mode=mode, min_shard=8, keep_activations=keep, epsilon=0.0))
    return DistCAClient.local(config=config, num_ranks=ranks)


def check_steps(c, lens, steps: int, heads=(6, 2), seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, heads[0], 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, heads[1], 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(T, heads[1], 8, generator=g, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(T, heads[0], 8, generator=g, dtype=torch.float64)
    want = attend_with_grads_ref(q, k, v, lens, dout, 8 ** -0.5)
    for _ in range(steps):
        q.grad = k.grad = v.grad = None
        out = c.attend(q, k, v, lens)
        out.backward(dout)
        for got, ref in zip((out, q.grad, k.grad, v.grad), want):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
        c.new_step()


@pytest.mark.parametrize("servers,mode,keep", [(2, "inplace", True), (3, "inplace", False),
                                              (4, "inplace", True), (2, "dedicated", True),
                                              (3, "dedicated", False)])
def test_local_client_over_the_heap_equals_the_reference(servers, mode, keep):
    with client(servers, mode, keep) as c:
        check_steps(c, batch(servers * 7 + keep), steps=4)
        group = c._runtime._group
        assert isinstance(group, HeapGroup)
        counts = [group.endpoint(i).device_exchanges for i in range(group.world_size)]
        # the plan's routes were installed in the first steps; later rounds ran device-driven
        assert len(set(counts)) == 1 and counts[0] >= 4, counts


def test_batches_of_several_plans_keep_their_own_routes():
    """Two batch shapes, alternating, in one client: each plan's exchanges have routes of their own
    (the same sizes under one route would mix plans)."""
    a, b = batch(11, 300), batch(12, 500)
    with client(3) as c:
        for _ in range(2):
            check_steps(c, a, steps=2, seed=1)
            check_steps(c, b, steps=2, seed=2)
        group = c._runtime._group
        assert len(group.endpoint(0).routes) == 8  # 2 plans x (forward, backward) x (dispatch, return)
        assert group.endpoint(0).device_exchanges >= 8


def test_a_failing_participant_fails_the_round_and_the_next_runs_on_a_new_group(monkeypatch):
    lens = batch(5)
    with client(3) as c:
        check_steps(c, lens, steps=3)
        first = c._runtime._group
        participants = next(iter(c._runtime._bound.values()))
        boom = participants[1].executor

        def broken(*args, **kwargs):
            raise RuntimeError("kernel failed on participant 1")
        monkeypatch.setattr(boom, "forward", broken)
        g = torch.Generator().manual_seed(1)
        x = [torch.randn(sum(lens), h, 8, generator=g, dtype=torch.float64) for h in (6, 2, 2)]
        with pytest.raises(RuntimeError, match="kernel failed on participant 1"):
            c.attend(*x, lens)
        monkeypatch.undo()
        c.new_step()
        check_steps(c, lens, steps=3)
        assert c._runtime._group is not first and first.broken


def test_local_heap_refuses_bad_sizes():
    with pytest.raises(ValueError, match="world_size"):
        LocalHeap(0, HEAP)
    with pytest.raises(ValueError, match="heap_bytes"):
        LocalHeap(4, 1024)
    with pytest.raises(ValueError, match="rank 3"):
        LocalHeap(2, HEAP).endpoint(3)
