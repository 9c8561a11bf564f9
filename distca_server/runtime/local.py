"""``DistCAClient.local``: every participant of the plan in this process, run in lock step by one thread.

The batch handed to ``attend`` is cut into ``num_ranks`` virtual client ranks (whole documents,
contiguous, about equal tokens); each participant runs exactly the code a distributed participant
runs, over the in-process all-to-all of :mod:`distca_server.transport.local`
(:class:`~distca_server.transport.local.LockstepGroup`: the thread that runs the round starts every
participant's exchange, then completes them all; no participant thread, lock or event), and writes its
rank's results straight into its rows of one batch-wide output. Steps end as on Ray (see
:class:`~distca_server.runtime.base.StepState`); plans are cached across steps per batch shape
(planning is deterministic), participants are bound per step and batch (reusing the layouts a
batch shape's participants had in an earlier step).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import numpy as np
import torch

from scheduler import Plan, plan_batch
from scheduler.config import PlanConfig
from scheduler.cost import RoundKind
from scheduler.parts import plan_parts

from ..errors import DistCAError, first_cause
from ..kernels import get_backend
from ..participant import Participant, drive, drive_all
from ..transport.local import LockstepGroup
from ..transport.local_heap import HeapGroup
from ..transport.routed import GRACE_S
from ..wire import RowFormat
from .base import PlannedBatch, Runtime, StepState
from .graphed import RoundGraphs
from .order import RoundQueue, StreamFence

PLANS_KEPT = 16
_PLAN_IDS = itertools.count(1)  # plan ids of this process's local plans (0 means "none")


def split_documents(doc_lens: list[int], num_ranks: int) -> list[list[int]]:
    """Cut documents into ``num_ranks`` contiguous groups of about equal tokens.

    Document ``i`` goes to rank ``floor(R · midpoint_i / total)``, so ranks keep the batch's order
    and a rank may be empty (fewer documents than ranks).
    """
    if not doc_lens:
        return [[] for _ in range(num_ranks)]
    lens = np.asarray(doc_lens, dtype=np.int64)
    mid2 = 2 * np.cumsum(lens) - lens  # twice each document's midpoint, in exact integers
    rank = np.minimum(num_ranks - 1, (mid2 * num_ranks) // (2 * int(lens.sum())))
    groups: list[list[int]] = [[] for _ in range(num_ranks)]
    for r, l in zip(rank.tolist(), doc_lens):
        groups[r].append(l)
    return groups


class LocalBatch(PlannedBatch):
    """One batch of one step bound to every participant of its plan (all in this process)."""

    def __init__(self, runtime: "LocalRuntime", plan: Plan, fmt: RowFormat, device: torch.device,
                 step: int, batch: int, like: list[Participant] | None = None):
        self.runtime, self._plan, self.fmt, self.step, self.batch = runtime, plan, fmt, step, batch
        self.device = torch.device(device)
        backend = get_backend(runtime.backend, device)
        self.backend_name = backend.name
        if like is not None:  # the same plan in an earlier step: its parts and layouts, not rebuilt
            self.participants = [p.rebound(p.part.at(step, batch)) for p in like]
        else:
            # A plan id unique in this process: the participants' routes (their exchanges' identity
            # on a routed transport) must differ between plans; later steps rebind the same id.
            plan_id = next(_PLAN_IDS)
            self.participants = [Participant(part, fmt, backend, device)
                                 for part in plan_parts(plan, step, batch, plan_id)]
        tokens = [sum(x) for x in plan.doc_lens_per_rank]
        self.bounds = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64).tolist()
        self._replay_on = None  # (group, its endpoints) of the last replayed round

    @property
    def plan(self) -> Plan:
        return self._plan

    def _rows(self, p: Participant, tensors):
        """Participant ``p``'s rank's rows of each tensor (views), or Nones for a server-only one."""
        if p.rank is None:
            return (None,) * len(tensors)
        a, b = self.bounds[p.rank], self.bounds[p.rank + 1]
        return tuple(t[a:b] for t in tensors)

    def _failed(self, exc: BaseException) -> None:
        """A round of the batch raised ``exc``: release the batch's kept activations (the caller
        re-raises; a try/except, not a context manager, on a path every layer takes)."""
        self.release(f"a round of batch {self.batch} failed: {type(exc).__name__}: {str(exc)[:200]}")

    def _run(self, jobs) -> list:
        """Run one round's jobs (eagerly)."""
        try:
            return self.runtime.run(jobs, self.device)
        except BaseException as exc:
            self._failed(exc)
            raise

    def _replayed(self, kind: RoundKind, softmax_scale: float, inputs: tuple, outputs: tuple,
                  kept: int | None = None) -> bool:
        """Run the round from its captured CUDA graphs where the runtime keeps them
        (:mod:`.graphed`; ``kept``: a kept-activation round's key); False: run it eagerly."""
        runtime, group = self.runtime, self.runtime._group
        if (runtime.graphs is None or self.device.type not in runtime.graphs.device_types
                or not isinstance(group, HeapGroup) or group.broken):
            return False
        if self._replay_on is None or self._replay_on[0] is not group:  # the group's endpoints, once
            self._replay_on = (group, [group.endpoint(i, self.device) for i in range(len(self.participants))])
        transports = self._replay_on[1]

        def abort(exc: BaseException) -> None:  # as run() aborts a failed eager round's group
            group.abort(-1, f"{type(exc).__name__}: {exc}")
        try:
            return runtime.graphs.run(self.shape_key, self.participants, transports, kind, softmax_scale,
                                      inputs, outputs, self._rows, kept, abort)
        except BaseException as exc:
            # A replay that failed before queuing anything (a kept-row check) leaves the group as
            # the eager round's failure does: aborted, so the next round forms a new one (a
            # participant that raised mid-round would be an exchange behind its peers); a replay
            # that failed later aborted it already.
            if not group.broken:
                abort(exc)
            self._failed(exc)
            raise

    def _single_rank(self, jobs) -> tuple:
        """One client rank holds the whole batch: its results are the outputs, as they are (a rank
        whose rows stay home returns the kernel's outputs without a copy)."""
        results = self._run(jobs)
        return next(r for p, r in zip(self.participants, results) if p.rank is not None)

    def _forward(self, q, k, v, softmax_scale, keep):
        if len(self.bounds) == 2:
            return self._single_rank([lambda t, p=p: p.forward_steps(t, *self._rows(p, (q, k, v)), softmax_scale,
                                                               keep=keep)
                                      for p in self.participants])
        T = q.shape[0]
        out = q.new_empty((T, self.fmt.num_heads_q, self.fmt.head_dim))
        lse = q.new_empty((T, self.fmt.num_heads_q), dtype=self.fmt.lse_dtype)
        if self._replayed(RoundKind.FORWARD, softmax_scale, (q, k, v), (out, lse), keep):
            return out, lse

        def job(p):
            rq, rk, rv, ro, rl = self._rows(p, (q, k, v, out, lse))
            return lambda t: p.forward_steps(t, rq, rk, rv, softmax_scale, out=ro, lse=rl, keep=keep)
        self._run([job(p) for p in self.participants])
        return out, lse

    def _backward(self, q, k, v, out, lse, dout, softmax_scale):
        if len(self.bounds) == 2:
            return self._single_rank([lambda t, p=p: p.backward_steps(t, *self._rows(p, (q, k, v, out, lse, dout)),
                                                                softmax_scale)
                                      for p in self.participants])
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if self._replayed(RoundKind.BACKWARD, softmax_scale, (q, k, v, out, lse, dout), (dq, dk, dv)):
            return dq, dk, dv

        def job(p):
            rows = self._rows(p, (q, k, v, out, lse, dout, dq, dk, dv))
            return lambda t: p.backward_steps(t, *rows[:6], softmax_scale, dq=rows[6], dk=rows[7], dv=rows[8])
        self._run([job(p) for p in self.participants])
        return dq, dk, dv

    def _backward_kept(self, kept, dout, softmax_scale):
        if len(self.bounds) == 2:
            return self._single_rank([lambda t, p=p: p.backward_kept_steps(t, self._rows(p, (dout,))[0], softmax_scale,
                                                                     kept=kept)
                                      for p in self.participants])
        dq = torch.empty_like(dout)
        dk = dout.new_empty((dout.shape[0], self.fmt.num_heads_kv, self.fmt.head_dim))
        dv = torch.empty_like(dk)
        if self._replayed(RoundKind.BACKWARD, softmax_scale, (dout,), (dq, dk, dv), kept):
            return dq, dk, dv

        def job(p):
            rows = self._rows(p, (dout, dq, dk, dv))
            return lambda t: p.backward_kept_steps(t, rows[0], softmax_scale, kept=kept, dq=rows[1], dk=rows[2],
                                             dv=rows[3])
        self._run([job(p) for p in self.participants])
        return dq, dk, dv

    def forward_async(self, q, k, v, softmax_scale, counts_for_step=True, synchronous=False):
        return self.runtime.submit(self, RoundKind.FORWARD, counts_for_step, synchronous, self._forward,
                                   q, k, v, softmax_scale)

    def backward(self, q, k, v, out, lse, dout, softmax_scale):
        return self.runtime.submit(self, RoundKind.BACKWARD, True, True, self._backward,
                                   q, k, v, out, lse, dout, softmax_scale).result()

    def backward_kept(self, kept, dout, softmax_scale):
        return self.runtime.submit(self, RoundKind.BACKWARD, True, True, self._backward_kept,
                                   kept, dout, softmax_scale).result()


class LocalRuntime(Runtime):
    """Plans, participants and rounds of a ``DistCAClient.local`` client.

    Args:
        num_servers: attention servers (participants of this process).
        num_ranks: virtual client ranks the batch is cut into.
        plan: the planner's settings (:class:`~scheduler.config.PlanConfig`, checked; see
            :func:`scheduler.plan_batch`).
        backend: kernel backend name or "auto".
        timeout_s: the job's wait bound (seconds); kept for the config, since participants in lock
            step never wait for each other.
    """

    group_factory = LockstepGroup
    """Makes the in-process group of a round's participants: ``group_factory(world_size,
    timeout_s)``."""

    def __init__(self, num_servers: int, num_ranks: int, plan: PlanConfig, *, backend: str, timeout_s: float):
        if not isinstance(plan, PlanConfig):
            raise ValueError(f"plan must be a PlanConfig, got {type(plan).__name__}")
        self.plan = plan
        self.num_servers, self.num_ranks, self.mode = num_servers, num_ranks, plan.mode
        self.keep_activations = plan.keep_activations
        self.backend, self.timeout_s = backend, timeout_s
        self.world_size = num_ranks if plan.mode == "inplace" else num_ranks + num_servers
        self._stopped = False
        self._group = None
        self._pool: ThreadPoolExecutor | None = None  # only for a blocking group (_run_threads)
        self._streams: dict = {}  # device -> {participant: CUDA stream} (_run_threads)
        self._plans: OrderedDict = OrderedDict()  # batch shape -> Plan, across steps
        # batch shape -> the participants last bound to its plan (their layouts are reused)
        self._bound: dict = {}
        self._state = StepState()
        # captured rounds (JobConfig.cuda_graphs; rounds over a CUDA heap), or None
        self.graphs: RoundGraphs | None = None
        self._lock = threading.RLock()
        self._closed = False
        # Rounds run one at a time, in call order, like a distributed client's rounds.
        self._rounds = RoundQueue("distca-local-rounds")

    def _plan(self, key, doc_lens: list[int], fmt: RowFormat, window: int | None) -> Plan:
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_batch(split_documents(doc_lens, self.num_ranks), self.num_servers,
                              cost=fmt.cost, config=self.plan, window=window)
            self._plans[key] = plan
            while len(self._plans) > PLANS_KEPT:
                gone, _ = self._plans.popitem(last=False)
                self._bound.pop(gone, None)
        else:
            self._plans.move_to_end(key)
        return plan

    def step_for(self, doc_lens: list[int], fmt: RowFormat, device: torch.device,
                 window: int | None = None) -> LocalBatch:
        """The current step's batch for this batch shape and window; planned on first sight of
        the shape (cached across steps), bound to fresh participants on first sight in the step (which
        reuse the layouts of the participants an earlier step bound to the same plan)."""
        if self._closed:
            raise DistCAError("this DistCAClient is closed")
        key = (tuple(doc_lens), fmt, str(device), window)
        with self._lock:
            found = self._state.lookup(key)
            if found is None:
                plan = self._plan(key, doc_lens, fmt, window)
                found = LocalBatch(self, plan, fmt, device, self._state.step, self._state.next_batch_index(),
                                   like=self._bound.get(key))
                found.shape_key = key  # its rounds' captured graphs, across steps
                self._bound[key] = found.participants
                self._state.add(key, found)
            return found

    def submit(self, batch: LocalBatch, kind: RoundKind, counts_for_step: bool, synchronous: bool, fn, *args):
        """Count a round of ``batch`` toward its step and run ``fn(*args)`` after the earlier
        rounds: here (``synchronous``) or on the rounds thread (a forward round's ``fn`` also gets
        the key its activations are kept under, or None); returns its future (a forward round's
        tells the step when it is claimed)."""
        with self._lock:
            if self._closed:
                raise DistCAError("this DistCAClient is closed")
            seq = self._state.count_round(batch, kind, counts_for_step)
            kept = seq if kind == RoundKind.FORWARD and batch.keep_activations and counts_for_step else None
            ticket = None
            if kind == RoundKind.FORWARD:
                args = args + (kept,)
                # under the lock with the count: another thread must not end the step between
                ticket = self._state.open_ticket(batch, kept) if counts_for_step else None
            slot = self._rounds.reserve()
        future = slot.here(fn, *args) if synchronous else slot.queued(fn, args, *args)
        return self._state.claimable(batch, future, kept, ticket) if kind == RoundKind.FORWARD else future

    def run(self, jobs, device: torch.device | str = "cpu"):
        """Run one round's job per participant; return their results in order.

        Each job gets its participant's transport endpoint on ``device`` (where the batch's
        tensors live: the endpoint's buffers must be there too) and returns the participant's
        round generator (:meth:`~distca_server.participant.Participant.forward_steps` and the
        like). Over a :class:`~distca_server.transport.local.LockstepGroup` (the default
        :attr:`group_factory`) :func:`~distca_server.participant.drive_all` runs them all on this
        thread: it starts every participant's exchange, then completes them all, then lets each
        go on, so the round's device work is queued by one thread on its current stream, with no
        hand-off, lock or event. Over a group whose exchanges block until the peers arrive (a
        one-sided transport), participants 1.. run on threads (:meth:`_run_threads`).

        The first error a participant raised is re-raised (its peers are stopped); a failed round
        leaves a group that the next round replaces.
        """
        if self._stopped:
            raise DistCAError("this DistCAClient is closed")
        if self._group is None or self._group.broken:
            if self._group is not None:
                self._group.close()  # its transports' threads, if any
            if self.graphs is not None:
                self.graphs.clear()  # recorded on the group that is gone
            self._group = self.group_factory(self.world_size, self.timeout_s)
        group = self._group
        if not isinstance(group, LockstepGroup):
            return self._run_threads(group, jobs, device)
        try:
            return drive_all([job(group.endpoint(i, device)) for i, job in enumerate(jobs)])
        except BaseException as exc:
            group.abort(-1, f"{type(exc).__name__}: {exc}")
            raise

    def _run_threads(self, group, jobs, device):
        """:meth:`run` over a blocking group: participant 0 on this thread, the others on pool
        threads whose streams wait on this thread's and are joined back by events
        (:class:`~distca_server.runtime.order.StreamFence`)."""
        def call(i, job):
            try:
                return drive(job(group.endpoint(i, device)))
            except BaseException as exc:
                group.abort(i, f"{type(exc).__name__}: {exc}")
                raise
        if len(jobs) == 1:
            return [call(0, jobs[0])]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.world_size - 1, thread_name_prefix="distca-local")
        fence = StreamFence(torch.device(device))
        done: list = [None] * len(jobs)
        streams = self._participant_streams(torch.device(device), len(jobs))

        def helper(i, job):
            # Each participant on a CUDA stream of its own: a device-driven exchange orders its
            # stream after the thread's current stream, and one participant's wait queued on a
            # shared stream could hold up the peer it waits for.
            with torch.cuda.stream(streams[i]) if streams else contextlib.nullcontext():
                fence.enter()
                try:
                    return call(i, job)
                finally:
                    done[i] = fence.leave()
        futures = [self._pool.submit(helper, i, job) for i, job in enumerate(jobs) if i]
        own, first = [], []
        try:
            first.append(call(0, jobs[0]))
        except BaseException as exc:
            own.append(exc)
        budget = 2 * self.timeout_s + 5  # every wait inside a participant ends by its timeout
        failed = bool(own)
        if not failed:
            finished, pending = wait(futures, timeout=budget, return_when=FIRST_EXCEPTION)
            failed = any(f.exception() is not None for f in finished)
        if failed:
            # The group is aborted: the others' exchanges end at once. One stuck in its own
            # work (a kernel) cannot be stopped: it gets a grace, not the whole budget.
            _, pending = wait(futures, timeout=GRACE_S)
        errors = own + [f.exception() for f in futures if f.done() and f.exception() is not None]
        if pending:
            group.abort(-1, "round did not finish")
            # Its pool thread stays busy until that work returns: the next round takes a fresh pool.
            self._pool.shutdown(wait=False)
            self._pool = None
            if not errors:
                stuck = [i for i, f in enumerate(futures, 1) if not f.done()]
                raise DistCAError(f"local participants {stuck} did not finish within {budget:g} s")
        else:
            fence.join(done)
        if errors:
            raise first_cause(errors)
        return first + [f.result() for f in futures]

    def _participant_streams(self, device: torch.device, n: int) -> dict:
        """CUDA streams of participants 1..n-1 on ``device`` (made once; participant 0 runs eager
        rounds on the caller's thread and stream), or {} on the CPU."""
        if device.type != "cuda":
            return {}
        streams = self._streams.setdefault(str(device), {})
        for i in range(1, n):
            if i not in streams:
                streams[i] = torch.cuda.Stream(device)
        return streams

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._rounds.close()  # rounds already queued still run
        self._stopped = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._group is not None:
            self._group.close()
        self._plans.clear()
        self._state.advance()
