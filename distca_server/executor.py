"""One attention server's work in a round: its CA-tasks as ONE fused varlen kernel call.

The server receives, from every client rank, the Q rows of its tasks (task order) and each
document's KV rows once (deduplicated). Tasks of one document that share KV rows each need their
own key range in a varlen call, so the executor gathers them (a local copy, not network bytes) and
in backward sums the gathered rows' gradients back onto the shared rows (in float32).
"""

from __future__ import annotations

import torch

from scheduler.layout import ServerLayout

from .dtypes import accumulation_dtype
from .rowsum import RowScatter


class ServerExecutor:
    """Runs one server's tasks of a plan.

    Args:
        layout: the server's :class:`~scheduler.layout.ServerLayout`.
        backend: a kernel backend from :func:`distca_server.kernels.get_backend`.
        device: where the received rows live.
        window: the plan's sliding window (None: full causal attention).

    Each task's mask is absolute-position causal ∧ window ∧ its key range: a full-window task
    (``kv_end == q_end``) is the kernels' bottom-right alignment; partial-KV tasks pass their
    diagonals (``q_start - kv_start``, :attr:`ServerLayout.diagonals`), which the CPU backends
    take in the same one call and FlashAttention-style ones in one call per mask class.
    """

    def __init__(self, layout: ServerLayout, backend, device: torch.device, window: int | None = None):
        self.layout = layout
        self.backend = backend
        self.window = window
        self.diagonals = (None if layout.diagonals is None
                          else torch.as_tensor(layout.diagonals, dtype=torch.int64))  # host: per task
        self.cu_seqlens_q = torch.as_tensor(layout.cu_seqlens_q, dtype=torch.int32, device=device)
        self.cu_seqlens_k = torch.as_tensor(layout.cu_seqlens_k, dtype=torch.int32, device=device)
        self.kv_gather = (None if layout.kv_gather is None
                          else torch.as_tensor(layout.kv_gather, dtype=torch.long, device=device))
        # dK/dV of the gathered rows flow back onto the received rows, summed where tasks share them.
        self.kv_scatter = (None if layout.kv_gather is None
                           else RowScatter([layout.kv_gather], sum(layout.kv_rows), device))

    def _task_kv(self, k: torch.Tensor, v: torch.Tensor):
        if self.kv_gather is None:
            return k, v
        return k.index_select(0, self.kv_gather), v.index_select(0, self.kv_gather)

    def _args(self, scale: float):
        lay = self.layout
        return (self.cu_seqlens_q, self.cu_seqlens_k, lay.max_seqlen_q, lay.max_seqlen_k, scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float):
        """Forward round.

        Args:
            q: [sum(q_rows), num_heads_q, head_dim]: received Q rows, task order.
            k, v: [sum(kv_rows), num_heads_kv, head_dim]: received deduplicated KV rows.
            softmax_scale: multiplier of ``Q Kᵀ`` before the softmax.

        Returns:
            ``(out, lse)``: out like ``q``; lse [sum(q_rows), num_heads_q] float32 (float64 for
            float64 inputs), natural-log log-sum-exp of each row's scaled scores.
        """
        if self.layout.num_tasks == 0:
            return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=accumulation_dtype(q.dtype))
        kt, vt = self._task_kv(k, v)
        return self.backend.forward(q, kt, vt, *self._args(softmax_scale), window=self.window,
                                    diagonals=self.diagonals)

    def backward(self, dout, q, k, v, out, lse, softmax_scale: float):
        """Backward round: ``(dq, dk, dv)`` shaped like ``q`` and the deduplicated ``k``, ``v``."""
        if self.layout.num_tasks == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        kt, vt = self._task_kv(k, v)
        dq, dkt, dvt = self.backend.backward(dout, q, kt, vt, out, lse, *self._args(softmax_scale),
                                             window=self.window, diagonals=self.diagonals)
        if self.kv_gather is None:
            return dq, dkt, dvt
        return dq, self.kv_scatter([dkt], torch.empty_like(k)), self.kv_scatter([dvt], torch.empty_like(v))
