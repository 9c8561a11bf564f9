"""Quickstart: core attention of a packed batch of real documents, served by in-process servers.

Samples document lengths from the Pretrain trace (package data of distca_sim), plans them over
attention servers, runs forward and backward through ``DistCAClient.attend`` and checks the result
against local causal attention. Run: ``python examples/quickstart.py [--servers 4 --context 4096]``.
"""

from __future__ import annotations

import argparse
import time

import torch

from distca_client import DistCAClient
from distca_server.kernels import get_backend
from distca_sim.workloads import sample_batch
from scheduler.checks import finite_nonnegative, nonnegative_int, positive_int
from scheduler.config import PlanConfig


def checked(kind, check, words: str):
    """An argparse type: ``kind(text)`` that ``check`` (a :mod:`scheduler.checks` range check)
    accepts. A bad value is argparse's one-line error naming the flag (``must be <words>, got
    '<text>'``), not a traceback from deep inside the client or the planner."""
    def parse(text: str):
        try:
            return check("value", kind(text))
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {words}, got {text!r}") from None
    return parse


count = checked(int, positive_int, "a positive int")


def local_attention(q, k, v, dout, doc_lens, scale):
    """Single-device causal varlen attention and its gradients (the torch_cpu kernel)."""
    backend = get_backend("auto", q.device)
    cu = torch.tensor([0] + torch.tensor(doc_lens).cumsum(0).tolist(), dtype=torch.int32)
    n = max(doc_lens)
    out, lse = backend.forward(q, k, v, cu, cu, n, n, scale)
    return (out, *backend.backward(dout, q, k, v, out, lse, cu, cu, n, n, scale))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", type=count, default=4, help="attention servers (and client ranks)")
    ap.add_argument("--context", type=count, default=4096, help="tokens per client rank")
    ap.add_argument("--trace", choices=["pretrain", "prolong"], default="pretrain")
    ap.add_argument("--mode", choices=["inplace", "dedicated"], default="inplace")
    ap.add_argument("--epsilon", type=checked(float, finite_nonnegative, "a finite number >= 0"),
                    default=PlanConfig.epsilon, help="planner imbalance tolerance")
    ap.add_argument("--step", type=checked(int, nonnegative_int, "an int >= 0"), default=3,
                    help="which batch of the trace to take")
    args = ap.parse_args(argv)

    per_rank = sample_batch(args.trace, args.servers, args.context, seed=0, step=args.step)
    doc_lens = [n for lens in per_rank for n in lens]
    heads_q, heads_kv, head_dim = 8, 2, 64
    torch.manual_seed(0)
    total = sum(doc_lens)
    q = torch.randn(total, heads_q, head_dim, requires_grad=True)
    k = torch.randn(total, heads_kv, head_dim, requires_grad=True)
    v = torch.randn(total, heads_kv, head_dim, requires_grad=True)
    print(f"batch: {len(doc_lens)} documents from the {args.trace} trace, {total} tokens "
          f"({args.servers} ranks x {args.context}), longest {max(doc_lens)}")

    dout = torch.randn(total, heads_q, head_dim)
    with DistCAClient.local(args.servers, config=PlanConfig(epsilon=args.epsilon, mode=args.mode)) as client:
        start = time.perf_counter()
        out = client.attend(q, k, v, doc_lens)
        out.backward(dout)
        elapsed = time.perf_counter() - start
        print(client.last_plan.summary())

    with torch.no_grad():
        want = local_attention(q, k, v, dout, doc_lens, head_dim ** -0.5)
        got = (out, q.grad, k.grad, v.grad)
        errors = {name: ((g - w).abs().max() / w.abs().max()).item()
                  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    print(f"forward + backward through distca: {elapsed:.2f} s")
    print("max relative error vs local attention: "
          + ", ".join(f"{name} {e:.1e}" for name, e in errors.items()))
    if max(errors.values()) > 1e-5:
        raise SystemExit("distca disagrees with local attention")

if __name__ == "__main__":
    main()
