"""Group epochs and their failures, for a job's scheduler: the part of
:class:`~scheduler.coordinator.Coordinator` that keeps or forms each batch's group, relays each
epoch's bootstrap value, refuses what the job's transport cannot carry, and arbitrates a failed
epoch into one verdict (:class:`~scheduler.arbitration.Arbitration`).

Kept apart from :mod:`scheduler.coordinator` (which inherits :class:`GroupEpochsMixin`) so the
state machine of one step reads on its own; pure like it: no Ray, no asyncio, no clock.
"""

from __future__ import annotations

import msgpack

from .arbitration import Arbitration, Member
from .checks import is_int
from .messages import error_answer
from .outcomes import Assignment, EpochDecision, FailureOutcome

KEEP_EPOCHS = 2  # bootstrap values and failure verdicts of older epochs are forgotten
# The device types each transport of scheduler.checks.TRANSPORTS moves (groups.py forms them):
# torch.distributed (gloo on CPU, NCCL on GPU), the one-sided exchange over shared memory between
# the processes of one host (CPU tensors), or over NVSHMEM symmetric GPU memory.
TRANSPORT_DEVICES = {"torch_dist": ("cpu", "cuda"), "shm": ("cpu",), "nvshmem": ("cuda",)}
# A bootstrap value is plain msgpack data, at most this many bytes packed (a TCPStore address, a
# heap handle and an NVSHMEM unique id take ~20-200): members hand it to each other through the
# scheduler, which must not hold whatever a buggy or hostile member publishes.
MAX_BOOTSTRAP_BYTES = 4096


class GroupEpochsMixin:
    """The groups batches run in and the verdicts of failed ones:
    :class:`~scheduler.coordinator.Coordinator`'s epochs, bootstrap values and failure
    arbitrations. Works on the coordinator's state (``name``, ``mode``, ``transport``,
    ``world_size``, ``clients``, ``servers``, ``epoch``, ``members``, ``epoch_servers``,
    ``groups``, ``bootstraps``, ``failures``, ``next_step``, ``floor``, ``failure_grace_s``) and
    calls its ``_check_step`` and ``_fail_step``."""

    # ---- group epochs ------------------------------------------------------------------------
    def epoch_for(self, live_servers, device_type: str) -> EpochDecision:
        """The group for the next batch: the current epoch if nobody joined, left or restarted
        and the device type is the same, else a new epoch.

        Args:
            live_servers: dedicated server ids that answered, in plan order (ignored in-place).
            device_type: ``"cpu"`` or ``"cuda"`` (the transport's backend follows it).
        """
        servers = tuple(live_servers) if self.mode == "dedicated" else ()
        W = self.world_size or 0
        members = self._members(servers, device_type)
        if members == self.members:
            return EpochDecision(self.epoch, self.epoch_servers)
        self.epoch += 1
        self.members, self.epoch_servers = members, servers
        self.groups[self.epoch] = self._describe(servers)
        for table in (self.bootstraps, self.failures, self.groups):
            for old in [e for e in table if e < self.epoch - KEEP_EPOCHS]:
                del table[old]
        world = W + len(servers)
        return EpochDecision(self.epoch, servers, tuple(
            Assignment(sid, self.epoch, W + i, world, i, device_type) for i, sid in enumerate(servers)))

    def _members(self, servers: tuple, device_type: str) -> tuple:
        """Who a group of ``servers`` (dedicated ids in plan order, ``()`` in-place) would be made
        of: every client's and server's incarnation, and the device type."""
        clients = tuple(self.clients.get(r, {}).get("incarnation") for r in range(self.world_size or 0))
        return (clients, tuple((sid, self.servers.get(sid, {}).get("incarnation")) for sid in servers),
                device_type)

    def servers_for(self, step: int, live_servers) -> list[int]:
        """The dedicated servers to plan the next batch of ``step`` over: the live ones
        (``live_servers``, ascending), except while ``step`` has batches planned in the current
        epoch and every server of that epoch still answers: then that epoch's servers. A server
        that registered in between (a new or restarted one) joins at the next step, because
        every round of a step must run in the group its first batch was planned in (its
        backward rounds too). A server of the epoch that no longer answers leaves the live list
        as it is, and :meth:`step_group_change` fails the step."""
        live = list(live_servers or ())
        if self.mode != "dedicated" or self.step_epochs.get(step) != self.epoch:
            return live
        kept = set(live)
        return list(self.epoch_servers) if all(sid in kept for sid in self.epoch_servers) else live

    def step_group_change(self, step: int, servers, device_type: str) -> str | None:
        """Why a batch of ``step`` over ``servers`` (see :meth:`servers_for`) cannot run in the
        group the step's earlier batches were planned in, or None when it can (or it is the
        step's first batch): whose membership changed since (a client that registered again, a
        server lost, restarted or new) or the device type."""
        bound = self.step_epochs.get(step)
        servers = tuple(servers) if self.mode == "dedicated" else ()
        if bound is None or (bound == self.epoch and self._members(servers, device_type) == self.members):
            return None
        if bound != self.epoch or self.members is None:
            return f"the job's group changed since (group epoch {bound}, now {self.epoch})"
        (old_clients, old_servers, old_device), (new_clients, new_servers, _) = (
            self.members, self._members(servers, device_type))
        why = [f"client rank {r} {'left' if b is None else 'registered again'}"
               for r, (a, b) in enumerate(zip(old_clients, new_clients)) if a != b]
        now = dict(new_servers)
        for sid, incarnation in old_servers:
            if sid not in now:
                why.append(f"attention server {sid} no longer answers")
            elif now[sid] != incarnation:
                why.append(f"attention server {sid} restarted")
        why += [f"attention server {sid} joined" for sid in sorted(set(now) - dict(old_servers).keys())]
        if device_type != old_device:
            why.append(f"the batch is on {device_type}, the step's earlier batches on {old_device}")
        return "; ".join(why) or "its group changed"

    def publish_bootstrap(self, epoch: int, value) -> None:
        """World rank 0 of group ``epoch`` publishes what the others need to join it (opaque here:
        see :mod:`scheduler.coordinator`'s doc). Kept as its msgpack round trip (lists for
        tuples), so every member looks up plain data.

        Raises:
            ValueError: ``epoch`` not an int >= 0, ``value`` None, not msgpack data, or more than
                :data:`MAX_BOOTSTRAP_BYTES` packed.
        """
        if not is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        if value is None:
            raise ValueError(f"group epoch {epoch}: the bootstrap value must not be None")
        try:
            packed = msgpack.packb(value, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"group epoch {epoch}: the bootstrap value must be msgpack data, got "
                             f"{type(value).__name__} ({exc})") from None
        if len(packed) > MAX_BOOTSTRAP_BYTES:
            raise ValueError(f"group epoch {epoch}: the bootstrap value takes {len(packed)} bytes packed, "
                             f"more than {MAX_BOOTSTRAP_BYTES}")
        self.bootstraps[int(epoch)] = msgpack.unpackb(packed, raw=False)

    def bootstrap(self, epoch: int):
        """Group ``epoch``'s bootstrap value, or None while none was published (or once the
        epoch is forgotten)."""
        return self.bootstraps.get(epoch)

    def _transport_error(self, device_type: str, servers) -> dict | None:
        """The error answer of a batch the job's transport cannot carry: a device type it does
        not move, or (``shm``) members on several nodes; None if it can."""
        if device_type not in TRANSPORT_DEVICES[self.transport]:
            return error_answer("ValueError", f"job {self.name!r} runs transport {self.transport!r}, which "
                                              f"moves {' or '.join(TRANSPORT_DEVICES[self.transport])} "
                                              f"tensors, not {device_type}")
        if self.transport != "shm":
            return None
        nodes: dict[str, list[str]] = {}
        for r in range(self.world_size or 0):
            nodes.setdefault(str(self.clients.get(r, {}).get("node", "?")), []).append(f"client rank {r}")
        for sid in servers if self.mode == "dedicated" else ():
            nodes.setdefault(str(self.servers.get(sid, {}).get("node", "?")), []).append(f"attention server {sid}")
        if len(nodes) <= 1:
            return None
        where = "; ".join(f"node {n}: {', '.join(who)}" for n, who in sorted(nodes.items()))
        return error_answer("DistCAError", f"job {self.name!r} runs transport 'shm', which needs every "
                                           f"member of a group on one node, but they are on {len(nodes)} "
                                           f"nodes ({where})")

    # ---- failures ----------------------------------------------------------------------------
    def failure(self, epoch: int, world_rank: int, step: int, now: float, reached: int = 0,
                cause: str | None = None, detected: bool = False, in_round: bool = True,
                waited_s: float | None = None) -> FailureOutcome:
        """World rank ``world_rank`` of group ``epoch`` checks in to a failure of the epoch.

        A member checks in when a round failed for it (``cause``: what went wrong; ``detected``:
        it found the problem itself, e.g. a part that does not match its peers', rather than seeing
        a collective fail) or, alive and told that the epoch's arbitration opened, with
        ``cause=None``. ``reached`` is how many rounds of the epoch it
        reached (completed, plus the one it is in or waiting for); ``in_round`` whether it is in
        one (a server waiting for the next round's header is); ``waited_s`` how long it had been
        in it, seconds (None: not in one, or not known); ``step`` the step it was in (-1 if it does
        not know, e.g. a server).

        The first check-in opens the epoch's arbitration (deadline ``now + failure_grace_s``;
        ``opened``). The verdict is decided in the call where the last member checks in, or by
        :meth:`close_failure` at the deadline; who is lost and which cause everyone reads is
        :class:`~scheduler.arbitration.Arbitration`'s rule (the silent, and the late). An epoch
        that is not current and has no arbitration (already over) is answered at once, naming
        nobody. Every verdict ends its epoch (the next batch forms a new group), ends the step
        (the job goes on at the step after), and leaves lost servers out of plans until they
        answer a ping again.

        Raises:
            ValueError: ``step`` out of bounds, or ``waited_s`` negative or not finite.
        """
        if waited_s is not None and not (isinstance(waited_s, (int, float)) and 0 <= waited_s < float("inf")):
            raise ValueError(f"world rank {world_rank}'s failure of group epoch {epoch}: waited_s must be a "
                             f"finite number of seconds >= 0, got {waited_s!r}")
        if step != -1:  # a server does not know the step; a client's is bounded like its reports
            self._check_step(step, f"world rank {world_rank}'s failure of group epoch {epoch}")
        fail = self.failures.get(epoch)
        opened = False
        if fail is None:
            if epoch != self.epoch or epoch not in self.groups or self.members is None:
                return FailureOutcome({"epoch": epoch, "lost": [], "lost_ranks": [], "slowest": "",
                                       "next_step": max(self.next_step, self.floor, step + 1),
                                       "cause": f"group epoch {epoch} is over", "detected": False},
                                      now)
            fail = self.failures[epoch] = Arbitration(epoch, self.groups[epoch], now + self.failure_grace_s,
                                                      self.failure_grace_s)
            opened = True
        if fail.verdict is None:
            fail.check_in(world_rank, step, reached, in_round, cause, detected, now, waited_s)
            if fail.complete:
                self._decide(fail)
        return FailureOutcome(fail.verdict, fail.deadline, opened)

    def close_failure(self, epoch: int, now: float) -> dict | None:
        """The verdict of group ``epoch``'s failure: decided now if the grace period is over
        (``now >= deadline``), else None (still waiting). An epoch without arbitration names
        nobody."""
        fail = self.failures.get(epoch)
        if fail is None:
            return {"epoch": epoch, "lost": [], "lost_ranks": [], "slowest": "", "next_step": max(self.next_step, self.floor),
                    "cause": f"group epoch {epoch} is over", "detected": False}
        if fail.verdict is None and now >= fail.deadline:
            self._decide(fail)
        return fail.verdict

    def arbitration(self, epoch: int) -> str | None:
        """``"open"`` while group ``epoch``'s failure is being arbitrated (members must check in),
        ``"decided"`` once its verdict is out, None if the epoch has not failed."""
        fail = self.failures.get(epoch)
        return None if fail is None else ("open" if fail.verdict is None else "decided")

    def _decide(self, fail: Arbitration) -> None:
        """Decide ``fail``'s verdict and act on it: lost servers out of plans until they answer a
        ping, a fresh group for the next batch, the step failed for every later report."""
        lost = fail.lost()
        for r, _ in lost:
            server = self.servers.get(fail.members[r].server)
            if server is not None and server["state"] == "alive":
                server["state"] = "suspect"
        if fail.epoch == self.epoch:
            self.members = None  # whatever happened, the next batch forms a fresh group
        cause, detected = fail.cause()
        if fail.step >= 0:
            self._fail_step(fail.step, error_answer("DistCAError", f"step {fail.step} failed in group "
                                                                    f"epoch {fail.epoch}: {cause}"[:500]))
        fail.verdict = {"epoch": fail.epoch, "lost": [why for _, why in lost], "lost_ranks": [r for r, _ in lost],
                        "slowest": "" if lost else fail.slowest(),
                        "next_step": max(self.next_step, self.floor), "cause": cause, "detected": detected}

    def _describe(self, servers) -> dict[int, Member]:
        """World rank -> member of a group of the clients and ``servers`` (in plan order)."""
        W = self.world_size or 0
        out = {r: Member(f"client rank {r} (node {self.clients.get(r, {}).get('node', '?')})", True, None)
               for r in range(W)}
        for plan_index, sid in enumerate(servers):
            out[W + plan_index] = Member(
                f"attention server {sid} (node {self.servers.get(sid, {}).get('node', '?')})", False, sid)
        return out
