"""A plan's derived statistics: per-server and per-rank loads, rows and bytes moved by each round,
bytes held with kept activations, imbalance and the readable summary.

Kept apart from :mod:`scheduler.tasks` (whose :class:`~scheduler.tasks.Plan` inherits
:class:`PlanStatsMixin`) so the plan's data, checks and wire format read on their own. Pure
Python + numpy.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from .bound import LoadBound, load_bound
from .cost import KV_TENSORS, RoundKind, causal_pairs, is_split
from .kv import kv_intervals


def _pairs(arr: np.ndarray, window: int | None) -> np.ndarray:
    """float64 pairs of each task row (int64 [n, >= 4]: ..., q_start, q_end, kv_start, kv_end as
    the last four columns); never wrapping around. Exact while every offset is below 2**31 (int64
    products); beyond, computed in float64 (the prefix sums it subtracts are rounded, so a
    windowed task's pairs, a small difference of two large sums, carry their rounding: about
    1e4 pairs of 1e14 at offsets near 2**36)."""
    qs, qe, ks, ke = arr[:, -4], arr[:, -3], arr[:, -2], arr[:, -1]
    if len(arr) == 0 or int(max(qe.max(), ke.max())) < 2**31:  # every int64 product fits
        return causal_pairs(qs, qe, ks, ke, window).astype(np.float64)
    return causal_pairs(*(x.astype(np.float64) for x in (qs, qe, ks, ke)), window)


def _exact_sum(values: np.ndarray) -> int:
    """Sum of non-negative int64 values as a Python int (no wrap-around past int64)."""
    if values.size == 0 or float(values.sum(dtype=np.float64)) < 2.0**62:
        return int(values.sum())
    return sum(values.tolist())


class PlanStatsMixin:
    """Loads, rows, bytes and the summary of a :class:`~scheduler.tasks.Plan`, all derived from its
    arrays (``task_array``, ``doc_lens_flat``, ``doc_counts``) and fields (``mode``, ``num_servers``,
    ``num_ranks``, ``cost``, ``epsilon``, ``min_shard``, ``window``, ``keep_activations``)."""

    # ---- loads and bytes --------------------------------------------------------------------------
    def server_loads(self) -> list[float]:
        """Forward (windowed) causal attention FLOPs per server (see :meth:`CostModel.task_flops`);
        float64, never wrapping around; the pairs exact while documents stay below 2**31 tokens
        and a server's pairs below 2**53 (longer documents: see :func:`_pairs`)."""
        arr = self.task_array
        per_server = np.bincount(arr[:, 0], weights=_pairs(arr, self.window), minlength=self.num_servers)
        return (per_server * self.cost.flops_per_pair).tolist()

    def rank_loads(self) -> list[float]:
        """Forward FLOPs of each client rank's own documents: the load with no balancing."""
        lens = self.doc_lens_flat
        ranks = np.repeat(np.arange(self.num_ranks), self.doc_counts)
        zero = np.zeros_like(lens)
        whole = _pairs(np.stack([zero, lens, zero, lens], axis=1), self.window)
        per_rank = np.bincount(ranks, weights=whole, minlength=self.num_ranks)
        return (per_rank * self.cost.flops_per_pair).tolist()

    def load_bound(self) -> LoadBound:
        """The lower bound on the most loaded server of any plan of this batch with this
        ``min_shard`` (:func:`scheduler.bound.load_bound`; pairs, not FLOPs)."""
        return load_bound(self.doc_lens_flat, self.num_servers, self.min_shard, self.window)

    @cached_property
    def _task_rows(self) -> tuple[np.ndarray, ...]:
        """Row counts without the dense matrices: ``(q_rows, split, kv_server, kv_rank, kv_rows)``:
        int64 [num_tasks] query rows and bool [num_tasks] :func:`~scheduler.cost.is_split` per task,
        and per (server, rank, document) group its server, rank and KV rows (the union of its
        tasks' key ranges, :func:`scheduler.kv.kv_intervals`), all int64."""
        arr = self.task_array
        kv = kv_intervals(arr)  # canonical order: each (server, rank, doc) group is contiguous
        owner = kv.first[kv.group]
        split = is_split(arr[:, 3], arr[:, 4], arr[:, 5], arr[:, 6], self.window) if len(arr) else \
            np.zeros(0, dtype=bool)
        return arr[:, 4] - arr[:, 3], split, arr[owner, 0], arr[owner, 1], kv.lengths

    def _off_rank(self, rank: np.ndarray, server: np.ndarray) -> np.ndarray:
        """bool per row group: True where its rows really cross the network (all in dedicated mode,
        all but a rank's own server in-place)."""
        return rank != server if self.mode == "inplace" else np.ones(len(rank), dtype=bool)

    def _per_server(self, server: np.ndarray, rows: np.ndarray) -> list[int]:
        out = np.zeros(self.num_servers, dtype=np.int64)
        np.add.at(out, server, rows)
        return out.tolist()

    @cached_property
    def row_matrix(self) -> tuple[np.ndarray, np.ndarray]:
        """Rows sent per (src_rank, server): ``(q_rows, kv_rows)``, both int64 [num_ranks, num_servers].

        ``kv_rows`` counts each document's KV rows once per server (the union of the key ranges its
        shards there need, :func:`scheduler.kv.kv_intervals`), however many shards of that
        document the server runs. Dense: the simulator's traffic matrices; byte totals
        (:meth:`comm_bytes`, :meth:`held_bytes`) come from the per-task counts instead.
        """
        arr = self.task_array
        shape = (self.num_ranks, self.num_servers)
        q_rows = np.zeros(shape, dtype=np.int64)
        kv_rows = np.zeros(shape, dtype=np.int64)
        q, _, kv_server, kv_rank, kv_len = self._task_rows
        np.add.at(q_rows, (arr[:, 1], arr[:, 0]), q)
        np.add.at(kv_rows, (kv_rank, kv_server), kv_len)
        return q_rows, kv_rows

    @cached_property
    def split_row_matrix(self) -> np.ndarray:
        """Query rows of split tasks (:func:`~scheduler.cost.is_split`: partial-KV) per (src_rank,
        server): int64 [num_ranks, num_servers], counted once per task like :attr:`row_matrix`'s
        query rows. A kept backward round sends these rows' merged O and LSE."""
        arr = self.task_array
        q, split, *_ = self._task_rows
        rows = np.zeros((self.num_ranks, self.num_servers), dtype=np.int64)
        np.add.at(rows, (arr[split, 1], arr[split, 0]), q[split])
        return rows

    def off_rank_mask(self) -> np.ndarray:
        """bool [num_ranks, num_servers]: True where rows really cross the network."""
        mask = np.ones((self.num_ranks, self.num_servers), dtype=bool)
        if self.mode == "inplace":
            np.fill_diagonal(mask, False)
        return mask

    def comm_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes moved off-rank in one round of each kind, by tensor.

        Returns ``{"forward": {"q", "k", "v", "out", "lse", "total"}, "backward": {"q", "k", "v",
        "out", "lse", "dout", "dq", "dk", "dv", "total"}}``; with :attr:`keep_activations` the
        backward round holds ``dout``, ``out``, ``lse``, ``dq``, ``dk``, ``dv`` and ``total``,
        where ``out`` and ``lse`` are the merged rows of split tasks only
        (:attr:`split_row_matrix`; 0 in a plan without partial-KV tasks). Rows a client sends to
        its own in-place server are not counted. K and V rows count once per (document, server);
        dK and dV come back the same way.
        """
        arr = self.task_array
        q, split, kv_server, kv_rank, kv_len = self._task_rows
        off = self._off_rank(arr[:, 1], arr[:, 0])
        q_total, kv_total = _exact_sum(q[off]), _exact_sum(kv_len[self._off_rank(kv_rank, kv_server)])
        split_total = _exact_sum(q[off & split]) if self.keep_activations else 0
        result = {}
        for kind in RoundKind:
            merged = kind.split_dispatch_with(self.keep_activations)
            per = {n: (kv_total if n in KV_TENSORS else split_total if n in merged else q_total)
                   * self.cost.bytes_per_token(n) for n in kind.tensors_with(self.keep_activations)}
            per["total"] = sum(per.values())
            result[kind.value] = per
        return result

    def held_bytes(self) -> list[int]:
        """Bytes each server holds for one layer from its forward round until its backward round:
        the Q, O and LSE rows of its tasks (only Q for split tasks, whose partial O and LSE are not
        kept) and each document's KV rows once (:meth:`~scheduler.cost.CostModel.held_row_bytes`),
        its own rank's rows included (the client drops them). A step holds this once per layer
        and batch until that layer's backward round; all zeros without :attr:`keep_activations`.
        The owners' merged rows of split shards are :meth:`owner_held_bytes`. int [num_servers]."""
        if not self.keep_activations:
            return [0] * self.num_servers
        arr = self.task_array
        q, split, kv_server, _, kv_len = self._task_rows
        hq, hkv = self.cost.held_row_bytes()
        merged = self.cost.merged_row_bytes()
        return [qs * hq + kv * hkv - sp * merged
                for qs, kv, sp in zip(self._per_server(arr[:, 0], q), self._per_server(kv_server, kv_len),
                                      self._per_server(arr[split, 0], q[split]))]

    def owner_held_bytes(self) -> list[int]:
        """Bytes each client rank (the queries' owner) keeps from a forward round until its
        backward round with :attr:`keep_activations`: the merged O and LSE
        (:data:`~scheduler.cost.MERGED_TENSORS`) of each row of its split query shards, once per
        row however many servers hold a key piece of it. All zeros for a plan without partial-KV
        tasks or without :attr:`keep_activations`. int [num_ranks]."""
        if not self.keep_activations:
            return [0] * self.num_ranks
        arr = self.task_array
        split = arr[is_split(arr[:, 3], arr[:, 4], arr[:, 5], arr[:, 6], self.window)]
        shards = np.unique(split[:, [1, 2, 3, 4]], axis=0) if len(split) else np.zeros((0, 4), np.int64)
        rows = np.bincount(shards[:, 0], weights=shards[:, 3] - shards[:, 2], minlength=self.num_ranks)
        return [int(r) * self.cost.merged_row_bytes() for r in rows.astype(np.int64).tolist()]

    def imbalance(self) -> tuple[float, float]:
        """``(before, after)``: max/mean attention FLOPs over ranks with no balancing, and over
        servers under this plan. 1.0 is perfect balance."""
        def ratio(loads):
            mean = sum(loads) / len(loads)
            return max(loads) / mean if mean > 0 else 1.0
        return ratio(self.rank_loads()), ratio(self.server_loads())

    def tasks_moved(self) -> int:
        """Tasks a server runs for another rank's documents (every task in dedicated mode)."""
        arr = self.task_array
        if self.mode == "dedicated":
            return len(arr)
        return int((arr[:, 0] != arr[:, 1]).sum())

    def summary(self) -> str:
        """A few readable lines: imbalance before and after, the lower bound, bytes by tensor,
        tasks moved."""
        before, after = self.imbalance()
        bound = self.load_bound()
        comm = self.comm_bytes()
        split_docs = len(self.task_array) - len(self.doc_lens_flat)

        def mib(n):
            return f"{n / 2**20:.1f} MiB"

        def rel(pairs):
            return f"{pairs / bound.mean:.3f}" if bound.total else "1.000"
        lines = [
            f"plan: {self.mode}, {self.num_ranks} ranks, {self.num_servers} servers, "
            f"{len(self.doc_lens_flat)} documents, {len(self.task_array)} CA-tasks, epsilon={self.epsilon}, "
            f"min_shard={self.min_shard}" + (f", window={self.window}" if self.window else ""),
            f"  imbalance (max/mean attention FLOPs): before {before:.3f}, after {after:.3f}",
            f"  lower bound on max/mean: {bound.ratio():.3f} (largest piece {rel(bound.piece)}, "
            f"shared server {rel(bound.shared)}); target (1 + epsilon) x bound = "
            f"{(1 + self.epsilon) * bound.ratio():.3f}",
            f"  tasks moved off their rank: {self.tasks_moved()}, extra shards from splitting: {split_docs}",
        ]
        for kind in ("forward", "backward"):
            per = comm[kind]
            parts = ", ".join(f"{n} {mib(per[n])}" for n in per if n != "total")
            lines.append(f"  {kind} bytes: {mib(per['total'])} ({parts})")
        if self.keep_activations:
            held = self.held_bytes()
            lines.append(f"  kept activations, held per layer from forward to backward: max {mib(max(held))} "
                         f"on server {held.index(max(held))}, mean {mib(sum(held) / len(held))}")
            owners = self.owner_held_bytes()
            if any(owners):
                lines.append(f"  merged O and LSE of split shards kept by their owners: max {mib(max(owners))} "
                             f"on rank {owners.index(max(owners))}")
        return "\n".join(lines)
