"""A participant's part of a plan: the descriptor the scheduler sends each client and server.

A client needs only the tasks of its own documents (on every server); a server only its own task
list. Sending each participant its part instead of the whole plan keeps descriptors O(own tasks)
at any cluster size. Parts travel as msgpack (int64 arrays as ``bin``), validated on decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np

from .cost import CostModel
from .tasks import (MODES, Plan, participant_count, participant_roles,
                    server_participant_index)

FORMAT = "distca.part"
VERSION = 1
_KEYS = {"format", "version", "step", "batch", "mode", "num_ranks", "num_servers", "cost",
         "participant", "rank", "server", "doc_lens", "client_tasks", "server_tasks"}
_I64 = np.dtype("<i8")
_MAX = 1 << 40


@dataclass(eq=False)
class PlanPart:
    """What participant ``participant`` needs of one step's plan for one batch.

    Attributes:
        step, batch: which training step and which batch of that step (ping-pong nano-batches
            are batches 0 and 1).
        mode, num_ranks, num_servers, cost: as in :class:`~scheduler.tasks.Plan`.
        participant: index in the all-to-all group (ranks first, then dedicated servers).
        rank: the client rank this participant is, or None (a dedicated server).
        server: the server this participant is, or None (a client in dedicated mode).
        doc_lens: the client rank's document lengths (empty without a client role).
        client_tasks: int64 [n, 7] (server, src_rank, doc_index, q_start, q_end, kv_start, kv_end)
            of every task of this rank's documents, sorted, as in ``Plan.task_array``.
        server_tasks: int64 [m, 7], the same columns, of the tasks this server runs.

    Raises:
        ValueError: any field out of range, tasks not sorted or not full-prefix shards, or client
            tasks that do not tile each of the rank's documents exactly once.
    """

    step: int
    batch: int
    mode: str
    num_ranks: int
    num_servers: int
    cost: CostModel
    participant: int
    rank: int | None
    server: int | None
    doc_lens: list[int]
    client_tasks: np.ndarray
    server_tasks: np.ndarray

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("step", "batch", "num_ranks", "num_servers", "participant"):
            v = getattr(self, name)
            if type(v) is not int or not 0 <= v < _MAX or (name.startswith("num") and v == 0):
                raise ValueError(f"{name} must be a non-negative int (positive for counts), got {v!r}")
        if self.mode == "inplace" and self.num_ranks != self.num_servers:
            raise ValueError(f"inplace part with {self.num_ranks} ranks but {self.num_servers} servers")
        if not 0 <= self.participant < self.num_participants:
            raise ValueError(f"participant {self.participant} out of range [0, {self.num_participants})")
        want_rank, want_server = participant_roles(self.mode, self.num_ranks, self.participant)
        if (self.rank, self.server) != (want_rank, want_server):
            raise ValueError(f"participant {self.participant} in {self.mode} mode is rank {want_rank} "
                             f"and server {want_server}, not rank {self.rank} and server {self.server}")
        if any(type(x) is not int or x <= 0 for x in self.doc_lens):
            raise ValueError(f"doc_lens must be positive ints, got {self.doc_lens[:5]}")
        if self.rank is None and self.doc_lens:
            raise ValueError("a participant without a client role carries no documents")
        self.client_tasks = self._check_tasks("client_tasks", self.client_tasks)
        self.server_tasks = self._check_tasks("server_tasks", self.server_tasks)
        ct, st = self.client_tasks, self.server_tasks
        if self.rank is None and len(ct):
            raise ValueError("a participant without a client role has no client tasks")
        if len(ct) and (ct[:, 1] != self.rank).any():
            raise ValueError(f"client tasks of rank {self.rank} name other ranks")
        if self.server is None and len(st):
            raise ValueError("a participant without a server role has no server tasks")
        if len(st) and (st[:, 0] != self.server).any():
            raise ValueError(f"server tasks of server {self.server} name other servers")
        if len(ct):
            lens = np.asarray(self.doc_lens, dtype=np.int64)
            if (ct[:, 2] >= len(lens)).any() or (ct[:, 4] > lens[np.minimum(ct[:, 2], len(lens) - 1)]).any():
                raise ValueError("client tasks reach past the rank's documents")
        self._check_coverage()

    def _check_tasks(self, name: str, arr) -> np.ndarray:
        arr = np.asarray(arr)
        if arr.size == 0:
            return np.zeros((0, 7), dtype=np.int64)
        if arr.ndim != 2 or arr.shape[1] != 7 or arr.dtype.kind not in "iu":
            raise ValueError(f"{name} must be an int64 array [n, 7], got {arr.dtype} {arr.shape}")
        arr = arr.astype(np.int64, copy=False)
        srv, rank, doc, qs, qe, ks, ke = arr.T
        bad = ((srv < 0) | (srv >= self.num_servers) | (rank < 0) | (rank >= self.num_ranks) | (doc < 0)
               | (qs < 0) | (qe <= qs) | (ks != 0) | (ke != qe))
        if bad.any():
            raise ValueError(f"{name} row {arr[np.argmax(bad)].tolist()} is not a full-prefix CA-task "
                             f"of a known server and rank")
        order = np.lexsort((qs, doc, rank, srv))
        if (order != np.arange(len(arr))).any():
            raise ValueError(f"{name} must be sorted by (server, src_rank, doc_index, q_start)")
        return arr

    def _check_coverage(self) -> None:
        if self.rank is None:
            return
        ct = self.client_tasks
        lens = self.doc_lens
        if not lens:
            if len(ct):
                raise ValueError("client tasks for a rank without documents")
            return
        order = np.lexsort((ct[:, 3], ct[:, 2]))
        doc, qs, qe = ct[order, 2], ct[order, 3], ct[order, 4]
        # Each document's shards, by start, must run 0 -> len with no gap or overlap.
        first = np.ones(len(doc), dtype=bool)
        first[1:] = doc[1:] != doc[:-1]
        ok = (len(doc) > 0 and np.array_equal(np.unique(doc), np.arange(len(lens)))
              and (qs[first] == 0).all() and (qs[~first] == qe[np.flatnonzero(~first) - 1]).all())
        last = np.ones(len(doc), dtype=bool)
        last[:-1] = first[1:]
        if not ok or (qe[last] != np.asarray(lens, dtype=np.int64)[doc[last]]).any():
            raise ValueError(f"client tasks do not cover each of rank {self.rank}'s documents exactly once")

    # ---- what the runtime asks -----------------------------------------------------------------
    @property
    def num_participants(self) -> int:
        return participant_count(self.mode, self.num_ranks, self.num_servers)

    def server_participant(self, server: int) -> int:
        return server_participant_index(self.mode, self.num_ranks, server)

    @property
    def num_tokens(self) -> int:
        return sum(self.doc_lens)

    # ---- wire format ---------------------------------------------------------------------------
    def to_msgpack(self) -> bytes:
        def b(a):
            return np.ascontiguousarray(a, dtype=_I64).tobytes()
        return msgpack.packb({
            "format": FORMAT, "version": VERSION, "step": self.step, "batch": self.batch,
            "mode": self.mode, "num_ranks": self.num_ranks, "num_servers": self.num_servers,
            "cost": [self.cost.num_heads_q, self.cost.num_heads_kv, self.cost.head_dim, self.cost.dtype_bytes],
            "participant": self.participant, "rank": self.rank, "server": self.server,
            "doc_lens": b(self.doc_lens), "client_tasks": b(self.client_tasks),
            "server_tasks": b(self.server_tasks)}, use_bin_type=True)

    @classmethod
    def from_msgpack(cls, data: bytes) -> "PlanPart":
        """Decode and validate; raises ``ValueError`` (only) on malformed bytes."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"part descriptor must be bytes, got {type(data).__name__}")
        try:
            obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, max_str_len=1 << 16,
                                  max_array_len=1 << 16, max_map_len=64)
        except Exception as exc:  # msgpack raises several unrelated types for corrupt input
            raise ValueError(f"part descriptor is not valid msgpack: {type(exc).__name__}: {exc}") from None
        if not isinstance(obj, dict) or set(obj) != _KEYS:
            raise ValueError(f"part descriptor must be a map with keys {sorted(_KEYS)}")
        if obj["format"] != FORMAT or type(obj["version"]) is not int or obj["version"] != VERSION:
            raise ValueError(f"not a {FORMAT} v{VERSION} descriptor")
        cost = obj["cost"]
        if not isinstance(cost, list) or len(cost) != 4 or any(type(x) is not int for x in cost):
            raise ValueError(f"field 'cost' must be four ints, got {cost!r}")
        arrays = {}
        for key in ("doc_lens", "client_tasks", "server_tasks"):
            raw = obj[key]
            if not isinstance(raw, bytes) or len(raw) % 8:
                raise ValueError(f"field {key!r} must be int64 bytes")
            arrays[key] = np.frombuffer(raw, dtype=_I64)
        for key in ("client_tasks", "server_tasks"):
            if len(arrays[key]) % 7:
                raise ValueError(f"field {key!r} holds {len(arrays[key])} ints, not rows of 7")
            arrays[key] = arrays[key].reshape(-1, 7)
        for key in ("rank", "server"):
            if obj[key] is not None and type(obj[key]) is not int:
                raise ValueError(f"field {key!r} must be an int or nil, got {obj[key]!r}")
        try:
            return cls(step=obj["step"], batch=obj["batch"], mode=obj["mode"],
                       num_ranks=obj["num_ranks"], num_servers=obj["num_servers"],
                       cost=CostModel(*cost), participant=obj["participant"], rank=obj["rank"],
                       server=obj["server"], doc_lens=arrays["doc_lens"].tolist(),
                       client_tasks=arrays["client_tasks"], server_tasks=arrays["server_tasks"])
        except (TypeError, OverflowError, IndexError) as exc:
            raise ValueError(f"invalid part descriptor: {exc}") from None


def plan_part(plan: Plan, participant: int, step: int = 0, batch: int = 0) -> PlanPart:
    """Cut participant ``participant``'s part out of ``plan``."""
    if not 0 <= participant < plan.num_participants:
        raise ValueError(f"participant {participant} out of range [0, {plan.num_participants})")
    rank, server = participant_roles(plan.mode, plan.num_ranks, participant)
    arr = plan.task_array
    client = arr[arr[:, 1] == rank] if rank is not None else arr[:0]
    own = arr[arr[:, 0] == server] if server is not None else arr[:0]
    return PlanPart(step=step, batch=batch, mode=plan.mode, num_ranks=plan.num_ranks,
                    num_servers=plan.num_servers, cost=plan.cost, participant=participant,
                    rank=rank, server=server,
                    doc_lens=list(plan.doc_lens_per_rank[rank]) if rank is not None else [],
                    client_tasks=client, server_tasks=own)


def plan_parts(plan: Plan, step: int = 0, batch: int = 0) -> list[PlanPart]:
    """Every participant's part, in participant order."""
    return [plan_part(plan, i, step, batch) for i in range(plan.num_participants)]


__all__ = ["PlanPart", "plan_part", "plan_parts"]
