"""One thread for every NVSHMEM host call of a process (issue 22 item 3).

NVSHMEM's host API is not meant to be called from several threads at once; a process's rounds may
run on the caller's thread or on a rounds thread. :class:`HostThread` runs the calls in order on one
daemon thread (puts and signals queued without waiting, waiting calls bounded by a timeout), and
:class:`HostBoundHeap` sends a heap's NVSHMEM calls through it.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Callable

import numpy as np
import torch

from ..errors import DistCAError


class HostThread:
    """A single daemon thread through which a process makes every NVSHMEM host call.

    :meth:`call` runs a function there and waits for it (bounded); :meth:`submit` queues one
    without waiting (puts and signals: their order is the queue's, and an error surfaces at the
    next :meth:`call`). A call made from the thread itself runs at once. Daemon: a call stuck in
    NVSHMEM (an init or finalize waiting for a dead peer) never keeps the process from exiting.

    A call that overran its wait leaves the thread *stuck* (:attr:`stuck`): later calls and
    submissions fail at once, rather than each waiting out its own bound behind it. Once the
    overrun call returns (a quiet whose stream a watchdog's force drained late), the thread is
    usable again; an error that call raised is reported by the next :meth:`call`.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str = "distca-nvshmem"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._overran: list[tuple[Future, str]] = []  # calls that overran their wait, oldest first
        self._overran_lock = threading.Lock()  # callers on several threads may overrun
        self._error: BaseException | None = None  # the first error of a submitted or overrun call

    @property
    def ident(self) -> int | None:
        """The thread's identity (``threading.get_ident()`` inside it)."""
        return self._thread.ident

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if future is None:  # submitted: no one waits; keep the first error
                try:
                    fn(*args)
                except BaseException as exc:  # noqa: BLE001 - reported by the next call
                    if self._error is None:
                        self._error = exc
                continue
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                    future.set_exception(exc)

    @property
    def stuck(self) -> str | None:
        """The name of the oldest call that overran its wait and has not returned yet; None when
        there is none (an overrun call that returned since no longer counts)."""
        if not self._overran:  # nearly always: no lock taken on every submission
            return None
        with self._overran_lock:
            while self._overran and self._overran[0][0].done():
                future, _ = self._overran.pop(0)
                late = future.exception()  # no one else will ever read it
                if late is not None and self._error is None:
                    self._error = late
            return self._overran[0][1] if self._overran else None

    def _check(self, what: str) -> None:
        stuck = self.stuck
        if stuck is not None:
            raise DistCAError(f"NVSHMEM {what}: the NVSHMEM host thread is still stuck in {stuck}")
        if not self._thread.is_alive():
            raise DistCAError(f"NVSHMEM {what}: the NVSHMEM host thread has stopped")

    def submit(self, fn: Callable, *args) -> None:
        """Queue ``fn(*args)`` on the thread without waiting (its error, if any, is raised by the
        next :meth:`call`).

        Raises:
            DistCAError: the thread is stuck in an earlier call or stopped.
        """
        if threading.current_thread() is self._thread:
            fn(*args)
            return
        self._check(getattr(fn, "__name__", "call"))
        self._queue.put((None, fn, args))

    def call(self, fn: Callable, *args, timeout_s: float | None = None, what: str | None = None):
        """``fn(*args)`` on the thread, after every call queued before it; returns its result.

        Args:
            timeout_s: the longest wait, in seconds (None: no bound).
            what: names the call in errors (default: ``fn``'s name).

        Raises:
            DistCAError: it did not return within ``timeout_s`` (the thread is then *stuck*: later
                calls fail at once until it returns), the thread is stuck or stopped, or a submitted
                call (or an overrun one, late) failed.
            whatever ``fn`` raises.
        """
        what = what or getattr(fn, "__name__", "call")
        if threading.current_thread() is self._thread:
            return fn(*args)
        self._check(what)
        future: Future = Future()
        self._queue.put((future, fn, args))
        try:
            result = future.result(timeout=timeout_s)
        except FutureTimeout:
            with self._overran_lock:
                self._overran.append((future, what))
            raise DistCAError(f"NVSHMEM {what} did not return within {timeout_s} s") from None
        error, self._error = self._error, None
        if error is not None:
            raise DistCAError(f"an earlier NVSHMEM call failed before {what}: {error}") from error
        return result

    def stop(self) -> None:
        """Let the thread end once the calls queued so far have run."""
        self._queue.put(None)


class HostBoundHeap:
    """A heap whose NVSHMEM calls run on a :class:`HostThread` (a :class:`.symmetric.SymmetricHeap`).

    ``put``, ``put_signal`` and ``signal`` first run the heap's ``stage`` on the calling thread
    (stream work that must see the caller's current stream; returns the source to put), then queue
    the heap's own method on the host thread; ``quiet``, ``close`` and ``finalize`` run there and
    wait (bounded by ``timeout_s``). Local copies and reads of this PE's own memory (``copy``,
    ``signals``, ``read``, ``idle``) call no NVSHMEM and run on the calling thread. The endpoint's
    ``stream_ops(abort_value, submit, timeout_s)``, where it has one, is offered as
    ``stream_ops(abort_value)`` with this host thread's ``submit``.

    Args:
        heap: the endpoint whose ``put``/``put_signal``/``signal``/``quiet``/``close`` make
            NVSHMEM calls; it may define ``stage(src) -> src`` (``src`` None for a signal).
        host: the process's :class:`HostThread`.
        timeout_s: the longest wait of a waiting call, in seconds.
    """

    def __init__(self, heap, host: HostThread, timeout_s: float):
        self.heap, self.host, self.timeout_s = heap, host, float(timeout_s)
        self.rank, self.world_size, self.device, self.arena = heap.rank, heap.world_size, heap.device, heap.arena
        self._stage = getattr(heap, "stage", lambda src: src)

    def put(self, pe: int, offset: int, src: torch.Tensor) -> None:
        if src.numel():
            self.host.submit(self.heap.put, pe, offset, self._stage(src))

    def put_signal(self, pe: int, offset: int, src: torch.Tensor, slot: int, value: int) -> None:
        self.host.submit(self.heap.put_signal, pe, offset, self._stage(src), slot, int(value))

    def signal(self, pe: int, slot: int, value: int) -> None:
        self._stage(None)
        self.host.submit(self.heap.signal, pe, slot, int(value))

    def quiet(self) -> None:
        self.host.call(self.heap.quiet, timeout_s=self.timeout_s, what="quiet")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.heap.copy(dst, src)

    def signals(self) -> np.ndarray:
        return self.heap.signals()

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.heap.read(offset, nbytes)

    def idle(self, seconds: float) -> None:
        self.heap.idle(seconds)

    def close(self) -> None:
        self.host.call(self.heap.close, timeout_s=self.timeout_s, what="close")

    def __getattr__(self, name):  # finalize ... of the endpoint (not host calls themselves)
        if name.startswith("_") or name == "heap":
            raise AttributeError(name)
        if name == "stream_ops":
            # The endpoint's device-driven stream must submit its NVSHMEM calls to this host
            # thread; looked up here so that an endpoint without one has no attribute either.
            make = getattr(self.heap, "stream_ops")
            return lambda abort_value: make(abort_value, submit=self.host.submit, timeout_s=self.timeout_s)
        return getattr(self.heap, name)
