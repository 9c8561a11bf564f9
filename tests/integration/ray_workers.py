"""A Ray actor that plays one training worker in the runtime tests (imported by Ray workers)."""

from __future__ import annotations

import os
import time

import ray
import torch

from distca_client import DistCAClient, DistCAError
from distca_server.refs import attend_with_grads_ref, varlen_attention_ref
from distca_server.wire import RowFormat


def _inputs(lens, seed, hq=4, hkv=2, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    return [torch.randn(T, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv, hq)]


def _failed(exc, start):
    return {"ok": False, "type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}


@ray.remote(num_cpus=0)
class TrainWorker:
    def __init__(self, name: str, rank: int, world_size: int, timeout_s: float = 10.0):
        self.rank = rank
        self.client = DistCAClient.connect(name, rank=rank, world_size=world_size, timeout_s=timeout_s)
        self.pending = None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()

    def reconnect(self, name: str, timeout_s: float = 10.0) -> None:
        """Close this worker's client and connect to job ``name`` instead (tests that run several
        jobs reuse their worker processes)."""
        self.client.close()
        self.client = DistCAClient.connect(name, rank=self.rank, world_size=2, timeout_s=timeout_s)

    def registration_token(self) -> str:
        """The secret this client's registration returned (its reports carry it)."""
        return self.client._runtime._token

    def transport_kind(self) -> str | None:
        """The class name of the transport of this client's group epoch (None while in none)."""
        transport = self.client._runtime.member.transport
        return None if transport is None else type(transport).__name__

    def device_exchanges(self) -> int | None:
        """Exchanges of this client's group epoch that ran device-driven (a routed transport)."""
        transport = self.client._runtime.member.transport
        return getattr(transport, "device_exchanges", None)

    def tagged_rounds(self) -> int:
        """Rounds this client ran without a header exchange (in-place, routes installed)."""
        return self.client._runtime.member.tagged_rounds

    def scheduler_lost(self) -> bool:
        """Whether this client noticed that the job's scheduler died (its long-poll failed)."""
        return self.client._runtime.member.scheduler_lost

    def step(self, lens, seed, layers=2, head_dim=16, dtype="float32", late_s=0.0, bad_layer=None,
             delay_s=0.0, scale_layer=None):
        """``layers`` attends (each on its own q,k,v) and one backward; returns the max relative
        error of out, dq, dk, dv against the float64 reference, or the error raised, and how long
        the step took (``seconds``, from its first attend; a late start not counted).

        ``late_s``: get the plan of the step first, then wait this long before the first round.
        ``bad_layer``: that layer's q has one row too few (a local ``ValueError``).
        ``delay_s``: wait this long before the step's first report (a slow data loader).
        ``scale_layer``: that layer attends with half the softmax scale (another round than the
        other ranks')."""
        time.sleep(delay_s)
        start = time.monotonic()
        try:
            dt = getattr(torch, dtype)
            cases = [_inputs(lens, seed * 100 + self.rank * 10 + i, d=head_dim, dtype=dt) for i in range(layers)]
            leaves = [[t.clone().requires_grad_() for t in c[:3]] for c in cases]
            if late_s:
                self.client._runtime.step_for(list(lens), RowFormat.of(*leaves[0][:2]), torch.device("cpu"))
                time.sleep(late_s)
                start = time.monotonic()
            outs = []
            for i, (q, k, v) in enumerate(leaves):
                scale = head_dim ** -0.5 / (2 if i == scale_layer else 1)
                outs.append(self.client.attend(q[1:] if i == bad_layer else q, k, v, lens, softmax_scale=scale))
            sum((o.float() * c[3].float()).sum() for o, c in zip(outs, cases)).backward()
            worst = 0.0
            for (q, k, v), out, c in zip(leaves, outs, cases):
                want = attend_with_grads_ref(c[0], c[1], c[2], lens, c[3], head_dim ** -0.5)
                for g, w in zip((out, q.grad, k.grad, v.grad), want):
                    worst = max(worst, ((g.double() - w).abs().max() / w.abs().max()).item())
            return {"ok": True, "error": worst, "seconds": time.monotonic() - start}
        except (DistCAError, ValueError) as exc:
            return _failed(exc, start)

    def forward_loop(self, lens_list, seed, ping_pong=False):
        """A forward-only loop (no grad, ``new_step()`` after each batch): with ``ping_pong``,
        each batch runs as two async nano-batches with the same documents. Returns the max
        relative error of every output against the float64 reference."""
        start = time.monotonic()
        worst = 0.0
        try:
            with torch.no_grad():
                for i, lens in enumerate(lens_list):
                    runs = [_inputs(lens, seed + 10 * i + j + self.rank)[:3] for j in range(2 if ping_pong else 1)]
                    for _ in range(2):  # two layers, each nano-batch back on its own plan
                        handles = [self.client.attend_async(q, k, v, lens) for q, k, v in runs]
                        for (q, k, v), h in zip(runs, handles):
                            want = varlen_attention_ref(q.double(), k.double(), v.double(), lens, 16 ** -0.5)
                            worst = max(worst, ((h.wait().double() - want).abs().max() / want.abs().max()).item())
                    self.client.new_step()
            return {"ok": True, "error": worst, "seconds": time.monotonic() - start}
        except (DistCAError, ValueError) as exc:
            return _failed(exc, start)

    def ping_pong(self, lens_a, lens_b, seed):
        """Two nano-batches with interleaved async rounds (DistCA §4.2), then backward."""
        try:
            a = [t.clone().requires_grad_() for t in _inputs(lens_a, seed + self.rank)[:3]]
            b = [t.clone().requires_grad_() for t in _inputs(lens_b, seed + 50 + self.rank)[:3]]
            ha = self.client.attend_async(*a, lens_a)
            hb = self.client.attend_async(*b, lens_b)
            out_a, out_b = ha.wait(), hb.wait()
            (out_a.sum() + out_b.square().sum()).backward()
            worst = 0.0
            for (q, k, v), out, lens, dout in ((a, out_a, lens_a, torch.ones_like(out_a)),
                                               (b, out_b, lens_b, 2 * out_b.detach())):
                want = attend_with_grads_ref(q.detach(), k.detach(), v.detach(), lens, dout, 16 ** -0.5)
                for g, w in zip((out, q.grad, k.grad, v.grad), want):
                    worst = max(worst, ((g.double() - w).abs().max() / w.abs().max()).item())
            return {"ok": True, "error": worst}
        except (DistCAError, ValueError) as exc:
            return {"ok": False, "type": type(exc).__name__, "message": str(exc)}

    def forward_only(self, lens, seed):
        """One grad-requiring forward round, held for :meth:`finish` (a step left mid-way)."""
        try:
            q, k, v, dout = _inputs(lens, seed + self.rank)
            leaves = [t.requires_grad_() for t in (q, k, v)]
            self.pending = (self.client.attend(*leaves, lens), dout)
            return {"ok": True}
        except (DistCAError, ValueError) as exc:
            return {"ok": False, "type": type(exc).__name__, "message": str(exc)}

    def backward_pending(self):
        """The backward round of the grad-requiring forward round :meth:`forward_only` held (with
        kept activations: dO only, the servers use the rows they kept)."""
        start = time.monotonic()
        try:
            out, dout = self.pending
            (out * dout).sum().backward()
            return {"ok": True, "seconds": time.monotonic() - start}
        except (DistCAError, ValueError) as exc:
            return {"ok": False, "type": type(exc).__name__, "message": str(exc),
                    "seconds": time.monotonic() - start}

    def held_bytes(self) -> int:
        """Kept activations this client's participant holds now (its in-place server role)."""
        batch = self.client.last_step
        return 0 if batch is None else batch.held_bytes()

    def finish(self, lens, seed, window=None):
        """Another layer's forward and the backward of the held step. ``window``: that layer
        attends with this sliding window (another batch of the step than the held one's)."""
        start = time.monotonic()
        try:
            q, k, v, _ = _inputs(lens, seed + 7 + self.rank)
            out2 = self.client.attend(q.requires_grad_(), k, v, lens, window=window)
            out, dout = self.pending
            ((out * dout).sum() + out2.sum()).backward()
            return {"ok": True, "seconds": time.monotonic() - start}
        except (DistCAError, ValueError) as exc:
            return {"ok": False, "type": type(exc).__name__, "message": str(exc),
                    "seconds": time.monotonic() - start}

    def plan_and_traffic(self, lens, seed):
        """One one-layer step (forward and backward); returns the client's ``last_plan`` (msgpack),
        its ``traffic()``, its part's participant index, and the error against the reference."""
        try:
            result = self.step(lens, seed, layers=1)
            plan = self.client.last_plan
            assert plan is self.client.last_plan  # fetched once, then cached
            part = self.client.last_step.part
            return dict(result, plan=plan.to_msgpack(), traffic=self.client.traffic(),
                        participant=part.participant, rank=part.rank, step=self.client.last_step.step)
        except (DistCAError, ValueError) as exc:
            return {"ok": False, "type": type(exc).__name__, "message": str(exc)}

    def bad_shape_step(self, lens, head_dim):
        q, k, v, _ = _inputs(lens, 0, d=head_dim)
        try:
            self.client.attend(q, k, v, lens)
            return {"ok": True}
        except (DistCAError, ValueError) as exc:
            return {"ok": False, "type": type(exc).__name__, "message": str(exc)}
