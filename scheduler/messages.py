"""A client's report to the scheduler and the scheduler's answer, as they travel: msgpack bytes.

One report per client per ``(step, batch)`` is the control plane's only call on the hot path, so
its cost per call bounds a step of many clients. Ray serialises every argument and the return
value of an actor call on its own; measured on the scheduler actor (``bench/control_plane.py``),
a call with five arguments (step, batch, rank, documents, shape) returning a dict costs it about
twice the CPU of a plain ping, one ``bytes`` argument returning ``bytes`` about 1.25 times. So
both directions are one msgpack message each:

- the request, a :mod:`scheduler.descriptor` of format ``distca.report``: ``step``, ``batch``,
  ``rank``, ``token`` (the secret of ``rank``'s registration, or None), ``doc_lens`` (an int64
  ``bin``: the documents' token counts in packing order) and ``shape`` (``{"cost":
  CostModel.to_wire(), "device_type": "cpu" | "cuda", "window": int | None, "dtype": "float16" |
  "bfloat16" | "float32" | "float64"}``; ``window`` and ``dtype`` may be absent: see
  :func:`checked_shape`);
- the answer, the coordinator's answer map as it is: ``{"part": bytes, "group": {...}}`` or an
  error answer (:func:`error_answer`). The part inside stays the msgpack
  :class:`~scheduler.parts.PlanPart` the coordinator encoded once; nothing is re-encoded.

Only the request crosses a trust boundary (the scheduler decodes what any client sends); step,
batch, rank and shape are checked by :meth:`Coordinator.report`, as for a call made in process;
the shape's checks (:func:`agreed_shape`) are here.
"""

from __future__ import annotations

import msgpack
import numpy as np

from . import descriptor
from .checks import INT64_MAX
from .cost import CostModel, window_arg

DEVICE_TYPES = ("cpu", "cuda")
# The activation dtypes a report may name (torch's names without "torch."), with their element
# sizes: two dtypes of one size (float16, bfloat16) agree on every byte count, so only the name
# tells them apart before a round mixes them.
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_SHAPE_KEYS = frozenset({"cost", "device_type", "window", "dtype"})

FORMAT, VERSION = "distca.report", 2
_KEYS = frozenset({"step", "batch", "rank", "doc_lens", "shape", "token"})


def encode_report(step: int, batch: int, rank: int, doc_lens, shape: dict, token: str | None = None) -> bytes:
    """Client ``rank``'s report of ``(step, batch)``: ``doc_lens`` (ints >= 0, any int
    array-like) and the attention ``shape`` map, as one ``distca.report`` message. ``token``:
    the secret ``rank``'s registration returned; the scheduler actor plans only reports that
    carry the current one, so a client replaced by another of its rank (a zombie) is refused
    rather than mixing its batches into the job's.

    Raises:
        ValueError: a document length that is not an int in ``[0, 2**63)``.
    """
    if isinstance(doc_lens, np.ndarray):
        ints = doc_lens.ndim == 1 and (not doc_lens.size or doc_lens.dtype.kind in "iu")
    else:  # one check per element type, not per element (the client sends thousands)
        doc_lens = list(doc_lens)
        ints = all(issubclass(t, (int, np.integer)) and not issubclass(t, (bool, np.bool_))
                   for t in set(map(type, doc_lens)))
    arr = np.asarray(doc_lens) if ints else None
    if arr is None or (arr.size and (arr.min() < 0 or arr.max() > INT64_MAX)):
        shown = doc_lens.ravel()[:5].tolist() if isinstance(doc_lens, np.ndarray) else doc_lens[:5]
        raise ValueError(f"doc_lens must be a 1-D sequence of ints in [0, 2**63), got {shown}")
    return descriptor.pack(FORMAT, VERSION, {"step": step, "batch": batch, "rank": rank,
                                             "doc_lens": descriptor.int_bin(arr), "shape": shape,
                                             "token": token})


def decode_report(data) -> tuple:
    """``(step, batch, rank, doc_lens, shape, token)`` of a report message; ``doc_lens`` a list
    of Python ints. Values other than the documents are returned as sent (the coordinator checks
    them, the actor the token: ``Coordinator.check_member``).

    Raises:
        ValueError: not a ``distca.report`` v2 message (malformed msgpack, other keys, another
            format or version), or ``doc_lens`` not int64 bytes of values >= 0.
    """
    obj = descriptor.unpack(data, FORMAT, VERSION, _KEYS, "report")
    return (obj["step"], obj["batch"], obj["rank"], descriptor.int_array(obj, "doc_lens").tolist(), obj["shape"],
            obj["token"])


def encode_answer(answer: dict) -> bytes:
    """The scheduler's answer map (bytes, ints, strings, bools, nested maps) as msgpack."""
    return msgpack.packb(answer, use_bin_type=True)


def decode_answer(data: bytes) -> dict:
    """The answer map of :func:`encode_answer` (``bytes`` fields stay ``bytes``).

    Raises:
        ValueError: not a msgpack map.
    """
    try:
        answer = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for corrupt input
        raise ValueError(f"scheduler answer is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(answer, dict):
        raise ValueError(f"scheduler answer must be a map, got {type(answer).__name__}")
    return answer


__all__ = ["FORMAT", "VERSION", "decode_answer", "decode_report", "encode_answer", "encode_report"]


def error_answer(kind: str, message: str, **extra) -> dict:
    """A report's error answer: ``kind`` is ``"ValueError"`` (bad input), ``"DistCAError"`` or
    ``"resync"`` (the step is over: go on at ``extra["next_step"]``)."""
    return {"error": kind, "message": message, **extra}


def same_report(a, b) -> bool:
    """``a == b`` for reports; anything that cannot be compared counts as different."""
    try:
        return bool(a == b)
    except Exception:  # e.g. arrays, whose == is elementwise
        return False


def checked_shape(rank: int, shape) -> tuple[CostModel, str, int | None, str | None]:
    """Rank ``rank``'s shape as ``(CostModel, device_type, window, dtype)``.

    ``window`` and ``dtype`` may be absent or None (not stated). A report without ``dtype`` is
    one of a client older than the dtype check: it is accepted, and agrees only with reports
    that do not state one either (:func:`agreed_shape`).

    Raises:
        ValueError: not ``{"cost": [4 ints], "device_type": "cpu" | "cuda"}`` with an optional
            ``"window"`` (a positive int or None) and ``"dtype"`` (a name of
            :data:`DTYPE_BYTES` whose element size is the cost's ``dtype_bytes``, or None),
            naming the rank.
    """
    if not isinstance(shape, dict) or not {"cost", "device_type"} <= set(shape) <= _SHAPE_KEYS:
        raise ValueError(f"rank {rank}: the attention shape must be a dict with keys 'cost', "
                         f"'device_type' and optionally 'window' and 'dtype', got {shape!r}")
    try:
        cost = CostModel.from_wire(shape["cost"])
        window = window_arg(shape.get("window"))
    except ValueError as exc:
        raise ValueError(f"rank {rank}: {exc}") from None
    if shape["device_type"] not in DEVICE_TYPES:
        raise ValueError(f"rank {rank}: device_type must be one of {DEVICE_TYPES}, got {shape['device_type']!r}")
    dtype = shape.get("dtype")
    if dtype is not None and (type(dtype) is not str or dtype not in DTYPE_BYTES):
        raise ValueError(f"rank {rank}: dtype must be one of {tuple(DTYPE_BYTES)} or None, got {dtype!r}")
    if dtype is not None and DTYPE_BYTES[dtype] != cost.dtype_bytes:
        raise ValueError(f"rank {rank}: dtype {dtype} has {DTYPE_BYTES[dtype]}-byte elements but the "
                         f"attention shape says {cost.dtype_bytes}")
    return cost, shape["device_type"], window, dtype


def agreed_shape(reports: dict[int, tuple]) -> tuple[CostModel, str, int | None]:
    """The one ``(CostModel, device_type, window)`` all reports carry; they must state one
    activation dtype too (or all none: see :func:`checked_shape`).

    Raises:
        ValueError: a shape :func:`checked_shape` refuses (naming the rank), or clients that
            disagree on any of cost, device type, window or dtype (naming which ranks sent what,
            each rank's dtype included).
    """
    by_shape: dict[tuple, list[int]] = {}
    seen: dict[str, tuple] = {}  # repr of a shape already checked -> its checked_shape
    for rank in sorted(reports):
        shape = reports[rank][1]
        # Clients send the same shape: check each distinct one once (at 1024 clients, building a
        # CostModel per report was 8 ms of the step). repr tells 2 from 2.0 and True.
        known = seen.get(repr(shape)) if type(shape) is dict else None
        if known is None:
            known = checked_shape(rank, shape)
            seen[repr(shape)] = known
        by_shape.setdefault(known, []).append(rank)
    if len(by_shape) != 1:
        sent = "; ".join(f"ranks {ranks} sent {{'cost': {c.to_wire()}, 'device_type': {d!r}, 'window': {w!r}, "
                         f"'dtype': {t!r}}}" for (c, d, w, t), ranks in by_shape.items())
        raise ValueError(f"clients disagree on the attention shape: {sent}")
    (shape, _), = by_shape.items()
    return shape[:3]
