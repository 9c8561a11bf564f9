"""``AttentionServer``: a dedicated attention server as a Ray actor.

A background thread serves rounds: it waits for the round header, finds the step's part (pushed by
the scheduler), runs the server's CA-tasks as one fused kernel call and sends the results back. It
keeps no state between rounds: backward receives Q, K, V, O, LSE and dO again. Method calls
(``ping``, ``assign``, ``install_part``, ``stats``) run on other threads of the actor, so the job can
be inspected while a round is in flight.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict

import ray
import torch

from scheduler.actor import NAMESPACE, scheduler_actor_name
from scheduler.parts import PlanPart

from .errors import DistCAError
from scheduler.cost import RoundKind

from .header import exchange_header
from .kernels import get_backend
from .participant import Participant
from .transport.torch_dist import join_group
from .wire import RowFormat

_PARTS_KEPT = 8


class AttentionServer:
    """Serves CA-tasks of job ``name`` as server ``index`` (plan index assigned per group epoch).

    Args:
        name: the job (its scheduler actor is ``distca-scheduler-<name>``).
        index: this server's id in the job.
        timeout_s: deadline of every exchange inside a round.
        idle_timeout_s: how long the server waits for the next round's header (the clients may be
            busy with everything but attention for a long time).
        backend: attention kernel backend ("auto" picks the fastest on the device).
    """

    def __init__(self, name: str, index: int, timeout_s: float = 60.0,
                 idle_timeout_s: float = 3600.0, backend: str = "auto"):
        self.name, self.index, self.timeout_s = name, index, timeout_s
        self.idle_timeout_s, self.backend_name = idle_timeout_s, backend
        self.scheduler = ray.get_actor(scheduler_actor_name(name), namespace=NAMESPACE)
        self.node = ray.util.get_node_ip_address()
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        self._cond = threading.Condition()
        self._assignment: tuple | None = None
        self._parts: OrderedDict = OrderedDict()
        self._stop = False
        self.state = "waiting"
        self.rounds_served = 0
        self.phase_seconds: dict[str, float] = {}  # pack / all_to_all / kernel / unpack, all rounds
        self.last_error = ""
        self._rounds_metric = ray.util.metrics.Counter(
            "distca_rounds_served", "rounds an attention server has served", ("job", "server"))
        handle = ray.get_runtime_context().current_actor
        ray.get(self.scheduler.register_server.remote(
            index, handle, {"node": self.node, "pid": os.getpid(), "incarnation": self.incarnation}))
        self._thread = threading.Thread(target=self._serve, name=f"distca-server-{index}", daemon=True)
        self._thread.start()

    # ---- called by the scheduler and by tools ---------------------------------------------------
    def ping(self) -> bool:
        return not self._stop

    def assign(self, epoch: int, world_rank: int, world_size: int, plan_index: int, device_type: str) -> None:
        """Join group ``epoch`` as ``world_rank`` (plan server ``plan_index``) at the next round."""
        with self._cond:
            if self._assignment is None or epoch > self._assignment[0]:
                self._assignment = (epoch, world_rank, world_size, plan_index, device_type)
                self._cond.notify_all()

    def install_part(self, step: int, batch: int, data: bytes) -> None:
        """Accept this server's descriptor of ``(step, batch)``.

        Raises:
            ValueError: malformed bytes or a part that is not a server's; the server keeps serving.
        """
        part = PlanPart.from_msgpack(data)
        if part.server is None or (part.step, part.batch) != (step, batch):
            raise ValueError(f"descriptor is for step {part.step} batch {part.batch} server "
                             f"{part.server}, not a server part of step {step} batch {batch}")
        with self._cond:
            self._parts[(step, batch)] = part
            while len(self._parts) > _PARTS_KEPT:
                self._parts.popitem(last=False)
            self._cond.notify_all()

    def stats(self) -> dict:
        return {"index": self.index, "node": self.node, "state": self.state,
                "node_id": ray.get_runtime_context().get_node_id(),
                "rounds_served": self.rounds_served, "last_error": self.last_error,
                "phase_seconds": dict(self.phase_seconds),
                "assignment": self._assignment}

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    # ---- the serving loop -------------------------------------------------------------------------
    def _wait(self, predicate, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._stop:
                value = predicate()
                if value is not None:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 1.0))
        return None

    def _newer_assignment(self, joined_epoch):
        a = self._assignment
        return a if a is not None and a[0] != joined_epoch else None

    def _serve(self) -> None:
        transport, epoch, num_clients = None, None, 0
        participants: OrderedDict = OrderedDict()
        while not self._stop:
            pending = self._newer_assignment(epoch)
            if transport is None and pending is None:
                pending = self._wait(lambda: self._newer_assignment(epoch), timeout_s=1.0)
                if pending is None:
                    continue
            if pending is not None:  # a new group epoch: leave the old group, join the new one
                if transport is not None:
                    transport.close()
                    transport = None
                epoch, world_rank, world_size, plan_index, device_type = pending
                num_clients = world_rank - plan_index  # world ranks: clients first, then servers
                device = torch.device("cuda" if device_type == "cuda" else "cpu")
                self.state = f"joining epoch {epoch}"
                participants.clear()
                try:
                    transport = join_group(
                        epoch=epoch, rank=world_rank, world_size=world_size, host=self.node,
                        timeout_s=self.timeout_s, device=device,
                        publish=lambda h, p, e=epoch: self._publish(e, h, p),
                        lookup=lambda e=epoch: self._lookup(e))
                except DistCAError as exc:
                    self._fail(epoch, world_rank, -1, str(exc))
                    continue
            self.state = "serving"
            step = -1
            try:
                header = exchange_header(transport, None, num_clients, timeout_s=self.idle_timeout_s)
                step = header.step
                key = (header.step, header.batch, header.dtype)
                participant = participants.get(key)
                if participant is None:
                    participant = self._participant(header, transport.device)
                    participants[key] = participant
                    while len(participants) > _PARTS_KEPT:
                        participants.popitem(last=False)
                before = dict(participant.timings)
                if header.kind == RoundKind.FORWARD:
                    participant.forward(transport, None, None, None, header.softmax_scale)
                elif header.kind == RoundKind.BACKWARD:
                    participant.backward(transport, None, None, None, None, None, None,
                                         header.softmax_scale)
                self.rounds_served += 1
                for phase, seconds in participant.timings.items():
                    self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds - before.get(phase, 0.0)
                self._rounds_metric.inc(tags={"job": self.name, "server": str(self.index)})
            except (DistCAError, ValueError, RuntimeError) as exc:
                rank = transport.rank
                transport.close()
                transport = None
                self._fail(epoch, rank, step, str(exc))

    def _participant(self, header, device) -> Participant:
        part = self._wait(lambda: self._parts.get((header.step, header.batch)), self.timeout_s)
        if part is None:
            raise DistCAError(f"server {self.index}: no descriptor for step {header.step} "
                              f"batch {header.batch} within {self.timeout_s:g} s")
        fmt = RowFormat(part.cost, header.dtype)
        return Participant(part, fmt, get_backend(self.backend_name, device), device)

    def _publish(self, epoch: int, host: str, port: int) -> None:
        ray.get(self.scheduler.publish_store.remote(epoch, host, port), timeout=self.timeout_s)

    def _lookup(self, epoch: int) -> tuple[str, int]:
        addr = ray.get(self.scheduler.store_address.remote(epoch), timeout=self.timeout_s + 5)
        if addr is None:
            raise DistCAError(f"no rendezvous address for group epoch {epoch}")
        return tuple(addr)

    def _fail(self, epoch, world_rank, step, detail: str) -> None:
        self.state = "recovering"
        self.last_error = detail[:500]
        try:
            ray.get(self.scheduler.report_failure.remote(epoch, world_rank, step, detail),
                    timeout=self.timeout_s)
        except Exception:  # the scheduler itself may be gone; keep waiting for an assignment
            pass
        self.state = "waiting"


AttentionServerActor = ray.remote(AttentionServer)
