"""msgpack wire format of a :class:`~scheduler.tasks.Plan` (the scheduler's descriptor).

One msgpack map with fixed keys; integer arrays travel as little-endian int64 ``bin`` fields so a
plan of thousands of tasks encodes and decodes in well under a millisecond. Decoding validates
every field and raises ``ValueError`` (and nothing else) on malformed bytes; the plan's own
``__post_init__`` then checks that the tasks cover every causal pair exactly once.
"""

from __future__ import annotations

import math

import msgpack
import numpy as np

from .cost import CostModel
from .tasks import MODES, CATask, Plan

FORMAT = "distca.plan"
VERSION = 1
_KEYS = {"format", "version", "mode", "num_servers", "epsilon", "cost",
         "doc_counts", "doc_lens", "task_counts", "tasks"}
_I64 = np.dtype("<i8")
# A descriptor is small; refuse absurd sizes before allocating (256 MiB of int64 is ~33M tasks).
_MAX_BYTES = 256 * 2**20


def _bin(values) -> bytes:
    return np.ascontiguousarray(values, dtype=_I64).tobytes()


def plan_to_msgpack(plan: Plan) -> bytes:
    """Encode ``plan``; the inverse of :func:`plan_from_msgpack`."""
    task_counts = [len(tasks) for tasks in plan.server_tasks]
    return msgpack.packb({
        "format": FORMAT,
        "version": VERSION,
        "mode": plan.mode,
        "num_servers": plan.num_servers,
        "epsilon": float(plan.epsilon),
        "cost": [plan.cost.num_heads_q, plan.cost.num_heads_kv, plan.cost.head_dim, plan.cost.dtype_bytes],
        "doc_counts": _bin([len(x) for x in plan.doc_lens_per_rank]),
        "doc_lens": _bin(plan.doc_lens_flat),
        "task_counts": _bin(task_counts),
        "tasks": _bin(plan.task_array[:, 1:]),
    }, use_bin_type=True)


def _int_array(obj: dict, key: str) -> np.ndarray:
    raw = obj[key]
    if not isinstance(raw, bytes):
        raise ValueError(f"field {key!r} must be bytes of int64, got {type(raw).__name__}")
    if len(raw) % 8:
        raise ValueError(f"field {key!r} has {len(raw)} bytes, not a multiple of 8")
    arr = np.frombuffer(raw, dtype=_I64)
    if (arr < 0).any():
        raise ValueError(f"field {key!r} holds negative values: {arr[arr < 0][:5].tolist()}")
    return arr


def _plain_int(obj: dict, key: str, lo: int, hi: int) -> int:
    value = obj[key]
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"field {key!r} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def plan_from_msgpack(data: bytes) -> Plan:
    """Decode and validate a plan descriptor.

    Raises:
        ValueError: bytes that are not msgpack, not a plan map, of another version, with a field
            of the wrong type, size or range, or whose tasks do not form a valid plan.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"plan descriptor must be bytes, got {type(data).__name__}")
    if len(data) > _MAX_BYTES:
        raise ValueError(f"plan descriptor of {len(data)} bytes exceeds {_MAX_BYTES}")
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, use_list=True, strict_map_key=True,
                              max_bin_len=_MAX_BYTES, max_str_len=1 << 16,
                              max_array_len=1 << 16, max_map_len=64)
    except Exception as exc:  # msgpack raises several unrelated types for corrupt input
        raise ValueError(f"plan descriptor is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"plan descriptor must be a map, got {type(obj).__name__}")
    if set(obj) != _KEYS:
        raise ValueError(f"plan descriptor keys differ: missing {sorted(_KEYS - set(obj), key=str)}, "
                         f"unexpected {sorted(set(obj) - _KEYS, key=str)}")
    if obj["format"] != FORMAT or type(obj["version"]) is not int or obj["version"] != VERSION:
        raise ValueError(f"not a {FORMAT} v{VERSION} descriptor: format={obj['format']!r}, "
                         f"version={obj['version']!r}")
    if obj["mode"] not in MODES:
        raise ValueError(f"field 'mode' must be one of {MODES}, got {obj['mode']!r}")
    num_servers = _plain_int(obj, "num_servers", 1, 1 << 20)
    epsilon = obj["epsilon"]
    if type(epsilon) not in (float, int) or not (0 <= epsilon and math.isfinite(epsilon)):
        raise ValueError(f"field 'epsilon' must be a finite number >= 0, got {epsilon!r}")
    cost = obj["cost"]
    if not isinstance(cost, list) or len(cost) != 4 or any(type(x) is not int for x in cost):
        raise ValueError(f"field 'cost' must be four ints, got {cost!r}")
    cost_model = CostModel(*cost)  # raises ValueError on bad sizes

    doc_counts = _int_array(obj, "doc_counts")
    doc_lens = _int_array(obj, "doc_lens")
    task_counts = _int_array(obj, "task_counts")
    tasks = _int_array(obj, "tasks")
    # Bound every count before summing, so an int64 sum cannot wrap around.
    if len(doc_counts) == 0 or (doc_counts > len(doc_lens)).any() or int(doc_counts.sum()) != len(doc_lens):
        raise ValueError(f"doc_counts (sum {int(doc_counts.sum())}, {len(doc_counts)} ranks) "
                         f"disagree with {len(doc_lens)} document lengths")
    if len(task_counts) != num_servers:
        raise ValueError(f"task_counts has {len(task_counts)} entries for {num_servers} servers")
    if len(tasks) % 6 or (task_counts > len(tasks) // 6).any() or int(task_counts.sum()) * 6 != len(tasks):
        raise ValueError(f"tasks field holds {len(tasks)} ints, expected 6 x {int(task_counts.sum())}")

    bounds = np.concatenate([[0], np.cumsum(doc_counts)]).tolist()
    doc_lens_list = doc_lens.tolist()
    doc_lens_per_rank = [doc_lens_list[bounds[r]:bounds[r + 1]] for r in range(len(doc_counts))]
    rows = list(map(CATask._make, tasks.reshape(-1, 6).tolist()))
    tb = np.concatenate([[0], np.cumsum(task_counts)]).tolist()
    server_tasks = [rows[tb[s]:tb[s + 1]] for s in range(num_servers)]
    try:
        return Plan(doc_lens_per_rank=doc_lens_per_rank, num_servers=num_servers,
                    mode=obj["mode"], cost=cost_model, server_tasks=server_tasks,
                    epsilon=float(epsilon))
    except (TypeError, OverflowError, IndexError) as exc:  # defensive: report as bad input
        raise ValueError(f"invalid plan: {exc}") from None
