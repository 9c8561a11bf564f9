"""A participant's part of a plan: the descriptor the scheduler sends each client and server.

A client needs only the tasks of its own documents (on every server); a server only its own task
list. Sending each participant its part instead of the whole plan keeps descriptors O(own tasks)
at any cluster size. Parts travel in the :mod:`scheduler.descriptor` envelope and are validated in
full on decode; parts cut from a plan (already validated) skip the checks and are cut in one pass.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from . import descriptor
from .checks import INT64_MAX, MAX_SERVERS, MODES, bad_lengths, boolean, int_in_range
from .cost import CostModel, window_arg, window_kv_start
from .cover import cover_problems
from .tasks import (Plan, participant_count, participant_roles,
                    server_participant_index)

FORMAT = "distca.part"
VERSION = 2  # 2: the window and kept activations
_KEYS = frozenset({"step", "batch", "mode", "num_ranks", "num_servers", "cost", "participant", "rank",
                   "server", "doc_lens", "client_tasks", "server_tasks", "plan_id", "window",
                   "keep_activations"})
_MAX = (1 << 40) - 1
PLAN_ID_MAX = (1 << 64) - 1
_NO_TASKS = np.zeros((0, 7), dtype=np.int64)
_NO_TASKS.flags.writeable = False


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
        plan_id: the identity of the plan this part was cut from (:func:`plan_identity`, an unsigned
            64-bit int; 0 when none was given). Every participant of a round checks that all
            agree before any byte moves.
        window: the plan's sliding window (None: full causal); the servers' kernels mask by it.
        keep_activations: the plan's :attr:`~scheduler.tasks.Plan.keep_activations`: a server keeps
            each forward round's rows and results until that layer's backward round (dO only).

    Raises:
        ValueError: any field out of range, tasks not sorted or outside their documents, or client
            tasks that do not cover each of the rank's documents' masks exactly once
            (:mod:`scheduler.cover`).
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
    plan_id: int = 0
    window: int | None = None
    keep_activations: bool = False

    def __post_init__(self) -> None:
        self.window = window_arg(self.window)
        boolean("keep_activations", self.keep_activations)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.cost, CostModel):
            raise ValueError(f"cost must be a CostModel, got {type(self.cost).__name__}")
        for name in ("step", "batch", "num_ranks", "num_servers", "participant"):
            setattr(self, name, int_in_range(name, getattr(self, name), 1 if name.startswith("num") else 0, _MAX))
        # as a plan's descriptor: a receiver builds per-server layouts, which must stay small
        int_in_range("num_servers", self.num_servers, 1, MAX_SERVERS)
        self.plan_id = int_in_range("plan_id", self.plan_id, 0, PLAN_ID_MAX)
        if self.mode == "inplace" and self.num_ranks != self.num_servers:
            raise ValueError(f"inplace part with {self.num_ranks} ranks but {self.num_servers} servers")
        if not 0 <= self.participant < self.num_participants:
            raise ValueError(f"participant {self.participant} out of range [0, {self.num_participants})")
        want_rank, want_server = participant_roles(self.mode, self.num_ranks, self.participant)
        if (self.rank, self.server) != (want_rank, want_server):
            raise ValueError(f"participant {self.participant} in {self.mode} mode is rank {want_rank} "
                             f"and server {want_server}, not rank {self.rank} and server {self.server}")
        bad = bad_lengths(self.doc_lens)
        if bad:
            raise ValueError(f"doc_lens must be positive ints, got {bad[:5]}")
        self.doc_lens = [int(x) for x in self.doc_lens]
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
            return _NO_TASKS
        if arr.ndim != 2 or arr.shape[1] != 7 or arr.dtype.kind not in "iu":
            raise ValueError(f"{name} must be an int64 array [n, 7], got {arr.dtype} {arr.shape}")
        arr = arr.astype(np.int64, copy=False)
        srv, rank, doc, qs, qe, ks, ke = arr.T
        bad = ((srv < 0) | (srv >= self.num_servers) | (rank < 0) | (rank >= self.num_ranks) | (doc < 0)
               | (qs < 0) | (qe <= qs) | (ks < 0) | (ke <= ks) | (ke > qe)
               | (ks < window_kv_start(qs, self.window)))
        if bad.any():
            raise ValueError(f"{name} row {arr[np.argmax(bad)].tolist()} is not a CA-task of a known "
                             f"server and rank (0 <= q_start < q_end, max(0, q_start - window + 1) <= "
                             f"kv_start < kv_end <= q_end, window={self.window})")
        order = np.lexsort((ks, qs, doc, rank, srv))
        if (order != np.arange(len(arr))).any():
            raise ValueError(f"{name} must be sorted by (server, src_rank, doc_index, q_start, kv_start)")
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
        problems, _ = cover_problems(ct[:, 2], ct[:, 3], ct[:, 4], ct[:, 5], ct[:, 6],
                                     np.asarray(lens, dtype=np.int64), self.window)
        if problems:
            raise ValueError(f"client tasks do not cover each of rank {self.rank}'s documents exactly "
                             f"once: " + "; ".join(f"{what} (docs {gids[:5].tolist()})" for what, gids in problems))

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
        """Serialise to a :mod:`scheduler.descriptor` map of format ``distca.part``: the scalar
        fields (``plan_id`` an unsigned 64-bit int, ``window`` an int or nil), ``cost`` (:meth:`CostModel.to_wire`), and
        int64 ``bin`` arrays ``doc_lens``, ``client_tasks`` and ``server_tasks`` (rows of 7)."""
        return descriptor.pack(FORMAT, VERSION, {
            "step": self.step, "batch": self.batch, "mode": self.mode, "num_ranks": self.num_ranks,
            "num_servers": self.num_servers, "cost": self.cost.to_wire(),
            "participant": self.participant, "rank": self.rank, "server": self.server,
            "doc_lens": descriptor.int_bin(self.doc_lens),
            "client_tasks": descriptor.int_bin(self.client_tasks),
            "server_tasks": descriptor.int_bin(self.server_tasks), "plan_id": self.plan_id,
            "window": self.window, "keep_activations": self.keep_activations})

    @classmethod
    def from_msgpack(cls, data: bytes) -> "PlanPart":
        """Decode and validate (the trust boundary: every check of the constructor runs).

        Raises:
            ValueError: (only) malformed bytes or a part that is not valid.
        """
        obj = descriptor.unpack(data, FORMAT, VERSION, _KEYS, "part")
        fields = {key: descriptor.int_field(obj, key, 0, MAX_SERVERS if key == "num_servers" else _MAX)
                  for key in ("step", "batch", "num_ranks", "num_servers", "participant")}
        fields["plan_id"] = descriptor.int_field(obj, "plan_id", 0, PLAN_ID_MAX)
        fields["window"] = descriptor.int_field(obj, "window", 1, INT64_MAX, optional=True)
        fields["keep_activations"] = descriptor.bool_field(obj, "keep_activations")
        for key in ("rank", "server"):
            fields[key] = descriptor.int_field(obj, key, 0, _MAX, optional=True)
        try:
            return cls(mode=descriptor.choice_field(obj, "mode", MODES), cost=descriptor.cost_field(obj),
                       doc_lens=descriptor.int_array(obj, "doc_lens").tolist(),
                       client_tasks=descriptor.int_array(obj, "client_tasks", 7),
                       server_tasks=descriptor.int_array(obj, "server_tasks", 7), **fields)
        except (TypeError, OverflowError, IndexError) as exc:
            raise ValueError(f"invalid part descriptor: {exc}") from None

    def at(self, step: int, batch: int) -> "PlanPart":
        """This part bound to training step ``step`` and batch ``batch`` (the same plan's part in a
        later step); the task arrays are shared (read-only), nothing else is re-checked.

        Raises:
            ValueError: a negative or too large ``step`` or ``batch``.
        """
        part = object.__new__(type(self))
        part.__dict__.update(self.__dict__, step=int_in_range("step", step, 0, _MAX),
                             batch=int_in_range("batch", batch, 0, _MAX))
        return part

    @classmethod
    def _cut(cls, shared: dict, participant: int, rank: int | None, server: int | None, doc_lens: list[int],
             client_tasks: np.ndarray, server_tasks: np.ndarray) -> "PlanPart":
        """A part of an already validated plan, built without re-validation.

        ``shared``: the fields every part of the plan has alike (:func:`_shared_fields`); the
        rest are the participant's own: its roles, its rank's document lengths (a list of its
        own) and its rows of ``plan.task_array``, in that order. Only :func:`plan_part` and
        :func:`plan_parts` call this.
        """
        part = object.__new__(cls)  # skips __post_init__: the plan's own checks already cover it
        # one update: at 1024 participants a batch cuts 1024 parts, and this is most of each
        part.__dict__.update(shared, participant=participant, rank=rank, server=server, doc_lens=doc_lens,
                             client_tasks=client_tasks, server_tasks=server_tasks)
        return part


def _shared_fields(plan: Plan, step: int, batch: int, plan_id: int) -> dict:
    """The fields of a :class:`PlanPart` that every participant's part of ``plan`` has alike."""
    return dict(step=step, batch=batch, mode=plan.mode, num_ranks=plan.num_ranks,
                num_servers=plan.num_servers, cost=plan.cost, plan_id=plan_id, window=plan.window,
                keep_activations=plan.keep_activations)


def _read_only(arr: np.ndarray) -> np.ndarray:
    """A read-only view: parts share rows with the plan, and a part must not change the plan."""
    view = arr.view()
    view.flags.writeable = False
    return view


def _check_cut_args(plan: Plan, step, batch) -> tuple[int, int]:
    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a Plan, got {type(plan).__name__}")
    return int_in_range("step", step, 0, _MAX), int_in_range("batch", batch, 0, _MAX)


def plan_identity(descriptor_bytes: bytes, step: int, batch: int) -> int:
    """The identity of a plan bound to ``(step, batch)``: the first 8 bytes of the BLAKE2b hash
    of ``step``, ``batch`` (int64) and the plan's descriptor (:meth:`Plan.to_msgpack`), as an
    unsigned 64-bit int (never 0, which means "none given"). The scheduler computes it once per
    batch and puts it in every part, so participants holding parts of different plans (another
    step's, or a forged one) find out before any byte moves."""
    h = hashlib.blake2b(descriptor.int_bin([step, batch]), digest_size=8)
    h.update(descriptor_bytes)
    return int.from_bytes(h.digest(), "little") or 1


def plan_part(plan: Plan, participant: int, step: int = 0, batch: int = 0, plan_id: int = 0) -> PlanPart:
    """Cut participant ``participant``'s part out of ``plan`` (a validated :class:`Plan`),
    carrying ``plan_id`` (see :func:`plan_identity`).

    To cut every part, :func:`plan_parts` is much faster (one pass instead of one per part).

    Raises:
        ValueError: ``participant`` outside ``[0, plan.num_participants)``, or a bad step/batch.
    """
    step, batch = _check_cut_args(plan, step, batch)
    plan_id = int_in_range("plan_id", plan_id, 0, PLAN_ID_MAX)
    participant = int_in_range("participant", participant, 0, plan.num_participants - 1)
    rank, server = participant_roles(plan.mode, plan.num_ranks, participant)
    arr = plan.task_array
    client = _read_only(arr[arr[:, 1] == rank]) if rank is not None else _NO_TASKS
    own = _read_only(arr[arr[:, 0] == server]) if server is not None else _NO_TASKS
    doc_lens = list(plan.doc_lens_per_rank[rank]) if rank is not None else []
    return PlanPart._cut(_shared_fields(plan, step, batch, plan_id), participant, rank, server, doc_lens,
                         client, own)


def plan_parts(plan: Plan, step: int = 0, batch: int = 0, plan_id: int = 0) -> list[PlanPart]:
    """Every participant's part of ``plan``, in participant order, cut in one pass.

    ``plan.task_array`` is already in server order (the plan's canonical order), so each server's
    rows are one slice; one stable sort by ``src_rank`` keeps that order inside each rank, so each
    client's rows are one slice too. Boundaries come from ``np.searchsorted``; no part is
    re-validated (the plan was). O(T log T + P) for T tasks and P participants.

    Every part carries ``plan_id`` (see :func:`plan_identity`).

    Raises:
        ValueError: a bad step, batch or plan id.
    """
    step, batch = _check_cut_args(plan, step, batch)
    plan_id = int_in_range("plan_id", plan_id, 0, PLAN_ID_MAX)
    arr = _read_only(plan.task_array)
    by_server = np.searchsorted(arr[:, 0], np.arange(plan.num_servers + 1)).tolist()
    by_rank_arr = _read_only(arr.take(np.argsort(arr[:, 1], kind="stable"), axis=0))  # take: 2x a fancy index
    by_rank = np.searchsorted(by_rank_arr[:, 1], np.arange(plan.num_ranks + 1)).tolist()
    shared, cut = _shared_fields(plan, step, batch, plan_id), PlanPart._cut
    lens, ranks = plan.doc_lens_per_rank, plan.num_ranks
    # Roles by mode (participant_roles' rule) in one loop each: at 1024 participants the per-part
    # Python is most of the cut, so nothing is computed per part that a mode fixes.
    clients = [by_rank_arr[a:b] for a, b in zip(by_rank, by_rank[1:])]
    servers = [arr[a:b] for a, b in zip(by_server, by_server[1:])]
    if plan.mode == "inplace":  # participant p: client rank p and server p
        return [cut(shared, p, p, p, list(lens[p]), c, s) for p, (c, s) in enumerate(zip(clients, servers))]
    return ([cut(shared, r, r, None, list(lens[r]), c, _NO_TASKS) for r, c in enumerate(clients)]
            + [cut(shared, ranks + s, None, s, [], _NO_TASKS, own) for s, own in enumerate(servers)])


__all__ = ["PLAN_ID_MAX", "PlanPart", "plan_identity", "plan_part", "plan_parts"]
