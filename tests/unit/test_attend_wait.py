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
