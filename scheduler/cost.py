"""What a CA-task costs: causal attention FLOPs and bytes per token (measured latency: profile.py).

Pure Python (no torch). Units: FLOPs are floating-point operations (a multiply-add counts 2),
bytes are bytes, latencies are seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# Rows of these tensors follow the KV rows of a document; every other tensor follows the query shard.
KV_TENSORS = frozenset({"k", "v", "dk", "dv"})
# What a server keeps of a forward round until that layer's backward round when activations are
# kept: the rows it received and its results. The backward round then dispatches only dO.
KEPT_TENSORS = ("q", "k", "v", "out", "lse")


class RoundKind(str, Enum):
    """The two uses of a plan in a step, and the tensors each one moves (DESIGN "round").

    A round is a dispatch all-to-all (clients -> servers: :meth:`dispatch_with`, in wire order)
    and a return all-to-all (servers -> clients: :attr:`returns`). The value is the name used in
    metrics, ``Plan.comm_bytes()`` and traffic counters; :attr:`code` is the round header's int.

    With kept activations (``keep_activations=True``) the servers hold :data:`KEPT_TENSORS` of
    each forward round until its backward round, which then dispatches only ``dout``. The forward
    round is the same either way.
    """

    FORWARD = "forward"
    BACKWARD = "backward"

    def dispatch_with(self, keep_activations: bool) -> tuple[str, ...]:
        """The tensors clients send servers in this round, in wire order."""
        if self is RoundKind.FORWARD:
            return ("q", "k", "v")
        return ("dout",) if keep_activations else ("q", "k", "v", "out", "lse", "dout")

    def tensors_with(self, keep_activations: bool) -> tuple[str, ...]:
        """Every tensor that crosses the network in this round: dispatch, then return."""
        return self.dispatch_with(keep_activations) + self.returns

    @property
    def dispatch(self) -> tuple[str, ...]:
        """:meth:`dispatch_with` of a stateless round (the servers keep nothing)."""
        return self.dispatch_with(False)

    @property
    def returns(self) -> tuple[str, ...]:
        return ("out", "lse") if self is RoundKind.FORWARD else ("dq", "dk", "dv")

    @property
    def tensors(self) -> tuple[str, ...]:
        """:meth:`tensors_with` of a stateless round."""
        return self.tensors_with(False)

    @property
    def code(self) -> int:
        return 1 if self is RoundKind.FORWARD else 2

    @classmethod
    def from_code(cls, code: int) -> "RoundKind":
        """Raises ValueError for a code that names no round kind."""
        for kind in cls:
            if kind.code == code:
                return kind
        raise ValueError(f"no round kind has code {code!r}")


BACKWARD_FLOPS_FACTOR = 2.5


def causal_pairs(q_start: int, q_end: int, kv_start: int, kv_end: int) -> int:
    """Number of (query, key) pairs a CA-task computes, causal with bottom-right alignment.

    Query row ``i`` of ``[q_start, q_end)`` sees key ``j`` of ``[kv_start, kv_end)`` when
    ``j - kv_start <= (i - q_start) + (kv_len - q_len)`` (FlashAttention's bottom-right convention
    when ``q_len < kv_len``). For the usual task ``kv = [0, q_end)`` this is
    ``sum_{t=q_start}^{q_end-1} (t + 1)``.

    Raises:
        ValueError: a negative range length.
    """
    q_len = q_end - q_start
    kv_len = kv_end - kv_start
    if q_len < 0 or kv_len < 0:
        raise ValueError(f"negative range: q=[{q_start}, {q_end}), kv=[{kv_start}, {kv_end})")
    shift = kv_len - q_len
    # Row i sees min(kv_len, max(0, i + shift + 1)) keys; sum it in closed form.
    lo = max(0, -shift)  # first row that sees at least one key
    full = max(lo, min(q_len, kv_len - shift))  # rows from here on see all kv_len keys
    partial = 0
    if full > lo:
        a, b = lo + shift + 1, full + shift  # counts of the partial rows, an arithmetic run
        partial = (a + b) * (full - lo) // 2
    return partial + (q_len - full) * kv_len


@dataclass(frozen=True)
class CostModel:
    """Attention shape and element size that turn token counts into FLOPs and bytes.

    Args:
        num_heads_q: query heads (per client, after any tensor parallelism).
        num_heads_kv: key/value heads; ``num_heads_q % num_heads_kv == 0`` (GQA).
        head_dim: per-head dimension.
        dtype_bytes: bytes per element of Q, K, V, O and their gradients (2 for bf16).

    The LSE travels in float32, or float64 when ``dtype_bytes == 8`` (float64 runs keep their
    precision end to end).

    Raises:
        ValueError: a non-positive size, heads not divisible, or ``dtype_bytes`` not in 1, 2, 4, 8.
    """

    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        bad = {
            name: getattr(self, name)
            for name in ("num_heads_q", "num_heads_kv", "head_dim", "dtype_bytes")
            if not isinstance(getattr(self, name), int)
            or isinstance(getattr(self, name), bool)
            or getattr(self, name) <= 0
        }
        if bad:
            raise ValueError(f"CostModel sizes must be positive ints, got {bad}")
        if self.num_heads_q % self.num_heads_kv:
            raise ValueError(
                f"num_heads_q={self.num_heads_q} is not a multiple of num_heads_kv={self.num_heads_kv}"
            )
        if self.dtype_bytes not in (1, 2, 4, 8):
            raise ValueError(f"dtype_bytes must be 1, 2, 4 or 8, got {self.dtype_bytes}")

    # ---- FLOPs -------------------------------------------------------------------------------
    @property
    def flops_per_pair(self) -> int:
        """Forward FLOPs per (query, key) pair: ``4 · head_dim · num_heads_q``.

        Two matmuls (``Q Kᵀ`` and ``P V``) of ``2 · head_dim`` FLOPs each per pair and head; the
        convention of the FlashAttention-2 paper (Dao, 2023, §4.1), also used by DistCA §2.
        """
        return 4 * self.head_dim * self.num_heads_q

    def task_flops(self, q_start: int, q_end: int, kv_start: int, kv_end: int,
                   backward: bool = False) -> float:
        """Causal attention FLOPs of one CA-task.

        Forward = ``4 · head_dim · num_heads_q · pairs`` (see :func:`causal_pairs`); backward =
        2.5 × forward (five matmuls instead of two: FlashAttention-2 paper, §4.1).
        """
        flops = self.flops_per_pair * causal_pairs(q_start, q_end, kv_start, kv_end)
        return flops * BACKWARD_FLOPS_FACTOR if backward else float(flops)

    def doc_flops(self, doc_len: int, backward: bool = False) -> float:
        """FLOPs of a whole document of ``doc_len`` tokens: ``pairs = l (l + 1) / 2``."""
        return self.task_flops(0, doc_len, 0, doc_len, backward)

    # ---- bytes -------------------------------------------------------------------------------
    @property
    def lse_bytes(self) -> int:
        """Bytes per LSE element: 4 (float32), or 8 when ``dtype_bytes == 8``."""
        return 8 if self.dtype_bytes == 8 else 4

    def bytes_per_token(self, tensor: str) -> int:
        """Bytes one token's row of ``tensor`` occupies on the wire.

        ``tensor`` is one of q, k, v, out, lse, dout, dq, dk, dv. Q-shaped rows hold
        ``num_heads_q · head_dim`` elements, KV-shaped rows ``num_heads_kv · head_dim``, LSE rows
        ``num_heads_q`` values of :attr:`lse_bytes`.

        Raises:
            ValueError: an unknown tensor name.
        """
        if tensor == "lse":
            return self.num_heads_q * self.lse_bytes
        if tensor in KV_TENSORS:
            return self.num_heads_kv * self.head_dim * self.dtype_bytes
        if tensor in ("q", "out", "dout", "dq"):
            return self.num_heads_q * self.head_dim * self.dtype_bytes
        raise ValueError(f"unknown tensor {tensor!r}; expected one of {RoundKind.BACKWARD.tensors}")

    def _row_bytes(self, names) -> tuple[int, int]:
        """``(bytes per query row, bytes per KV row)`` of the tensors ``names``."""
        q_row = sum(self.bytes_per_token(n) for n in names if n not in KV_TENSORS)
        kv_row = sum(self.bytes_per_token(n) for n in names if n in KV_TENSORS)
        return q_row, kv_row

    def step_row_bytes(self, keep_activations: bool = False) -> tuple[int, int]:
        """Bytes per query row and per KV row moved over one forward plus one backward round.

        Returns ``(q_row_bytes, kv_row_bytes)``; the planner ranks moves by FLOPs per these bytes.
        With ``keep_activations`` the backward round sends dO instead of Q, K, V, O, LSE, dO.
        """
        return self._row_bytes([n for kind in RoundKind for n in kind.tensors_with(keep_activations)])

    def held_row_bytes(self) -> tuple[int, int]:
        """Bytes a server holds per received query row and per received KV row from a forward
        round until its backward round when activations are kept (:data:`KEPT_TENSORS`):
        ``(q + out + lse, k + v)``."""
        return self._row_bytes(KEPT_TENSORS)

    def to_wire(self) -> list[int]:
        """The one msgpack form of an attention shape: ``[num_heads_q, num_heads_kv, head_dim,
        dtype_bytes]`` (plan and part descriptors, scheduler reports)."""
        return [self.num_heads_q, self.num_heads_kv, self.head_dim, self.dtype_bytes]

    @classmethod
    def from_wire(cls, obj) -> "CostModel":
        """Inverse of :meth:`to_wire`.

        Raises:
            ValueError: not a list of four ints, or sizes :class:`CostModel` refuses.
        """
        if not isinstance(obj, (list, tuple)) or len(obj) != 4 or any(type(x) is not int for x in obj):
            raise ValueError(f"an attention shape must be four ints [num_heads_q, num_heads_kv, "
                             f"head_dim, dtype_bytes], got {obj!r}")
        return cls(*obj)

    def to_dict(self) -> dict:
        return {"num_heads_q": self.num_heads_q, "num_heads_kv": self.num_heads_kv,
                "head_dim": self.head_dim, "dtype_bytes": self.dtype_bytes}
