"""Scatter rows into place where a few target rows receive several contributions.

Both ends of the data path meet this: a server's fused call gathers a document's KV rows once per
task (tasks of one document share a KV prefix), and a client gets a document's KV prefix back from
every server that holds one of its shards. Most rows come back exactly once; summing all of them in
float32 would convert and add every row. Instead every row is copied into place, and only the
repeated ones are then overwritten by their sum in :func:`~distca_server.dtypes.accumulation_dtype`
(FlashAttention-2 also keeps dK/dV partial sums in float32).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .dtypes import accumulation_dtype


class RowScatter:
    """Scatter of ``pieces[i]`` (rows) to target rows ``indices[i]`` of a ``num_rows``-row tensor.

    Args:
        indices: per piece, int64 [rows of that piece]: the target row of each row.
        num_rows: rows of the destination.
        device: where the index tensors live.

    Raises:
        ValueError: a target row out of range, or a destination row no piece writes.
    """

    def __init__(self, indices: Sequence[np.ndarray], num_rows: int, device):
        self.device = torch.device(device)
        pieces = [np.asarray(x, dtype=np.int64) for x in indices]
        flat = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
        if len(flat) and (flat.min() < 0 or flat.max() >= num_rows):
            raise ValueError(f"target rows out of range [0, {num_rows}): "
                             f"{flat[(flat < 0) | (flat >= num_rows)][:5].tolist()}")
        counts = np.bincount(flat, minlength=num_rows)
        if (counts == 0).any():
            raise ValueError(f"rows {np.flatnonzero(counts == 0)[:5].tolist()} receive no contribution")
        self.num_rows = num_rows
        self.indices = [self._idx(x) for x in pieces]
        repeated = counts[flat] > 1
        self.repeated_rows = None
        if repeated.any():
            rows = np.unique(flat[repeated])
            slot = np.searchsorted(rows, flat)
            bounds = np.cumsum([0] + [len(x) for x in pieces])
            self.repeated_rows = self._idx(rows)
            self.repeated = [(self._idx(np.flatnonzero(repeated[a:b])), self._idx(slot[a:b][repeated[a:b]]))
                             for a, b in zip(bounds[:-1], bounds[1:])]

    def _idx(self, a) -> torch.Tensor:
        return torch.as_tensor(a, dtype=torch.long, device=self.device)

    @property
    def has_sums(self) -> bool:
        return self.repeated_rows is not None

    def __call__(self, pieces: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Write the pieces (each [rows_i, *row_shape], out's dtype) into ``out``
        [num_rows, *row_shape]; repeated rows get the sum of their contributions. Returns out."""
        for index, rows in zip(self.indices, pieces):
            out.index_copy_(0, index, rows)
        if self.repeated_rows is not None:
            acc = accumulation_dtype(out.dtype)
            sums = torch.zeros((len(self.repeated_rows), *out.shape[1:]), dtype=acc, device=out.device)
            for (pos, slot), rows in zip(self.repeated, pieces):
                sums.index_add_(0, slot, rows.index_select(0, pos).to(acc))
            out.index_copy_(0, self.repeated_rows, sums.to(out.dtype))
        return out


class PartialMerge(RowScatter):
    """Merge partial attention results of query rows that several CA-tasks computed.

    A query shard split on the key axis (partial-KV tasks) comes back as one ``(out, lse)`` partial
    per task: each the attention of the row over that task's keys alone (a row that saw none of
    them: ``out = 0``, ``lse = -inf``). The exact result over all keys is the log-sum-exp merge
    (FlashAttention-2's rescaling, Dao 2023, Alg. 1)::

        lse = log sum_p exp(lse_p)          out = sum_p exp(lse_p - lse) * out_p

    computed in :func:`~distca_server.dtypes.accumulation_dtype`; rows computed once are copied.
    Same arguments as :class:`RowScatter`; calling it as a :class:`RowScatter` sums the pieces
    (what the dQ parts of a split shard need).
    """

    def merge(self, outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], out: torch.Tensor,
              lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the partials (``outs[i]`` [rows_i, H, D] in out's dtype, ``lses[i]`` [rows_i, H]
        in lse's dtype) into ``out`` [num_rows, H, D] and ``lse`` [num_rows, H]; returns them."""
        for index, o, l in zip(self.indices, outs, lses):
            out.index_copy_(0, index, o)
            lse.index_copy_(0, index, l)
        if self.repeated_rows is None:
            return out, lse
        acc = accumulation_dtype(out.dtype)
        n, heads = len(self.repeated_rows), lse.shape[1]
        top = torch.full((n, heads), float("-inf"), dtype=acc, device=out.device)
        parts = [(slot, l.index_select(0, pos).to(acc), o.index_select(0, pos))
                 for (pos, slot), o, l in zip(self.repeated, outs, lses)]
        for slot, l, _ in parts:
            top.scatter_reduce_(0, slot[:, None].expand_as(l), l, "amax")
        top = top.masked_fill(top == float("-inf"), 0.0)  # rows no partial saw: weights stay 0
        weight = torch.zeros((n, heads), dtype=acc, device=out.device)
        total = torch.zeros((n, *out.shape[1:]), dtype=acc, device=out.device)
        for slot, l, o in parts:
            w = torch.exp(l - top.index_select(0, slot))
            weight.index_add_(0, slot, w)
            total.index_add_(0, slot, w[..., None] * o.to(acc))
        merged = total / weight.clamp_min(torch.finfo(acc).tiny)[..., None]
        out.index_copy_(0, self.repeated_rows, merged.to(out.dtype))
        lse.index_copy_(0, self.repeated_rows, (top + torch.log(weight)).to(lse.dtype))
        return out, lse
