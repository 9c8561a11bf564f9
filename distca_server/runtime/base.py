"""The interface every runtime implements, and the step bookkeeping they share.

A *runtime* turns ``attend`` calls into rounds: :class:`Runtime` binds each batch of a training
step to its plan and to the participants this process runs (:meth:`Runtime.step_for`), and the
returned :class:`PlannedBatch` runs that batch's forward and backward rounds. Two runtimes
implement it: :class:`~distca_server.runtime.local.LocalRuntime` (every participant a thread of
this process) and :class:`~distca_server.runtime.ray_client.RayClientRuntime` (this process is one
client of a job on Ray). ``DistCAClient`` and its autograd function see only this interface.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import Future

import torch

from scheduler.cost import RoundKind
from scheduler.parts import PlanPart
from scheduler.tasks import Plan

from ..errors import DistCAError
from ..wire import RowFormat

Traffic = dict[str, dict[str, int]]
"""Bytes sent to other participants: ``{round_kind.value: {tensor: bytes}}``, e.g.
``{"forward": {"q": ..., "k": ..., "v": ..., "out": ..., "lse": ...}, "backward": {...}}``;
tensors and kinds with nothing sent are absent."""

BATCHES_KEPT = 16
"""Default ``max_batches``: how many idle batches (no forward round awaiting its backward) a step
keeps bound. Without a limit, an evaluation loop over many batch shapes and no ``new_step`` would
hold every one. An evicted batch is planned again under a new batch index; a batch with a forward
round awaiting its backward is never evicted."""


def as_traffic(counter) -> Traffic:
    """A participant's ``traffic`` counter (``{(kind, tensor): bytes}``, see
    :attr:`~distca_server.participant.Participant.traffic`) as a :data:`Traffic` dict."""
    out: Traffic = {}
    for (kind, name), n in list(counter.items()):
        out.setdefault(kind, {})[name] = int(n)
    return out


def sum_traffic(traffics) -> Traffic:
    """Sum :data:`Traffic` dicts, tensor by tensor."""
    total: Traffic = {}
    for traffic in traffics:
        for kind, per in traffic.items():
            into = total.setdefault(kind, {})
            for name, n in per.items():
                into[name] = into.get(name, 0) + n
    return total


class StepTraffic:
    """The bytes a client's batches of its current step sent (``DistCAClient.traffic``), without
    holding the batches: a forward-only loop over many batch shapes never ends its step, and
    every batch it kept would hold its participants (index tensors, on the GPU on a GPU) after
    the runtime evicted it (:data:`BATCHES_KEPT`). Live batches are referenced weakly; a batch
    of the current step that is freed first adds its counters, final by then, to a running sum.
    Thread-safe (a batch may be freed on any thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._step: int | None = None
        self._live: weakref.WeakSet = weakref.WeakSet()
        self._gone: Traffic = {}  # the freed batches' traffic, summed

    def add(self, batch: "PlannedBatch") -> None:
        """Count ``batch`` in its step (a new step forgets the previous one's batches)."""
        with self._lock:
            if batch.step != self._step:
                self._step, self._live, self._gone = batch.step, weakref.WeakSet(), {}
            if batch in self._live:
                return
            self._live.add(batch)
        counters = [p.traffic for p in batch.participants]  # the counters, not the batch
        weakref.finalize(batch, self._freed, batch.step, counters)

    def _freed(self, step: int, counters: list) -> None:
        traffic = sum_traffic(as_traffic(c) for c in counters)
        with self._lock:
            if step == self._step:
                self._gone = sum_traffic([self._gone, traffic])

    def batches(self) -> list:
        """The current step's batches still alive, by batch index."""
        with self._lock:
            return sorted(self._live, key=lambda b: b.batch)

    def total(self) -> Traffic:
        """The current step's bytes, summed over its batches, live and freed."""
        with self._lock:
            live, gone = list(self._live), self._gone
        return sum_traffic([gone] + [b.traffic() for b in live])


class PlannedBatch(ABC):
    """One batch of one training step bound to its plan and to this process's participants.

    The ``step`` object of distca's attention op (:mod:`distca_client.op`): every layer's forward
    round and, later, its backward round run through it. Rounds run in call order, one at a time.

    Attributes:
        step: the training step this batch belongs to (counted by the runtime from 0).
        batch: its index within the step (ping-pong nano-batches are batches 0 and 1).
        participants: the :class:`~distca_server.participant.Participant` s this process runs for
            it, in participant order: every participant of the plan on the local runtime, this
            client's one participant on Ray. Built for this batch, so their ``traffic`` and
            ``timings`` counters cover this batch's rounds only.
        backend_name: the attention kernel backend the participants' servers use.
    """

    step: int
    batch: int
    participants: list
    backend_name: str

    @property
    @abstractmethod
    def plan(self) -> Plan:
        """The whole :class:`~scheduler.tasks.Plan` of this batch (every rank's documents, every
        server's CA-tasks).

        Raises:
            DistCAError: the Ray runtime could not fetch it from the scheduler.
        """

    @property
    def parts(self) -> list[PlanPart]:
        """The :class:`~scheduler.parts.PlanPart` of each participant this process runs, in
        participant order (all of them locally, this client's one on Ray)."""
        return [p.part for p in self.participants]

    @property
    def part(self) -> PlanPart:
        """The part of this process's first participant: on Ray this client's part; locally
        participant 0's (client rank 0, and server 0 in in-place mode)."""
        return self.participants[0].part

    @abstractmethod
    def forward_async(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                      counts_for_step: bool = True, synchronous: bool = False) -> Future:
        """Queue the forward round behind this process's earlier rounds (see
        :mod:`~distca_server.runtime.order`).

        Args:
            q: [T, num_heads_q, head_dim]; k, v: [T, num_heads_kv, head_dim]: this process's
                rows of the batch (detached), T its tokens.
            softmax_scale: multiplier of ``Q Kᵀ``.
            counts_for_step: whether a backward round may follow (the forward ran with grad);
                the round's ticket (:class:`StepState`) is opened with it, and the caller takes
                it from the future (``take_ticket()``).
            synchronous: run the round on this thread, after the earlier rounds, and return
                once it is done (the caller waits for it anyway: no hand-off to another thread).

        Returns:
            A future of ``(out [T, num_heads_q, head_dim] in q's dtype, lse [T, num_heads_q] in
            :attr:`~distca_server.wire.RowFormat.lse_dtype`)``; its ``result()`` raises
            :class:`DistCAError` if a participant was lost or timed out. Its ``kept`` attribute
            is the key under which the servers keep this round's activations for
            :meth:`backward_kept` (a kept-activation plan and ``counts_for_step``), else None.

        Raises:
            DistCAError: the runtime is closed, or this batch belongs to a step that has ended.
        """

    @abstractmethod
    def backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, dout: torch.Tensor, softmax_scale: float):
        """Run the backward round (blocking) and return ``(dq, dk, dv)``, shaped and typed like
        ``q``, ``k``, ``v``. ``out``, ``lse`` are the forward round's results, ``dout`` the
        gradient of ``out`` (contiguous).

        Raises:
            DistCAError: a participant was lost or timed out, the runtime is closed, or the step
                of this batch has ended.
        """

    @abstractmethod
    def backward_kept(self, kept: int, dout: torch.Tensor, softmax_scale: float):
        """Run the backward round of the forward round whose future had ``kept`` (blocking): the
        caller passes only ``dout`` [T, num_heads_q, head_dim] (contiguous), which travels with the
        merged O and LSE rows of split query shards that the participants kept; returns
        ``(dq [T, num_heads_q, head_dim], dk, dv [T, num_heads_kv, head_dim])`` in dout's dtype.
        The participants free that round's kept activations.

        Raises:
            DistCAError: a participant was lost or timed out, the runtime is closed, or the step
                of this batch has ended (its kept activations were released).
            ValueError: a server keeps nothing under ``kept``.
        """

    @property
    def keep_activations(self) -> bool:
        """Whether this batch's plan keeps activations on the servers (its backward rounds send
        dO only)."""
        return self.participants[0].keep_activations

    def held_bytes(self) -> int:
        """Bytes of kept activations this process's participants hold now (all servers locally,
        this client's in-place server on Ray)."""
        return sum(p.held_bytes() for p in self.participants)

    def release(self, why: str) -> None:
        """Drop every kept activation of this batch here (its step ended or a round failed)."""
        for p in self.participants:
            p.release(why)

    def release_round(self, kept: int) -> None:
        """Drop here the activations kept under ``kept`` alone: autograd freed that forward
        round's node without a backward round."""
        for p in self.participants:
            p.release_round(kept)

    def traffic(self) -> Traffic:
        """Bytes this process's participants sent to *other* participants in this batch's rounds
        so far (rows a client hands its own in-place server are not counted). Locally: all
        virtual participants, so one forward and one backward round equal
        ``plan.comm_bytes()``; on Ray: this client's participant."""
        return sum_traffic(as_traffic(p.traffic) for p in self.participants)


class Runtime(ABC):
    """Plans batches, binds them to participants and runs their rounds in call order.

    Subclasses keep their step bookkeeping in ``self._state`` (a :class:`StepState`), guarded by
    ``self._lock``, and the job's attention backend name in ``self.backend`` ("auto" or a key of
    :data:`~distca_server.kernels.BACKENDS`; the client checks a device against it)."""

    _state: "StepState"
    _lock: threading.RLock
    backend: str

    @property
    def step(self) -> int:
        """The current step."""
        return self._state.step

    @abstractmethod
    def step_for(self, doc_lens: list[int], fmt: RowFormat, device: torch.device,
                 window: int | None = None) -> PlannedBatch:
        """The batch of the current step with these documents, attention shape, device and
        sliding window (None: full causal), bound on first sight (planned, or the plan fetched
        from the scheduler). Layers with different windows in one step get one batch (and plan)
        each.

        Ends the current step first if it is over (:class:`StepState`: outside a backward pass,
        after a backward round, with no forward round awaiting its backward).

        Raises:
            ValueError: bad input (the Ray scheduler reports it to every client of the batch).
            DistCAError: the runtime is closed, or a participant or the scheduler failed.
        """

    @property
    def max_batches(self) -> int:
        """How many idle batches a step keeps bound (see :class:`StepState`)."""
        return self._state.max_batches

    @max_batches.setter
    def max_batches(self, n: int) -> None:
        with self._lock:
            self._state.max_batches = n

    def new_step(self) -> None:
        """End the current step now (forward-only loops: nothing counts toward the step)."""
        with self._lock:
            if self._state.batches:
                self._state.advance()

    def fail_step(self, error: ValueError) -> None:
        """This process's own input failed a check (``error``, which the caller raises) in the
        current step. A runtime with peers makes them fail the step at once with the same
        message instead of waiting for it; locally there is nobody to tell."""

    @abstractmethod
    def close(self) -> None:
        """Stop the runtime's threads and leave any group; later calls raise DistCAError."""


def in_backward() -> bool:
    """Whether the calling thread runs inside an autograd backward pass. Activation
    checkpointing recomputes a forward there, reentrant or not."""
    return torch._C._current_graph_task_id() != -1


class Ticket:
    """A counted forward round of a step, held by its autograd node (see :class:`StepState`).

    :meth:`resolve` when its backward round has run. A ticket that is freed while still open
    (the node was dropped without a backward) closes itself and releases its kept activations."""

    __slots__ = ("_close", "id", "_round_done", "__weakref__")

    def __init__(self, close, ticket_id: int, round_done):
        self._close, self.id, self._round_done = close, ticket_id, round_done

    def resolve(self) -> None:
        self._close(self.id, False)

    def watch(self, future) -> None:
        """Tell the step when ``future``, this ticket's forward round, is done: only then do the
        round's kept rows exist to be released, if the ticket was closed without a backward or
        its step ended meanwhile."""
        done = self._round_done  # not self: the future must not keep the ticket alive
        future.add_done_callback(lambda _: done())


class StepState:
    """Which step a runtime is in, the batches bound in it, and when it ends.

    When a step ends: every counted forward round (grad enabled and q, k or v requiring grad) is
    a *ticket* of its step (:meth:`open_ticket`). A ticket stays open until its backward round runs
    or autograd frees its node without one. In the second case its kept activations are released
    here at once: checkpointing's recomputed forwards, a forward with grad that is never
    backpropagated. The step ends at the first :meth:`lookup` made *outside* a backward pass once
    a backward round of the step has run and no ticket is open, or at :meth:`advance`. A lookup
    made inside a backward pass (checkpoint recomputation) belongs to the step being
    backpropagated. So reentrant and non-reentrant checkpointing make one step, and so does a
    pipeline schedule that runs every micro-batch's forward and then each backward. This depends
    only on the program's order of calls and frees, so every client of a job ends a step at the
    same call. A graph kept alive without a backward (an output stored across steps) keeps its
    step open.

    Which batch an ``attend`` call belongs to: a batch with the same key (documents, attention
    shape, device, window) whose forward results were all claimed (``wait()``-ed, in program order), the
    least recently used first; if every such batch still has a forward round outstanding, a new
    batch. So ping-pong nano-batches with identical documents are two batches on that client as on
    the clients whose nano-batches differ, and each layer goes back to its own nano-batch: the
    choice follows the program's order of calls, the same on every client, never timing.

    Batches with an open ticket are never evicted. Of the idle ones, the step keeps the
    ``max_batches`` most recently used bound (:meth:`add`).

    Not thread-safe: the runtime holds its lock. Claims and tickets, which round futures and
    autograd's frees change from other threads, take a lock of their own.
    """

    def __init__(self, step: int = 0, max_batches: int = BATCHES_KEPT):
        self.step, self.max_batches = step, max_batches
        self.batches: OrderedDict = OrderedDict()  # batch index -> PlannedBatch, least recently used first
        self._next_batch = 0
        self.forward_rounds = self.backward_rounds = self.seq = 0
        self._guard = threading.RLock()  # re-entered when a release frees another ticket
        self._open: dict[int, int] = {}  # id(batch) -> forward rounds whose results are not claimed
        self._tickets: dict[int, _OpenTicket] = {}  # ticket id -> its batch and kept key
        self._busy: dict[int, int] = {}  # id(batch) -> its open tickets
        self._ticket_ids = itertools.count()  # unique across steps: a stale ticket never closes a new one

    @property
    def ended(self) -> bool:
        """Whether the step is over for a call made here and now (see the class doc)."""
        return self.backward_rounds > 0 and not self._tickets and not in_backward()

    @property
    def awaits_backward(self) -> bool:
        """Whether a ticket of the step is open: a counted forward round whose backward round
        has not run (the peers will wait for this client in it)."""
        with self._guard:
            return bool(self._tickets)

    def advance(self, step: int | None = None) -> None:
        """Start step ``step`` (default: the next one) with no batches; the old batches' kept
        activations are released and their open tickets forgotten. A forward round still
        queued or running keeps its rows only after this: its ticket is marked dropped, so
        they go when it is done."""
        with self._guard:
            for entry in self._tickets.values():
                entry.dropped = True
        for batch in self.batches.values():
            batch.release(f"step {self.step} ended")
        self.step = self.step + 1 if step is None else step
        self.batches.clear()
        self._next_batch = 0
        self.forward_rounds = self.backward_rounds = self.seq = 0
        with self._guard:
            self._open.clear()
            self._tickets.clear()
            self._busy.clear()

    def lookup(self, key):
        """The batch of the current step for ``key`` (ending the step first if it is over): the
        least recently used one bound to ``key`` with every forward result claimed, or None."""
        if self.ended:
            self.advance()
        with self._guard:
            for index, batch in self.batches.items():
                if batch.key == key and not self._open.get(id(batch)):
                    self.batches.move_to_end(index)
                    return batch
        return None

    def next_batch_index(self) -> int:
        return self._next_batch

    def add(self, key, batch: PlannedBatch) -> None:
        """Bind ``batch`` (whose index is :meth:`next_batch_index`) to ``key``; then evict the
        least recently used idle batches (no open ticket) beyond ``max_batches`` idle ones."""
        batch.key = key
        self.batches[self._next_batch] = batch
        self._next_batch += 1
        with self._guard:
            idle = [i for i, b in self.batches.items() if not self._busy.get(id(b))]
            for index in idle[:max(0, len(idle) - self.max_batches)]:
                old = self.batches.pop(index)
                self._open.pop(id(old), None)
                old.release(f"batch {old.batch} of step {self.step} was evicted "
                            f"({self.max_batches} idle batches kept)")

    def open_ticket(self, batch: PlannedBatch, kept: int | None) -> Ticket:
        """The ticket of ``batch``'s counted forward round (``kept``: the key of the activations
        kept for it, or None), opened by the runtime's ``submit`` together with
        :meth:`count_round`, under the runtime's lock: no other thread can end the step between
        the two (:meth:`count_round` refused a batch of an earlier step). The caller then
        :meth:`Ticket.watch`-es the round's future."""
        with self._guard:
            entry = _OpenTicket(batch, kept)
            ticket = Ticket(self._close, next(self._ticket_ids), functools.partial(self._round_done, entry))
            self._tickets[ticket.id] = entry
            self._busy[id(batch)] = self._busy.get(id(batch), 0) + 1
        weakref.finalize(ticket, self._close, ticket.id, True).atexit = False
        return ticket

    def _close(self, ticket_id: int, dropped: bool) -> None:
        """Close a ticket: its backward round ran, or (``dropped``) its node was freed without
        one; then its kept activations go as soon as its forward round is done."""
        with self._guard:
            entry = self._tickets.pop(ticket_id, None)
            if entry is None:  # closed already, or its step ended
                return
            n = self._busy.pop(id(entry.batch)) - 1
            if n:
                self._busy[id(entry.batch)] = n
            entry.dropped = dropped
            release = dropped and entry.round_done
        if release:
            entry.release()

    def _round_done(self, entry: "_OpenTicket") -> None:
        with self._guard:
            entry.round_done = True
            release = entry.dropped
        if release:
            entry.release()

    def claimable(self, batch: PlannedBatch, future: Future, kept: int | None = None,
                  ticket: Ticket | None = None) -> Future:
        """``future`` (of ``batch``'s forward round, whose activations the servers keep under
        ``kept``) as a future whose first ``result()`` call claims the round: until then,
        ``batch`` is not handed out for its key again. ``ticket``: the round's (counted), which
        watches ``future`` and which the caller takes with :meth:`_ClaimedFuture.take_ticket`."""
        with self._guard:
            self._open[id(batch)] = self._open.get(id(batch), 0) + 1
        if ticket is not None:
            ticket.watch(future)
        return _ClaimedFuture(future, lambda: self._claim(batch), kept, ticket)

    def _claim(self, batch: PlannedBatch) -> None:
        with self._guard:
            n = self._open.get(id(batch), 0)
            if n > 1:
                self._open[id(batch)] = n - 1
            else:
                self._open.pop(id(batch), None)

    def count_round(self, batch: PlannedBatch, kind: RoundKind, counts_for_step: bool = True) -> int:
        """Count one round of ``batch``; returns its sequence number within the step.

        Raises:
            DistCAError: ``batch`` belongs to an earlier step.
        """
        if batch.step != self.step:
            raise DistCAError(f"batch {batch.batch} of step {batch.step} used in step {self.step} "
                              f"(its step ended: a backward pass had run and no forward round awaited "
                              f"its backward, or new_step() was called)")
        seq = self.seq
        self.seq += 1
        if kind == RoundKind.FORWARD and counts_for_step:
            self.forward_rounds += 1
        elif kind == RoundKind.BACKWARD:
            self.backward_rounds += 1
        return seq


class _OpenTicket:
    """An open ticket's batch and kept key; ``dropped``: its node was freed without a backward;
    ``round_done``: its forward round finished (so its kept rows exist and can go)."""

    def __init__(self, batch: PlannedBatch, kept: int | None):
        self.batch, self.kept = batch, kept
        self.dropped = self.round_done = False

    def release(self) -> None:
        if self.kept is not None:
            self.batch.release_round(self.kept)


class _ClaimedFuture:
    """A round's future (``inner``) that calls ``on_claim`` once, at the first ``result()`` call;
    ``kept``: see :meth:`PlannedBatch.forward_async`. It reads through to ``inner`` (a queued
    round's :class:`~.order.RoundFuture` joins the taker's stream in its ``result``), rather than
    being a second ``Future`` fed by a callback."""

    __slots__ = ("_on_claim", "kept", "_inner", "_ticket")

    def __init__(self, inner, on_claim, kept: int | None = None, ticket: Ticket | None = None):
        self._on_claim, self.kept, self._inner, self._ticket = on_claim, kept, inner, ticket

    def take_ticket(self) -> Ticket | None:
        """The round's ticket (counted rounds), handed over once: the future must not keep it
        alive, since autograd's node owns it (a node freed without a backward frees it)."""
        ticket, self._ticket = self._ticket, None
        return ticket

    def done(self) -> bool:
        return self._inner.done()

    def exception(self, timeout=None) -> BaseException | None:
        return self._inner.exception(timeout)

    def add_done_callback(self, fn) -> None:
        """``fn(self)`` once the round is done (now, if it is)."""
        self._inner.add_done_callback(lambda _: fn(self))

    def result(self, timeout=None):
        claim, self._on_claim = self._on_claim, None
        if claim is not None:
            claim()
        return self._inner.result(timeout)
