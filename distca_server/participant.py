"""One process's part in a plan's rounds: client rank, attention server, or both (in-place).

A round is two exchanges: dispatch (clients send rows to servers) and return (servers send results
back). Every participant takes part in both, even with nothing to send, so nobody waits on a peer
that skipped one.

Where each byte is written (one copy per byte and direction):

- dispatch: a client gathers each tensor's rows for the other participants straight into the
  transport's send buffer (``index_select(..., out=view)``), one segment per tensor laid out server
  by server. An in-place participant gathers its own rows straight into the head of its receive
  buffer; they never pass through the transport.
- the server's receive buffer holds each tensor contiguous across senders (its own rows first,
  then the other ranks in order), exactly the order of its fused kernel call's ``cu_seqlens``, so
  the kernel reads the received rows where they landed.
- return: the kernel's outputs are already laid out [own rows][rank 0, rank 1, ...] and are sent as
  they are; the client scatters each result from the receive buffer (and, in-place, from its own
  server's outputs) into the output with ``index_copy_``; KV rows that several servers computed on
  are summed in float32 (:class:`~distca_server.rowsum.RowScatter`).
- a participant whose rows all stay home in order (one in-place server, or a plan that moves
  nothing) hands its tensors to the kernel as they are and copies nothing.

Kept activations (a plan with ``keep_activations``): a forward round that will have a backward
round names a key (the round's sequence number in the step); the server role keeps what it
received and computed under it (:data:`~scheduler.cost.KEPT_TENSORS`: copies out of the reused
receive buffer, or the client's own tensors when they were handed over as they are) until the
backward round with that key, which dispatches only dO. Keys belong to this participant, i.e. to
one batch of one step, so layers and batches never mix; :meth:`Participant.release` drops them
all (step ended, a round failed).

Kept activations with *split* tasks (partial-KV, :func:`~scheduler.cost.is_split`): a server's O
and LSE of a key piece are partial, but FlashAttention-2's backward needs the merged ones
(D = rowsum(dO ∘ O), P = exp(S - LSE)). So the server keeps only the Q (and KV) rows of a split
task, the client role keeps the merged O and LSE of its split shards' rows (once per row) under the
same key, and the backward round sends those rows with dO (:data:`~scheduler.cost.MERGED_TENSORS`,
a third row class next to query and KV rows: one row per query row of a split task, task order).
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict

import numpy as np
import torch

from scheduler.comm_layout import CommLayout, comm_layout, part_rows, row_class
from scheduler.cost import RoundKind
from scheduler.parts import PlanPart

from .executor import ServerExecutor
from .kept import KeptActivations
from .rowsum import PartialMerge, RowScatter
from .transport.base import aligned
from .wire import RowFormat



def drive(steps):
    """Run one participant's round generator (:meth:`Participant.forward_steps` and the like) to its
    end on this thread, waiting for each exchange handle it yields; returns the round's result.

    Raises what the round or an exchange's ``wait`` raises."""
    try:
        handle = next(steps)
        while True:
            handle.wait()
            handle = steps.send(None)
    except StopIteration as stop:
        return stop.value


def drive_all(rounds: list) -> list:
    """Run several participants' round generators in lock step on this thread: each to its next
    exchange, then every exchange handle's ``wait``, then each on (the protocol of
    :class:`~distca_server.transport.local.LockstepGroup`). Returns their results in order.

    Raises:
        the first error a round raised (the others are closed); else the first ``wait``'s
        :class:`~distca_server.errors.DistCAError` (a round ended while a peer still exchanged).
    """
    results: list = [None] * len(rounds)
    live = list(range(len(rounds)))
    try:
        while live:
            handles, going = [], []
            for i in live:
                try:
                    handles.append(next(rounds[i]))
                    going.append(i)
                except StopIteration as stop:
                    results[i] = stop.value
            for handle in handles:
                handle.wait()
            live = going
    finally:
        for steps in rounds:
            steps.close()
    return results


class Participant(KeptActivations):
    """One participant of a plan's all-to-all group, built from its :class:`PlanPart`.

    In-place mode: participant ``i`` is client rank ``i`` and server ``i``. Dedicated mode:
    participants ``0..R-1`` are client ranks, ``R..R+S-1`` servers.

    Attributes:
        traffic: ``{(round kind value, tensor): bytes}`` this participant sent to other participants.
        timings: seconds spent per phase over all rounds: ``pack`` (gathering rows into send and
            receive buffers), ``all_to_all`` (the exchanges, waiting for peers included), ``kernel``
            (the server's fused call) and ``unpack`` (scattering results into the outputs).
            CPU wall time; on a GPU the phases are asynchronous and only the total is meaningful.
    """

    def __init__(self, part: PlanPart, fmt: RowFormat, backend, device: torch.device):
        self.part, self.index, self.fmt, self.device = part, part.participant, fmt, torch.device(device)
        self.rank, self.server = part.rank, part.server
        self.traffic: dict[tuple[str, str], int] = defaultdict(int)
        self.timings: dict[str, float] = defaultdict(float)
        self.keep_activations = part.keep_activations
        # Server role, kept activations: key -> ({tensor: rows}, [(tensor, version)] of those
        # shared with the client, checked for in-place changes as autograd checks saved tensors).
        self.kept: dict[int, tuple[dict, list]] = {}
        # Client role, kept activations: key -> {"out", "lse"}: merged rows of its split shards.
        self.kept_merged: dict[int, dict] = {}
        self.released = ""  # why kept activations were dropped (a later backward names it)
        # Everything the part moves, worked out once (scheduler.comm_layout); here only what the
        # copies need on the device: index tensors, the row scatters and the executor.
        self.rows = rows = part_rows(part)
        self._layouts: dict = {}  # RoundKind -> CommLayout, built at the first round of each kind
        self.own_server = self.server if self.rank is not None else None
        self.results_home, self.inputs_home = rows.results_home, rows.inputs_home

        def idx(a):
            return torch.as_tensor(np.asarray(a, dtype=np.int64), device=self.device)

        if self.rank is not None:
            own = self.own_server
            self.num_tokens = rows.num_tokens
            self.q_send_idx, self.kv_send_idx = idx(rows.q_send), idx(rows.kv_send)
            self.q_own_idx, self.kv_own_idx = idx(rows.q_own), idx(rows.kv_own)
            # A document's KV prefix goes to every server holding one of its shards: dK/dV sum.
            kv_pieces = ([rows.kv_own] if own is not None else []) + [rows.kv_send]
            self.kv_scatter = RowScatter(kv_pieces, self.num_tokens, self.device)
            # A query shard split on the key axis comes back once per task: partials to merge.
            q_pieces = ([rows.q_own] if own is not None else []) + [rows.q_send]
            self.q_merge = (PartialMerge(q_pieces, self.num_tokens, self.device)
                            if sum(map(len, q_pieces)) != self.num_tokens else None)
            self.merged_rows = idx(rows.merged_rows)
            self.split_send_idx, self.split_own_idx = idx(rows.split_send), idx(rows.split_own)
        if self.server is not None:
            self.executor = ServerExecutor(rows.server_layout, backend, self.device, window=part.window)
            self.split_pos = idx(rows.split_pos) if rows.split_pos is not None else None
            self.unsplit_pos = idx(rows.unsplit_pos)

    # ---- byte layouts ------------------------------------------------------------------------------
    def _typed(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        """A byte range of a buffer as rows of tensor ``name``."""
        rows = buf.numel() // self.fmt.row_bytes(name)
        return buf.view(self.fmt.row_dtype(name)).view(rows, *self.fmt.row_shape(name))

    def _segments(self, key: str, transport, heads: list[int], rest: list[int]):
        """Carve transport buffer ``key`` into one aligned segment per tensor: ``heads[i]`` bytes the
        participant fills itself, then ``rest[i]`` bytes the transport fills. Returns the whole
        segments and their transport parts."""
        sizes = [aligned(h + r) for h, r in zip(heads, rest)]
        buf = transport.buffer(key, sum(sizes))
        whole, tail, off = [], [], 0
        for h, r, size in zip(heads, rest, sizes):
            whole.append(buf[off:off + h + r])
            tail.append(buf[off + h:off + h + r])
            off += size
        return whole, tail

    # ---- a round -----------------------------------------------------------------------------------
    def layout(self, kind: RoundKind) -> CommLayout:
        """This participant's :class:`~scheduler.comm_layout.CommLayout` for rounds of ``kind``
        (built once per kind; rebound participants share it)."""
        found = self._layouts.get(kind)
        if found is None:
            found = self._layouts[kind] = comm_layout(self.rows, kind, self.fmt.row_bytes, self.keep_activations)
        return found

    def _route(self, kind: RoundKind, which: str) -> tuple | None:
        """The route of this plan's ``which`` exchange of rounds of ``kind`` (the same on every
        participant): every such exchange moves the same sizes into the same buffers, so a
        transport that can (:mod:`~distca_server.transport.routed`) drives it from the device
        once installed."""
        if self.part.plan_id == 0:  # a part cut without an identity: nothing tells its plans apart
            return None
        f = self.fmt
        return (self.part.plan_id, kind.value, which, str(f.dtype), f.num_heads_q, f.num_heads_kv, f.head_dim)

    def installed(self, transport, kind: RoundKind) -> bool:
        """Whether both exchanges of this plan's rounds of ``kind`` would run device-driven on
        ``transport`` now (a :class:`~distca_server.transport.routed.RoutedTransport` with both
        routes installed); False for a participant alone in its group (it exchanges nothing)."""
        check = getattr(transport, "installed", None)
        routes = [self._route(kind, which) for which in ("dispatch", "return")]
        return (check is not None and self.part.num_participants > 1 and None not in routes
                and all(map(check, routes)))

    def _round(self, transport, kind: RoundKind, local, compute):
        """Run one round (a generator: it yields each exchange's handle, see :func:`drive`); returns
        ``(results from the other servers, own server's results)`` on a client (each
        ``{name: tensor}``, the first laid out server by server), else ``(None, None)``."""
        t0 = time.perf_counter()
        shape = self.layout(kind)
        names, merged, back = shape.names, shape.merged, shape.back
        # Tensors the kernel reads where they are (rows all home, in order; made row-contiguous, so
        # that the buffers' layout, and with it the exchanges' route, depends on the plan alone).
        home = self.inputs_home
        if home and not all(x.is_contiguous() for x in local.values()):  # rare: a copy, as a gather would be
            local = {n: x.contiguous() for n, x in local.items()}
        heads = [0] * len(names) if home else shape.heads.tolist()
        # Two transport buffers per participant, reused by every round: "client" holds the rows a
        # client sends, then the results it receives back (the send is complete by then);
        # "server" holds the rows a server receives, until its kernel has run.
        _, send = self._segments("client", transport, [0] * len(names), shape.send_sizes)
        inputs, recv = self._segments("server", transport, heads, shape.recv_sizes)
        if self.rank is not None:
            for i, name in enumerate(names):
                send_idx, own_idx = ((self.q_send_idx, self.q_own_idx), (self.kv_send_idx, self.kv_own_idx),
                                     (self.split_send_idx, self.split_own_idx))[row_class(name, merged)]
                src = local[name]
                if shape.send_sizes[i]:
                    torch.index_select(src, 0, send_idx, out=self._typed(send[i], name))
                    self.traffic[(kind.value, name)] += shape.send_sizes[i]
                if self.server is not None and not home:
                    torch.index_select(src, 0, own_idx, out=self._typed(inputs[i][:heads[i]], name))
        t1 = time.perf_counter()
        # Alone in the group, a participant has nobody to exchange with: its own rows never pass
        # through a transport, so every split is 0 and the exchange would only check that.
        alone = self.part.num_participants == 1
        if not alone:
            yield transport.exchange(send, shape.send_splits, recv, shape.recv_splits,
                                     route=self._route(kind, "dispatch"))
        t2 = time.perf_counter()
        self.timings["pack"] += t1 - t0
        self.timings["all_to_all"] += t2 - t1

        # The server's fused kernel call on the received rows, then the return exchange.
        own_results, ret_send = None, []
        if self.server is not None:
            results = compute(local if home else {n: self._typed(buf, n) for n, buf in zip(names, inputs)})
            t3 = time.perf_counter()
            self.timings["kernel"] += t3 - t2
            t2 = t3
            own_results = {}
            for name, head in zip(back, shape.head_rows_back.tolist()):
                rows = results[name].contiguous()
                own_results[name] = rows[:head]
                ret_send.append(rows[head:].reshape(-1).view(torch.uint8))
                sent = rows[head:].numel() * rows.element_size()
                if sent:
                    self.traffic[(kind.value, name)] += sent
        else:
            ret_send = [torch.empty(0, dtype=torch.uint8, device=self.device)] * len(back)
        _, ret_recv = self._segments("client", transport, [0] * len(back), shape.ret_recv_sizes)
        if not alone:
            yield transport.exchange(ret_send, shape.ret_send_splits, ret_recv, shape.ret_recv_splits,
                                     route=self._route(kind, "return"))
        self.timings["all_to_all"] += time.perf_counter() - t2
        if self.rank is None:
            return None, None
        return {n: self._typed(buf, n) for n, buf in zip(back, ret_recv)}, own_results

    def rebound(self, part: PlanPart) -> "Participant":
        """A fresh participant for ``part``, the same plan part in another step or batch: it shares
        this one's layout, index tensors and executor (read-only, built from the plan, and costly
        to rebuild: host work and small host-to-device copies), with its own traffic, timings and
        kept activations.

        Raises:
            ValueError: ``part`` is not this participant's part of the same plan.
        """
        a, b = self.part, part
        same = (a.plan_id, a.participant, a.rank, a.server, a.doc_lens, a.window, a.keep_activations)
        if same != (b.plan_id, b.participant, b.rank, b.server, b.doc_lens, b.window, b.keep_activations) or not all(
                x is y or np.array_equal(x, y) for x, y in ((a.client_tasks, b.client_tasks),
                                                             (a.server_tasks, b.server_tasks))):
            raise ValueError(f"participant {b.participant} of step {b.step} batch {b.batch} is not "
                             f"participant {a.participant}'s part of the same plan")
        fresh = copy.copy(self)
        fresh.part = part
        fresh.traffic, fresh.timings = defaultdict(int), defaultdict(float)
        fresh.kept, fresh.kept_merged, fresh.released = {}, {}, ""
        return fresh

    def _who(self) -> str:
        return f"server {self.server} (step {self.part.step} batch {self.part.batch})"

    # ---- rounds ------------------------------------------------------------------------------------
    def forward(self, transport, q, k, v, softmax_scale: float, *, out=None, lse=None,
                keep: int | None = None):
        """Run :meth:`forward_steps` to the end, waiting for each exchange here."""
        return drive(self.forward_steps(transport, q, k, v, softmax_scale, out=out, lse=lse, keep=keep))

    def backward(self, transport, q, k, v, out, lse, dout, softmax_scale: float, *, dq=None, dk=None,
                 dv=None):
        """Run :meth:`backward_steps` to the end, waiting for each exchange here."""
        return drive(self.backward_steps(transport, q, k, v, out, lse, dout, softmax_scale, dq=dq, dk=dk, dv=dv))

    def backward_kept(self, transport, dout, softmax_scale: float, *, kept: int, dq=None, dk=None,
                      dv=None):
        """Run :meth:`backward_kept_steps` to the end, waiting for each exchange here."""
        return drive(self.backward_kept_steps(transport, dout, softmax_scale, kept=kept, dq=dq, dk=dk, dv=dv))

    # The rounds as generators: each yields the handle of every exchange it starts and goes on once
    # the handle is complete, so one thread can run every participant of a process in lock step
    # (the local runtime) or a thread its one participant (:func:`drive`).
    @torch.no_grad()  # rounds run on worker threads, where grad mode is on; autograd is above us
    def forward_steps(self, transport, q, k, v, softmax_scale: float, *, out=None, lse=None,
                      keep: int | None = None):
        """Forward round. Clients pass their local ``q`` [T, Hq, D], ``k``, ``v`` [T, Hkv, D] and
        get ``(out [T, Hq, D], lse [T, Hq])``; server-only participants pass None and get None.

        ``out`` and ``lse``, if given, are where the results are written (e.g. this rank's slice of
        a batch-wide tensor): q's dtype for out, :attr:`RowFormat.lse_dtype` for lse.

        ``keep`` (kept-activation plans, a forward round that will have a backward round): the
        key under which the server role keeps its rows and results, and the client role the
        merged O and LSE of its split shards' rows, for :meth:`backward_kept`.

        Raises:
            ValueError: ``keep`` on a stateless plan, a key already kept, or
                :data:`~distca_server.kept.MAX_KEPT_ROUNDS` rounds kept already (before any byte moves).
        """
        local = {"q": q, "k": k, "v": v} if self.rank is not None else None
        self._check_keep(keep)

        def compute(x):
            o, s = self.executor.forward(x["q"], x["k"], x["v"], softmax_scale)
            if keep is not None:
                self._keep(keep, x, {"out": o, "lse": s}, shared=x is local)
            return {"out": o, "lse": s}
        remote, own = yield from self._round(transport, RoundKind.FORWARD, local, compute)
        if remote is None:
            return None
        if self.results_home:
            return self._place(own["out"], out), self._place(own["lse"], lse)
        T = self.num_tokens
        t0 = time.perf_counter()
        if out is None:
            out = q.new_empty((T, self.fmt.num_heads_q, self.fmt.head_dim))
        if lse is None:
            lse = q.new_empty((T, self.fmt.num_heads_q), dtype=self.fmt.lse_dtype)
        if self.q_merge is not None:
            pick = (lambda name: ([own[name]] if own is not None else []) + [remote[name]])
            self.q_merge.merge(pick("out"), pick("lse"), out, lse)
            if keep is not None and self._keeps_merged():
                self.kept_merged[keep] = {"out": out.index_select(0, self.merged_rows),
                                          "lse": lse.index_select(0, self.merged_rows)}
        else:
            for name, dst in (("out", out), ("lse", lse)):
                dst.index_copy_(0, self.q_send_idx, remote[name])
                if own is not None:
                    dst.index_copy_(0, self.q_own_idx, own[name])
        self.timings["unpack"] += time.perf_counter() - t0
        return out, lse

    @torch.no_grad()
    def backward_steps(self, transport, q, k, v, out, lse, dout, softmax_scale: float, *, dq=None, dk=None,
                       dv=None):
        """Backward round of a stateless plan: clients get ``(dq, dk, dv)`` shaped like their
        ``q``, ``k``, ``v``; gradients of KV rows used by several servers are summed in float32
        (float64).

        ``dq``, ``dk``, ``dv``, if given, are where the gradients are written (q's, k's, v's
        shape and dtype)."""
        if self.keep_activations:
            raise ValueError(f"{self._who()}: the plan keeps activations; its backward rounds send dO "
                             f"only (backward_kept)")
        local = ({"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout}
                 if self.rank is not None else None)

        def compute(x):
            g = self.executor.backward(x["dout"], x["q"], x["k"], x["v"], x["out"], x["lse"],
                                       softmax_scale)
            return dict(zip(("dq", "dk", "dv"), g))
        return (yield from self._backward_round(transport, local, compute, dq, dk, dv))

    @torch.no_grad()
    def backward_kept_steps(self, transport, dout, softmax_scale: float, *, kept: int, dq=None, dk=None,
                            dv=None):
        """Backward round of forward round ``kept`` of a kept-activation plan: clients pass only
        ``dout`` [T, Hq, D] and get ``(dq [T, Hq, D], dk, dv [T, Hkv, D])`` in dout's dtype; the
        round sends dO and, for the query rows of split tasks, the merged O and LSE the client
        role kept. The server role computes from the rows it kept (and those merged rows) and
        frees them. Server-only participants pass ``dout=None`` and get None.

        Raises:
            ValueError: the server keeps nothing under ``kept`` (never kept, already used, or
                released after a failed round or the end of the step).
            RuntimeError: a kept tensor shared with the client was modified in place meanwhile.
        """
        local = {"dout": dout, **self._take_merged(kept, dout)} if self.rank is not None else None
        rows = self._take_kept(kept) if self.server is not None else None

        def compute(x):
            g = self.executor.backward(x["dout"], rows["q"], rows["k"], rows["v"],
                                       self._full(rows["out"], x["out"]), self._full(rows["lse"], x["lse"]),
                                       softmax_scale)
            return dict(zip(("dq", "dk", "dv"), g))
        if dout is not None and (dk is None or dv is None) and not self.results_home:
            # the scatter of dK, dV needs their shape (the client kept no K, V); rows that stay
            # home are handed back as the kernel wrote them, with no buffer and no copy
            kv = dout.new_empty((dout.shape[0], self.fmt.num_heads_kv, self.fmt.head_dim))
            dk = torch.empty_like(kv) if dk is None else dk
            dv = torch.empty_like(kv) if dv is None else dv
        return (yield from self._backward_round(transport, local, compute, dq, dk, dv, like_q=dout))

    def _backward_round(self, transport, local, compute, dq, dk, dv, like_q=None):
        remote, own = yield from self._round(transport, RoundKind.BACKWARD, local, compute)
        if remote is None:
            return None
        if self.results_home:
            return self._place(own["dq"], dq), self._place(own["dk"], dk), self._place(own["dv"], dv)
        t0 = time.perf_counter()
        dq = torch.empty_like(local["q"] if like_q is None else like_q) if dq is None else dq
        if self.q_merge is not None:  # dQ parts of a split shard sum in float32
            self.q_merge(([own["dq"]] if own is not None else []) + [remote["dq"]], dq)
        else:
            dq.index_copy_(0, self.q_send_idx, remote["dq"])
            if own is not None:
                dq.index_copy_(0, self.q_own_idx, own["dq"])
        grads = []
        for name, given in (("dk", dk), ("dv", dv)):
            pieces = ([own[name]] if own is not None else []) + [remote[name]]
            grads.append(self.kv_scatter(pieces, torch.empty_like(local[name[1]]) if given is None else given))
        self.timings["unpack"] += time.perf_counter() - t0
        return dq, grads[0], grads[1]

    @staticmethod
    def _place(result: torch.Tensor, given: torch.Tensor | None) -> torch.Tensor:
        return result if given is None else given.copy_(result)
