"""A Ray actor that plays one training worker in the runtime tests (imported by Ray workers)."""

from __future__ import annotations

import time

import ray
import torch

from distca_client import DistCAClient, DistCAError
from distca_server.refs import attend_with_grads_ref


def _inputs(lens, seed, hq=4, hkv=2, d=16):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    return [torch.randn(T, h, d, generator=g) for h in (hq, hkv, hkv, hq)]


@ray.remote(num_cpus=0)
class TrainWorker:
    def __init__(self, name: str, rank: int, world_size: int, timeout_s: float = 10.0):
        self.rank = rank
        self.client = DistCAClient.connect(name, rank=rank, world_size=world_size, timeout_s=timeout_s)
        self.pending = None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def step(self, lens, seed, layers=2, head_dim=16):
        """``layers`` attends (each on its own q,k,v) and one backward; returns the max relative
        error of out, dq, dk, dv against the float64 reference, or the error raised."""
        start = time.monotonic()
        try:
            cases = [_inputs(lens, seed * 100 + self.rank * 10 + i, d=head_dim) for i in range(layers)]
            leaves = [[t.clone().requires_grad_() for t in c[:3]] for c in cases]
            outs = [self.client.attend(q, k, v, lens) for q, k, v in leaves]
            sum((o * c[3]).sum() for o, c in zip(outs, cases)).backward()
            worst = 0.0
            for (q, k, v), out, c in zip(leaves, outs, cases):
                want = attend_with_grads_ref(c[0], c[1], c[2], lens, c[3], head_dim ** -0.5)
                for g, w in zip((out, q.grad, k.grad, v.grad), want):
                    worst = max(worst, ((g.double() - w).abs().max() / w.abs().max()).item())
            return {"ok": True, "error": worst, "seconds": time.monotonic() - start}
        except (DistCAError, ValueError) as exc:
            return {"ok": False, "type": type(exc).__name__, "message": str(exc),
                    "seconds": time.monotonic() - start}

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

    def finish(self, lens, seed):
        """Another layer's forward and the backward of the held step."""
        start = time.monotonic()
        try:
            q, k, v, _ = _inputs(lens, seed + 7 + self.rank)
            out2 = self.client.attend(q.requires_grad_(), k, v, lens)
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
