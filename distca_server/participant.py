"""One process's part in a plan's rounds: client rank, attention server, or both (in-place).

A round is two all-to-alls: dispatch (clients send rows to servers) and return (servers send
results back). Every participant calls both, even with nothing to send, so a round is always a
pair of collectives and nobody waits on a peer that skipped one.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from scheduler.layout import client_layout_from, server_layout_from
from scheduler.parts import PlanPart

from .dtypes import accumulation_dtype
from .executor import ServerExecutor
from scheduler.cost import KV_TENSORS, RoundKind

from .wire import RowFormat, pack, unpack


class Participant:
    """One participant of a plan's all-to-all group, built from its :class:`PlanPart`.

    In-place mode: participant ``i`` is client rank ``i`` and server ``i``. Dedicated mode:
    participants ``0..R-1`` are client ranks, ``R..R+S-1`` servers.

    Attributes:
        traffic: ``{(round_kind, tensor): bytes}`` this participant sent to other participants.
        timings: seconds spent per phase over all rounds: ``pack`` (gathering rows into send
            buffers), ``all_to_all`` (the exchanges, waiting for peers included), ``kernel`` (the
            server's fused call) and ``unpack`` (splitting, concatenating, scattering results).
            CPU wall time; on a GPU the phases are asynchronous and only the total is meaningful.
    """

    def __init__(self, part: PlanPart, fmt: RowFormat, backend, device: torch.device):
        self.part, self.index, self.fmt, self.device = part, part.participant, fmt, torch.device(device)
        self.rank, self.server = part.rank, part.server
        self.traffic: dict[tuple[str, str], int] = defaultdict(int)
        self.timings: dict[str, float] = defaultdict(float)  # seconds per phase, summed over rounds
        if self.rank is not None:
            lay = client_layout_from(part.doc_lens, part.client_tasks, part.num_servers, self.rank)

            def idx(a):
                return torch.as_tensor(a, dtype=torch.long, device=self.device)
            self.q_index = [idx(a) for a in lay.q_index]
            self.kv_index = [idx(a) for a in lay.kv_index]
            self.q_all = torch.cat(self.q_index)
            self.kv_all = torch.cat(self.kv_index)
            self.num_tokens = part.num_tokens
        if self.server is not None:
            self.server_lay = server_layout_from(part.server_tasks, part.num_ranks, self.server)
            self.executor = ServerExecutor(self.server_lay, backend, self.device)

    # ---- the two exchanges of a round --------------------------------------------------------------
    def _exchange(self, transport, kind: RoundKind, names, outgoing: dict[int, list[torch.Tensor]],
                  recv_rows: dict[int, tuple[int, int]]):
        """Send ``outgoing[participant]`` (tensors in ``names`` order); receive messages of
        ``recv_rows[participant] = (q_rows, kv_rows)``; return ``{participant: {name: tensor}}``."""
        P = self.part.num_participants
        send_splits, chunks = [0] * P, []
        for dst in sorted(outgoing):
            parts = pack(outgoing[dst])
            chunks.extend(parts)
            send_splits[dst] = sum(p.numel() for p in parts)
            if dst != self.index:
                for name, p in zip(names, parts):
                    self.traffic[(kind.value, name)] += p.numel()
        recv_splits = [0] * P
        for src, (qr, kr) in recv_rows.items():
            recv_splits[src] = self.fmt.message_bytes(names, qr, kr)
        send = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=self.device)
        t0 = time.perf_counter()
        recv = transport.all_to_all(send, send_splits, recv_splits)
        t1 = time.perf_counter()
        self.timings["all_to_all"] += t1 - t0
        result, offset = {}, 0
        for src in range(P):
            size = recv_splits[src]
            if src in recv_rows:
                result[src] = unpack(recv[offset:offset + size], self.fmt, names, *recv_rows[src])
            offset += size
        self.timings["unpack"] += time.perf_counter() - t1
        return result

    def _round(self, transport, kind: RoundKind, local, compute):
        part = self.part
        dispatch_names, return_names = kind.dispatch, kind.returns
        start = time.perf_counter()
        pre_a2a = self.timings["all_to_all"] + self.timings["unpack"]
        kernel0 = self.timings["kernel"]
        outgoing, expect_back = {}, {}
        if self.rank is not None:
            for s in range(part.num_servers):
                qi, ki = self.q_index[s], self.kv_index[s]
                dst = part.server_participant(s)
                outgoing[dst] = [local[n].index_select(0, ki if n in KV_TENSORS else qi)
                                 for n in dispatch_names]
                expect_back[dst] = (len(qi), len(ki))
        incoming = {}
        if self.server is not None:
            lay = self.server_lay
            incoming = {r: (lay.q_rows[r], lay.kv_rows[r]) for r in range(part.num_ranks)}
        received = self._exchange(transport, kind, dispatch_names, outgoing, incoming)

        replies = {}
        if self.server is not None:
            ranks = range(part.num_ranks)
            inputs = {n: torch.cat([received[r][n] for r in ranks]) for n in dispatch_names}
            t0 = time.perf_counter()
            results = compute(inputs)
            self.timings["kernel"] += time.perf_counter() - t0
            q_off = k_off = 0
            for r in ranks:
                qr, kr = incoming[r]
                replies[r] = [results[n][k_off:k_off + kr] if n in KV_TENSORS else results[n][q_off:q_off + qr]
                              for n in return_names]
                q_off, k_off = q_off + qr, k_off + kr
        back = self._exchange(transport, kind, return_names, replies, expect_back)
        result = None
        if self.rank is not None:
            servers = [part.server_participant(s) for s in range(part.num_servers)]
            result = {n: torch.cat([back[p][n] for p in servers]) for n in return_names}
        elapsed = time.perf_counter() - start
        # Whatever was not exchange, unpack or kernel time in this round was packing.
        accounted = self.timings["all_to_all"] + self.timings["unpack"] - pre_a2a
        self.timings["pack"] += max(0.0, elapsed - accounted - (self.timings["kernel"] - kernel0))
        return result

    # ---- rounds ------------------------------------------------------------------------------------
    def forward(self, transport, q, k, v, softmax_scale: float, *, out=None, lse=None):
        """Forward round. Clients pass their local ``q`` [T, Hq, D], ``k``, ``v`` [T, Hkv, D] and
        get ``(out [T, Hq, D], lse [T, Hq])``; server-only participants pass None and get None.

        ``out`` and ``lse``, if given, are where the results are written (e.g. this rank's slice of
        a batch-wide tensor): q's dtype for out, :attr:`RowFormat.lse_dtype` for lse."""
        local = {"q": q, "k": k, "v": v} if self.rank is not None else None

        def compute(x):
            out, lse = self.executor.forward(x["q"], x["k"], x["v"], softmax_scale)
            return {"out": out, "lse": lse}
        got = self._round(transport, RoundKind.FORWARD, local, compute)
        if got is None:
            return None
        T = self.num_tokens
        if out is None:
            out = q.new_empty((T, self.fmt.num_heads_q, self.fmt.head_dim))
        if lse is None:
            lse = q.new_empty((T, self.fmt.num_heads_q), dtype=self.fmt.lse_dtype)
        t0 = time.perf_counter()
        out.index_copy_(0, self.q_all, got["out"])
        lse.index_copy_(0, self.q_all, got["lse"])
        self.timings["unpack"] += time.perf_counter() - t0
        return out, lse

    def backward(self, transport, q, k, v, out, lse, dout, softmax_scale: float, *, dq=None, dk=None,
                 dv=None):
        """Backward round: clients get ``(dq, dk, dv)`` shaped like their ``q``, ``k``, ``v``;
        gradients of KV rows used by several servers are summed in float32 (float64).

        ``dq``, ``dk``, ``dv``, if given, are where the gradients are written (q's, k's, v's
        shape and dtype)."""
        grads_out = (dq, dk, dv)
        local = ({"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout}
                 if self.rank is not None else None)

        def compute(x):
            dq, dk, dv = self.executor.backward(x["dout"], x["q"], x["k"], x["v"], x["out"],
                                                x["lse"], softmax_scale)
            return {"dq": dq, "dk": dk, "dv": dv}
        got = self._round(transport, RoundKind.BACKWARD, local, compute)
        if got is None:
            return None
        t0 = time.perf_counter()
        dq = (torch.empty_like(q) if grads_out[0] is None else grads_out[0]).index_copy_(0, self.q_all, got["dq"])
        acc = accumulation_dtype(k.dtype)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device).index_add_(0, self.kv_all, got["dk"].to(acc))
        dv = torch.zeros(v.shape, dtype=acc, device=v.device).index_add_(0, self.kv_all, got["dv"].to(acc))
        self.timings["unpack"] += time.perf_counter() - t0
        dk, dv = dk.to(k.dtype), dv.to(v.dtype)
        if grads_out[1] is not None:
            dk = grads_out[1].copy_(dk)
        if grads_out[2] is not None:
            dv = grads_out[2].copy_(dv)
        return dq, dk, dv
