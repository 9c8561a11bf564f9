"""Tagged rounds benchmark: in-place Ray rounds over a symmetric heap, with the round header
exchanged in every round (the baseline) and only where a round's routes are not installed yet
(the default: later rounds carry the header's digest in their report rows).

Per configuration (clients ``W``, tokens per rank) two distca jobs run side by side, each with
``W`` client actors that ``DistCAClient.connect``: in-place, ``--transport`` (``shm`` on the CPU,
``nvshmem`` on a GPU, the actors sharing it through fractional ``num_gpus``), 8/2 heads, head_dim
64, ``--dtype``. In the baseline job each client's ``GroupMember.tag_rounds`` is False. A step is
what training does: ``--layers`` attends, then one backward over all of them, then (on a GPU) a
wait for the device. Every step has a new batch from the Pretrain trace, so a new plan, whose routes
install at its first forward and first backward round. One warm-up step, then ``--steps`` measured
steps, alternating which job goes first, so both see the same load.

Columns, per configuration: the step's wall time (the slowest client's, ms) in both jobs and their
ratio; the host time an ``attend`` holds its caller (mean over rounds and clients, ms): on a GPU,
where nothing waits for the device, the header is what makes the host wait for every peer; and per
step the header exchanges a client made (host-driven) and its device-driven exchanges, from the
member's and the transport's counters.

Usage::

    python bench/tagged_rounds.py            # 2 and 3 clients, 1K and 4K tokens per rank, 8 layers
    python bench/tagged_rounds.py --quick    # 2 clients, 512 tokens, 4 layers, 2 steps
    python bench/tagged_rounds.py --device cuda --transport nvshmem --dtype bfloat16 \\
        --clients 2 --context 8192 16384      # the GPU session's ``tagged`` stage

Writes JSON to ``--json`` (default ``bench/results/tagged_rounds.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from roundtrip_runtimes import SHAPE, TIMEOUT_S, BenchClient, close_job, rank_inputs, step_batch  # noqa: E402

from distca_server.wire import RowFormat  # noqa: E402
from scheduler.config import JobConfig, PlanConfig  # noqa: E402
from scheduler.cost import CostModel  # noqa: E402

EPSILON, MIN_SHARD = 0.05, 128


class TagClient(BenchClient):
    """A :class:`BenchClient` whose member exchanges the header in every round unless ``tagged``."""

    def __init__(self, name: str, rank: int, world_size: int, timeout_s: float, threads: int, tagged: bool):
        super().__init__(name, rank, world_size, timeout_s, threads)
        self.client._runtime.member.tag_rounds = tagged

    def counters(self) -> dict:
        member = self.client._runtime.member
        return {"rounds": member.rounds_done, "tagged": member.tagged_rounds,
                "device_exchanges": getattr(member.transport, "device_exchanges", 0)}

    def train_step(self, lens: list[int], seed: int, step: int, layers: int, device: str, dtype: str) -> dict:
        """Plan, ``layers`` attends, one backward over all of them, then wait for the device.
        Returns the step's wall time and the host time of each attend and of the backward call
        (seconds)."""
        dev, dt = torch.device(device), getattr(torch, dtype)
        t0 = time.perf_counter()
        self.client._runtime.step_for(list(lens), RowFormat(CostModel(**SHAPE, dtype_bytes=dt.itemsize), dt), dev)
        outs, douts, attend_s = [], [], []
        for layer in range(layers):
            q, k, v, dout = (x.to(dev, dt) for x in rank_inputs(sum(lens), seed, step, layer, self.rank))
            leaves = [t.requires_grad_() for t in (q, k, v)]
            t1 = time.perf_counter()
            outs.append(self.client.attend(*leaves, lens))
            attend_s.append(time.perf_counter() - t1)
            douts.append(dout)
        t1 = time.perf_counter()
        torch.autograd.backward(outs, douts)
        backward_s = time.perf_counter() - t1
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return {"step_s": time.perf_counter() - t0, "attend_s": attend_s, "backward_s": backward_s}


class Job:
    """One distca job (in-place) and its client actors."""

    def __init__(self, clients: int, tagged: bool, args):
        import ray

        from distca_server import launch
        self.name = f"tagged-{clients}-{int(tagged)}-{os.getpid()}"
        heap = {} if args.heap_bytes is None else {"heap_bytes": args.heap_bytes}
        config = JobConfig(timeout_s=TIMEOUT_S, transport=args.transport, **heap,
                           plan=PlanConfig(mode="inplace", epsilon=EPSILON, min_shard=MIN_SHARD))
        self.job = launch(name=self.name, config=config, detached=False)
        gpus = 1 / (2 * clients) if args.device == "cuda" else 0  # both jobs' clients share the one GPU
        actor = ray.remote(num_cpus=0, num_gpus=gpus)(TagClient)
        self.workers = [actor.remote(self.name, r, clients, TIMEOUT_S, args.threads, tagged) for r in range(clients)]

    def step(self, index: int, ranks, args) -> dict:
        """One step: the slowest client's step time, every client's attend host times, and the
        counters' deltas (the most any client made)."""
        import ray
        before = ray.get([w.counters.remote() for w in self.workers], timeout=TIMEOUT_S)
        got = ray.get([w.train_step.remote(ranks[r], args.seed, index, args.layers, args.device, args.dtype)
                       for r, w in enumerate(self.workers)], timeout=TIMEOUT_S * 4)
        after = ray.get([w.counters.remote() for w in self.workers], timeout=TIMEOUT_S)
        delta = [{k: a[k] - (b[k] if a["rounds"] >= b["rounds"] else 0) for k in a}
                 for a, b in zip(after, before)]  # a new group epoch starts its counts again
        return {"step_s": max(g["step_s"] for g in got), "attend_s": [t for g in got for t in g["attend_s"]],
                "backward_s": max(g["backward_s"] for g in got),
                "headers": max(d["rounds"] - d["tagged"] for d in delta),
                "device_exchanges": max(d["device_exchanges"] for d in delta)}

    def close(self) -> None:
        close_job(self.name, self.workers)


def run_config(clients: int, context: int, args) -> dict:
    jobs = {"every": Job(clients, False, args), "install": Job(clients, True, args)}
    steps = {name: [] for name in jobs}
    try:
        for i in range(args.warmup + args.steps):
            ranks = step_batch(clients, context, i)
            order = list(jobs) if i % 2 == 0 else list(jobs)[::-1]
            for name in order:
                result = jobs[name].step(i, ranks, args)
                if i >= args.warmup:
                    steps[name].append(result)
    finally:
        for job in jobs.values():
            job.close()
    row = {"clients": clients, "tokens_per_rank": context, "layers": args.layers, "device": args.device,
           "transport": args.transport, "dtype": args.dtype}
    for name, got in steps.items():
        row[f"step_ms_{name}"] = 1e3 * statistics.mean(s["step_s"] for s in got)
        row[f"attend_host_ms_{name}"] = 1e3 * statistics.mean(t for s in got for t in s["attend_s"])
        row[f"backward_host_ms_{name}"] = 1e3 * statistics.mean(s["backward_s"] for s in got)
        row[f"headers_per_step_{name}"] = statistics.mean(s["headers"] for s in got)
        row[f"device_exchanges_per_step_{name}"] = statistics.mean(s["device_exchanges"] for s in got)
    row["step_ratio"] = row["step_ms_install"] / row["step_ms_every"]
    row["attend_host_ratio"] = row["attend_host_ms_install"] / row["attend_host_ms_every"]
    return row


def table(rows) -> str:
    head = (f"{'clients':>7} {'tokens/rank':>11} {'step ms every':>13} {'tagged':>8} {'ratio':>6} "
            f"{'attend host ms every':>20} {'tagged':>7} {'ratio':>6} {'headers/step every→tagged':>26} "
            f"{'device-driven/step every→tagged':>32}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['clients']:>7} {r['tokens_per_rank']:>11} {r['step_ms_every']:>13.2f} "
                     f"{r['step_ms_install']:>8.2f} {r['step_ratio']:>6.2f} {r['attend_host_ms_every']:>20.3f} "
                     f"{r['attend_host_ms_install']:>7.3f} {r['attend_host_ratio']:>6.2f} "
                     f"{r['headers_per_step_every']:>12.1f} → {r['headers_per_step_install']:<11.1f} "
                     f"{r['device_exchanges_per_step_every']:>18.1f} → {r['device_exchanges_per_step_install']:<11.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 clients, 512 tokens per rank, 4 layers, 2 steps")
    p.add_argument("--clients", type=int, nargs="+", help="clients per job (default 2 3)")
    p.add_argument("--context", type=int, nargs="+", help="tokens per rank (default 1024 4096)")
    p.add_argument("--layers", type=int, help="layers per step (default 8)")
    p.add_argument("--steps", type=int, help="measured steps (default 4)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per client process")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--transport", choices=("shm", "nvshmem"), help="default shm on the CPU, nvshmem on cuda")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--heap-bytes", type=int, default=None, help="each PE's symmetric heap (default the job's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "tagged_rounds.json")
    args = p.parse_args(argv)
    args.clients = args.clients or ([2] if args.quick else [2, 3])
    args.context = args.context or ([512] if args.quick else [1024, 4096])
    args.layers = args.layers or (4 if args.quick else 8)
    args.steps = args.steps or (2 if args.quick else 4)
    args.transport = args.transport or ("nvshmem" if args.device == "cuda" else "shm")

    import ray

    from roundtrip_runtimes import ship_by_value, start_local_ray
    started = start_local_ray(max(4, 2 * max(args.clients) + 2))
    try:
        ship_by_value()
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        rows = [run_config(c, n, args) for c in args.clients for n in args.context]
    finally:
        if started:
            ray.shutdown()
    print(table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                     "rows": rows}, indent=1, default=str) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
