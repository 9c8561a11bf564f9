"""Row shapes, dtypes and bytes of one attention layer's tensors (:class:`RowFormat`).

How rows travel is elsewhere: :mod:`scheduler.comm_layout` says how many bytes of each tensor
move between which participants, :mod:`distca_server.participant` gathers the rows into transport
buffers laid out that way, and :mod:`distca_server.header` describes and checks a round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.cost import KV_TENSORS, CostModel

from .dtypes import accumulation_dtype


@dataclass(frozen=True)
class RowFormat:
    """Row shapes and dtypes of one attention layer's tensors: the :class:`CostModel` shape with
    the torch dtype of its activations.

    ``q``-shaped rows are ``[num_heads_q, head_dim]`` of ``dtype``; ``kv``-shaped rows
    ``[num_heads_kv, head_dim]``; LSE rows ``[num_heads_q]`` of :attr:`lse_dtype`. Byte counts
    come from :meth:`CostModel.bytes_per_token`, so the planner's bytes and the wire's agree.

    Raises:
        ValueError: ``dtype``'s element size differs from ``cost.dtype_bytes``.
    """

    cost: CostModel
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.dtype.itemsize != self.cost.dtype_bytes:
            raise ValueError(f"dtype {self.dtype} has {self.dtype.itemsize}-byte elements but the "
                             f"attention shape says {self.cost.dtype_bytes}")

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor) -> "RowFormat":
        """The format of ``q`` [T, num_heads_q, head_dim] and ``k`` [T, num_heads_kv, head_dim]."""
        return cls(CostModel(q.shape[1], k.shape[1], q.shape[2], q.dtype.itemsize), q.dtype)

    @property
    def num_heads_q(self) -> int:
        return self.cost.num_heads_q

    @property
    def num_heads_kv(self) -> int:
        return self.cost.num_heads_kv

    @property
    def head_dim(self) -> int:
        return self.cost.head_dim

    @property
    def lse_dtype(self) -> torch.dtype:
        return accumulation_dtype(self.dtype)

    def row_shape(self, name: str) -> tuple[int, ...]:
        if name == "lse":
            return (self.num_heads_q,)
        heads = self.num_heads_kv if name in KV_TENSORS else self.num_heads_q
        return (heads, self.head_dim)

    def row_dtype(self, name: str) -> torch.dtype:
        return self.lse_dtype if name == "lse" else self.dtype

    def row_bytes(self, name: str) -> int:
        return self.cost.bytes_per_token(name)
