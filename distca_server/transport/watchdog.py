"""The watchdog of a PE's device-driven exchanges (:mod:`.routed`, :mod:`.exchange_graph`): a
daemon thread that never blocks the thread queueing work. It resolves the exchanges whose marker
passed, expires those past their deadline (the transport names the silent peers, tells them, and
forces the abort value into its own words so the stream drains), expires at once an exchange whose
peer aborted or left.
"""

from __future__ import annotations

import threading
import time

from ..errors import DistCAError

WATCH_POLL_S = 0.05  # the watchdog's longest sleep while exchanges are in flight


class Watchdog:
    """A daemon thread that bounds a transport's device-driven exchanges: it resolves those whose
    marker passed and expires those past their deadline (:meth:`.routed.RoutedTransport._expire`)."""

    def __init__(self, transport):
        self._transport = transport
        self._wake = threading.Condition()
        self._stop = False
        # True from before the thread looks for exchanges in flight until it knows it has some: only
        # then may it sleep with no timeout, so only then must a new exchange wake it (a poke
        # otherwise woke it at every exchange, and a layer's replays make several)
        self._idle = True
        self._thread = threading.Thread(target=self._run, name=f"distca-watchdog-{transport.rank}", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Call after adding an exchange in flight: wakes the thread if it may be sleeping with no
        timeout (else it looks again within :data:`WATCH_POLL_S`)."""
        if self._idle:
            with self._wake:
                self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        t = self._transport
        while True:
            with self._wake:
                if self._stop:
                    return
                # Deadlines are seconds: looking every WATCH_POLL_S while anything is in flight
                # keeps a failure within GRACE_S of its deadline; idle, it sleeps until poked.
                # _idle is set before the look: an exchange added after it finds _idle set and
                # notifies (under the lock, so once this thread waits); one added before is seen
                self._idle = True
                busy = bool(t._unresolved())
                self._idle = not busy
                self._wake.wait(WATCH_POLL_S if busy else None)
                if self._stop:
                    return
            now, words = time.monotonic(), None
            for e in t._unresolved():
                try:
                    if e.marker.done():
                        t._resolve(e)
                    elif e.expired is None and now >= e.deadline:
                        t._expire(e)
                    elif e.expired is None:  # a peer this exchange waits on may have failed or left
                        words = t.heap.signals() if words is None else words
                        t._check_peers(e, words)
                except Exception as exc:  # noqa: BLE001 - the watchdog must outlive any one failure
                    t._fail(e, DistCAError(f"participant {t.rank}: the watchdog failed on {e.label}: "
                                           f"{type(exc).__name__}: {exc}"))


__all__ = ["WATCH_POLL_S", "Watchdog"]
