"""The one msgpack envelope of the scheduler's descriptors (:class:`~scheduler.tasks.Plan` and
:class:`~scheduler.parts.PlanPart`): the trust boundary of everything that travels.

A descriptor is one msgpack map: ``format`` (a name such as ``"distca.plan"``), ``version`` (an
int) and a fixed set of fields. Integer arrays travel as little-endian int64 ``bin`` fields, so
thousands of tasks encode and decode in well under a millisecond. Decoding is strict: size limits
before anything is allocated, the exact key set, the exact format and version, and typed field
readers; every failure is a ``ValueError`` (never a msgpack, numpy or ``KeyError``), so a corrupt
or hostile descriptor can only be refused. The format's own class then validates the content.
"""

from __future__ import annotations

import msgpack
import numpy as np

from .checks import finite_nonnegative, int_in_range
from .cost import CostModel

I64 = np.dtype("<i8")
# A descriptor is small; refuse absurd sizes before allocating (256 MiB of int64 is ~33M tasks).
MAX_BYTES = 256 * 2**20
_ENVELOPE = ("format", "version")


def int_bin(values) -> bytes:
    """``values`` (any int array-like) as the little-endian int64 bytes of a ``bin`` field."""
    return np.ascontiguousarray(values, dtype=I64).tobytes()


def pack(fmt: str, version: int, fields: dict) -> bytes:
    """Encode ``{"format": fmt, "version": version, **fields}``; the inverse of :func:`unpack`."""
    return msgpack.packb({"format": fmt, "version": version, **fields}, use_bin_type=True)


def unpack(data, fmt: str, version: int, keys: frozenset, what: str) -> dict:
    """Decode the envelope of a ``what`` descriptor and return its map (format and version included).

    Args:
        data: bytes, bytearray or memoryview of at most :data:`MAX_BYTES`.
        fmt, version: the only format name and version accepted.
        keys: the field names besides ``format`` and ``version``; no more, no fewer.
        what: the descriptor's name in error messages (``"plan"``, ``"part"``).

    Raises:
        ValueError: not bytes, too large, not msgpack (or trailing bytes), not a map, other keys,
            another format or version.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"{what} descriptor must be bytes, got {type(data).__name__}")
    if len(data) > MAX_BYTES:
        raise ValueError(f"{what} descriptor of {len(data)} bytes exceeds {MAX_BYTES}")
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, use_list=True, strict_map_key=True,
                              max_bin_len=MAX_BYTES, max_str_len=1 << 16,
                              max_array_len=1 << 16, max_map_len=64)
    except Exception as exc:  # msgpack raises several unrelated types for corrupt input
        raise ValueError(f"{what} descriptor is not valid msgpack: {type(exc).__name__}: {exc}") from None
    want = set(keys) | set(_ENVELOPE)
    if not isinstance(obj, dict):
        raise ValueError(f"{what} descriptor must be a map with keys {sorted(want)}, "
                         f"got {type(obj).__name__}")
    if set(obj) != want:
        raise ValueError(f"{what} descriptor must be a map with keys {sorted(want)}: missing "
                         f"{sorted(want - set(obj), key=str)}, unexpected {sorted(set(obj) - want, key=str)}")
    if obj["format"] != fmt or type(obj["version"]) is not int or obj["version"] != version:
        raise ValueError(f"not a {fmt} v{version} descriptor: format={obj['format']!r}, "
                         f"version={obj['version']!r}")
    return obj


# ---- typed field readers (each raises ValueError naming the field and the value) -----------------
def int_array(obj: dict, key: str, columns: int = 1) -> np.ndarray:
    """Field ``key`` as a read-only int64 array, ``[n]`` or ``[n, columns]``; values must be >= 0."""
    raw = obj[key]
    if not isinstance(raw, bytes):
        raise ValueError(f"field {key!r} must be int64 bytes, got {type(raw).__name__}")
    if len(raw) % 8:
        raise ValueError(f"field {key!r} must be int64 bytes: {len(raw)} is not a multiple of 8")
    arr = np.frombuffer(raw, dtype=I64)
    if (arr < 0).any():
        raise ValueError(f"field {key!r} holds negative values: {arr[arr < 0][:5].tolist()}")
    if columns > 1:
        if len(arr) % columns:
            raise ValueError(f"field {key!r} holds {len(arr)} ints, not rows of {columns}")
        arr = arr.reshape(-1, columns)
    return arr


def int_field(obj: dict, key: str, lo: int, hi: int, optional: bool = False) -> int | None:
    """Field ``key`` as an int in ``[lo, hi]`` (or None when ``optional`` and nil)."""
    if optional and obj[key] is None:
        return None
    return int_in_range(f"field {key!r}", obj[key], lo, hi)


def number_field(obj: dict, key: str) -> float:
    """Field ``key`` as a finite float >= 0."""
    return finite_nonnegative(f"field {key!r}", obj[key])


def bool_field(obj: dict, key: str) -> bool:
    """Field ``key``, which must be a msgpack bool."""
    value = obj[key]
    if type(value) is not bool:
        raise ValueError(f"field {key!r} must be a bool, got {value!r}")
    return value


def choice_field(obj: dict, key: str, choices: tuple) -> str:
    """Field ``key``, which must be one of the strings ``choices``."""
    value = obj[key]
    if type(value) is not str or value not in choices:
        raise ValueError(f"field {key!r} must be one of {choices}, got {value!r}")
    return value


def cost_field(obj: dict, key: str = "cost") -> CostModel:
    """Field ``key`` as a :class:`CostModel` from its wire form :meth:`CostModel.to_wire`."""
    try:
        return CostModel.from_wire(obj[key])
    except ValueError as exc:
        raise ValueError(f"field {key!r}: {exc}") from None


__all__ = ["I64", "MAX_BYTES", "bool_field", "choice_field", "cost_field", "int_array", "int_bin", "int_field",
           "number_field", "pack", "unpack"]
