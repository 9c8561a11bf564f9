"""Which batch an ``attend`` call belongs to (``StepState``, no Ray): identical ping-pong
nano-batches are two batches, each layer goes back to its own, by the program's order of calls
and claims, never by timing (issue 11, defect 4)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from distca_client import DistCAClient, DistCAError
from distca_server.refs import varlen_attention_ref
from distca_server.runtime.base import StepState
from scheduler.config import JobConfig, PlanConfig
from scheduler.cost import RoundKind


class _Batch:
    def __init__(self, step, index):
        self.step, self.batch = step, index
        self.released = []

    def release(self, why):  # a PlannedBatch drops its kept activations when its step ends
        self.released.append(why)

    def release_round(self, kept):  # ... and one round's when autograd dropped its node
        self.released.append(kept)


def _bind(state, key):
    found = state.lookup(key)
    if found is None:
        found = _Batch(state.step, state.next_batch_index())
        state.add(key, found)
    return found


def _forward(state, batch):
    state.count_round(batch, RoundKind.FORWARD)
    inner = Future()
    inner.set_result("out")
    return state.claimable(batch, inner)


def test_same_key_while_a_forward_is_unclaimed_is_a_new_batch():
    state = StepState()
    a1 = _bind(state, "k")
    fa = _forward(state, a1)
    b1 = _bind(state, "k")  # rank 0's second nano-batch, same documents: A's result not claimed yet
    fb = _forward(state, b1)
    assert (a1.batch, b1.batch) == (0, 1)
    assert fa.result() == "out" and fb.result() == "out"  # both claimed (wait(), in program order)
    a2 = _bind(state, "k")  # layer 2 of A: the least recently used free batch
    fa = _forward(state, a2)
    b2 = _bind(state, "k")  # layer 2 of B: A's batch is busy again
    assert (a2, b2) == (a1, b1)
    fa.result()
    assert fa.done()
    c = _bind(state, "other")
    assert c.batch == 2 and _bind(state, "other") is c  # a distinct key, then found again


def test_a_claim_is_counted_once_and_advance_forgets_everything():
    state = StepState(5)
    a = _bind(state, "k")
    f = _forward(state, a)
    assert _bind(state, "k") is not a
    f.result()
    f.result()  # a second result() does not claim twice
    state.advance()
    assert state.step == 6 and state.lookup("k") is None and state.next_batch_index() == 0
    assert a.released == ["step 5 ended"]  # its kept activations were dropped


def test_failed_rounds_can_still_be_claimed():
    state = StepState()
    a = _bind(state, "k")
    state.count_round(a, RoundKind.FORWARD)
    inner = Future()
    claimed = state.claimable(a, inner)
    inner.set_exception(RuntimeError("lost"))
    assert isinstance(claimed.exception(), RuntimeError)
    try:
        claimed.result()
    except RuntimeError:
        pass
    assert state.lookup("k") is a


def test_local_ping_pong_with_identical_nano_batches_is_exact():
    lens = [100, 28]
    g = torch.Generator().manual_seed(0)
    runs = [[torch.randn(128, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2)] for _ in range(2)]
    config = JobConfig(plan=PlanConfig(min_shard=8), servers=2, backend="reference")
    with DistCAClient.local(config=config) as client, torch.no_grad():
        for _ in range(2):  # two layers, each nano-batch back on its own batch
            handles = [client.attend_async(q, k, v, lens) for q, k, v in runs]
            batches = [h._pending.step for h in handles]
            assert [b.batch for b in batches] == [0, 1]
            for (q, k, v), h in zip(runs, handles):
                want = varlen_attention_ref(q, k, v, lens, 16 ** -0.5)
                assert (h.wait() - want).abs().max().item() < 1e-10


def test_a_dropped_ticket_releases_its_round_once_the_round_is_done():
    state = StepState()
    a = _bind(state, "k")
    state.count_round(a, RoundKind.FORWARD)
    inner = Future()
    future = state.claimable(a, inner, 0, state.open_ticket(a, 0))
    ticket = future.take_ticket()
    assert future.take_ticket() is None  # handed over once: the future does not keep it alive
    del ticket  # autograd freed the node while the round still runs: its rows do not exist yet
    assert a.released == []
    inner.set_result("out")
    assert a.released == [0]  # released as soon as the round had kept them
    state.count_round(a, RoundKind.FORWARD)
    done = Future()
    done.set_result("out")
    kept = state.claimable(a, done, 1, state.open_ticket(a, 1)).take_ticket()
    kept.resolve()  # its backward ran: the backward round freed the rows itself
    del kept
    assert a.released == [0]


def test_a_step_does_not_end_inside_a_backward_pass():
    state = StepState()
    a = _bind(state, "k")
    state.count_round(a, RoundKind.BACKWARD)
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(state.ended)  # a checkpoint's recomputation looks its batch up here
            return g
    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert seen == [False] and state.ended


def test_a_step_ended_while_a_counted_round_runs_releases_its_rows_once_it_is_done():
    state = StepState()
    a = _bind(state, "k")
    state.count_round(a, RoundKind.FORWARD)
    inner = Future()
    ticket = state.claimable(a, inner, 0, state.open_ticket(a, 0)).take_ticket()
    state.advance()  # new_step() while the round still runs: its rows do not exist yet
    assert a.released == ["step 0 ended"]
    inner.set_result("out")
    assert a.released == ["step 0 ended", 0]  # the round had kept them after the step released the batch
    ticket.resolve()  # a late backward's resolve (or the node's free) does nothing more
    del ticket
    assert a.released == ["step 0 ended", 0]


def test_new_step_during_an_async_round_leaves_no_kept_rows_behind(monkeypatch):
    import threading
    import time

    from distca_server import executor

    started, go = threading.Event(), threading.Event()
    forward = executor.ServerExecutor.forward

    def held_forward(self, *args, **kwargs):  # hold the round until new_step() has run
        started.set()
        assert go.wait(60)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(executor.ServerExecutor, "forward", held_forward)
    g = torch.Generator().manual_seed(0)
    with DistCAClient.local(num_servers=3, config=PlanConfig(min_shard=4, keep_activations=True)) as client:
        held = lambda: sum(p.held_bytes() for ps in client._runtime._bound.values() for p in ps)  # noqa: E731
        for lens in ([43, 3, 25], [30, 30]):  # a new batch shape each step
            q, k, v = (torch.randn(sum(lens), h, 8, generator=g, dtype=torch.float64, requires_grad=True)
                       for h in (4, 2, 2))
            started.clear(), go.clear()
            handle = client.attend_async(q, k, v, lens)
            assert started.wait(60)
            client.new_step()
            go.set()
            out = handle.wait(60)
            assert (out - varlen_attention_ref(q.detach(), k.detach(), v.detach(), lens, 8 ** -0.5)).abs().max() < 1e-10
            deadline = time.monotonic() + 60  # the release runs in the round's done callback
            while held() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert held() == 0
            with pytest.raises(DistCAError, match="step"):  # its step ended: the backward is refused
                out.sum().backward()
