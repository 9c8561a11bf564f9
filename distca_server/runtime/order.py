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


class Settled:
    """The future of a round that ran on the caller's thread (:meth:`RoundSlot.here`): done when
    made, with the methods of ``concurrent.futures.Future`` that rounds' takers use (``done``,
    ``result``, ``exception``, ``add_done_callback``). A ``Future`` builds a condition variable and
    its lock, and its callbacks take that lock: host time every synchronous round (``attend`` and
    every backward) paid for a result that is already there."""

    __slots__ = ("_result", "_exception")

    def __init__(self, result=None, exception: BaseException | None = None):
        self._result, self._exception = result, exception

    @staticmethod
    def of(fn, args) -> "Settled":
        """``fn(*args)``'s result, or the exception it raised (for whoever takes the result)."""
        try:
            return Settled(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - the round's error belongs to whoever takes its result
            return Settled(exception=exc)

    def done(self) -> bool:
        return True

    def result(self, timeout=None):
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self, timeout=None) -> BaseException | None:
        return self._exception

    def add_done_callback(self, fn) -> None:
        """Call ``fn(self)`` now (the future is done), as ``Future`` does for a done future."""
        fn(self)


def _settle(future: Future, finished, fn, args) -> None:
    """Run ``fn(*args)`` into ``future``, then call ``finished()``."""
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
        finished()


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

    The queue links each slot to the one before it, never to a future: a future keeps its result,
    and a forward round's ``out`` carries its autograd node, which must go when the caller drops
    it (that frees the activations the servers keep for it). A slot makes its ``threading.Event``
    only when a later round has to wait for it (a round queued on the worker thread still
    running): synchronous rounds one after another, the common case, make none."""

    __slots__ = ("_queue", "_before", "_done", "_event")

    def __init__(self, queue: "RoundQueue", before: "RoundSlot | None"):
        self._queue, self._before, self._done, self._event = queue, before, False, None

    def _finish(self) -> None:
        """The round ran (or failed): wake whoever waits for it."""
        with self._queue._lock:
            self._done, event = True, self._event
        if event is not None:
            event.set()

    def wait_done(self) -> None:
        """Return once the round ran (each round's own waits are bounded by the transports'
        timeouts, so this is too)."""
        with self._queue._lock:
            if self._done:
                return
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        event.wait()

    def _after_before(self) -> None:
        before, self._before = self._before, None
        if before is not None:
            before.wait_done()

    def here(self, fn, *args) -> Settled:
        """Run ``fn(*args)`` on this thread once the rounds before it are done; returns the
        (done) future of its result."""
        try:
            self._after_before()
            return Settled.of(fn, args)
        finally:
            self._finish()

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
            self._queue._worker().submit(_settle, future, self._finish, job, ())
        except BaseException:
            self._finish()
            raise
        return future


class RoundQueue:
    """A process's rounds, one at a time in the order :meth:`reserve` was called (see the module
    doc). ``name`` names the worker thread."""

    def __init__(self, name: str):
        self._name = name
        self._lock = threading.Lock()
        self._last: RoundSlot | None = None
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
            slot = self._last = RoundSlot(self, self._last)
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
            last.wait_done()
        if pool is not None:
            pool.shutdown(wait=True)
