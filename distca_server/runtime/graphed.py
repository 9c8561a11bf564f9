"""Rounds captured once and replayed (issue 22 item 4): ``DistCAClient.local`` over an in-process
heap on CUDA with ``JobConfig(cuda_graphs=True)``.

A plan's forward round (Q, K, V in; O, LSE out) and backward round (stateless plans: Q, K, V, O,
LSE, dO in; kept-activation plans: dO in; dQ, dK, dV out) do the same device work every time they
run with the same batch shape and softmax scale: the same gathers into the same transport
buffers, the same exchanges (the plan's routes), the same fused kernel call and the same merges.
So after :data:`WARMUP_ROUNDS` eager rounds (the first grows the transport buffers, the next
installs the routes), each participant's round is recorded once into a CUDA graph with static
input and output tensors (:meth:`~distca_server.transport.routed.RoutedTransport.graph`: over
:class:`~distca_server.transport.memop_stream.MemopStream` the round's torch work and its
exchanges go to the participant's communication stream while it is recorded). Every later round
of that shape, in every layer and in later steps, is replayed from the thread that runs the round:
copy the batch's tensors into the static inputs (one copy per tensor; each participant's rows are
views of them), replay every participant's recording (each on its transport's communication
stream, ordered after the caller's), and copy the static outputs out once the caller's stream has
waited for them all. The host queues that work and waits for nothing; the participants' streams
wait for each other on the device.

Kept activations (the default plan: a server keeps each layer's rows from its forward round until
that layer's backward round, :mod:`distca_server.kept`) are host-side dicts keyed by the round,
which a recording cannot write. So:

- a forward round is recorded keeping its rows under :data:`CAPTURE_KEY`; what it kept (tensors
  of the recording's memory pool, one set per recording, which the next replay of that recording
  overwrites) is taken out of the participant and remembered. After each replay the caller's
  stream copies those rows into tensors of their own, kept under the round's real key, as the
  eager round would have kept them; rows the eager round keeps by reference (a client's own Q, K,
  V when every row stays home) are kept by reference to the caller's tensors, not copied.
- a backward round is recorded taking static kept rows (allocated once, shaped like the rows the
  plan keeps); each replay first takes the round's real kept rows from the participant (with the
  eager round's checks: kept, not modified in place) and copies them into the static ones.

The replayed rounds cost one extra device copy of the kept rows per round against the eager ones;
their results are the eager rounds' bit for bit (the same kernels on the same rows; a kernel whose
backward sums with atomics, as FlashAttention-2's dQ, varies in rounding, eager or replayed).

Neither single-rank batches (nothing is exchanged) nor rounds on the CPU are captured.

A capture that fails (a kernel or call that CUDA cannot record) turns graphs off for the runtime,
with a warning naming the error; the rounds then run as before. A replay that fails aborts the
group at once, as a failed eager round does (its peers stop waiting for it), and raises as the
round would (the cause: the eager round's ValueError about kept rows, a participant's error, else
:class:`~distca_server.errors.DistCAError`); the group that the next round forms starts without
captures.
"""

from __future__ import annotations

import itertools
import warnings
from collections import OrderedDict

import torch

from scheduler.cost import RoundKind

from ..errors import first_cause
from ..participant import drive
from ..transport.exchange_graph import level_graph_tags
from ..transport.symmetric_words import GRAPH_BLOCKS

WARMUP_ROUNDS = 2
"""Eager rounds of a (batch shape, round kind, softmax scale, kept or not) before it is captured."""

CAPTURE_KEY = -1
"""The key a recorded round keeps (forward) or takes (backward) its rows under; real rounds' keys,
their sequence numbers in the step, are >= 0."""


def _no_abort(exc: BaseException) -> None:
    """:meth:`CapturedRound.replay`'s default ``abort``: nothing to stop."""


class CapturedRound:
    """One round kind of one batch shape, recorded per participant: the batch's static inputs and
    outputs (each participant's rows are views of them), its kept rows (kept-activation plans)
    and each participant's :class:`~distca_server.transport.exchange_graph.ExchangeGraph`.

    Args:
        participants: the batch's participants, in group order.
        transports: their endpoints of the group (``RoutedTransport``, CUDA heap).
        kind: FORWARD or BACKWARD.
        softmax_scale: the scale recorded into the kernel call.
        inputs, outputs: the batch-wide tensors of the round (only their shapes and dtypes are
            used here). Forward: (q, k, v) and (out, lse); backward: (q, k, v, out, lse, dout), or
            (dout,) with kept activations, and (dq, dk, dv).
        rows: ``rows(participant, tensors)``: the participant's rows of each tensor (views; None
            for a server-only one), the same every step of the batch shape.
        kept: the key of the round's kept rows (a kept-activation plan's round), else None. A
            backward round's static kept rows are shaped like the rows ``participants`` keep
            under it now.

    Raises:
        ValueError, DistCAError: as :meth:`~distca_server.transport.routed.RoutedTransport.graph`
            (e.g. a route not installed yet), or a participant keeps no rows under ``kept``; a
            CUDA error while recording.
    """

    def __init__(self, participants, transports, kind: RoundKind, softmax_scale: float, inputs, outputs, rows,
                 kept: int | None = None):
        self.kind, self.keeps, self.rows = kind, kept is not None, rows
        self.inputs = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in inputs)
        self.outputs = tuple(torch.empty(y.shape, dtype=y.dtype, device=y.device) for y in outputs)
        self.views = [rows(p, self.inputs) for p in participants]  # each participant's static input rows
        # backward with kept activations: per participant (server's rows, client's merged rows)
        self.kept_rows = ([self._static_kept(p, kept) for p in participants]
                          if self.keeps and kind == RoundKind.BACKWARD else None)
        # forward with kept activations: per participant, what each of its 2 recordings kept
        self.stash = [[(None, None)] * 2 for _ in participants]
        self._owning: dict = {}  # (participant, set) -> how its kept rows become its own (_own)
        self.graphs = []
        level_graph_tags(transports)  # an earlier capture that failed part-way left them unequal
        try:
            for i, (p, t) in enumerate(zip(participants, transports)):
                self.graphs.append(t.graph(self._round(i, p, t, softmax_scale, self.views[i], rows(p, self.outputs))))
        except BaseException:
            # The participants captured so far give their blocks back, so that at the next capture
            # every participant picks the same block (those never tried took none).
            self.release()
            raise

    @staticmethod
    def _static_kept(p, kept: int) -> tuple:
        rows = merged = None
        if p.server is not None:
            if kept not in p.kept:
                raise p._missing(kept)
            rows = {n: torch.empty_like(x) for n, x in p.kept[kept][0].items()}
        if p._keeps_merged():
            if kept not in p.kept_merged:
                raise p._missing(kept)
            merged = {n: torch.empty_like(x) for n, x in p.kept_merged[kept].items()}
        return rows, merged

    def _round(self, i: int, p, t, scale: float, ins, outs):
        """The function a recording of participant ``i`` runs (twice: once per recording),
        counting no traffic: a recording's Python runs when it is captured (on CUDA) or replayed
        (the CPU stand-in), on the participants of that step; :meth:`replay` counts each round
        on the participants it is replayed for."""
        fn = self._recorded(i, p, t, scale, ins, outs)

        def uncounted():
            counted = dict(p.traffic)
            try:
                fn()
            finally:
                p.traffic.clear()
                p.traffic.update(counted)
        return uncounted

    def _recorded(self, i: int, p, t, scale: float, ins, outs):
        if self.kind == RoundKind.FORWARD and not self.keeps:
            return lambda: drive(p.forward_steps(t, *ins, scale, out=outs[0], lse=outs[1]))
        if self.kind == RoundKind.BACKWARD and not self.keeps:
            return lambda: drive(p.backward_steps(t, *ins, scale, dq=outs[0], dk=outs[1], dv=outs[2]))
        if self.kind == RoundKind.FORWARD:
            calls = itertools.count()

            def forward():
                drive(p.forward_steps(t, *ins, scale, out=outs[0], lse=outs[1], keep=CAPTURE_KEY))
                rows, graph_set = p.kept.pop(CAPTURE_KEY, (None,))[0], next(calls) % 2
                self.stash[i][graph_set] = (rows, p.kept_merged.pop(CAPTURE_KEY, None))
                self._owning.pop((i, graph_set), None)  # worked out again from these rows
            return forward
        rows, merged = self.kept_rows[i]

        def backward():
            p.adopt(CAPTURE_KEY, rows, merged)
            drive(p.backward_kept_steps(t, ins[0], scale, kept=CAPTURE_KEY, dq=outs[0], dk=outs[1], dv=outs[2]))
        return backward

    def usable(self) -> bool:
        """Whether every participant's recording can still be replayed (no later capture took its
        words, the transport buffers did not move)."""
        return all(g.usable for g in self.graphs)

    def release(self) -> None:
        """Give every participant's graph words back (the next capture takes them)."""
        for g in self.graphs:
            g.release()

    def replay(self, participants, inputs, outputs, kept: int | None = None, abort=_no_abort) -> None:
        """Copy the batch's ``inputs`` in, replay every participant's recording and copy the
        ``outputs`` out, all queued from the caller's current stream (returns at once on a GPU).
        A kept-activation round keeps (forward) or takes (backward) ``participants``' rows under
        ``kept``. Every copy is on the current stream, one per tensor, those before the replays
        in one host call per dtype pair (``torch._foreach_copy_``: :func:`copy_groups`) and
        those after likewise.

        Each recording runs on its transport's communication stream, which its replay orders after
        the current stream (``begin``); the current stream then waits for each replay's marker.
        Every replay is queued before the first of those waits, so no participant's recording is
        queued behind another's (they wait for each other's rows on the device). No stream of the
        caller's own is needed between the two: per participant that would be two more
        stream-to-stream waits (an event made, recorded and waited for each) and two stream
        switches per round.

        A participant's replay that fails (its queuing or its wait) calls ``abort(exc)`` at once,
        as a failed eager round aborts its group: the peers' recordings stop waiting for rows it
        will never send (on the device too: the transport forces their waits) instead of running
        to their deadline, and the next round forms a new group. The error raised is the cause
        (:func:`~distca_server.errors.first_cause`), not a peer's abort.

        Raises:
            DistCAError: the group is aborted, or a participant's previous replay failed.
            ValueError: a forward round's key is kept already, or a backward round's is not kept
                (as the eager rounds raise), before anything is queued.
            RuntimeError: a kept tensor shared with the client was modified in place meanwhile.
        """
        forward, backward = self.keeps and self.kind == RoundKind.FORWARD, self.keeps and self.kind == RoundKind.BACKWARD
        if forward:
            for p in participants:
                p._check_keep(kept)
        dst, src = list(self.inputs), list(inputs)
        if backward:
            for p, statics in zip(participants, self.kept_rows):
                for static, given in zip(statics, _take(p, kept, inputs[0])):
                    for n, x in (static or {}).items():
                        dst.append(x)
                        src.append(given[n])
        _copy_all(dst, src)
        sets = [g.next_set for g in self.graphs]
        handles, failed = [], []
        for graph in self.graphs:
            try:
                handles.append(graph.replay())
            except BaseException as exc:  # noqa: BLE001 - raised below, once the queued ones are waited for
                failed.append(exc)  # the later participants are not queued: the earlier ones' peers never send
                abort(exc)
                break
        for handle in handles:  # every one, a failure too: nothing queued later may overtake a replay
            try:
                handle.wait()  # the current stream waits for the replay, on the device
            except BaseException as exc:  # noqa: BLE001 - raised below
                if not failed:  # the first failure stops the peers, whose waits would run to their deadline
                    abort(exc)
                failed.append(exc)
        if failed:
            raise first_cause(failed)  # the cause, not the peers' aborts
        for p in participants:  # the bytes each replayed recording sent, as its eager round counts them
            for key, n in p.layout(self.kind).sent.items():
                p.traffic[key] += n
        dst, src = list(outputs), list(self.outputs)
        if forward:  # on the caller's stream, after every replay
            own = [self._own(i, sets[i], p, inputs, dst, src) for i, p in enumerate(participants)]
        _copy_all(dst, src)
        if forward:
            for p, (rows, merged) in zip(participants, own):
                p.adopt(kept, rows, merged)

    def _own(self, i: int, graph_set: int, p, inputs, dst: list, src: list) -> tuple:
        """(rows, merged) participant ``i``'s recording ``graph_set`` kept, as tensors of their own: its rows of a
        static input (kept by reference, as the eager round keeps the client's own rows) become its
        rows of the caller's tensor; the others are new tensors, whose copies from the recording's
        are appended to ``dst`` / ``src``. Which is which is the same at every replay of a
        recording (its kept tensors and static views do not change), so it is worked out once."""
        plan = self._owning.get((i, graph_set))
        if plan is None:
            plan = self._owning[(i, graph_set)] = self._owning_plan(*self.stash[i][graph_set], i)
        by_reference, rows_plan, merged_plan = plan
        given = self.rows(p, inputs) if by_reference else None

        def fresh(entries):
            if entries is None:
                return None
            out = {}
            for n, x, j in entries:
                if j is not None:
                    out[n] = given[j]
                else:
                    out[n] = y = torch.empty_like(x)
                    dst.append(y)
                    src.append(x)
            return out
        return fresh(rows_plan), fresh(merged_plan)

    def _owning_plan(self, rows: dict | None, merged: dict | None, i: int) -> tuple:
        """(whether any kept row is a static input's view, then per kept dict a list of (name,
        tensor, index of the static input it is a view of, or None: copied))."""
        static = {id(x): j for j, x in enumerate(self.views[i]) if x is not None}
        by_reference = bool(rows) and any(id(x) in static for x in rows.values())

        def entries(d: dict | None, may_share: bool):
            if d is None:
                return None
            return [(n, x, static.get(id(x)) if may_share else None) for n, x in d.items()]
        return by_reference, entries(rows, by_reference), entries(merged, False)


def _copy_all(dst: list, src: list) -> None:
    """``dst[i].copy_(src[i])`` for every i, on the current stream, in as few host calls as the
    device copies in one kernel (these copies are most of a replayed round's host work): one
    ``torch._foreach_copy_`` on the CPU, one per :func:`copy_groups` group on CUDA."""
    if not dst:
        return
    if not dst[0].is_cuda:  # the CPU copies tensor by tensor whatever the call: one call is cheapest
        torch._foreach_copy_(dst, src, non_blocking=True)
        return
    for d, s in copy_groups(dst, src):
        torch._foreach_copy_(d, s, non_blocking=True)


def copy_groups(dst: list, src: list) -> list:
    """``(dst, src)`` lists, one per (destination dtype, source dtype), in first-seen order.

    On CUDA, ``torch._foreach_copy_`` copies a whole list in one kernel only when every
    destination has one dtype and every source one (and each pair is dense with the same sizes
    and strides, as distca's static and kept tensors are); otherwise it falls back to one
    ``copy_``, one kernel launch, per tensor. A bf16 round's lists mix rows with the float32
    LSE: a forward's outputs and kept rows with 2 participants are 12 tensors, 12 launches in one
    call where its two groups launch 2 (a backward's kept rows in, 11 and 2).
    """
    groups: dict = {}
    for d, s in zip(dst, src):
        group = groups.get((d.dtype, s.dtype))
        if group is None:
            group = groups[(d.dtype, s.dtype)] = ([], [])
        group[0].append(d)
        group[1].append(s)
    return list(groups.values())


def _take(p, kept: int, like) -> tuple:
    """Participant ``p``'s (server rows, merged rows) kept under ``kept``, no longer held by it."""
    rows = p._take_kept(kept) if p.server is not None else None
    merged = p._take_merged(kept, like) if p._keeps_merged() else None
    return rows, merged


class RoundGraphs:
    """The captured rounds of one :class:`~distca_server.runtime.local.LocalRuntime` (see the
    module docstring): counts eager rounds per key, captures, replays, and keeps at most
    :data:`~distca_server.transport.symmetric_words.GRAPH_BLOCKS` captures (each takes one
    block of every participant's graph words), the least recently used going first."""

    device_types = ("cuda",)
    """Device types whose rounds are captured (CUDA graphs)."""

    def __init__(self):
        self._seen: dict = {}  # key -> eager rounds run
        self._captured: OrderedDict = OrderedDict()  # key -> CapturedRound
        self.disabled: str | None = None  # why graphs are off (a capture failed)
        self.replays = 0  # rounds replayed (for tests and benchmarks)

    def clear(self) -> None:
        """Forget every capture (the group they were recorded on is gone)."""
        self._seen.clear()
        self._captured.clear()

    def run(self, key, participants, transports, kind: RoundKind, softmax_scale: float, inputs, outputs, rows,
            kept: int | None = None, abort=_no_abort) -> bool:
        """Replay round ``key`` if it was captured, capture it once it ran :data:`WARMUP_ROUNDS`
        times eagerly; returns whether it ran here (False: run it eagerly). ``inputs``,
        ``outputs``, ``rows``: the batch's tensors and each participant's rows of them
        (:class:`CapturedRound`); ``kept``: a kept-activation plan's round key, ``abort``: stops
        the group when a replay fails (:meth:`CapturedRound.replay`)."""
        if self.disabled is not None:
            return False
        key = (key, kind, float(softmax_scale), kept is not None)
        found = self._captured.get(key)
        if found is not None and not found.usable():
            self._captured.pop(key).release()
            found = None
        if found is None:
            seen = self._seen.get(key, 0)
            if seen < WARMUP_ROUNDS:
                self._seen[key] = seen + 1
                return False
            if len(self._captured) >= GRAPH_BLOCKS:  # its words go to this capture (every PE alike)
                self._captured.popitem(last=False)[1].release()
            try:
                found = CapturedRound(participants, transports, kind, softmax_scale, inputs, outputs, rows, kept)
            except ValueError:  # a route not installed yet (its buffers grew late), or no kept rows
                self._seen[key] = WARMUP_ROUNDS - 1  # to capture: eager once more (it raises the latter)
                return False
            except Exception as exc:  # noqa: BLE001 - graphs are an optimisation: run eagerly
                self.disabled = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"distca: capturing a round failed, rounds run without CUDA graphs: {self.disabled}",
                              RuntimeWarning, stacklevel=3)
                return False
            self._captured[key] = found
        self._captured.move_to_end(key)
        found.replay(participants, inputs, outputs, kept, abort)
        self.replays += 1
        return True


__all__ = ["CAPTURE_KEY", "CapturedRound", "RoundGraphs", "WARMUP_ROUNDS", "copy_groups"]
