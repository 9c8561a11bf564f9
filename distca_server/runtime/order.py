"""The order of a process's rounds, and of their device work against the caller's CUDA stream.

Rounds of one process run one at a time, in the order they were counted (every client issues
them in the same order, so the all-to-alls of a round pair up). Two ways to run one:

* **synchronous** (``attend``, every backward round): on the caller's thread, once the rounds
  queued before it are done. No hand-off to another thread, and the round's device work goes on
  the caller's current stream, after what the caller queued there, so nothing needs an event.
* **queued** (``attend_async``): on the queue's one worker thread, which starts only when a first
  round is queued. The caller's current stream records an event at submit; the worker's stream
  waits on it before the round's work (q, k, v made on a ping-pong side stream are complete
  before the gather reads them), and records a completion event after it; taking the result
  (:class:`RoundFuture`, ``handle.wait()``) makes the taker's current stream wait on that event.
  So the worker never blocks on the device and may queue the next round's work at once.

:class:`StreamFence` carries the same ordering to the helper threads of a round (the local
runtime's participants): they wait on the event of the thread that started the round, and that
thread's stream then waits on each helper's completion event; no thread blocks on a stream.
On the CPU (no CUDA tensor) both are no-ops.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..errors import DistCAError


def cuda_device(tensors) -> torch.device | None:
    """The device of the first CUDA tensor among ``tensors`` (None entries allowed), else None."""
    return next((t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda), None)


class StreamFence:
    """Orders the device work of other threads after the creating thread's current CUDA stream
    (:meth:`enter`, on the other thread) and back (:meth:`leave` there, :meth:`join` here).

    Args:
        device: the round's CUDA device; None (the CPU) makes every method do nothing.
    """

    __slots__ = ("device", "ready")

    def __init__(self, device: torch.device | None):
        self.device = device if device is not None and device.type == "cuda" else None
        self.ready = None
        if self.device is not None:
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(self.device))

    def enter(self) -> None:
        """On another thread, before its device work: its current stream waits for the work the
        creating thread had queued when the fence was made."""
        if self.device is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)

    def leave(self):
        """On another thread, after its device work: an event on its current stream (None on the
        CPU), for :meth:`join`."""
        if self.device is None:
            return None
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done

    def join(self, events) -> None:
        """On the creating thread: its current stream waits for every event :meth:`leave` gave."""
        if self.device is None:
            return
        stream = torch.cuda.current_stream(self.device)
        for done in events:
            if done is not None:
                stream.wait_event(done)


def _settle(future: Future, finished: threading.Event, fn, args) -> None:
    """Run ``fn(*args)`` into ``future``, then set ``finished``."""
    try:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as exc:  # the round's error belongs to whoever takes its result
            future.set_exception(exc)
        else:
            future.set_result(result)
    finally:
        finished.set()


class RoundFuture(Future):
    """The future of a queued round: :meth:`result` also makes the *calling* thread's current
    CUDA stream wait on the round's completion event (``device_done``, recorded on the rounds
    thread's stream after the round's work), so the results are complete on the stream that reads
    them, and no thread blocks on a stream. On the CPU it is a plain future."""

    def __init__(self, fence: "StreamFence"):
        super().__init__()
        self._fence, self.device_done = fence, None

    def join_stream(self) -> None:
        """This thread's current stream waits for the round's device work (no-op on the CPU)."""
        self._fence.join([self.device_done])

    def result(self, timeout=None):
        out = super().result(timeout)
        self.join_stream()
        return out


class RoundSlot:
    """A round's place in its :class:`RoundQueue` (taken by :meth:`RoundQueue.reserve`, under the
    runtime's lock, in the order rounds are counted); run it with :meth:`here` or :meth:`queued`,
    exactly once.

    The queue links slots by their ``finished`` events, never by their futures: a future keeps its
    result, and a forward round's ``out`` carries its autograd node, which must go when the caller
    drops it (that frees the activations the servers keep for it)."""

    __slots__ = ("_queue", "_before", "finished")

    def __init__(self, queue: "RoundQueue", before: threading.Event | None):
        self._queue, self._before, self.finished = queue, before, threading.Event()

    def _after_before(self) -> None:
        before, self._before = self._before, None
        if before is not None:
            before.wait()  # each round's own waits are bounded (the transports' timeouts)

    def here(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on this thread once the rounds before it are done; returns the
        (done) future of its result."""
        future: Future = Future()
        try:
            self._after_before()
        except BaseException:
            self.finished.set()
            raise
        _settle(future, self.finished, fn, args)
        return future

    def queued(self, fn, tensors, *args) -> Future:
        """Run ``fn(*args)`` on the queue's worker thread after the rounds before it, ordered
        after the work the caller's current stream holds now (``tensors``: the round's tensors,
        to find their CUDA device); returns its future."""
        fence = StreamFence(cuda_device(tensors))

        future = RoundFuture(fence)

        def job():
            self._after_before()
            fence.enter()
            try:
                return fn(*args)
            finally:  # set before the result: whoever sees the future done sees its event
                future.device_done = fence.leave()
        try:
            self._queue._worker().submit(_settle, future, self.finished, job, ())
        except BaseException:
            self.finished.set()
            raise
        return future


class RoundQueue:
    """A process's rounds, one at a time in the order :meth:`reserve` was called (see the module
    doc). ``name`` names the worker thread."""

    def __init__(self, name: str):
        self._name = name
        self._lock = threading.Lock()
        self._last: threading.Event | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def reserve(self) -> RoundSlot:
        """The next place in the order.

        Raises:
            DistCAError: the queue is closed.
        """
        with self._lock:
            if self._closed:
                raise DistCAError("this DistCAClient is closed")
            slot = RoundSlot(self, self._last)
            self._last = slot.finished
            return slot

    def _worker(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
            return self._pool

    def close(self) -> None:
        """Refuse new rounds; wait for the reserved ones (queued rounds still run)."""
        with self._lock:
            self._closed = True
            last, pool = self._last, self._pool
        if last is not None:
            last.wait()
        if pool is not None:
            pool.shutdown(wait=True)
