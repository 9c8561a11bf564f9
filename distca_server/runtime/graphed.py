"""Rounds captured once and replayed (issue 22 item 4): ``DistCAClient.local`` over an in-process
heap on CUDA with ``JobConfig(cuda_graphs=True)``.

A stateless plan's forward round (Q, K, V in; O, LSE out) and backward round (Q, K, V, O, LSE, dO
in; dQ, dK, dV out) do the same device work every time they run with the same batch shape and
softmax scale: the same gathers into the same transport buffers, the same exchanges (the plan's
routes), the same fused kernel call and the same merges. So after :data:`WARMUP_ROUNDS` eager
rounds (the first grows the transport buffers, the next installs the routes), each participant's
round is recorded once into a CUDA graph with static input and output tensors
(:meth:`~distca_server.transport.routed.RoutedTransport.graph`: over
:class:`~distca_server.transport.memop_stream.MemopStream` the round's torch work and its
exchanges go to the participant's communication stream while it is recorded). Every later round
of that shape, in every layer and in later steps, is replayed from the thread that runs the round:
per participant, copy its rows into the static inputs, replay, copy the static outputs into its
rows of the batch-wide outputs, each on a CUDA stream of its own ordered after the caller's. The
host queues that work and waits for nothing; the participants' streams wait for each other on
the device.

Kept-activation plans are not captured: their forward rounds keep per-layer rows in host-side
dicts, which a replay would overwrite. Neither are single-rank batches (nothing is exchanged) nor
rounds on the CPU.

A capture that fails (a kernel or call that CUDA cannot record) turns graphs off for the runtime,
with a warning naming the error; the rounds then run as before. A replay that fails raises as the
round would (:class:`~distca_server.errors.DistCAError`), and the group that the next round forms
starts without graphs.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch

from scheduler.cost import RoundKind

from ..participant import drive
from ..transport.symmetric_words import GRAPH_BLOCKS

WARMUP_ROUNDS = 2
"""Eager rounds of a (batch shape, round kind, softmax scale) before it is captured."""


class CapturedRound:
    """One round kind of one batch shape, recorded per participant: its static inputs and outputs
    and its :class:`~distca_server.transport.exchange_graph.ExchangeGraph`.

    Args:
        participants: the batch's participants, in group order.
        transports: their endpoints of the group (``RoutedTransport``, CUDA heap).
        kind: FORWARD or BACKWARD (a stateless plan's).
        softmax_scale: the scale recorded into the kernel call.
        inputs, outputs: per participant, its rows of each tensor (None for a server-only one);
            only their shapes and dtypes are used here.

    Raises:
        ValueError, DistCAError: as :meth:`~distca_server.transport.routed.RoutedTransport.graph`
            (e.g. a route not installed yet), or a CUDA error while recording.
    """

    def __init__(self, participants, transports, kind: RoundKind, softmax_scale: float, inputs, outputs):
        self.kind = kind
        self.inputs = [tuple(None if x is None else torch.empty_like(x) for x in row) for row in inputs]
        self.outputs = [tuple(None if x is None else torch.empty_like(x) for x in row) for row in outputs]
        self.graphs = []
        for p, t, ins, outs in zip(participants, transports, self.inputs, self.outputs):
            self.graphs.append(t.graph(self._round(p, t, softmax_scale, ins, outs)))

    def _round(self, p, t, scale: float, ins, outs):
        if self.kind == RoundKind.FORWARD:
            return lambda: drive(p.forward_steps(t, *ins, scale, out=outs[0], lse=outs[1]))
        return lambda: drive(p.backward_steps(t, *ins, scale, dq=outs[0], dk=outs[1], dv=outs[2]))

    def usable(self) -> bool:
        """Whether every participant's recording can still be replayed (no later capture took its
        words, the transport buffers did not move)."""
        return all(g.usable for g in self.graphs)

    def release(self) -> None:
        """Give every participant's graph words back (the next capture takes them)."""
        for g in self.graphs:
            g.release()

    def replay(self, inputs, outputs, streams: list) -> None:
        """Copy ``inputs`` in, replay, copy ``outputs`` out, participant ``i`` on ``streams[i]``
        after the current stream, which then waits for them all (returns at once).

        Raises:
            DistCAError: the group is aborted, or a participant's previous replay failed.
        """
        caller = torch.cuda.current_stream()
        for ins, outs, s_in, s_out, graph, stream in zip(inputs, outputs, self.inputs, self.outputs, self.graphs,
                                                          streams):
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                for static, x in zip(s_in, ins):
                    if x is not None:
                        static.copy_(x, non_blocking=True)
                graph.replay().wait()  # this stream waits for the replay, on the device
                for y, static in zip(outs, s_out):
                    if y is not None:
                        y.copy_(static, non_blocking=True)
            for x in (*ins, *outs):  # used on `stream`: the allocator must not hand them on before
                if x is not None:
                    x.record_stream(stream)
            caller.wait_stream(stream)


class RoundGraphs:
    """The captured rounds of one :class:`~distca_server.runtime.local.LocalRuntime` (see the
    module docstring): counts eager rounds per key, captures, replays, and keeps at most
    :data:`~distca_server.transport.symmetric_words.GRAPH_BLOCKS` captures (each takes one
    block of every participant's graph words), the least recently used going first."""

    def __init__(self):
        self._seen: dict = {}  # key -> eager rounds run
        self._captured: OrderedDict = OrderedDict()  # key -> CapturedRound
        self.disabled: str | None = None  # why graphs are off (a capture failed)
        self.replays = 0  # rounds replayed (for tests and benchmarks)

    def clear(self) -> None:
        """Forget every capture (the group they were recorded on is gone)."""
        self._seen.clear()
        self._captured.clear()

    def run(self, key, participants, transports, kind: RoundKind, softmax_scale: float, inputs, outputs,
            streams: list) -> bool:
        """Replay round ``key`` if it was captured, capture it once it ran :data:`WARMUP_ROUNDS`
        times eagerly; returns whether it ran here (False: run it eagerly). ``streams``: a CUDA
        stream per participant (the runtime's) for the replay."""
        if self.disabled is not None:
            return False
        key = (key, kind, float(softmax_scale))
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
                found = CapturedRound(participants, transports, kind, softmax_scale, inputs, outputs)
            except ValueError:  # a route not installed yet (its buffers grew late): eager once more
                self._seen[key] = WARMUP_ROUNDS - 1
                return False
            except Exception as exc:  # noqa: BLE001 - graphs are an optimisation: run eagerly
                self.disabled = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"distca: capturing a round failed, rounds run without CUDA graphs: {self.disabled}",
                              RuntimeWarning, stacklevel=3)
                return False
            self._captured[key] = found
        self._captured.move_to_end(key)
        found.replay(inputs, outputs, streams)
        self.replays += 1
        return True


__all__ = ["CapturedRound", "RoundGraphs", "WARMUP_ROUNDS"]
