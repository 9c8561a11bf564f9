"""The round header: a tiny all-to-all before each round so every participant knows, and checks,
which round comes next and that every pair of participants agrees on what moves between them.

Each participant sends every peer one row of :data:`HEADER_BYTES`: the round
``(step, batch, seq, kind, dtype, softmax_scale, plan_id, kept)`` (a client's; a dedicated server sends
zeros, it learns the round from the clients) and its *claims* about that peer: its participant
index, the bytes it will send the peer and expects from it in the round's dispatch and return
exchanges, and a digest of the CA-tasks between the two (the tasks it sends the peer's server, and
the ones its server runs for the peer's rank). Then:

- every participant checks that all clients agree on the round (a client running ahead or behind,
  or one with another dtype, fails the round everywhere instead of mixing rounds);
- every participant checks each peer's claims against its own part of the plan: the same plan id,
  the same byte counts in both directions, the same tasks. Both ends of a pair see both sides of
  it, so any pair that would move disagreeing sizes (which aborts the process inside gloo) or the
  same sizes with different meaning (a wrong answer) is refused by both before any byte moves.
  Participants that found nothing wrong see their exchange with the refusing ones fail.
"""

from __future__ import annotations

import hashlib
import struct
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from scheduler.cost import RoundKind
from scheduler.tasks import participant_roles

from .dtypes import DTYPE_CODES, DTYPES_BY_CODE, dtype_name
from .transport.base import all_to_all
from .transport.route import route_id

_ROUND = 8  # step, batch, seq, kind, dtype, scale bits, plan id, kept
_CLAIMS = 8  # participant, has claims, dispatch send/recv, return send/recv bytes, digest out/in
HEADER_BYTES = 8 * (_ROUND + _CLAIMS)
_U64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


@dataclass(frozen=True)
class RoundHeader:
    """``(step, batch, seq, kind, dtype, softmax_scale, plan_id, kept)`` of one round; ``seq``
    counts the rounds of the step on this client; ``plan_id`` is the id every part of the batch's
    plan carries (:func:`scheduler.parts.plan_identity`). ``kept`` (kept-activation plans): in a
    forward round, the key under which servers keep its rows until its backward round; in a
    backward round, the key of the forward round whose rows it uses; -1 for none."""

    step: int
    batch: int
    seq: int
    kind: RoundKind
    dtype: torch.dtype
    softmax_scale: float
    plan_id: int = 0
    kept: int = -1

    def values(self) -> list[int]:
        scale_bits = struct.unpack("<q", struct.pack("<d", self.softmax_scale))[0]
        return [self.step, self.batch, self.seq, self.kind.code, DTYPE_CODES[self.dtype], scale_bits,
                _signed(self.plan_id), self.kept]

    @classmethod
    def decode(cls, values) -> "RoundHeader":
        """From the first :data:`_ROUND` int64 values of a header row.

        Raises:
            ValueError: an unknown dtype or round kind code.
        """
        step, batch, seq, kind, dtype, bits, plan_id, kept = (int(x) for x in values[:_ROUND])
        if dtype not in DTYPES_BY_CODE:
            raise ValueError(f"malformed round header: dtype code {dtype}")
        try:
            round_kind = RoundKind.from_code(kind)
        except ValueError:
            raise ValueError(f"malformed round header: kind code {kind}") from None
        return cls(step, batch, seq, round_kind, DTYPES_BY_CODE[dtype],
                   struct.unpack("<d", struct.pack("<q", bits))[0], plan_id & _U64, max(kept, -1))

    @property
    def tag(self) -> int:
        """A 63-bit digest of :meth:`values`, never 0: what a round that skips the header exchange
        stamps into its exchanges' report rows, so that every pair still checks it runs the same
        round (:meth:`~distca_server.transport.routed.RoutedTransport.exchange`)."""
        return route_id(("round", *self.values()))  # the one int63 digest every process computes alike

    def describe(self, every_field: bool = False) -> str:
        """``step S batch B round N (kind, kept K, dtype)``; ``every_field``: with the softmax
        scale and the plan id too (rounds that differ only there)."""
        kept = f", kept {self.kept}" if self.kept >= 0 else ""
        more = f", softmax_scale {self.softmax_scale!r}, plan {self.plan_id}" if every_field else ""
        return (f"step {self.step} batch {self.batch} round {self.seq} ({self.kind.value}{kept}, "
                f"{dtype_name(self.dtype)}{more})")


# ---- claims: what a participant's part says moves between it and each peer ------------------------
_claims_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _digests(part) -> tuple[np.ndarray, np.ndarray]:
    """Per peer participant: a 63-bit digest of the CA-tasks this participant's client role sends
    the peer's server (``out``), and of those its server role runs for the peer's rank (``in``).
    Both ends list a pair's tasks in the same (wire) order, so equal tasks give equal digests."""
    P = part.num_participants
    cost = np.asarray(part.cost.to_wire(), dtype=np.int64).tobytes()

    def digest(rows: np.ndarray) -> int:
        h = hashlib.blake2b(cost, digest_size=8)
        h.update(np.ascontiguousarray(rows[:, 2:], dtype=np.int64).tobytes())
        return int.from_bytes(h.digest(), "little") >> 1

    empty = digest(np.zeros((0, 7), dtype=np.int64))
    out = np.full(P, empty, dtype=np.int64)
    into = np.full(P, empty, dtype=np.int64)
    ct, st = part.client_tasks, part.server_tasks
    if len(ct):
        bounds = np.searchsorted(ct[:, 0], np.arange(part.num_servers + 1))
        for s in np.flatnonzero(np.diff(bounds)).tolist():
            out[part.server_participant(s)] = digest(ct[bounds[s]:bounds[s + 1]])
    if len(st):
        bounds = np.searchsorted(st[:, 1], np.arange(part.num_ranks + 1))
        for r in np.flatnonzero(np.diff(bounds)).tolist():
            into[r] = digest(st[bounds[r]:bounds[r + 1]])  # rank r is participant r
    return out, into


def claims(participant, kind: RoundKind) -> np.ndarray:
    """int64 [P, :data:`_CLAIMS`]: what ``participant`` (a
    :class:`~distca_server.participant.Participant`) will move with each peer in a round of
    ``kind``: its own index, 1, bytes it sends and expects in the dispatch and in the return
    exchange (its :class:`~scheduler.comm_layout.CommLayout`), and the task digests
    (:func:`_digests`). Cached per participant and kind."""
    per = _claims_cache.setdefault(participant, {})
    found = per.get(kind)
    if found is not None:
        return found
    part = participant.part
    P = part.num_participants
    sent, expected, ret_sent, ret_expected = participant.layout(kind).peer_bytes()
    out, into = _digests(part)
    table = np.stack([np.full(P, part.participant), np.ones(P, dtype=np.int64),
                      sent, expected, ret_sent, ret_expected, out, into], axis=1)
    per[kind] = table.astype(np.int64)
    return per[kind]


# ---- the exchange ---------------------------------------------------------------------------------
def encode(header: RoundHeader | None, own_claims: np.ndarray | None, world_size: int,
           world_rank: int) -> torch.Tensor:
    """uint8 [world_size * HEADER_BYTES]: one header row per destination (a dedicated server,
    which knows neither the round nor its part yet, sends zeros and its own index)."""
    rows = np.zeros((world_size, _ROUND + _CLAIMS), dtype=np.int64)
    if header is not None:
        rows[:, :_ROUND] = header.values()
    if own_claims is not None:
        rows[:, _ROUND:] = own_claims
    else:
        rows[:, _ROUND] = world_rank
    return torch.from_numpy(rows.reshape(-1)).view(torch.uint8)


def exchange_header(transport, header: RoundHeader | None, own_claims: np.ndarray | None,
                    timeout_s: float | None = None) -> np.ndarray:
    """Send each peer its header row; returns int64 [P, _ROUND + _CLAIMS], row ``j`` from peer j.

    Raises:
        DistCAError: the exchange failed (from the transport).
    """
    P = transport.world_size
    send = encode(header, own_claims, P, transport.rank).to(transport.device)
    recv = all_to_all(transport, send, [HEADER_BYTES] * P, [HEADER_BYTES] * P, timeout_s=timeout_s)
    return recv.cpu().view(torch.int64).view(P, _ROUND + _CLAIMS).numpy().copy()


def common_header(rows: np.ndarray, num_clients: int) -> RoundHeader:
    """The round all clients' rows name.

    Raises:
        ValueError: clients disagree on the next round (every participant raises the same).
    """
    heads = rows[:num_clients, :_ROUND]
    if not (heads == heads[0]).all():
        def described(values, every_field: bool) -> str:
            try:
                return RoundHeader.decode(values).describe(every_field)
            except ValueError:
                return "malformed"
        seen = [described(values, False) for values in heads]
        if len(set(seen)) == 1:  # they differ in a field the short description leaves out
            seen = [described(values, True) for values in heads]
        raise ValueError("clients disagree on the next round: "
                         + "; ".join(f"rank {r}: {d}" for r, d in enumerate(seen)))
    return RoundHeader.decode(heads[0])


def _who(part, j: int) -> str:
    rank, server = participant_roles(part.mode, part.num_ranks, j)
    roles = ([f"rank {rank}"] if rank is not None else []) + ([f"server {server}"] if server is not None else [])
    return f"participant {j} ({' and '.join(roles)})"


def check_claims(common: RoundHeader, rows: np.ndarray, participant, world_rank: int) -> None:
    """Check that this participant's part belongs to the round the clients named and agrees with
    every peer's claims about the bytes and tasks between them.

    Raises:
        ValueError: naming the participants and the numbers that disagree.
    """
    part = participant.part
    what = common.describe()
    if (part.step, part.batch) != (common.step, common.batch) or part.plan_id != common.plan_id:
        raise ValueError(f"{what}: {_who(part, world_rank)} holds the part of step {part.step} batch "
                         f"{part.batch} of plan {part.plan_id:#018x}, the clients run plan "
                         f"{common.plan_id:#018x}")
    if part.participant != world_rank:
        raise ValueError(f"{what}: world rank {world_rank} holds the part of {_who(part, part.participant)}")
    if part.num_participants != len(rows):
        raise ValueError(f"{what}: the part is for {part.num_participants} participants, the group has {len(rows)}")
    mine = claims(participant, common.kind)
    theirs = rows[:, _ROUND:]
    # Vectorised over peers (a round at 1024 participants checks 1024 rows); the message names the
    # first disagreeing peer.
    peers = (theirs[:, 1] == 1) & (np.arange(len(rows)) != world_rank)  # peers that know their part
    checks = [
        (theirs[:, 0] != np.arange(len(rows)),
         lambda j: f"{what}: {_who(part, j)} holds the part of participant {theirs[j, 0]}"),
        (theirs[:, 2] != mine[:, 3],
         lambda j: f"{what}: {_who(part, world_rank)} expects {mine[j, 3]} bytes of the dispatch from "
                   f"{_who(part, j)}, which sends {theirs[j, 2]}"),
        (theirs[:, 4] != mine[:, 5],
         lambda j: f"{what}: {_who(part, world_rank)} expects {mine[j, 5]} bytes of the return from "
                   f"{_who(part, j)}, which sends {theirs[j, 4]}"),
        (mine[:, 2] != theirs[:, 3],
         lambda j: f"{what}: {_who(part, j)} expects {theirs[j, 3]} bytes of the dispatch from "
                   f"{_who(part, world_rank)}, which sends {mine[j, 2]}"),
        (mine[:, 4] != theirs[:, 5],
         lambda j: f"{what}: {_who(part, j)} expects {theirs[j, 5]} bytes of the return from "
                   f"{_who(part, world_rank)}, which sends {mine[j, 4]}"),
        ((theirs[:, 6] != mine[:, 7]) | (theirs[:, 7] != mine[:, 6]),
         lambda j: f"{what}: the CA-tasks between {_who(part, world_rank)} and {_who(part, j)} differ "
                   f"(the same sizes, other documents or shards)"),
    ]
    for bad, message in checks:
        bad = np.flatnonzero(bad & peers)
        if len(bad):
            raise ValueError(message(int(bad[0])))
