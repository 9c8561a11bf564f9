"""The words and tables of the one-sided exchange (:mod:`.symmetric`, :mod:`.routed`,
:mod:`.exchange_graph`): signal word kinds and values, the inbox and report rows at the arena's
start, and the heap sizes they need (every heap implementation sizes itself from here)."""

from __future__ import annotations

from .base import aligned

MAX_SEGMENTS = 16  # segments of one exchange (a round's tensors)
MAX_WISHES = 8  # growth requests one announce carries (more wait for the next exchange)
# Signal words, per source PE: slot(kind, src) = kind * world_size + src.
ANNOUNCE, DATA, ABORT = 0, 1, 2
SIGNAL_KINDS = 3
# What a PE's ABORT word says about it (the low bits; the high bits hold the generation).
CLOSED, TIMED_OUT, MISMATCH = 1, 2, 3
MOVED_ON = 4  # not written: a peer with a word of a newer generation has left for a later epoch
PEER_FAILED = 5  # gave up its exchange because another peer failed (fails only those waiting on it)
GRACE_S = 1.0  # seconds: how long after its deadline a failed exchange may take to raise, and how
#               long close() waits for a host-driven exchange on another thread to stop
_WHY = {CLOSED: "left the group", TIMED_OUT: "timed out waiting for its peers",
        PEER_FAILED: "gave up after another participant failed",
        MISMATCH: "found a mismatch (sizes, route or round)", MOVED_ON: "moved on to a later group epoch"}
# A PEER_FAILED word also names the failure it passes on (its PE + 1 from bit _CAUSE_SHIFT, its code
# from bit _CODE_BITS; 0: unknown), so a PE that sees the echo before the cause still names the cause.
_CODE_BITS, _CAUSE_SHIFT = 4, 8
_CODE_MASK = (1 << _CODE_BITS) - 1


def abort_low(code: int, cause: tuple[int, int] | None = None) -> int:
    """The low bits of an ABORT word: ``code``, and for PEER_FAILED the ``(PE, code)`` it passes on."""
    return code if cause is None else code | (cause[0] + 1) << _CAUSE_SHIFT | cause[1] << _CODE_BITS


def abort_parts(low: int) -> tuple[int, tuple[int, int] | None]:
    """``(code, cause)`` of an ABORT word's low bits (:func:`abort_low`; cause None: none named)."""
    cause = (low >> _CAUSE_SHIFT) - 1, (low >> _CODE_BITS) & _CODE_MASK
    return low & _CODE_MASK, cause if low >> _CAUSE_SHIFT else None


GEN_SHIFT = 32  # signal value = generation << GEN_SHIFT | exchange number (or ABORT code)
_LOW = (1 << GEN_SHIFT) - 1
MAX_GENERATION = (1 << 31) - 1  # keeps every value a positive int64
# Inbox row (int64): seq, segments, wishes, route, direct, (key id, bytes) per wish, (where, offset,
# bytes) per segment. ``route`` is the exchange's route id (0: none) and ``direct`` whether every
# receive segment of the announcing PE lies in its arena (both decide whether a route is installed,
# :mod:`.routed`).
_SEQ, _NSEG, _NWISH, _ROUTE, _DIRECT, _WISH = range(6)
_SEGS = _WISH + 2 * MAX_WISHES
_ROW = _SEGS + 3 * MAX_SEGMENTS
# Report row (int64): seq, segments, route, bytes per segment.
_REPORT = 3 + MAX_SEGMENTS
# Where an announced offset points: into the arena, or into the staging array (STAGED) or a key's
# array (its id, >= 2) as they are after this exchange's growth.
DIRECT, STAGED = 0, 1
STAGING = 1  # the staging array's key id (buffer keys hash to ids >= 2)


# Words of captured exchanges (:mod:`.exchange_graph`), after the SIGNAL_KINDS rows: per graph
# block, two sets, per exchange of the graph a credit and an arrival word per source PE.
GRAPH_BLOCKS, GRAPH_EXCHANGES = 4, 8


def signal_words(world_size: int) -> int:
    """How many signal words a heap of ``world_size`` PEs needs for :class:`SymmetricTransport`
    and the captured exchanges of :mod:`.exchange_graph`."""
    return (SIGNAL_KINDS + GRAPH_BLOCKS * 2 * GRAPH_EXCHANGES * 2) * int(world_size)


def table_bytes(world_size: int) -> int:
    """Arena bytes the inbox and report tables take (at the arena's start)."""
    return aligned(world_size * _ROW * 8) + aligned(world_size * _REPORT * 8)


def check_heap_bytes(heap_bytes: int, world_size: int) -> None:
    """Raise ValueError unless an arena of ``heap_bytes`` per PE holds more than the tables of
    ``world_size`` PEs (:func:`table_bytes`)."""
    if heap_bytes <= table_bytes(world_size):
        raise ValueError(f"heap_bytes must exceed the {table_bytes(world_size)} bytes of tables of "
                         f"{world_size} PEs, got {heap_bytes}")
