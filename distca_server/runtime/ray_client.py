"""``DistCAClient.connect``: a client of a distca job running on Ray.

Per step the client reports its batch to the scheduler actor once and gets its part of the plan;
then every layer's forward round and, later, backward round runs over the job's all-to-all group.
A step ends when as many backward rounds as grad-requiring forward rounds have run (or at
``new_step()``); within a step, each distinct batch (ping-pong nano-batches) gets its own plan.
All rounds of a client run in order on one worker thread, so ``attend_async`` rounds keep the same
order on every client.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import ray
import torch

from distca_server.errors import DistCAError
from distca_server.header import RoundHeader, exchange_header
from distca_server.kernels import get_backend
from distca_server.participant import Participant
from distca_server.transport.torch_dist import join_group
from distca_server.wire import RowFormat
from scheduler.actor import NAMESPACE, scheduler_actor_name
from scheduler.cost import RoundKind
from scheduler.parts import PlanPart


def _ray_rank_and_size(rank, world_size):
    if rank is not None and world_size is not None:
        return rank, world_size
    try:  # inside a Ray Train worker
        from ray import train
        ctx = train.get_context()
        r, w = ctx.get_world_rank(), ctx.get_world_size()
        return (rank if rank is not None else r), (world_size if world_size is not None else w)
    except Exception:  # not in a Ray Train session: fall back to the torchrun-style environment
        pass
    env_rank, env_size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if env_rank is not None and env_size is not None:
        return (rank if rank is not None else int(env_rank)), (world_size if world_size is not None else int(env_size))
    raise ValueError("connect() needs rank and world_size (pass them, run inside Ray Train, "
                     "or set RANK and WORLD_SIZE)")


class RemoteBatch:
    """One batch of one step bound to the job's group; the ``step`` object of the autograd function."""

    def __init__(self, runtime: "RemoteRuntime", participant: Participant, step: int, batch: int):
        self.runtime, self.participant, self.step, self.batch = runtime, participant, step, batch
        self.part = participant.part

    def forward_async(self, q, k, v, softmax_scale, counts_for_step):
        return self.runtime.submit(self, RoundKind.FORWARD, (q, k, v), softmax_scale, q.dtype, counts_for_step)

    def backward(self, q, k, v, out, lse, dout, softmax_scale):
        return self.runtime.round(self, RoundKind.BACKWARD, (q, k, v, out, lse, dout), softmax_scale, q.dtype)


class RemoteRuntime:
    """The client side of a job: scheduler round trips, the group, ordered rounds."""

    def __init__(self, name: str, rank: int | None, world_size: int | None, timeout_s: float | None):
        if not ray.is_initialized():
            raise DistCAError("DistCAClient.connect needs Ray: call it from a Ray task or actor, "
                              "or ray.init() first")
        self.rank, self.world_size = _ray_rank_and_size(rank, world_size)
        try:
            self.scheduler = ray.get_actor(scheduler_actor_name(name), namespace=NAMESPACE)
        except ValueError:
            raise ValueError(f"no distca job named {name!r}; start one with `distca up --name {name}` "
                             f"or distca_server.launch(name={name!r})") from None
        self.name = name
        self.node = ray.util.get_node_ip_address()
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        cfg = self._get(self.scheduler.register_client.remote(
            self.rank, self.world_size,
            {"node": self.node, "pid": os.getpid(), "incarnation": self.incarnation}), timeout_s or 60.0)
        self.mode, self.backend = cfg["mode"], cfg["backend"]
        self.timeout_s = float(timeout_s if timeout_s is not None else cfg["timeout_s"])
        self.step = cfg["next_step"]
        self._batches: OrderedDict = OrderedDict()
        self._forward_rounds = self._backward_rounds = self._seq = 0
        self._transport, self._epoch = None, None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"distca-client-{self.rank}")
        self._lock = threading.RLock()
        self.closed = False

    @staticmethod
    def _get(ref, timeout_s: float):
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise DistCAError(f"the distca scheduler did not answer within {timeout_s:g} s") from None
        except ray.exceptions.RayActorError as exc:
            raise DistCAError(f"the distca scheduler is gone: {exc}") from None

    # ---- steps and batches -----------------------------------------------------------------------
    def new_step(self) -> None:
        with self._lock:
            if self._batches:
                self._advance(self.step + 1)

    def _advance(self, step: int) -> None:
        self.step = step
        self._batches.clear()
        self._forward_rounds = self._backward_rounds = self._seq = 0

    def step_for(self, doc_lens: list[int], fmt: RowFormat, device: torch.device) -> RemoteBatch:
        """The batch object for ``doc_lens`` in the current step, asking the scheduler on first sight."""
        if self.closed:
            raise DistCAError("this DistCAClient is closed")
        with self._lock:
            if self._forward_rounds and self._backward_rounds >= self._forward_rounds:
                self._advance(self.step + 1)
            key = (tuple(doc_lens), fmt, str(device))
            found = self._batches.get(key)
            if found is not None:
                return found
            batch = len(self._batches)
            shape = {"num_heads_q": fmt.num_heads_q, "num_heads_kv": fmt.num_heads_kv,
                     "head_dim": fmt.head_dim, "dtype_bytes": fmt.dtype.itemsize,
                     "device_type": torch.device(device).type}
            answer = self._get(self.scheduler.report.remote(self.step, batch, self.rank, list(doc_lens), shape),
                               self.timeout_s + 10)
            if "error" in answer:  # every client of the batch gets it: all move on together
                self._advance(self.step + 1)
                if answer["error"] == "ValueError":
                    raise ValueError(answer["message"])
                raise DistCAError(answer["message"])
            part = PlanPart.from_msgpack(answer["part"])
            self._ensure_group(answer["group"], device)
            participant = Participant(part, fmt, get_backend(self.backend, device), device)
            found = RemoteBatch(self, participant, self.step, batch)
            self._batches[key] = found
            return found

    def _ensure_group(self, group: dict, device) -> None:
        epoch = group["epoch"]
        if self._transport is not None and self._epoch == epoch:
            return
        self._drop_group()
        scheduler, timeout = self.scheduler, self.timeout_s

        def publish(host, port):
            self._get(scheduler.publish_store.remote(epoch, host, port), timeout)

        def lookup():
            addr = self._get(scheduler.store_address.remote(epoch), timeout + 5)
            if addr is None:
                raise DistCAError(f"no rendezvous address for group epoch {epoch} within {timeout:g} s")
            return tuple(addr)
        try:
            self._transport = join_group(epoch=epoch, rank=group["world_rank"], world_size=group["world_size"],
                                         host=self.node, timeout_s=timeout, device=torch.device(device),
                                         publish=publish, lookup=lookup)
        except DistCAError as exc:
            self._failed(epoch, group["world_rank"], "joining the group", str(exc))
        self._epoch = epoch

    def _drop_group(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._transport, self._epoch = None, None

    # ---- rounds ----------------------------------------------------------------------------------
    def submit(self, batch: RemoteBatch, kind: int, tensors, softmax_scale: float, dtype, counts_for_step=True):
        """Queue a round on the client's worker thread; returns a future of its result."""
        with self._lock:
            if batch.step != self.step:
                raise DistCAError(f"batch of step {batch.step} used in step {self.step}")
            seq = self._seq
            self._seq += 1
            if kind == RoundKind.FORWARD and counts_for_step:
                self._forward_rounds += 1
            elif kind == RoundKind.BACKWARD:
                self._backward_rounds += 1
        header = RoundHeader(batch.step, batch.batch, seq, kind, dtype, float(softmax_scale))
        return self._worker.submit(self._run, batch, header, tensors)

    def round(self, batch, kind, tensors, softmax_scale, dtype, counts_for_step=True):
        return self.submit(batch, kind, tensors, softmax_scale, dtype, counts_for_step).result()

    def _run(self, batch: RemoteBatch, header: RoundHeader, tensors):
        transport = self._transport
        if transport is None or self._epoch is None:
            raise DistCAError(f"rank {self.rank} has no group for {header.describe()} (a previous "
                              f"round failed; start a new step)")
        try:
            exchange_header(transport, header, self.world_size)
            p = batch.participant
            if header.kind == RoundKind.FORWARD:
                return p.forward(transport, *tensors, header.softmax_scale)
            return p.backward(transport, *tensors, header.softmax_scale)
        except (DistCAError, ValueError, RuntimeError) as exc:
            self._failed(self._epoch, transport.rank, header.describe(), str(exc), step=header.step)

    def _failed(self, epoch: int, world_rank: int, what: str, detail: str, step: int | None = None):
        """Tell the scheduler, learn who was lost, leave the group, raise DistCAError."""
        self._drop_group()
        step = self.step if step is None else step
        try:
            verdict = ray.get(self.scheduler.report_failure.remote(epoch, world_rank, step, detail),
                              timeout=self.timeout_s)
        except Exception as exc:  # the scheduler itself is gone or slow
            verdict = {"lost": [f"the scheduler ({type(exc).__name__})"], "next_step": step + 1}
        with self._lock:
            self._advance(max(verdict["next_step"], self.step + 1))
        lost = ", ".join(verdict["lost"]) or "no participant named (all reported back)"
        raise DistCAError(f"rank {self.rank}: {what} failed; lost: {lost}. Cause: {detail[:300]}")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._worker.shutdown(wait=True)
        self._drop_group()
        try:
            ray.get(self.scheduler.unregister_client.remote(self.rank, self.incarnation), timeout=10)
        except Exception:  # closing must not fail because the job is already down
            pass
