"""Arbitration of a failed group epoch: who was lost, and why the round failed. Pure Python.

When a round fails anywhere in a group epoch, its members *check in* with the scheduler: the one
that saw the failure with its cause, the others (told through their long-poll) with how far they
got. Each check-in says how many rounds of the epoch the member reached (completed, plus the one
it is in or waiting for) and whether it is in a round now. The verdict is decided as soon as every
member checked in, or when the grace period ends:

- a member that never checked in is lost: it is dead, paused or cut off ("did not answer");
- a member that checked in from outside any round, having reached fewer rounds than the furthest
  client, is lost too: its peers waited for it in a round it never started ("late");
- every other member is alive and was where it should be, whatever it reported.

When nobody is lost (every client was in the round that timed out), the verdict still names the
client slowest to join it, if it joined at least half the first one's wait after it: a round that
times out with everyone present was one its last arrival reached too late to finish. Members say
how long they had been in their round when they checked in; the scheduler turns that into a join
time on its own clock, so no clocks need agree. A member's own finding, or a client of that
round with no join time, names nobody (:meth:`Arbitration.slowest`).

The verdict's cause is what the members reported, a member's own finding first (a ``ValueError``
it raised before moving bytes, e.g. parts that disagree) ahead of what a collective said (a
timeout, a closed connection), so every participant raises the same message.
"""

from __future__ import annotations

from typing import NamedTuple


class Member(NamedTuple):
    """A member of a group epoch, as verdicts name it."""

    who: str  # e.g. "client rank 1 (node 10.0.0.2)"
    client: bool
    server: int | None  # the dedicated server id, None for a client


class Arbitration:
    """The arbitration of one failed epoch.

    Args:
        epoch: the group epoch.
        members: world rank -> :class:`Member`, everyone of the epoch.
        deadline: when the silent members are named lost (on the caller's clock).
        grace_s: the grace period (for messages).
    """

    __slots__ = ("epoch", "members", "deadline", "grace_s", "reached", "waiting", "joined", "step", "causes",
                 "verdict")

    def __init__(self, epoch: int, members: dict[int, Member], deadline: float, grace_s: float):
        self.epoch, self.members, self.deadline, self.grace_s = epoch, members, deadline, grace_s
        self.reached: dict[int, int] = {}  # world rank -> rounds of the epoch it reached
        self.waiting: set[int] = set()  # world ranks that checked in from inside a round
        # world rank -> (round reached, when it joined that round, when it checked in), caller's clock
        self.joined: dict[int, tuple[int, float, float]] = {}
        self.step = -1  # the latest step a member reported failing in
        self.causes: list[tuple[str, bool]] = []  # (message, the member's own finding), in arrival order
        self.verdict: dict | None = None  # set by the coordinator once decided

    def check_in(self, world_rank: int, step: int, reached: int, in_round: bool, cause: str | None,
                 detected: bool, now: float | None = None, waited_s: float | None = None) -> None:
        """Record a member's check-in (repeated ones merge: the most rounds, in a round if any
        check-in was); ``waited_s``: how long it had been in its round (None if in none), at
        ``now``. A world rank outside the epoch only adds its cause."""
        if world_rank in self.members:
            self.reached[world_rank] = max(self.reached.get(world_rank, 0), int(reached))
            if in_round:
                self.waiting.add(world_rank)
                if waited_s is not None and now is not None:
                    seen = self.joined.get(world_rank)
                    if seen is None or int(reached) > seen[0]:  # the round it waits in now
                        self.joined[world_rank] = (int(reached), now - float(waited_s), now)
        self.step = max(self.step, int(step))
        if cause:
            self.causes.append((str(cause), bool(detected)))

    @property
    def complete(self) -> bool:
        """Every member checked in."""
        return set(self.reached) >= set(self.members)

    def lost(self) -> list[tuple[int, str]]:
        """``(world rank, "<who>: <why>")`` of every lost member, by world rank."""
        furthest = max((n for r, n in self.reached.items() if self.members[r].client), default=0)
        out = []
        for r, member in sorted(self.members.items()):
            if r not in self.reached:
                out.append((r, f"{member.who}: did not answer within {self.grace_s:g} s"))
            elif r not in self.waiting and self.reached[r] < furthest:
                out.append((r, f"{member.who}: late, had not started the round its peers waited for"))
        return out

    def slowest(self) -> str:
        """``"<who>: joined round N of the epoch X s after the first client"``, naming the client
        that joined the furthest round last, if that was at least half the first one's wait at
        its check-in after it; else ``""``. Only clients count: a dedicated server waits for the
        next round from the moment its last one ended.

        Nobody is named when a member found the cause itself (its own failure, e.g. parts that
        disagree, is the reason, not a late arrival), or when a client that reached the furthest
        round gave no join time in it (it failed outside the round: the last known join is not
        the last one)."""
        if self.cause()[1]:
            return ""
        furthest = max((n for r, n in self.reached.items() if self.members[r].client), default=0)
        at_furthest = [r for r, n in self.reached.items() if self.members[r].client and n == furthest]
        if any(self.joined.get(r, (None,))[0] != furthest for r in at_furthest):
            return ""
        rows = sorted((self.joined[r][1], r, self.joined[r][2]) for r in at_furthest)
        if len(rows) < 2:
            return ""
        (first, _, first_checked), (last, r, _) = rows[0], rows[-1]
        if last - first < 0.5 * (first_checked - first):
            return ""
        return f"{self.members[r].who}: joined round {furthest} of the epoch {last - first:.2f} s after the first client"

    def cause(self) -> tuple[str, bool]:
        """The cause every member reads: the first finding of a member's own, else the first
        thing reported; and whether it is a finding."""
        own = [c for c, found in self.causes if found]
        return (own or [c for c, _ in self.causes] or [""])[0], bool(own)


__all__ = ["Arbitration", "Member"]
