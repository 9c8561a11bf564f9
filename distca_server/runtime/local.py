"""``DistCAClient.local``: every participant of the plan as a thread of this process.

The batch handed to ``attend`` is cut into ``num_ranks`` virtual client ranks (whole documents,
contiguous, about equal tokens); each participant runs exactly the code a distributed participant
runs, over the in-process all-to-all of :mod:`distca_server.transport.local`.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch

from distca_server.errors import DistCAError
from distca_server.kernels import get_backend
from distca_server.participant import Participant
from distca_server.transport.local import LocalGroup
from distca_server.wire import RowFormat
from scheduler import Plan, plan_batch
from scheduler.parts import plan_parts

_CACHE_SIZE = 16


def split_documents(doc_lens: list[int], num_ranks: int) -> list[list[int]]:
    """Cut documents into ``num_ranks`` contiguous groups of about equal tokens.

    Document ``i`` goes to rank ``floor(R · midpoint_i / total)``, so ranks keep the batch's order
    and a rank may be empty (fewer documents than ranks).
    """
    if not doc_lens:
        return [[] for _ in range(num_ranks)]
    lens = np.asarray(doc_lens, dtype=np.int64)
    mid2 = 2 * np.cumsum(lens) - lens  # twice each document's midpoint, in exact integers
    rank = np.minimum(num_ranks - 1, (mid2 * num_ranks) // (2 * int(lens.sum())))
    groups: list[list[int]] = [[] for _ in range(num_ranks)]
    for r, l in zip(rank.tolist(), doc_lens):
        groups[r].append(l)
    return groups


class LocalStep:
    """One plan bound to its in-process participants; the ``step`` of :class:`DistCAAttention`."""

    def __init__(self, runtime: "LocalRuntime", plan: Plan, fmt: RowFormat, device: torch.device):
        self.runtime, self.plan = runtime, plan
        backend = get_backend(runtime.backend, device)
        self.backend_name = backend.name
        self.participants = [Participant(part, fmt, backend, device) for part in plan_parts(plan)]
        tokens = [sum(x) for x in plan.doc_lens_per_rank]
        self.bounds = np.concatenate([[0], np.cumsum(tokens)]).tolist()

    def _slices(self, *tensors):
        """Per participant: its rank's rows of each tensor, or Nones for server-only ones."""
        args = []
        for p in self.participants:
            if p.rank is None:
                args.append((None,) * len(tensors))
            else:
                a, b = self.bounds[p.rank], self.bounds[p.rank + 1]
                args.append(tuple(t[a:b] for t in tensors))
        return args

    def _gather(self, results, count):
        per_rank = [r for p, r in zip(self.participants, results) if p.rank is not None]
        return tuple(torch.cat([r[i] for r in per_rank]) for i in range(count))

    def _forward(self, q, k, v, softmax_scale):
        jobs = [(lambda t, p=p, a=a: p.forward(t, *a, softmax_scale))
                for p, a in zip(self.participants, self._slices(q, k, v))]
        return self._gather(self.runtime.run(jobs), 2)

    def _backward(self, q, k, v, out, lse, dout, softmax_scale):
        jobs = [(lambda t, p=p, a=a: p.backward(t, *a, softmax_scale))
                for p, a in zip(self.participants, self._slices(q, k, v, out, lse, dout))]
        return self._gather(self.runtime.run(jobs), 3)

    def forward_async(self, q, k, v, softmax_scale, counts_for_step=True):
        """Queue the forward round; a future of ``(out, lse)``."""
        return self.runtime.submit(self._forward, q, k, v, softmax_scale)

    def backward(self, q, k, v, out, lse, dout, softmax_scale):
        return self.runtime.submit(self._backward, q, k, v, out, lse, dout, softmax_scale).result()

    def traffic(self) -> dict[str, dict[str, int]]:
        """Bytes all participants sent to other participants so far: ``{kind: {tensor: bytes}}``."""
        total: dict[str, dict[str, int]] = {}
        for p in self.participants:
            for (kind, name), n in p.traffic.items():
                total.setdefault(kind, {}).setdefault(name, 0)
                total[kind][name] += n
        return total


class LocalRuntime:
    """Plans, participants and threads of a ``DistCAClient.local`` client."""

    def __init__(self, num_servers: int, num_ranks: int, mode: str, epsilon: float,
                 backend: str, min_shard: int, timeout_s: float):
        self.num_servers, self.num_ranks, self.mode = num_servers, num_ranks, mode
        self.epsilon, self.backend, self.min_shard = epsilon, backend, min_shard
        self.timeout_s = timeout_s
        self.world_size = num_ranks if mode == "inplace" else num_ranks + num_servers
        self._pool = ThreadPoolExecutor(max_workers=self.world_size, thread_name_prefix="distca-local")
        self._group: LocalGroup | None = None
        self._steps: OrderedDict = OrderedDict()
        # Rounds run one at a time, in call order, like a distributed client's rounds.
        self._rounds = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distca-local-rounds")

    def submit(self, fn, *args):
        """Queue one round (``fn(*args)``) behind the earlier ones; returns its future."""
        if self._pool is None:
            raise DistCAError("this DistCAClient is closed")
        return self._rounds.submit(fn, *args)

    def new_step(self) -> None:
        """Nothing to do locally: plans are cached per batch shape."""

    def step_for(self, doc_lens: list[int], fmt: RowFormat, device: torch.device) -> LocalStep:
        """The cached step for this batch shape, planning it on first sight."""
        key = (tuple(doc_lens), fmt, str(device))
        step = self._steps.get(key)
        if step is None:
            plan = plan_batch(split_documents(doc_lens, self.num_ranks), self.num_servers,
                              cost=fmt.cost, epsilon=self.epsilon, mode=self.mode, min_shard=self.min_shard)
            step = LocalStep(self, plan, fmt, device)
            self._steps[key] = step
            if len(self._steps) > _CACHE_SIZE:
                self._steps.popitem(last=False)
        else:
            self._steps.move_to_end(key)
        return step

    def run(self, jobs):
        """Run one exchange-synchronised job per participant; return their results in order.

        A failing participant aborts the group so the others stop waiting; the first real
        error (not the peers' resulting :class:`DistCAError`) is re-raised.
        """
        if self._pool is None:
            raise DistCAError("this DistCAClient is closed")
        if self._group is None or self._group.broken:
            self._group = LocalGroup(self.world_size, self.timeout_s)
        group = self._group

        def call(i, job):
            try:
                return job(group.endpoint(i))
            except BaseException as exc:
                group.abort(i, f"{type(exc).__name__}: {exc}")
                raise
        futures = [self._pool.submit(call, i, job) for i, job in enumerate(jobs)]
        done, pending = wait(futures, timeout=2 * self.timeout_s + 5)
        if pending:
            group.abort(-1, "round did not finish")
            raise DistCAError(f"{len(pending)} local participants did not finish within "
                              f"{2 * self.timeout_s + 5:g} s")
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            root = [e for e in errors if not isinstance(e, DistCAError)]
            raise (root or errors)[0]
        return [f.result() for f in futures]

    def close(self) -> None:
        if self._pool is not None:
            self._rounds.shutdown(wait=True)
            self._pool.shutdown(wait=True)
            self._pool = None
        self._steps.clear()
