"""The local runtime behind its declared interface: steps, plan cache, parts, traffic, stale batches."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from distca_client import DistCAClient, DistCAError
from distca_server.refs import varlen_attention_ref
from distca_server.runtime.base import BATCHES_KEPT, PlannedBatch, Runtime, StepState, sum_traffic
from scheduler.config import PlanConfig
from scheduler.cost import RoundKind


def _inputs(lens, seed=0, hq=4, hkv=2, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    return [torch.randn(T, h, d, generator=g, dtype=dtype) for h in (hq, hkv, hkv, hq)]


def _grad_step(client, lens, seed=0, layers=1):
    """``layers`` grad-requiring attends, then one backward through all of them."""
    outs = []
    for i in range(layers):
        q, k, v, dout = _inputs(lens, seed + i)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        outs.append((client.attend(*leaves, lens), dout))
    sum((o * d).sum() for o, d in outs).backward()


def _comm(plan, times=1):
    """``plan.comm_bytes()`` in ``traffic()``'s form (no totals, no zero tensors), ``times`` over."""
    return {kind: {n: b * times for n, b in per.items() if n != "total" and b}
            for kind, per in plan.comm_bytes().items() if per["total"]}


def _nonzero(traffic):
    return {kind: {n: b for n, b in per.items() if b} for kind, per in traffic.items()
            if any(per.values())}


def test_interface_and_parts():
    lens = [40, 3, 77, 1, 20]
    with DistCAClient.local(3, config=PlanConfig(mode="dedicated", min_shard=8), num_ranks=2) as client:
        assert isinstance(client._runtime, Runtime)
        assert client.last_step is None and client.last_plan is None and client.traffic() == {}
        _grad_step(client, lens)
        batch = client.last_step
        assert isinstance(batch, PlannedBatch)
        plan = client.last_plan
        assert plan is batch.plan and plan.num_ranks == 2 and plan.num_servers == 3
        assert [p.participant for p in batch.parts] == list(range(plan.num_participants)) == [0, 1, 2, 3, 4]
        assert [(p.rank, p.server) for p in batch.parts] == [(0, None), (1, None), (None, 0), (None, 1),
                                                            (None, 2)]
        assert batch.part is batch.parts[0]
        assert all((p.step, p.batch) == (batch.step, batch.batch) == (0, 0) for p in batch.parts)
        assert batch.backend_name


def test_step_ends_after_as_many_backward_as_counted_forward_rounds():
    lens = [50, 9, 31]
    with DistCAClient.local(2, config=PlanConfig(min_shard=8)) as client:
        runtime = client._runtime
        q, k, v, dout = _inputs(lens)
        # forward rounds without grad do not count: the step never ends by itself
        with torch.no_grad():
            client.attend(q, k, v, lens)
            first = client.last_step
            client.attend(q * 2, k, v, lens)
        assert client.last_step is first and runtime.step == 0
        client.attend(q, k, v, lens)  # no input requires grad: not counted either
        assert client.last_step is first and runtime.step == 0

        # two counted forward rounds; the step ends after the second backward round
        leaves = [[t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2)]
        outs = [client.attend(*x, lens) for x in leaves]
        assert client.last_step is first
        outs[1].backward(dout)
        client.attend(q, k, v, lens)  # one backward of two: same step, same batch
        assert client.last_step is first and runtime.step == 0
        outs[0].backward(dout)
        client.attend(q, k, v, lens)
        second = client.last_step
        assert second is not first and second.step == runtime.step == 1 and second.batch == 0
        assert second.plan is first.plan  # the plan is cached across steps by batch shape

        # the gradients are still exact
        want = varlen_attention_ref(*(t.detach().clone().requires_grad_() for t in (q, k, v)),
                                    lens, 8 ** -0.5)
        want.backward(dout)
        assert (outs[0].detach() - want.detach()).abs().max().item() <= 1e-10
        assert leaves[0][0].grad is not None and leaves[1][0].grad is not None


def test_new_step_ends_a_forward_only_step_and_stale_batches_refuse_rounds():
    lens = [30, 30]
    with DistCAClient.local(2, config=PlanConfig(min_shard=8)) as client:
        q, k, v, dout = _inputs(lens)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = client.attend(*leaves, lens)
        first = client.last_step
        client.new_step()
        assert client._runtime.step == 1
        with pytest.raises(DistCAError, match="step 0 used in step 1"):
            out.backward(dout)
        with torch.no_grad():
            client.attend(q, k, v, lens)
        assert client.last_step is not first and client.last_step.step == 1
        client.new_step()
        client.new_step()  # nothing bound in step 2 yet: stays
        assert client._runtime.step == 2


def test_traffic_is_the_last_steps_and_equals_comm_bytes():
    a, b = [70, 5, 140, 2, 33], [9, 200, 40]
    with DistCAClient.local(3, config=PlanConfig(mode="dedicated", min_shard=8), num_ranks=2) as client:
        _grad_step(client, a, layers=2)
        assert _nonzero(client.traffic()) == _comm(client.last_plan, times=2)
        _grad_step(client, a, seed=5)  # next step, same shape: counters start again
        assert client.last_step.step == 1
        assert _nonzero(client.traffic()) == _comm(client.last_plan)
        assert _nonzero(client.last_step.traffic()) == _comm(client.last_plan)

        # two batches in one step (ping-pong): the step's traffic sums both plans'
        qa, ka, va, da = (t.requires_grad_() if i < 3 else t for i, t in enumerate(_inputs(a, 1)))
        qb, kb, vb, db = (t.requires_grad_() if i < 3 else t for i, t in enumerate(_inputs(b, 2)))
        ha, hb = client.attend_async(qa, ka, va, a), client.attend_async(qb, kb, vb, b)
        out_a, out_b = ha.wait(), hb.wait()
        batch_a = client._runtime.step_for(a, client.last_step.fmt, torch.device("cpu"))  # claimed: found
        ((out_a * da).sum() + (out_b * db).sum()).backward()
        batch_b = client.last_step
        assert (batch_a.step, batch_a.batch, batch_b.step, batch_b.batch) == (2, 0, 2, 1)
        want = sum_traffic([_comm(batch_a.plan), _comm(batch_b.plan)])
        assert _nonzero(client.traffic()) == want


def test_batches_of_a_step_are_bounded():
    with DistCAClient.local(2, config=PlanConfig(min_shard=8)) as client, torch.no_grad():
        shapes = [[n, 3] for n in range(1, BATCHES_KEPT + 3)]
        for lens in shapes:
            client.attend(*_inputs(lens)[:3], lens)
        assert client.last_step.batch == BATCHES_KEPT + 1
        client.attend(*_inputs(shapes[0])[:3], shapes[0])  # evicted: bound again, new index
        assert client.last_step.batch == BATCHES_KEPT + 2 and client.last_step.step == 0
        client.attend(*_inputs(shapes[-1])[:3], shapes[-1])  # still kept
        assert client.last_step.batch == BATCHES_KEPT + 1


def test_closed_runtime_refuses_rounds():
    lens = [10, 10]
    client = DistCAClient.local(2, config=PlanConfig(min_shard=8))
    q, k, v, _ = _inputs(lens)
    client.attend(q, k, v, lens)
    client.close()
    client.close()  # idempotent
    with pytest.raises(DistCAError, match="closed"):
        client.attend(q, k, v, lens)


class _Batch:
    def __init__(self, step, batch):
        self.step, self.batch = step, batch
        self.released = []

    def release(self, why):  # a PlannedBatch drops its kept activations when its step ends
        self.released.append(why)


def _finished():
    done = Future()
    done.set_result(None)
    return done


def test_a_forward_only_loop_over_many_shapes_holds_no_evicted_batch_and_counts_every_ones_traffic():
    """An evaluation loop never ends its step: the client must not keep every batch it planned
    (each holds its participants) after the runtime evicted it, yet ``traffic()`` still sums
    every batch of the step, the freed ones too."""
    import gc
    import weakref
    shapes = [[60 + n, 3, 70] for n in range(3 * BATCHES_KEPT)]
    with DistCAClient.local(2, config=PlanConfig(min_shard=8), max_batches=2) as client, torch.no_grad():
        made, want = [], []
        for lens in shapes:
            client.attend(*_inputs(lens)[:3], lens)
            made.append(weakref.ref(client.last_step))
            want.append({kind: per for kind, per in _comm(client.last_plan).items() if kind == "forward"})
        gc.collect()
        alive = [r for r in made if r() is not None]
        assert len(alive) <= 2 + 1  # the runtime's idle batches, and the last one
        assert want[0] and _nonzero(client.traffic()) == sum_traffic(want)
        client.new_step()
        client.attend(*_inputs(shapes[0])[:3], shapes[0])
        assert _nonzero(client.traffic()) == want[0]  # the new step's alone


def test_step_state_counts_and_evicts():
    state = StepState(step=5)
    assert state.lookup("a") is None and state.next_batch_index() == 0
    a = _Batch(5, 0)
    state.add("a", a)
    assert state.lookup("a") is a and state.next_batch_index() == 1
    assert state.count_round(a, RoundKind.FORWARD, counts_for_step=False) == 0
    assert not state.ended
    assert state.count_round(a, RoundKind.FORWARD) == 1
    first = state.open_ticket(a, None)  # counted rounds: submit opens their tickets
    first.watch(_finished())
    assert state.count_round(a, RoundKind.FORWARD) == 2
    second = state.open_ticket(a, None)
    second.watch(_finished())
    state.count_round(a, RoundKind.BACKWARD)
    second.resolve()  # its backward ran
    assert not state.ended and state.lookup("a") is a
    state.count_round(a, RoundKind.BACKWARD)
    first.resolve()
    assert state.ended
    assert state.lookup("a") is None and state.step == 6 and state.next_batch_index() == 0
    with pytest.raises(DistCAError, match="batch 0 of step 5 used in step 6"):
        state.count_round(a, RoundKind.BACKWARD)
    state.advance(9)
    assert (state.step, state.forward_rounds, state.backward_rounds, state.seq) == (9, 0, 0, 0)


def test_a_batch_shape_seen_before_reuses_its_participants_layouts_and_stays_exact():
    lens = [300, 7, 1, 90, 33]
    with DistCAClient.local(num_servers=3, config=PlanConfig(epsilon=0.0, min_shard=4)) as client:
        steps = []
        for seed in range(3):  # one layer per step: every step binds the same plan anew
            q, k, v, dout = _inputs(lens, seed)
            leaves = [t.requires_grad_() for t in (q, k, v)]
            out = client.attend(*leaves, lens)
            out.backward(dout)
            ref = [t.detach().requires_grad_() for t in (q, k, v)]
            want = varlen_attention_ref(*ref, lens, 8 ** -0.5)
            want.backward(dout)
            torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
            for a, b in zip(leaves, ref):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-10)
            steps.append(client.last_step)
        first, last = steps[0].participants, steps[-1].participants
        assert steps[0] is not steps[-1] and steps[0].step != steps[-1].step
        assert all(a is not b and a.executor is b.executor for a, b in zip(first, last))
        assert any(p.traffic for p in first)  # rows moved
        assert [p.traffic for p in last] == [p.traffic for p in first]  # each step counts its own


def test_a_participant_stuck_in_its_kernel_fails_the_round_soon_and_the_next_round_runs():
    """Participant 1 of a blocking group (shm: a pool thread each) stalls in its kernel, never
    failing. Participant 0 times out: the round raises within about its timeout plus a grace
    (before: after 2 · timeout + 5 s, naming nobody), and the next round runs exact on a fresh
    pool (before: it queued behind the stuck thread and failed too)."""
    import threading
    import time

    from scheduler.config import JobConfig

    lens = [100, 1, 37, 12, 129, 31]
    # 10 s: the first and the recovery rounds must finish within it on a loaded machine; the
    # stalled round is bounded relative to it below
    cfg = JobConfig(servers=2, transport="shm", heap_bytes=16 << 20, timeout_s=10.0,
                    plan=PlanConfig(mode="inplace", min_shard=8))
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(sum(lens), h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
    release = threading.Event()
    with DistCAClient.local(config=cfg) as c, torch.no_grad():
        c.attend(q, k, v, lens)
        executor = next(iter(c._runtime._bound.values()))[1].executor
        forward = executor.forward
        executor.forward = lambda *a, **kw: (release.wait(60), forward(*a, **kw))[1]
        try:
            start = time.monotonic()
            with pytest.raises(DistCAError):
                c.attend(q, k, v, lens)
            assert time.monotonic() - start < 2 * cfg.timeout_s + 5 - 1  # not the old whole budget
            executor.forward = forward
            out = c.attend(q, k, v, lens)
        finally:
            release.set()
    want = varlen_attention_ref(q, k, v, lens, 8 ** -0.5)
    assert torch.allclose(out, want, atol=1e-10)
