"""Batches of packed documents drawn from real document-length traces (Pretrain, ProLong).

Pure Python + numpy (no torch). Lengths are tokens.

The traces are package data, ``distca_sim/data/doclens/{pretrain,prolong}.json`` (see the
``README.md`` there), read through :mod:`importlib.resources` so they work from any install: one
JSON list of per-document token counts each, published with the DistCA paper's evaluation
(arXiv 2510.18121, §6.1). This module reproduces how that evaluation turned them into batches:

1. :func:`sample_documents` — filter, upsample, draw and "elongate" document lengths to a context
   length;
2. :func:`pack_documents` — cut the document stream into chunks of exactly ``context_len`` tokens,
   one chunk per rank;
3. :func:`sample_batch` — both, cached, for step ``step`` of a run: what benchmarks call.

Everything is deterministic: the only randomness is ``numpy.random.default_rng(seed)``.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from scheduler.checks import INT64_MAX, is_int, nonnegative_int, positive_int

if TYPE_CHECKING:  # importlib.resources.abc is new in 3.11
    from importlib.resources.abc import Traversable

__all__ = [
    "TRACE_NAMES",
    "LONG_DOC_TOKENS",
    "SHORT_KEEP_FRACTION",
    "LONG_UPSAMPLE",
    "DEFAULT_NUM_DOCS",
    "PROLONG_FIX_PROB",
    "LEN_MULTIPLE",
    "trace_file",
    "load_trace",
    "sample_documents",
    "pack_documents",
    "sample_batch",
]

TRACE_NAMES = ("pretrain", "prolong")

LONG_DOC_TOKENS = 65536        # "long" = at least 64K tokens; also the elongation base
SHORT_KEEP_FRACTION = 0.5      # keep the first half (file order) of the short documents
LONG_UPSAMPLE = 4              # the long documents appear this many times in the pool
DEFAULT_NUM_DOCS = 10_000      # Pretrain draws this many documents
PROLONG_FIX_PROB = 0.3         # ProLong: a long document becomes exactly context_len tokens
LEN_MULTIPLE = 16              # every sampled length is rounded up to a multiple of this


def _check_name(name: Any) -> str:
    if name not in TRACE_NAMES:
        raise ValueError(f"unknown trace {name!r}; expected one of {TRACE_NAMES}")
    return name


# ---- traces ----------------------------------------------------------------------------------
def trace_file(name: str) -> Traversable:
    """The packaged JSON file of trace ``name`` (``"pretrain"`` or ``"prolong"``).

    A :class:`~importlib.resources.abc.Traversable` (``.read_text()``, ``.open()``), valid from a
    source checkout, an editable or a regular install alike.

    Raises:
        ValueError: an unknown name.
    """
    _check_name(name)
    return importlib.resources.files("distca_sim") / "data" / "doclens" / f"{name}.json"


def load_trace(name: str | Path) -> tuple[int, ...]:
    """Document lengths (tokens) of a trace, in file order.

    Args:
        name: ``"pretrain"`` or ``"prolong"`` (the package's traces, :func:`trace_file`), or the
            path of any JSON file holding a list of positive ints.

    Returns a tuple (cached: each trace is read once per process).

    Raises:
        ValueError: an unknown name, a missing file, or content that is not a non-empty list of
            positive ints.
    """
    if isinstance(name, str) and name in TRACE_NAMES:
        return _load_packaged(name)
    if isinstance(name, (str, Path)):
        return _load_path(str(Path(name).resolve()))
    raise ValueError(f"trace must be one of {TRACE_NAMES} or a path, got {name!r}")


@functools.lru_cache(maxsize=len(TRACE_NAMES))
def _load_packaged(name: str) -> tuple[int, ...]:
    return _parse_trace(trace_file(name).read_text(), f"trace {name!r}")


@functools.lru_cache(maxsize=16)
def _load_path(path: str) -> tuple[int, ...]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"trace file {path} does not exist (known names: {TRACE_NAMES})")
    return _parse_trace(p.read_text(), f"trace file {path}")


def _parse_trace(text: str, where: str) -> tuple[int, ...]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON ({e})") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"{where} must hold a non-empty JSON list of ints")
    bad = [(i, v) for i, v in enumerate(data) if not is_int(v) or v <= 0]
    if bad:
        raise ValueError(f"{where}: {len(bad)} entries are not positive ints, "
                         f"first (index, value): {bad[:5]}")
    return tuple(data)


# ---- sampling --------------------------------------------------------------------------------
def _elongate(lens: np.ndarray, context_len: int) -> np.ndarray:
    """``ceil(l · context_len / 65536)`` rounded up to a multiple of 16, in exact integers."""
    den = LONG_DOC_TOKENS * LEN_MULTIPLE
    return (lens.astype(np.int64) * context_len + den - 1) // den * LEN_MULTIPLE


def _pool(trace: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Short documents kept (first half, file order) and long documents upsampled.

    Returns ``(short, long)``; ``long`` is the file-order list of documents ``>= 64K`` repeated
    as a whole ``LONG_UPSAMPLE`` times (``[L1..Ln, L1..Ln, ...]``).
    """
    arr = np.asarray(trace, dtype=np.int64)
    short = arr[arr < LONG_DOC_TOKENS]
    short = short[: int(len(short) * SHORT_KEEP_FRACTION)]
    long = np.tile(arr[arr >= LONG_DOC_TOKENS], LONG_UPSAMPLE)
    return short, long


@functools.lru_cache(maxsize=len(TRACE_NAMES))
def _max_context_len(name: str) -> int:
    """The longest ``context_len`` (tokens) at which sampling trace ``name`` stays within int64.

    Two int64 quantities grow with it: :func:`_elongate`'s product ``l · context_len``, formed
    before the division by 64K · 16, for the longest document (and for 64K itself, ProLong's
    fixed length); and the packed stream's running total of elongated lengths, each below
    ``l · context_len / 64K + 16``, summed over the whole pool. Past the bound numpy wraps
    around silently: negative lengths, or a batch of wrong ones.
    """
    short, long = _pool(load_trace(name))
    pool = np.concatenate([short, long])
    den = LONG_DOC_TOKENS * LEN_MULTIPLE
    by_product = (INT64_MAX - (den - 1)) // max(int(pool.max()), LONG_DOC_TOKENS)
    by_total = (INT64_MAX - LEN_MULTIPLE * len(pool)) * LONG_DOC_TOKENS // int(pool.sum())
    return min(by_product, by_total)


def _check_context_len(name: str, context_len: Any) -> int:
    """``context_len`` as a Python int if it is a positive int at most :func:`_max_context_len`.

    Raises:
        ValueError: naming the value (and the bound, for one too long).
    """
    context_len = positive_int("context_len", context_len)
    top = _max_context_len(name)
    if context_len > top:
        raise ValueError(f"context_len must be at most {top} tokens for trace {name!r} (its documents, "
                         f"elongated by context_len / 65536, would overflow int64), got {context_len}")
    return context_len


@functools.lru_cache(maxsize=32)
def _sample_documents(name: str, context_len: int, num_docs: int | None, seed: int) -> np.ndarray:
    short, long = _pool(load_trace(name))
    rng = np.random.default_rng(seed)
    if name == "pretrain":
        pool = np.concatenate([short, long])
        n = min(DEFAULT_NUM_DOCS if num_docs is None else num_docs, len(pool))
        docs = _elongate(rng.choice(pool, size=n, replace=False), context_len)
    else:  # prolong
        fixed = rng.random(len(long)) < PROLONG_FIX_PROB
        long_lens = np.where(fixed, _elongate(np.array([LONG_DOC_TOKENS]), context_len)[0],
                             _elongate(long, context_len))
        docs = np.concatenate([long_lens, _elongate(short, context_len)])
        if num_docs is not None:
            docs = docs[:num_docs]
    docs.setflags(write=False)
    return docs


def sample_documents(name: str, context_len: int, num_docs: int | None = None,
                     seed: int = 0) -> list[int]:
    """Document lengths (tokens) sampled the way the DistCA paper's evaluation did (§6.1).

    Common to both traces: the documents shorter than 64K (65,536) tokens are filtered to the
    first 50% of them in file order; every document of 64K tokens or more is upsampled by
    repeating the whole file-order list of long documents 4 times. Every length is
    "elongated" to the context length, ``l · context_len / 65536``, and rounded up to a multiple of
    16 (so every length is at least 16, never 0).

    ``"pretrain"``: the pool (short docs, then the upsampled long docs) is sampled without
    replacement, ``numpy.random.default_rng(seed).choice(pool, num_docs, replace=False)``;
    ``num_docs`` defaults to 10,000 and is capped at the pool size. The order is the draw's order.

    ``"prolong"``: each upsampled long document, independently with probability 0.3 (one
    ``rng.random()`` per document, from ``default_rng(seed)``), is set to ``64K × elongate =
    context_len`` tokens; otherwise (probability 0.7) it keeps its own elongated length, which
    may exceed ``context_len`` (the packer cuts it). No draw: the documents come in file order,
    the long ones first, then the short ones. ``num_docs=None`` returns the whole pool; an int
    keeps its first ``num_docs`` documents.

    Args:
        name: ``"pretrain"`` or ``"prolong"``.
        context_len: tokens per rank chunk; also sets the elongation factor ``context_len / 64K``.
            At most what keeps the elongated lengths in int64 (about 7.4·10^13 for Pretrain,
            2.7·10^13 for ProLong: :func:`_max_context_len`).
        num_docs: how many documents (see above); a positive int or None.
        seed: seed of the numpy Generator; an int >= 0.

    Raises:
        ValueError: an unknown name or a bad ``context_len``, ``num_docs`` or ``seed``.
    """
    _check_name(name)
    context_len = _check_context_len(name, context_len)
    if num_docs is not None:
        num_docs = positive_int("num_docs", num_docs)
    seed = nonnegative_int("seed", seed)
    return _sample_documents(name, context_len, num_docs, seed).tolist()


# ---- packing ---------------------------------------------------------------------------------
class _Stream:
    """A document list repeated forever, read as chunks of ``context_len`` tokens.

    Chunk ``k`` covers tokens ``[k·C, (k+1)·C)`` of the infinite stream ``docs, docs, docs, ...``;
    a document crossing a chunk border is cut there and each piece is a separate document.
    """

    def __init__(self, doc_lens: np.ndarray, context_len: int) -> None:
        self.lens = doc_lens
        self.bounds = np.concatenate([[0], np.cumsum(doc_lens, dtype=np.int64)])
        self.total = int(self.bounds[-1])
        self.context_len = context_len

    def _once(self, lo: int, hi: int) -> list[int]:
        """Piece lengths of tokens ``[lo, hi)`` of one pass, ``0 <= lo < hi <= total``."""
        b = self.bounds
        i = int(np.searchsorted(b, lo, side="right"))
        j = int(np.searchsorted(b, hi, side="left"))
        cuts = [lo, *b[i:j].tolist(), hi]
        return [cuts[k + 1] - cuts[k] for k in range(len(cuts) - 1)]

    def chunk(self, k: int) -> list[int]:
        start, stop = k * self.context_len, (k + 1) * self.context_len
        (q0, r0), (q1, r1) = divmod(start, self.total), divmod(stop, self.total)
        if q0 == q1:
            return self._once(r0, r1)
        out = self._once(r0, self.total)
        if q1 - q0 > 1:
            out.extend(self.lens.tolist() * (q1 - q0 - 1))
        if r1:
            out.extend(self._once(0, r1))
        return out

    def chunks(self, first: int, count: int) -> list[list[int]]:
        return [self.chunk(k) for k in range(first, first + count)]


def _check_doc_lens(doc_lens: Any) -> np.ndarray:
    try:
        vals = list(doc_lens)
    except TypeError:
        raise ValueError(f"doc_lens must be a list of ints, got {doc_lens!r}") from None
    if not vals:
        raise ValueError("doc_lens must not be empty")
    bad = [(i, v) for i, v in enumerate(vals) if not is_int(v) or v <= 0]
    if bad:
        raise ValueError(f"doc_lens must be positive ints; {len(bad)} bad, first (index, value): "
                         f"{bad[:5]}")
    return np.asarray(vals, dtype=np.int64)


def pack_documents(doc_lens: Sequence[int], context_len: int, num_ranks: int) -> list[list[int]]:
    """Pack documents in order into ``num_ranks`` chunks of exactly ``context_len`` tokens.

    Documents fill rank 0's chunk, then rank 1's, and so on. A document that overflows a chunk is
    cut at the border: the part that fits ends this chunk and the rest starts the next one, as a
    separate document (no attention across the cut). When the documents run out before every rank
    is full, the packer cycles through ``doc_lens`` again from its first document (and again, as
    often as needed), so every rank always gets a full chunk; tokens are conserved in the sense
    that concatenating the chunks gives ``doc_lens`` repeated, with cuts added.

    Args:
        doc_lens: document lengths in tokens, positive ints, in packing order.
        context_len: tokens per rank, a positive int.
        num_ranks: number of chunks, a positive int.

    Returns:
        ``num_ranks`` lists of document lengths, each summing to ``context_len``.

    Raises:
        ValueError: an empty ``doc_lens``, a non-positive or non-int length, or a bad
            ``context_len`` / ``num_ranks``.
    """
    lens = _check_doc_lens(doc_lens)
    context_len = positive_int("context_len", context_len)
    num_ranks = positive_int("num_ranks", num_ranks)
    return _Stream(lens, context_len).chunks(0, num_ranks)


@functools.lru_cache(maxsize=32)
def _stream(name: str, context_len: int, seed: int) -> _Stream:
    return _Stream(_sample_documents(name, context_len, None, seed), context_len)


def sample_batch(name: str, num_ranks: int, context_len: int, seed: int = 0,
                 step: int = 0) -> list[list[int]]:
    """The ``step``-th batch of a run: ``num_ranks`` chunks of ``context_len`` tokens each.

    Samples documents with :func:`sample_documents` (``num_docs=None``, this ``seed``), packs them
    as :func:`pack_documents` does, and returns chunks ``[step·num_ranks, (step+1)·num_ranks)`` of
    the packed stream: successive steps take successive chunks. The stream cycles through the
    sampled documents forever (a chunk across the wrap holds the last document's tail and then
    the first document again), so every ``step >= 0`` is valid. The sampled and packed stream is
    cached per ``(name, context_len, seed)``; a call only slices it (well under a millisecond per
    rank).

    Example: ``sample_batch("pretrain", 256, 131072)``.

    Raises:
        ValueError: an unknown name or a bad ``num_ranks``, ``context_len`` (also one too long,
            as :func:`sample_documents`), ``seed`` or ``step``.
    """
    _check_name(name)
    num_ranks = positive_int("num_ranks", num_ranks)
    context_len = _check_context_len(name, context_len)
    seed = nonnegative_int("seed", seed)
    step = nonnegative_int("step", step)
    return _stream(name, context_len, seed).chunks(step * num_ranks, num_ranks)
