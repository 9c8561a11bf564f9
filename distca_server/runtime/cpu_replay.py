"""Captured rounds on the CPU, for tests and benchmarks: a stand-in for a CUDA graph's replay.

A CUDA graph cannot be recorded or replayed on the CPU, so :class:`ThreadReplay` stands in for a
participant's :class:`~distca_server.transport.exchange_graph.ExchangeGraph`: a replay runs the
recorded round function again, on a thread of its own (so that the participants' exchanges meet,
as their streams do on a GPU), alternating between the two signal sets as a replay does.
:func:`cpu_replays` makes :class:`~distca_server.runtime.graphed.RoundGraphs` capture CPU rounds
with it. Everything else (the static tensors, the copies in and out, the kept rows) is the real
code of :mod:`.graphed`.
"""

from __future__ import annotations

import contextlib
import threading

from ..transport.routed import RoutedTransport
from .graphed import RoundGraphs


class ThreadReplay:
    """One participant's recording on the CPU (module doc).

    Args:
        transport: the participant's transport (the stand-in's signature is
            ``RoutedTransport.graph``'s); closed when a replay's round raises, as a participant
            whose eager round fails leaves its group (its peers stop waiting for it at once).
        fn: the recorded round.
        runs: how many replays run ``fn`` (None: all); later ones queue nothing and return, as a
            graph replay returns once its work is queued. With the same inputs every replay, the
            no-op replays' outputs are those of the last run of each signal set (a benchmark of the
            host's own work; ``runs=2`` runs each set once).
    """

    def __init__(self, transport, fn, runs: int | None = None):
        self.transport, self.fn, self.runs, self.next_set, self.usable, self.calls = transport, fn, runs, 0, True, 0

    def replay(self):
        self.next_set, self.calls = 1 - self.next_set, self.calls + 1
        if self.runs is not None and self.calls > self.runs:
            return _Queued()
        failed: list = []

        def body():
            try:
                self.fn()
            except BaseException as exc:  # noqa: BLE001 - raised by wait()
                failed.append(exc)
                self.transport.close()
        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        # every wait inside the round ends by the transport's timeout: the eager rounds' budget
        return _Joined(thread, failed, 2 * self.transport.timeout_s + 5)

    def release(self) -> None:
        pass


class _Joined:
    def __init__(self, thread, failed, budget_s: float):
        self.thread, self.failed, self.budget_s = thread, failed, budget_s

    def wait(self) -> None:
        """Join the replay's thread; raise what the round raised.

        Raises:
            RuntimeError: the round did not finish within ``budget_s`` (twice the transport's
                timeout, plus 5 s).
        """
        self.thread.join(self.budget_s)
        if self.thread.is_alive():
            raise RuntimeError(f"a replayed round did not finish within {self.budget_s:g} s")
        if self.failed:
            raise self.failed[0]


class _Queued:
    def wait(self) -> None:
        pass


@contextlib.contextmanager
def cpu_replays(runs: int | None = None):
    """While inside, rounds on the CPU are captured (after their warm-up, as on CUDA) and replayed
    by :class:`ThreadReplay` (``runs`` as there)."""
    saved = RoundGraphs.device_types, RoutedTransport.graph
    RoundGraphs.device_types = ("cuda", "cpu")
    RoutedTransport.graph = lambda self, fn: ThreadReplay(self, fn, runs)
    try:
        yield
    finally:
        RoundGraphs.device_types, RoutedTransport.graph = saved


__all__ = ["ThreadReplay", "cpu_replays"]
