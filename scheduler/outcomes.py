"""What each transition of the scheduler's state machine (:class:`scheduler.coordinator.Coordinator`)
hands its wrapper: plain frozen data, and the batch's pure planning work (:func:`plan_and_cut`),
which the actor runs on a worker thread."""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import PlanConfig
from .parts import plan_identity, plan_parts
from .planner import plan_batch
from .tasks import Plan


@dataclass(frozen=True)
class ReportOutcome:
    """What :meth:`Coordinator.report` tells the wrapper.

    Attributes:
        answer: the reporting client's answer if it is known now (an error, or the part of a batch
            already planned), else None: wait until the batch is resolved, then :meth:`answer`.
        plan: True exactly once per batch, when the last client reported and the shapes agree:
            find the live servers and call :meth:`Coordinator.plan`.
        resolved: this call resolved the batch (an error for every client): wake its waiters.
    """

    answer: dict | None = None
    plan: bool = False
    resolved: bool = False


@dataclass(frozen=True)
class Assignment:
    """A dedicated server's place in a new group epoch (``AttentionServer.assign``'s arguments)."""

    server: int
    epoch: int
    world_rank: int
    world_size: int
    plan_index: int
    device_type: str


@dataclass(frozen=True)
class EpochDecision:
    """The group a batch runs in: ``epoch``, its dedicated ``servers`` in plan order, and the
    ``assignments`` to send (non-empty only when this decision formed a new epoch)."""

    epoch: int
    servers: tuple[int, ...]
    assignments: tuple[Assignment, ...] = ()


@dataclass
class PlanOutcome:
    """What :meth:`Coordinator.plan` tells the wrapper.

    Attributes:
        resolved: the batch got its answers now (parts or an error): wake its waiters.
        assignments: new-epoch assignments to send to dedicated servers, before their parts.
        server_parts: ``(server id, part bytes)`` to install on each dedicated server.
        record: the record of this plan (also :attr:`Coordinator.last`), or None if none was made.
    """

    resolved: bool = False
    assignments: tuple[Assignment, ...] = ()
    server_parts: list[tuple[int, bytes]] = field(default_factory=list)
    record: dict | None = None


@dataclass(frozen=True)
class PlanCut:
    """The pure work of :meth:`Coordinator.plan`: the batch's plan, its descriptor and every
    participant's part bytes (each carrying the plan's id), with the milliseconds planning and
    cutting took; or the ``ValueError`` message the documents raised (``plan`` None)."""

    plan: Plan | None
    parts: list[bytes]
    plan_ms: float = 0.0
    cut_ms: float = 0.0
    error: str | None = None
    descriptor: bytes = b""


def plan_and_cut(doc_lens_per_rank, num_servers: int, *, cost, config: PlanConfig, step: int, batch: int,
                 timer, window: int | None = None) -> PlanCut:
    """Plan batch ``(step, batch)`` with ``config`` (:func:`~scheduler.plan_batch`), encode the
    plan and cut every participant's part; ``timer`` (seconds) times the two. Bad documents or
    settings come back as :attr:`PlanCut.error` (the ``ValueError``'s message), not raised."""
    try:
        start = timer()
        plan = plan_batch(doc_lens_per_rank, num_servers, cost=cost, config=config, window=window)
        planned = timer()
        whole = plan.to_msgpack()
        parts = [p.to_msgpack() for p in plan_parts(plan, step, batch, plan_identity(whole, step, batch))]
        cut = timer()
    except ValueError as exc:  # bad documents: every client of the batch gets the same error
        return PlanCut(None, [], error=str(exc))
    return PlanCut(plan, parts, (planned - start) * 1e3, (cut - planned) * 1e3, descriptor=whole)


@dataclass(frozen=True)
class FailureOutcome:
    """What :meth:`Coordinator.failure` tells the wrapper: the ``verdict`` if it is decided, else
    None; then wait until ``deadline`` (on the caller's clock) or until another call decides it,
    and call :meth:`Coordinator.close_failure`. ``opened``: this call opened the epoch's
    arbitration: tell every member to check in (:meth:`Coordinator.arbitration`).

    A verdict is ``{"epoch", "lost": [descriptions], "lost_ranks": [world ranks], "slowest": str,
    "next_step", "cause": str, "detected": bool}``: ``slowest`` names, when nobody is lost, the
    client that joined the failed round late, else is ``""``; ``cause`` is what the members reported, a participant's own
    finding first; ``detected`` whether it is one (a ``ValueError`` a participant raised before
    moving bytes: parts that disagree, clients that disagree on the round, bad input) rather than
    what a collective reported (a timeout, a closed connection)."""

    verdict: dict | None
    deadline: float
    opened: bool = False


def lost_text(verdict: dict) -> str:
    """A verdict's lost members for a message: ``"a; b"``, or ``"none"``, with the client slowest
    to join the failed round when the verdict names one (see :class:`FailureOutcome`)."""
    if verdict["lost"]:
        return "; ".join(verdict["lost"])
    slowest = verdict.get("slowest")
    return f"none (slowest to join: {slowest})" if slowest else "none"
