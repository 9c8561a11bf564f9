"""``AttendHandle.wait(timeout)`` is bounded: a round still running after the timeout raises
``TimeoutError`` and goes on, and a later ``wait`` returns its exact result."""

from __future__ import annotations

import threading

import pytest
import torch

from distca_client import DistCAClient
from distca_server.refs import varlen_attention_ref


def test_wait_with_a_timeout_raises_then_the_round_still_finishes_exactly():
    lens = [37, 1, 90]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lens), 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(lens), 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    with DistCAClient.local(2) as client:
        # Rounds run one at a time in call order: a round queued behind a blocked one cannot end.
        gate = threading.Event()
        blocker = client._runtime._rounds.reserve().queued(gate.wait, (), 60)
        handle = client.attend_async(q, k, v, lens)
        with pytest.raises(TimeoutError, match="still running after 0.2 s"):
            handle.wait(timeout=0.2)
        assert not handle.done()
        gate.set()
        blocker.result(timeout=60)
        out = handle.wait(timeout=60)
        want = varlen_attention_ref(q, k, v, lens, 16 ** -0.5)
        want = want[0] if isinstance(want, tuple) else want
        assert (out - want).abs().max().item() <= 1e-10
        assert handle.wait() is out  # the result is kept


@pytest.mark.parametrize("huge", [float("inf"), 1e10, 10**400])
def test_wait_checks_its_timeout_and_waits_out_a_huge_one(huge):
    """A NaN, str or bool timeout is a ValueError (it was a wait of nan s, or accepted); inf, or
    a timeout past what a lock wait takes, waits until the round ends (it was an OverflowError
    while the round ran)."""
    lens = [5, 3]
    q, k, v = torch.randn(8, 2, 8), torch.randn(8, 1, 8), torch.randn(8, 1, 8)
    with DistCAClient.local(2) as client:
        gate = threading.Event()
        blocker = client._runtime._rounds.reserve().queued(gate.wait, (), 60)
        handle = client.attend_async(q, k, v, lens)
        for bad in (float("nan"), "1", True):
            with pytest.raises(ValueError, match="timeout must be a number of seconds or None"):
                handle.wait(timeout=bad)
        threading.Timer(0.2, gate.set).start()  # the round ends while the wait waits
        out = handle.wait(timeout=huge)
        blocker.result(timeout=60)
        assert out.shape == q.shape and handle.wait(timeout=-1) is out


@pytest.mark.parametrize("keep", [True, False])
def test_a_round_started_under_no_grad_stays_forward_only_when_waited_for_with_grad(keep):
    """A handle started under ``torch.no_grad`` and waited for outside it: the round was forward
    only (the servers kept nothing, the step counts no backward), so its output is not connected
    to autograd; before, it required grad and its backward failed inside a participant (kept
    activations) or ran a round the step never counted. The next step is exact."""
    from scheduler.config import JobConfig, PlanConfig
    lens = [40, 30, 3]
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lens), 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(sum(lens), 1, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    config = JobConfig(servers=2, transport="shm", timeout_s=60,
                       plan=PlanConfig(mode="inplace", min_shard=8, keep_activations=keep))
    with DistCAClient.local(config=config) as client:
        with torch.no_grad():
            handle = client.attend_async(q, k, v, lens)
        out = handle.wait()
        want = varlen_attention_ref(q.detach(), k.detach(), v.detach(), lens, 8 ** -0.5)
        want = want[0] if isinstance(want, tuple) else want
        assert not out.requires_grad and out.grad_fn is None
        assert (out - want).abs().max().item() <= 1e-10
        client.new_step()
        out = client.attend(q, k, v, lens)  # a training step after it
        out.backward(torch.ones_like(out))
        assert q.grad is not None and (out.detach() - want).abs().max().item() <= 1e-10


@pytest.mark.parametrize("call", ["attend", "attend_async"])
def test_a_bad_return_lse_fails_the_step_for_the_peers_before_raising(call, monkeypatch):
    """``return_lse`` is checked with the other inputs: the runtime is told (``fail_step``, which
    makes a Ray job's peers fail the step at once) before the ValueError, as for a bad window;
    before, the peers waited out their timeout, and the step after it too."""
    lens = [5, 3]
    q, k, v = torch.randn(8, 2, 8), torch.randn(8, 1, 8), torch.randn(8, 1, 8)
    with DistCAClient.local(2) as client:
        told = []
        monkeypatch.setattr(client._runtime, "fail_step", told.append)
        with pytest.raises(ValueError, match="return_lse must be a bool, got 1") as err:
            getattr(client, call)(q, k, v, lens, return_lse=1)
        assert told == [err.value]
        out = client.attend(q, k, v, lens)  # the next call runs
        assert out.shape == q.shape
