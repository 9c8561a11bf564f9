"""Tagged rounds benchmark: in-place Ray rounds over the shared-memory heap, with the round header
exchanged in every round (the baseline) and only where a round's routes are not installed yet
(the default: later rounds carry the header's digest in their report rows).

Per configuration (clients ``W``, tokens per rank) two distca jobs run side by side, each with
``W`` client actors (``roundtrip_runtimes.BenchClient``) that ``DistCAClient.connect`` with
``transport="shm"``, in-place, ``torch_cpu`` kernels, 8/2 heads, head_dim 64, float32. In the
baseline job each client's ``GroupMember.tag_rounds`` is False. A step: ``--layers`` forward
rounds, then one backward round per layer; every step a new batch from the Pretrain trace (so a
new plan, whose routes install at its first forward and first backward round). One warm-up step,
then ``--steps`` measured steps, alternating which job goes first, so both see the same load.

Columns, per configuration and round kind: the mean round wall time the slowest client sees
(``attend`` / ``out.backward``), ms, for both jobs and their ratio; and per step, the header
exchanges a client made (host-driven: its host waits for every peer) and its device-driven
exchanges, from the member's and the transport's counters.

Usage::

    python bench/tagged_rounds.py            # 2 and 3 clients, 1K and 4K tokens per rank, 8 layers
    python bench/tagged_rounds.py --quick    # 2 clients, 512 tokens, 4 layers, 2 steps

Writes JSON to ``--json`` (default ``bench/results/tagged_rounds.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from roundtrip_runtimes import TIMEOUT_S, BenchClient, close_job, step_batch  # noqa: E402

from scheduler.config import JobConfig, PlanConfig  # noqa: E402

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


class Job:
    """One distca job (in-place, ``shm``) and its client actors."""

    def __init__(self, clients: int, tagged: bool, threads: int):
        import ray

        from distca_server import launch
        self.name = f"tagged-{clients}-{int(tagged)}-{os.getpid()}"
        config = JobConfig(timeout_s=TIMEOUT_S, transport="shm",
                           plan=PlanConfig(mode="inplace", epsilon=EPSILON, min_shard=MIN_SHARD))
        self.job = launch(name=self.name, config=config, detached=False)
        actor = ray.remote(num_cpus=0)(TagClient)
        self.workers = [actor.remote(self.name, r, clients, TIMEOUT_S, threads, tagged) for r in range(clients)]

    def step(self, index: int, ranks, layers: int, seed: int) -> dict:
        """One step; per kind the slowest client's round times (s), and the counters' deltas."""
        import ray
        before = ray.get([w.counters.remote() for w in self.workers], timeout=TIMEOUT_S)
        fwd = ray.get([w.forward.remote(ranks[r], seed, index, layers) for r, w in enumerate(self.workers)],
                      timeout=TIMEOUT_S * 4)
        bwd = ray.get([w.backward.remote() for w in self.workers], timeout=TIMEOUT_S * 4)
        after = ray.get([w.counters.remote() for w in self.workers], timeout=TIMEOUT_S)
        delta = [{k: a[k] - (b[k] if a["rounds"] >= b["rounds"] else 0) for k in a}
                 for a, b in zip(after, before)]  # a new group epoch starts its counts again
        return {"forward": [max(r["round_s"][i] for r in fwd) for i in range(layers)],
                "backward": [max(r["round_s"][i] for r in bwd) for i in range(layers)],
                "headers": max(d["rounds"] - d["tagged"] for d in delta),
                "device_exchanges": max(d["device_exchanges"] for d in delta)}

    def close(self) -> None:
        close_job(self.name, self.workers)


def run_config(clients: int, context: int, args) -> dict:
    jobs = {"every": Job(clients, False, args.threads), "install": Job(clients, True, args.threads)}
    steps = {name: [] for name in jobs}
    try:
        for i in range(args.warmup + args.steps):
            ranks = step_batch(clients, context, i)
            order = list(jobs) if i % 2 == 0 else list(jobs)[::-1]
            for name in order:
                result = jobs[name].step(i, ranks, args.layers, args.seed)
                if i >= args.warmup:
                    steps[name].append(result)
    finally:
        for job in jobs.values():
            job.close()
    row = {"clients": clients, "tokens_per_rank": context, "layers": args.layers}
    for name, got in steps.items():
        for kind in ("forward", "backward"):
            row[f"{kind}_ms_{name}"] = 1e3 * statistics.mean(t for s in got for t in s[kind])
        row[f"headers_per_step_{name}"] = statistics.mean(s["headers"] for s in got)
        row[f"device_exchanges_per_step_{name}"] = statistics.mean(s["device_exchanges"] for s in got)
    for kind in ("forward", "backward"):
        row[f"{kind}_ratio"] = row[f"{kind}_ms_install"] / row[f"{kind}_ms_every"]
    return row


def table(rows) -> str:
    head = (f"{'clients':>7} {'tokens/rank':>11} {'round':<8} {'header every ms':>15} {'tagged ms':>9} "
            f"{'tagged/every':>12} {'headers/step every→tagged':>26} {'device-driven/step every→tagged':>32}")
    lines = [head]
    for r in rows:
        for kind in ("forward", "backward"):
            lines.append(f"{r['clients']:>7} {r['tokens_per_rank']:>11} {kind:<8} {r[f'{kind}_ms_every']:>15.2f} "
                         f"{r[f'{kind}_ms_install']:>9.2f} {r[f'{kind}_ratio']:>12.2f} "
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "tagged_rounds.json")
    args = p.parse_args(argv)
    args.clients = args.clients or ([2] if args.quick else [2, 3])
    args.context = args.context or ([512] if args.quick else [1024, 4096])
    args.layers = args.layers or (4 if args.quick else 8)
    args.steps = args.steps or (2 if args.quick else 4)

    import ray

    from roundtrip_runtimes import ship_by_value
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=max(4, 2 * max(args.clients) + 2), include_dashboard=False, log_to_driver=False)
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
