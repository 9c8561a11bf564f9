"""Membership of a job's scheduler: the part of :class:`~scheduler.coordinator.Coordinator` that
registers clients and dedicated servers, hands clients their tokens, records ping results and
bounds the steps members name.

Kept apart from :mod:`scheduler.coordinator` (which inherits :class:`MembershipMixin`) so the
state machine of one step reads on its own; pure like it: no Ray, no asyncio, no clock.
"""

from __future__ import annotations

import secrets

from .checks import is_int, positive_int

# Steps are ints below this (a job at 1000 steps a second takes 35 years to reach it): a step a
# member claims at registration above it is refused, so no report, abort or floor ever nears the
# int64 limits that torch and msgpack put on the step a round header carries.
MAX_STEP = 1 << 40
# A report, a client's failure or a check-in may name at most this many steps past the job's step
# (max(next_step, floor)): a client's own counter is never ahead of it, since every step it enters
# was resolved, failed or raised by its registration here. One step of slack, no more: a report far
# ahead would otherwise move the floor, and with it every client's counter, to its step.
STEPS_AHEAD = 1
SERVER_STATES = ("alive", "suspect", "dead")


class MembershipMixin:
    """Who is in the job: :class:`~scheduler.coordinator.Coordinator`'s registrations, tokens,
    server states and step checks. Works on the coordinator's state (``name``, ``world_size``,
    ``clients``, ``servers``, ``epoch``, ``members``, ``next_step``, ``floor``, the job's settings)
    and calls its ``_raise_floor`` and ``_forget_client``."""

    # ---- membership --------------------------------------------------------------------------
    def register_client(self, rank: int, world_size: int, info: dict) -> dict:
        """Client ``rank`` of ``world_size`` joins (or rejoins after a restart with a new
        ``info["incarnation"]``, which makes the next batch form a new epoch).

        A new incarnation (or a rank not registered now) is a new process: the reports the rank's
        old one left in open batches are dropped, and a batch already being planned with one fails
        its step (the coordinator's ``_forget_client``). The same incarnation again (a reconnect)
        keeps them.

        ``info`` may carry ``"step"`` (the step the client goes on with) and ``"epoch"`` (the last
        group epoch it was in): a client re-registering with a restarted scheduler rebuilds the
        job's step and epoch numbering this way.

        Returns:
            ``{"name", "mode", "timeout_s", "backend", "next_step", "keep_activations",
            "transport", "config"}``: the job's settings (``config``: all of them,
            :meth:`JobConfig.to_dict <scheduler.config.JobConfig.to_dict>`) and the step the
            client must start at.

        Raises:
            ValueError: rank out of range or a world size other than the job's.
        """
        positive_int("world_size", world_size)
        if self.world_size is None:
            self.world_size = int(world_size)
        elif world_size != self.world_size:
            raise ValueError(f"job {self.name!r} has {self.world_size} clients, not {world_size}")
        if not is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        self._check_claimed_step(info.get("step"), f"client rank {rank}")
        if self.clients.get(rank, {}).get("incarnation") != info.get("incarnation"):
            self._forget_client(int(rank))  # a replacement: its old process's reports are not its own
        self.clients[int(rank)] = dict(info, rank=int(rank))
        self._rebuild(info)
        return dict(self.settings(), next_step=max(self.next_step, self.floor))

    def settings(self) -> dict:
        """The job's settings, set once at launch, without registering anyone: ``{"name",
        "mode", "timeout_s", "backend", "keep_activations", "transport", "config"}`` (``config``:
        :meth:`JobConfig.to_dict <scheduler.config.JobConfig.to_dict>`). A client checks what it
        was given against them before it registers (a registration replaces the rank's earlier
        one, so a refused client must not register at all)."""
        return {"name": self.name, "mode": self.mode, "timeout_s": self.timeout_s,
                "backend": self.backend, "keep_activations": self.keep_activations,
                "transport": self.transport, "config": self.config.to_dict()}

    def _rebuild(self, info: dict) -> None:
        """Take a registering member's last step and epoch into account (after a scheduler
        restart the coordinator starts empty): steps before it are over, and epochs are numbered
        past it, so no member mistakes a new group for one it was in."""
        step, epoch = info.get("step"), info.get("epoch")
        if is_int(step) and step > self.floor:
            self._raise_floor(int(step))
        if is_int(epoch) and epoch > self.epoch:
            self.epoch, self.members = int(epoch), None

    @staticmethod
    def _check_claimed_step(step, who: str) -> None:
        """A registering member's last step: None, or an int in ``[0, MAX_STEP)``.

        Raises:
            ValueError: naming ``who`` and the step.
        """
        if step is not None and not (is_int(step) and 0 <= step < MAX_STEP):
            raise ValueError(f"{who} registered with step {step!r}; steps are ints in [0, {MAX_STEP})")

    def _check_step(self, step, what: str) -> None:
        """A step a client names in ``what`` (a report, a failure): an int from 0 to
        :data:`STEPS_AHEAD` past the job's step.

        Raises:
            ValueError: naming the step, the job's step and ``what``.
        """
        if not is_int(step) or step < 0:
            raise ValueError(f"{what}: step must be an int >= 0, got {step!r}")
        job_step = max(self.next_step, self.floor)
        if step > job_step + STEPS_AHEAD:
            raise ValueError(f"{what}: step {step} is ahead of job {self.name!r}, which is at step {job_step} "
                             f"(a client's step is never more than {STEPS_AHEAD} ahead of it)")

    def unregister_client(self, rank: int, incarnation: str) -> None:
        """Client ``rank`` leaves, unless a newer incarnation already took its place."""
        if self.clients.get(rank, {}).get("incarnation") == incarnation:
            del self.clients[rank]

    def issue_token(self, rank: int) -> str:
        """A new secret for registered client ``rank``, replacing its earlier one (the wrapper
        hands it out with each registration): :meth:`check_member` asks for it. Kept in the
        client's info, which :meth:`status` never shows.

        Raises:
            ValueError: ``rank`` is not a registered client.
        """
        if not is_int(rank) or rank not in self.clients:
            raise ValueError(f"rank {rank!r} is not registered with job {self.name!r}")
        token = self.clients[rank]["token"] = secrets.token_hex(16)
        return token

    def check_member(self, rank, token, call: str) -> None:
        """Refuse ``call`` (what changes the job, or reveals its documents) unless ``rank`` is a
        registered client and ``token`` the secret :meth:`issue_token` gave it last.

        Raises:
            ValueError: naming the rank and the call.
        """
        held = self.clients.get(rank, {}).get("token") if is_int(rank) else None
        given = token.encode("utf-8", "surrogatepass") if type(token) is str else None
        if held is None or given is None or not secrets.compare_digest(held.encode(), given):
            raise ValueError(f"job {self.name!r} refused {call} from rank {rank!r}: the caller is not that "
                             f"registered client (it needs the token rank {rank!r} got when it registered)")

    def register_server(self, index: int, info: dict) -> None:
        """Dedicated server ``index`` (re)starts, or re-registers with a restarted scheduler
        (``info["epoch"]``: its last group epoch); it joins the next group epoch.

        Raises:
            ValueError: ``index`` not an int >= 0.
        """
        if not is_int(index) or index < 0:
            raise ValueError(f"server index must be an int >= 0, got {index!r}")
        self.servers[int(index)] = dict(info, index=int(index), state="alive")
        self._rebuild({"epoch": info.get("epoch")})

    def servers_to_ping(self) -> dict[int, str]:
        """``{server id: state}`` of every server not known dead, ascending: the wrapper pings
        these ("suspect" ones briefly: they are left out until they answer)."""
        return {i: s["state"] for i, s in sorted(self.servers.items()) if s["state"] != "dead"}

    def servers_pinged(self, states: dict[int, str]) -> list[int]:
        """Record ping results, ``{server id: "alive" (answered and ready) | "suspect" (no answer
        in time, or not ready) | "dead" (its actor died)}``; returns the live ids, ascending.
        A suspect server is pinged again at the next plan; a dead one waits until it registers.

        Raises:
            ValueError: a state other than those three.
        """
        for sid, state in states.items():
            if state not in SERVER_STATES:
                raise ValueError(f"server {sid}: state must be one of {SERVER_STATES}, got {state!r}")
            if sid in self.servers:
                self.servers[sid]["state"] = state
        return sorted(sid for sid, state in states.items() if state == "alive" and sid in self.servers)
