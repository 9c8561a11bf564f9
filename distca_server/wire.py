"""Byte layout of one message: named tensors' rows back to back, no header.

Both ends know every message's row counts from the plan (see :mod:`scheduler.layout`), so a
message is just the concatenated bytes of its tensors in a fixed order: the round's
:attr:`~scheduler.cost.RoundKind.dispatch` or :attr:`~scheduler.cost.RoundKind.returns` names.
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

    def message_bytes(self, names, q_rows: int, kv_rows: int) -> int:
        return sum(self.row_bytes(n) * (kv_rows if n in KV_TENSORS else q_rows) for n in names)


def pack(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Byte views (uint8, 1-D) of ``tensors``, ready to concatenate into a send buffer."""
    return [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]


def unpack(buf: torch.Tensor, fmt: RowFormat, names, q_rows: int, kv_rows: int) -> dict[str, torch.Tensor]:
    """Split one message (uint8 [message_bytes]) back into ``{name: [rows, *row_shape]}`` tensors.

    Raises:
        ValueError: the buffer's size does not match the expected rows.
    """
    expected = fmt.message_bytes(names, q_rows, kv_rows)
    if buf.numel() != expected:
        raise ValueError(f"message of {buf.numel()} bytes, expected {expected} for {names} "
                         f"with {q_rows} query rows and {kv_rows} KV rows")
    out, offset = {}, 0
    for name in names:
        rows = kv_rows if name in KV_TENSORS else q_rows
        size = rows * fmt.row_bytes(name)
        piece = buf[offset:offset + size]
        dtype = fmt.row_dtype(name)
        if piece.storage_offset() % dtype.itemsize:
            piece = piece.clone()  # a view needs the element size's alignment
        out[name] = piece.view(dtype).reshape(rows, *fmt.row_shape(name))
        offset += size
    return out
