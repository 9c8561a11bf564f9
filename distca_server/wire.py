"""Byte layout of one message: named tensors' rows back to back, no header.

Both ends know every message's row counts from the plan (see :mod:`scheduler.layout`), so a
message is just the concatenated bytes of its tensors in a fixed order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Per round direction: the tensors of a message, in wire order.
FORWARD_DISPATCH = ("q", "k", "v")
FORWARD_RETURN = ("out", "lse")
BACKWARD_DISPATCH = ("q", "k", "v", "out", "lse", "dout")
BACKWARD_RETURN = ("dq", "dk", "dv")
KV_NAMES = frozenset({"k", "v", "dk", "dv"})


@dataclass(frozen=True)
class RowFormat:
    """Row shapes and dtypes of one attention layer's tensors.

    ``q``-shaped rows are ``[num_heads_q, head_dim]`` of ``dtype``; ``kv``-shaped rows
    ``[num_heads_kv, head_dim]``; LSE rows ``[num_heads_q]`` of ``lse_dtype`` (float32, or float64
    for float64 inputs).
    """

    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    dtype: torch.dtype

    @property
    def lse_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def row_shape(self, name: str) -> tuple[int, ...]:
        if name == "lse":
            return (self.num_heads_q,)
        heads = self.num_heads_kv if name in KV_NAMES else self.num_heads_q
        return (heads, self.head_dim)

    def row_dtype(self, name: str) -> torch.dtype:
        return self.lse_dtype if name == "lse" else self.dtype

    def row_bytes(self, name: str) -> int:
        n = 1
        for d in self.row_shape(name):
            n *= d
        return n * self.row_dtype(name).itemsize

    def message_bytes(self, names, q_rows: int, kv_rows: int) -> int:
        return sum(self.row_bytes(n) * (kv_rows if n in KV_NAMES else q_rows) for n in names)


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
        rows = kv_rows if name in KV_NAMES else q_rows
        size = rows * fmt.row_bytes(name)
        piece = buf[offset:offset + size]
        dtype = fmt.row_dtype(name)
        if piece.storage_offset() % dtype.itemsize:
            piece = piece.clone()  # a view needs the element size's alignment
        out[name] = piece.view(dtype).reshape(rows, *fmt.row_shape(name))
        offset += size
    return out
