"""Rounds run one at a time in the order they were counted: a synchronous round on the caller's
thread (no hand-off), a queued one on the rounds thread (``distca_server.runtime.order``)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from distca_client import DistCAClient
from distca_server.errors import DistCAError
from distca_server.refs import varlen_attention_ref
from distca_server.runtime.order import RoundQueue, StreamFence
from scheduler.config import PlanConfig


def test_a_synchronous_round_runs_on_the_callers_thread_and_starts_no_worker():
    rounds = RoundQueue("t")
    seen = []
    future = rounds.reserve().here(lambda x: seen.append(threading.current_thread()) or x * 2, 21)
    assert future.done() and future.result() == 42
    assert seen == [threading.current_thread()]
    assert rounds._pool is None  # nothing was handed off
    rounds.close()


def test_rounds_keep_the_order_they_were_reserved_in_across_threads():
    rounds = RoundQueue("t")
    order, gate = [], threading.Event()
    first = rounds.reserve()
    second = rounds.reserve()
    third = rounds.reserve()
    f1 = first.queued(lambda: (gate.wait(60), order.append(1)), ())
    # The synchronous round reserved second waits for the queued one, on another thread.
    done2 = threading.Event()

    def sync():
        second.here(order.append, 2)
        done2.set()
    t = threading.Thread(target=sync)
    t.start()
    f3 = third.queued(order.append, (), 3)
    assert not done2.wait(0.2) and order == []
    gate.set()
    t.join(60)
    f3.result(timeout=60)
    assert f1.done() and order == [1, 2, 3]
    rounds.close()


def test_a_failed_round_does_not_stop_the_next_and_close_refuses_new_rounds():
    rounds = RoundQueue("t")

    def boom():
        raise RuntimeError("round failed")
    bad = rounds.reserve().queued(boom, ())
    good = rounds.reserve().here(lambda: "next")
    with pytest.raises(RuntimeError, match="round failed"):
        bad.result(timeout=60)
    assert good.result() == "next"
    rounds.close()
    with pytest.raises(DistCAError, match="closed"):
        rounds.reserve()


def test_synchronous_rounds_make_no_event_and_carry_their_errors():
    rounds = RoundQueue("t")
    slots = [rounds.reserve() for _ in range(3)]
    assert slots[0].here(lambda: 1).result() == 1

    def boom():
        raise ValueError("bad round")
    failed = slots[1].here(boom)  # the error goes to whoever takes the result, as a Future's would
    assert failed.done() and isinstance(failed.exception(), ValueError)
    with pytest.raises(ValueError, match="bad round"):
        failed.result()
    seen = []
    failed.add_done_callback(seen.append)  # a done future calls back at once
    assert seen == [failed]
    assert slots[2].here(lambda: 3).result() == 3
    assert all(s._event is None for s in slots)  # nobody had to wait: no threading.Event was made
    rounds.close()


def test_a_round_waiting_for_a_running_one_wakes_when_it_ends():
    rounds = RoundQueue("t")
    gate, first, second = threading.Event(), rounds.reserve(), rounds.reserve()
    f1 = first.queued(gate.wait, (), 60)
    out = []
    t = threading.Thread(target=lambda: out.append(second.here(lambda: "after").result()))
    t.start()
    deadline = time.monotonic() + 60
    while first._event is None and time.monotonic() < deadline:  # it waits on an event made for it
        time.sleep(0.01)
    assert first._event is not None and t.is_alive() and out == []
    gate.set()
    t.join(60)
    assert f1.result(timeout=60) is True and out == ["after"]
    rounds.close()


def test_fence_does_nothing_on_the_cpu():
    fence = StreamFence(torch.device("cpu"))
    fence.enter()
    assert fence.leave() is None
    fence.join([None])


@pytest.mark.parametrize("num_servers,mode", [(1, "inplace"), (3, "inplace"), (2, "dedicated")])
def test_attend_forward_and_backward_never_use_the_rounds_thread(num_servers, mode):
    lens = [50, 1, 77, 13]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sum(lens), 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(sum(lens), 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    with DistCAClient.local(num_servers, config=PlanConfig(mode=mode, min_shard=8)) as client:
        out = client.attend(q, k, v, lens)
        out.square().sum().backward()
        assert client._runtime._rounds._pool is None  # every round ran on this thread
        grads = [t.grad.clone() for t in (q, k, v)]
        want = varlen_attention_ref(q, k, v, lens, 8 ** -0.5)
        want = want[0] if isinstance(want, tuple) else want
        assert (out - want).abs().max().item() <= 1e-10
        for t in (q, k, v):
            t.grad = None
        want.square().sum().backward()
        for got, t in zip(grads, (q, k, v)):
            assert (got - t.grad).abs().max().item() <= 1e-10
        # attend_async queues its round on the rounds thread; the result is the same.
        again = client.attend_async(q.detach(), k.detach(), v.detach(), lens).wait()
        assert client._runtime._rounds._pool is not None
        assert (again - want.detach()).abs().max().item() <= 1e-10
