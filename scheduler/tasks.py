"""CA-tasks and plans: what each attention server computes in one training step.

A plan is data: built by a pure function of the batch, validated on construction, serialised with
msgpack (never pickle), replayable. Pure Python + numpy.
"""

from __future__ import annotations

from functools import cached_property
from itertools import chain
from typing import NamedTuple

import numpy as np

from . import descriptor
from .checks import INT64_MAX, MAX_SERVERS, MODES, boolean, check_batch, check_rank_totals, is_int, positive_int
from .cost import CostModel, causal_pairs, window_arg
from .cover import cover_problems
from .plan_stats import PlanStatsMixin

class CATask(NamedTuple):
    """One CA-task: query rows ``[q_start, q_end)`` of one document attending to keys
    ``[kv_start, kv_end)`` of the same document, causal with bottom-right alignment.

    Offsets are token indices inside the document ``doc_index`` of client rank ``src_rank``; query
    ``i`` sees key ``j`` iff ``j <= i`` (and ``j > i - window``), absolute positions. A document's
    query shards partition its tokens; a shard is one *full-window* task (``kv_start =
    max(0, q_start - window + 1)``, 0 with no window, ``kv_end == q_end``) or is split on the key
    axis into *partial-KV* tasks whose key ranges tile those keys (:mod:`scheduler.cover`); their
    partial outputs merge exactly by their LSEs.
    (A NamedTuple rather than a dataclass: plans hold thousands and are built in milliseconds.)
    """

    src_rank: int
    doc_index: int
    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def q_len(self) -> int:
        return self.q_end - self.q_start

    @property
    def kv_len(self) -> int:
        return self.kv_end - self.kv_start

    def pairs(self, window: int | None = None) -> int:
        """(Query, key) pairs this task computes under ``window`` (:func:`~scheduler.cost.causal_pairs`)."""
        return causal_pairs(self.q_start, self.q_end, self.kv_start, self.kv_end, window)


def participant_count(mode: str, num_ranks: int, num_servers: int) -> int:
    """Processes in a plan's all-to-all: the ranks (in-place), or ranks then servers (dedicated)."""
    return num_ranks if mode == "inplace" else num_ranks + num_servers


def server_participant_index(mode: str, num_ranks: int, server: int) -> int:
    """Participant index of attention server ``server``."""
    return server if mode == "inplace" else num_ranks + server


def participant_roles(mode: str, num_ranks: int, participant: int) -> tuple[int | None, int | None]:
    """``(client rank, server)`` that participant ``participant`` plays; None where it has no role."""
    if mode == "inplace":
        return participant, participant
    if participant < num_ranks:
        return participant, None
    return None, participant - num_ranks


def _tasks_array(server_tasks) -> np.ndarray:
    """All tasks as an int64 array [num_tasks, 7]: server, then the six CATask fields."""
    counts = [len(tasks) for tasks in server_tasks]
    flat = [t for tasks in server_tasks for t in tasks]
    if not flat:
        return np.zeros((0, 7), dtype=np.int64)
    arr = np.empty((len(flat), 7), dtype=np.int64)
    arr[:, 0] = np.repeat(np.arange(len(counts)), counts)
    try:
        arr[:, 1:] = np.fromiter(chain.from_iterable(flat), dtype=np.int64,
                                 count=6 * len(flat)).reshape(-1, 6)
    except (OverflowError, TypeError, ValueError) as exc:
        raise ValueError(f"tasks must hold int64 offsets: {exc}") from None
    return arr


def _canonical(arr: np.ndarray) -> np.ndarray:
    """Tasks in the wire layout's order (server, src_rank, doc_index, q_start, kv_start)."""
    if len(arr) > 1:
        order = np.lexsort((arr[:, 5], arr[:, 3], arr[:, 2], arr[:, 1], arr[:, 0]))
        if (order != np.arange(len(arr))).any():
            return arr[order]
    return arr


def _first_rank_of(counts: np.ndarray, gid: int) -> int:
    return int(np.searchsorted(np.cumsum(counts), gid, side="right"))


class Plan(PlanStatsMixin):
    """One step's plan: every server's CA-tasks, and from them the all-to-all layout.

    Held as arrays (``doc_lens_flat``, ``doc_counts``, ``task_array``); the per-rank and
    per-server lists are built on first use. Its loads, bytes and summary are
    :class:`~scheduler.plan_stats.PlanStatsMixin`'s.

    Args:
        doc_lens_per_rank: document lengths (tokens) of each client rank, in packing order.
        num_servers: attention servers. ``mode="inplace"``: server ``i`` is client rank ``i``, so
            ``num_servers == len(doc_lens_per_rank)``; ``"dedicated"``: separate processes.
        mode: ``"inplace"`` or ``"dedicated"``.
        cost: shapes that turn tokens into FLOPs and bytes.
        server_tasks: ``server_tasks[s]`` is the list of :class:`CATask` server ``s`` runs; each
            list is kept sorted by ``(src_rank, doc_index, q_start, kv_start)``, the order of the
            wire layout.
        epsilon: the imbalance tolerance the plan was made for (information only).
        min_shard: the shortest shard a split document may have (tokens); 1 allows any.
        keep_activations: servers keep each forward round's received rows and results until that
            layer's backward round, which then sends only dO (:data:`~scheduler.cost.KEPT_TENSORS`),
            plus the owner's merged O and LSE for the query rows of split tasks
            (:data:`~scheduler.cost.MERGED_TENSORS`: a server's own O and LSE of a shard cut on
            the key axis are partial); changes :meth:`comm_bytes` and :meth:`held_bytes`, not the
            tasks.
        window: sliding-window attention (query ``i`` sees keys ``i - window + 1 .. i``), or None
            for full causal attention.

    Raises:
        ValueError: any field of the wrong type or range, a task outside its document, tasks that
            do not cover each document's mask exactly once (:mod:`scheduler.cover`: shards that do
            not partition the tokens, or a shard's key ranges that do not tile its keys), or a
            split document with a shard or key piece under ``min_shard``.
    """

    __hash__ = None  # mutable-looking data: equality by value, like the dataclass it replaces

    def __init__(self, doc_lens_per_rank, num_servers: int, mode: str, cost: CostModel, server_tasks,
                 epsilon: float = 0.0, min_shard: int = 1, keep_activations: bool = False,
                 window: int | None = None):
        counts, flat = check_batch(doc_lens_per_rank, num_servers, mode, cost, epsilon)
        positive_int("min_shard", min_shard)
        boolean("keep_activations", keep_activations)
        window = window_arg(window)
        if not isinstance(server_tasks, (list, tuple)) or len(server_tasks) != num_servers:
            raise ValueError(f"server_tasks must hold one list per server ({num_servers})")
        for s, tasks in enumerate(server_tasks):
            if not isinstance(tasks, (list, tuple)):
                raise ValueError(f"server_tasks[{s}] is {type(tasks).__name__}, not a list")
            for t in tasks:
                if not (isinstance(t, (tuple, list)) and len(t) == 6 and all(is_int(x) for x in t)):
                    raise ValueError(f"server {s}: a task must be six ints, got {t!r}")
        self._set(counts, flat, int(num_servers), mode, cost, _canonical(_tasks_array(server_tasks)),
                  float(epsilon), int(min_shard), keep_activations, window)
        self._check()

    @classmethod
    def _trusted(cls, *, counts: np.ndarray, doc_lens: np.ndarray, num_servers: int, mode: str,
                 cost: CostModel, task_array: np.ndarray, epsilon: float, min_shard: int,
                 keep_activations: bool = False, window: int | None = None) -> "Plan":
        """A plan from arrays its maker built valid by construction (the planner): no checks.
        ``task_array`` must already be in canonical order."""
        plan = cls.__new__(cls)
        plan._set(counts, doc_lens, num_servers, mode, cost, task_array, epsilon, min_shard,
                  keep_activations, window)
        return plan

    def _set(self, counts, doc_lens, num_servers, mode, cost, task_array, epsilon, min_shard,
             keep_activations, window) -> None:
        self.doc_counts = counts
        self.doc_lens_flat = doc_lens
        self.num_servers, self.mode, self.cost = num_servers, mode, cost
        self.task_array = task_array
        self.epsilon, self.min_shard, self.window = epsilon, min_shard, window
        self.keep_activations = keep_activations

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (self.mode == other.mode and self.num_servers == other.num_servers
                and self.cost == other.cost and self.epsilon == other.epsilon
                and self.min_shard == other.min_shard and self.window == other.window
                and self.keep_activations == other.keep_activations
                and np.array_equal(self.doc_counts, other.doc_counts)
                and np.array_equal(self.doc_lens_flat, other.doc_lens_flat)
                and np.array_equal(self.task_array, other.task_array))

    def __repr__(self) -> str:
        return (f"Plan(mode={self.mode!r}, num_ranks={self.num_ranks}, num_servers={self.num_servers}, "
                f"num_docs={len(self.doc_lens_flat)}, num_tasks={len(self.task_array)}, "
                f"epsilon={self.epsilon}, min_shard={self.min_shard}, window={self.window}, "
                f"keep_activations={self.keep_activations})")

    # ---- validation (vectorised: no Python loop over ranks, servers or tasks) ---------------------
    def _check(self) -> None:
        counts, lens, arr = self.doc_counts, self.doc_lens_flat, self.task_array
        num_ranks = len(counts)
        bad = lens <= 0
        if bad.any():
            r = _first_rank_of(counts, int(np.argmax(bad)))
            raise ValueError(f"rank {r}: document lengths must be positive ints, got {lens[bad][:5].tolist()}")
        check_rank_totals(counts, lens)
        starts = self.doc_offsets
        if self.mode == "inplace" and self.num_servers != num_ranks:
            raise ValueError(f"inplace mode needs one server per client rank: num_servers={self.num_servers}, "
                             f"ranks={num_ranks}")
        srv, rank, doc, qs, qe, ks, ke = arr.T
        if arr.size:
            if (rank < 0).any() or (rank >= num_ranks).any():
                raise ValueError(f"src_rank out of range [0, {num_ranks}): {sorted(set(rank[(rank < 0) | (rank >= num_ranks)].tolist()))[:5]}")
            bad = (doc < 0) | (doc >= counts[rank])
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"task {self._task_at(i)} names a document rank {rank[i]} does not have")
        gid = starts[rank] + doc if arr.size else np.zeros(0, dtype=np.int64)
        dl = lens[gid] if arr.size else gid
        bad = (qs < 0) | (qe <= qs) | (qe > dl) | (ks < 0) | (ke <= ks) | (ke > qe)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"task {self._task_at(i)} on server {srv[i]} is not a CA-task inside its document "
                f"(0 <= q_start < q_end <= doc_len={dl[i]}, 0 <= kv_start < kv_end <= q_end)")
        problems, _ = cover_problems(gid, qs, qe, ks, ke, lens, self.window, self.min_shard)
        if problems:
            raise ValueError("plan does not cover every causal pair exactly once: " + "; ".join(
                f"{what}: {self._doc_names(gids)}" for what, gids in problems))

    def _task_at(self, i: int) -> CATask:
        row = self.task_array[i]
        return CATask(*(int(x) for x in row[1:]))

    def _doc_names(self, gids) -> str:
        names = []
        for g in list(dict.fromkeys(int(x) for x in gids))[:5]:
            r = int(np.searchsorted(self.doc_offsets, g, side="right") - 1)
            names.append(f"(rank {r}, doc {g - int(self.doc_offsets[r])})")
        return ", ".join(names)

    # ---- derived arrays and lists ------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self.doc_counts)

    @property
    def num_participants(self) -> int:
        """Processes in the all-to-all: ranks (inplace), or ranks then servers (dedicated)."""
        return participant_count(self.mode, self.num_ranks, self.num_servers)

    def server_participant(self, server: int) -> int:
        """Participant index of attention server ``server`` in the all-to-all group."""
        return server_participant_index(self.mode, self.num_ranks, server)

    @cached_property
    def doc_offsets(self) -> np.ndarray:
        """Global index of each rank's first document: int64 [num_ranks]."""
        return (np.cumsum(self.doc_counts) - self.doc_counts).astype(np.int64)

    @cached_property
    def doc_lens_per_rank(self) -> list[list[int]]:
        """Document lengths (Python ints) of each client rank, in packing order."""
        flat = self.doc_lens_flat.tolist()
        bounds = np.concatenate([[0], np.cumsum(self.doc_counts)]).tolist()
        return [flat[bounds[r]:bounds[r + 1]] for r in range(self.num_ranks)]

    @cached_property
    def server_tasks(self) -> list[list[CATask]]:
        """``server_tasks[s]``: the :class:`CATask` list of server ``s``, in canonical order."""
        rows = list(map(CATask._make, self.task_array[:, 1:].tolist()))
        bounds = np.searchsorted(self.task_array[:, 0], np.arange(self.num_servers + 1)).tolist()
        return [rows[bounds[s]:bounds[s + 1]] for s in range(self.num_servers)]

    def server_task_counts(self) -> list[int]:
        """CA-tasks per server (without building the task lists)."""
        return np.bincount(self.task_array[:, 0], minlength=self.num_servers).tolist()

    # ---- wire format --------------------------------------------------------------------------------
    def to_msgpack(self) -> bytes:
        """Serialise to msgpack bytes: a :mod:`scheduler.descriptor` map of format ``distca.plan``.

        Fields: ``mode``, ``num_servers``, ``epsilon``, ``min_shard``, ``window`` (an int, or nil
        for full causal), ``keep_activations``, ``cost`` (:meth:`CostModel.to_wire`), and int64
        ``bin`` arrays ``doc_counts`` [num_ranks],
        ``doc_lens`` [num_docs], ``task_counts`` [num_servers] and ``tasks`` [num_tasks, 6] (the
        CATask fields, server after server).
        """
        return descriptor.pack(PLAN_FORMAT, PLAN_VERSION, {
            "mode": self.mode,
            "num_servers": self.num_servers,
            "epsilon": float(self.epsilon),
            "min_shard": self.min_shard,
            "window": self.window,
            "keep_activations": self.keep_activations,
            "cost": self.cost.to_wire(),
            "doc_counts": descriptor.int_bin(self.doc_counts),
            "doc_lens": descriptor.int_bin(self.doc_lens_flat),
            "task_counts": descriptor.int_bin(self.server_task_counts()),
            "tasks": descriptor.int_bin(self.task_array[:, 1:]),
        })

    @classmethod
    def from_msgpack(cls, data: bytes) -> "Plan":
        """Parse and validate a plan descriptor (the trust boundary: every check runs, vectorised,
        so the time grows with the descriptor's size, not with a Python loop over its ranks).

        Raises:
            ValueError: bytes that are not msgpack, not a plan map, of another version, with a
                field of the wrong type, size or range, or whose tasks do not form a valid plan.
        """
        obj = descriptor.unpack(data, PLAN_FORMAT, PLAN_VERSION, _PLAN_KEYS, "plan")
        mode = descriptor.choice_field(obj, "mode", MODES)
        num_servers = descriptor.int_field(obj, "num_servers", 1, MAX_SERVERS)
        epsilon = descriptor.number_field(obj, "epsilon")
        min_shard = descriptor.int_field(obj, "min_shard", 1, INT64_MAX)
        window = descriptor.int_field(obj, "window", 1, INT64_MAX, optional=True)
        keep = descriptor.bool_field(obj, "keep_activations")
        cost = descriptor.cost_field(obj)
        doc_counts = descriptor.int_array(obj, "doc_counts")
        doc_lens = descriptor.int_array(obj, "doc_lens")
        task_counts = descriptor.int_array(obj, "task_counts")
        tasks = descriptor.int_array(obj, "tasks")
        # Bound every count before summing, so an int64 sum cannot wrap around.
        if len(doc_counts) == 0 or (doc_counts > len(doc_lens)).any() or int(doc_counts.sum()) != len(doc_lens):
            raise ValueError(f"doc_counts (sum {int(doc_counts.sum())}, {len(doc_counts)} ranks) "
                             f"disagree with {len(doc_lens)} document lengths")
        if len(task_counts) != num_servers:
            raise ValueError(f"task_counts has {len(task_counts)} entries for {num_servers} servers")
        if len(tasks) % 6 or (task_counts > len(tasks) // 6).any() or int(task_counts.sum()) * 6 != len(tasks):
            raise ValueError(f"tasks field holds {len(tasks)} ints, expected 6 x {int(task_counts.sum())}")
        arr = np.empty((len(tasks) // 6, 7), dtype=np.int64)
        arr[:, 0] = np.repeat(np.arange(num_servers), task_counts)
        arr[:, 1:] = tasks.reshape(-1, 6)
        plan = cls._trusted(counts=doc_counts, doc_lens=doc_lens, num_servers=num_servers, mode=mode,
                            cost=cost, task_array=_canonical(arr), epsilon=epsilon, min_shard=min_shard,
                            keep_activations=keep, window=window)
        plan._check()
        return plan


PLAN_FORMAT, PLAN_VERSION = "distca.plan", 3
_PLAN_KEYS = frozenset({"mode", "num_servers", "epsilon", "min_shard", "window", "keep_activations",
                        "cost", "doc_counts", "doc_lens", "task_counts", "tasks"})
