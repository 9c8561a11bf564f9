"""Round-trip benchmark: per-round latency of the Ray runtime, phase by phase, against the local client.

For every configuration a local Ray instance runs a distca job (scheduler actor, and in dedicated
mode ``S`` :class:`~distca_server.runtime.server_actor.AttentionServer` actors) and ``W`` client actors that
``DistCAClient.connect`` to it; rounds move over gloo. The same batches then go through
``DistCAClient.local(num_ranks=W, config=JobConfig(servers=S, plan=PlanConfig(mode=...)))`` in this
process (participants as threads, in-process all-to-all): the baseline.

Configurations (participants = clients + dedicated servers): in-place with 2, 3 and 4 clients;
dedicated with 2 clients + 1 server and 2 clients + 2 servers (``--quick``: in-place 2 and
dedicated 2 + 1).

Workload: per step the batch is ``distca_sim.workloads.sample_batch("pretrain", W, context)``
(``--context`` tokens per rank, seed 0, step = step index); its documents, concatenated, are cut
into ``W`` ranks by :func:`distca_server.runtime.local.split_documents` exactly as the local client does,
and each Ray client gets its rank's document list and the same rows of Q, K, V and dO (seeded per
step, layer and rank). Attention shape: 8 query heads, 2 KV heads, head_dim 64, float32. A step is
``--layers`` forward rounds (one ``attend`` per layer) followed by one backward round per layer
(``out.backward(dout)``, last layer first). One warm-up step (it also forms the gloo group), then
``--steps`` measured steps; every step has a new batch and therefore a new plan. Each step runs on
the Ray runtime and on the local client back to back (alternating which goes first), so both see
the same machine load; the Ray job and its actors stay up (idle) while the local step runs.

Columns (milliseconds, mean over measured steps):

- ``plan``: once per step (forward rows only). Ray: the client's scheduler round trip for the new
  step, ``RayClientRuntime.step_for`` (report the batch, the scheduler plans once all ``W`` clients
  reported, each client decodes its plan part and builds its participant), the minimum over
  clients (the last client to report sees the pure round trip; the others also wait for it; the
  maximum is in the JSON, and so is the scheduler's own ``plan_batch`` time). Local:
  ``LocalRuntime.step_for`` on first sight of the batch (``plan_batch`` and building every
  participant).
- ``pack``, ``a2a``, ``kernel``, ``unpack``: per round, from the deltas of
  :attr:`Participant.timings` over the step's forward (backward) rounds divided by the number of
  layers, the **maximum over participants** per phase (the slowest participant's time in that
  phase). Ray in-place: the clients' participants (each also serves). Ray dedicated: the
  clients' participants and the servers' ``AttentionServer.stats()["phase_seconds"]``. Local: all
  participant threads. ``a2a`` includes waiting for peers, so the maxima of different
  participants overlap and the phases need not add up to ``total``. Means over participants are
  in the JSON (``*_mean_ms``) and in the PNG.
- ``other``: ``total`` minus the largest per-participant sum of the four phases: what the client
  sees beyond the busiest participant's round (Ray: the round header all-to-all, the hop to the
  client's round thread, autograd; local: the hop to the round thread and the participant threads).
- ``total``: round wall time as the client sees it (``attend`` for forward, ``out.backward`` for
  backward), the maximum over Ray clients.
- ``ray/local``: ratio of the totals.

Usage::

    python bench/roundtrip.py            # 5 configurations, 4096 tokens per rank, 4 layers, 3 steps
    python bench/roundtrip.py --quick    # 2 configurations, 256 tokens per rank, 1 layer, 1 step

Writes JSON to ``--json`` (default ``bench/results/roundtrip.json``) and a stacked bar chart of the
phases next to it (``--png``, default: the JSON path with ``.png``; ``--no-png`` to skip).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# DISTCA_TREE: measure another checkout of distca with this script (bench/exchange_before_after.py
# runs it on the base commit's tree); its packages come first, here and on the Ray workers.
TREE = Path(os.environ.get("DISTCA_TREE", ROOT)).resolve()
for _path in (ROOT, TREE):
    if str(_path) in sys.path:
        sys.path.remove(str(_path))
    sys.path.insert(0, str(_path))
# The bench helpers are this script's own, whatever tree it measures: ``bench`` is a namespace
# package, and with TREE first its modules would come from the other checkout (an older
# roundtrip_runtimes, or none), so pin the package to this tree's directory.
import bench  # noqa: E402
bench.__path__ = [str(ROOT / "bench")]


def _this_trees_worker_pythonpath():
    """``distca_cli.connect.worker_pythonpath`` of this tree, loaded from its file: an older TREE's
    distca_cli may not have it, and importing the package would import a distca_server (its
    ``__init__`` does) from whichever tree comes first. ``connect.py`` imports only the standard
    library at its top."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_roundtrip_cli_connect", ROOT / "distca_cli" / "connect.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.worker_pythonpath

import torch  # noqa: E402

from bench.report import finish  # noqa: E402
from bench.roundtrip_runtimes import (DTYPE, EPSILON, KINDS, MIN_SHARD, PHASES, SHAPE,  # noqa: E402
                                      TRACE, LocalRunner, RayRunner, mean_over_steps, ship_by_value,
                                      start_local_ray, step_batch)

CONFIGS = (("inplace", 2, 0), ("inplace", 3, 0), ("inplace", 4, 0),
           ("dedicated", 2, 1), ("dedicated", 2, 2))  # (mode, clients, dedicated servers)
QUICK_CONFIGS = (("inplace", 2, 0), ("dedicated", 2, 1))


def config_name(mode: str, clients: int, servers: int) -> str:
    return f"inplace {clients}c" if mode == "inplace" else f"dedicated {clients}c+{servers}s"

# ---- one configuration, table, chart -------------------------------------------------------------------
def bench_config(mode, clients, servers, args, log) -> list[dict]:
    """Warm-up and measured steps of one configuration, the Ray step and the local step of the same
    batch back to back (alternating which goes first), so both see the same machine load."""
    batches = [step_batch(clients, args.context, i) for i in range(args.warmup + args.steps)]
    name = config_name(mode, clients, servers)
    results = {"ray": [], "local": []}
    sched_ms = []
    wall = {"ray": 0.0, "local": 0.0}
    ray_runner = RayRunner(mode, clients, servers, args)
    local_runner = None
    try:
        local_runner = LocalRunner(mode, clients, servers, args)
        runners = {"ray": ray_runner, "local": local_runner}
        for i, ranks in enumerate(batches):
            measured = i >= args.warmup
            order = ("ray", "local") if i % 2 == 0 else ("local", "ray")
            took = {}
            for runtime in order:
                t0 = time.perf_counter()
                res = runners[runtime].step(i, ranks)
                took[runtime] = time.perf_counter() - t0
                if measured:
                    wall[runtime] += took[runtime]
                    results[runtime].append(res)
                    if runtime == "ray":
                        sched_ms.append(res["sched_plan_batch_ms"])
            log(f"  {name} step {i}{'' if measured else ' (warm-up)'}: ray {took['ray']:.2f} s, "
                f"local {took['local']:.2f} s")
        info = {"ray_clients": ray_runner.info, "server_kernel_measured": ray_runner.server_kernel_measured,
                "local_backend": local_runner.backend}
    finally:
        ray_runner.close()
        if local_runner is not None:
            local_runner.close()
    rows = []
    for kind in KINDS:
        row = {"config": name, "mode": mode, "clients": clients,
               "servers": servers if mode == "dedicated" else clients,
               "participants": clients + (servers if mode == "dedicated" else 0),
               "round": kind, "layers": args.layers, "steps": args.steps,
               "tokens_per_rank": args.context,
               "docs_per_step": [sum(len(r) for r in b) for b in batches[args.warmup:]]}
        for runtime in ("ray", "local"):
            for key, value in mean_over_steps([s[kind] for s in results[runtime]]).items():
                row[f"{runtime}_{key}"] = value
            row[f"{runtime}_wall_s"] = wall[runtime]
        row["ray_sched_plan_batch_ms"] = statistics.fmean(sched_ms) if kind == "forward" else None
        row["ratio"] = row["ray_total_ms"] / row["local_total_ms"]
        row["same_client_bytes"] = row["ray_client_bytes_per_round"] == row["local_client_bytes_per_round"]
        row["info"] = info
        rows.append(row)
    return rows


COLUMNS = [  # (header, key, format); keys without a prefix are shared, the rest get "ray_"/"local_"
    ("plan", "plan_ms", "{:.1f}"),
    ("pack", "pack_ms", "{:.1f}"),
    ("a2a", "all_to_all_ms", "{:.1f}"),
    ("kernel", "kernel_ms", "{:.1f}"),
    ("unpack", "unpack_ms", "{:.1f}"),
    ("other", "other_ms", "{:.1f}"),
    ("total", "total_ms", "{:.1f}"),
    ("coll", "collectives_per_round", "{:.0f}"),
]


def render_table(rows) -> str:
    """Plain aligned text: per configuration and round kind, a Ray line and a local line."""
    headers = ["config", "P", "round", "runtime"] + [h for h, _, _ in COLUMNS] + ["ray/local"]
    lines = []
    for r in rows:
        for prefix in ("ray", "local"):
            cells = [r["config"] if prefix == "ray" else "", str(r["participants"]) if prefix == "ray" else "",
                     r["round"] if prefix == "ray" else "", prefix]
            for _, key, fmt in COLUMNS:
                value = r.get(f"{prefix}_{key}")
                cells.append("-" if value is None else fmt.format(value))
            cells.append(f"{r['ratio']:.2f}" if prefix == "ray" else "")
            lines.append(cells)
    widths = [max([len(h)] + [len(c[i]) for c in lines]) for i, h in enumerate(headers)]
    left = {0, 2, 3}

    def fmt_line(values):
        return "  ".join(v.ljust(w) if i in left else v.rjust(w)
                         for i, (v, w) in enumerate(zip(values, widths))).rstrip()
    out = [fmt_line(headers), fmt_line(["-" * w for w in widths])]
    for i, cells in enumerate(lines):
        if i and i % 4 == 0:
            out.append("")
        out.append(fmt_line(cells))
    return "\n".join(out)


def headline(rows) -> list[str]:
    lines = []
    for kind in KINDS:
        ratios = [r["ratio"] for r in rows if r["round"] == kind]
        lines.append(f"{kind}: ray/local total {min(ratios):.2f}-{max(ratios):.2f}x over "
                     f"{len(ratios)} configurations")
    fwd = [r for r in rows if r["round"] == "forward"]
    lines.append("plan (ms, ray round trip / local step_for / scheduler plan_batch): " + ", ".join(
        f"{r['config']} {r['ray_plan_ms']:.1f}/{r['local_plan_ms']:.1f}/{r['ray_sched_plan_batch_ms']:.1f}"
        for r in fwd))
    differ = [f"{r['config']} {r['round']}" for r in rows if not r["same_client_bytes"]]
    lines.append("client bytes per round equal on both runtimes (same plans): "
                 + ("yes" if not differ else "NO for " + ", ".join(differ)))
    return lines


def plot(rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"pack": "#4c72b0", "all_to_all": "#dd8452", "kernel": "#55a868", "unpack": "#c44e52",
              "other": "#8c8c8c"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=False)
    for ax, kind in zip(axes, KINDS):
        sel = [r for r in rows if r["round"] == kind]
        labels, x = [], 0
        positions = []
        for r in sel:
            for prefix in ("ray", "local"):
                bottom = 0.0
                for ph in PHASES:
                    h = r[f"{prefix}_{ph}_mean_ms"]
                    ax.bar(x, h, bottom=bottom, color=colors[ph], width=0.8,
                           label=ph if not positions else None)
                    bottom += h
                rest = max(0.0, r[f"{prefix}_total_ms"] - bottom)
                ax.bar(x, rest, bottom=bottom, color=colors["other"], width=0.8,
                       label="other" if not positions else None)
                positions.append(x)
                labels.append(f"{r['config']}\n{prefix}")
                x += 1
            x += 0.5
        ax.set_xticks(positions)
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("ms per round")
        ax.set_title(f"{kind} round: phases, mean over participants")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="in-place 2 and dedicated 2+1 only, 256 tokens per rank, 1 layer, 1 step")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "roundtrip.json",
                   help="where to write the results (default: bench/results/roundtrip.json)")
    p.add_argument("--png", type=Path, help="chart path (default: the JSON path with .png)")
    p.add_argument("--no-png", action="store_true", help="do not draw the chart")
    p.add_argument("--context", type=int, help="tokens per rank (default 4096; --quick 256)")
    p.add_argument("--layers", type=int, help="attention layers per step (default 4; --quick 1)")
    p.add_argument("--steps", type=int, help="measured steps (default 3; --quick 1)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps (default 1)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads per process, Ray workers and this process (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", nargs="+", metavar="MODE:CLIENTS[:SERVERS]",
                   help="override the configurations, e.g. inplace:3 dedicated:2:1")
    args = p.parse_args(argv)
    args.context = args.context or (256 if args.quick else 4096)
    args.layers = args.layers or (1 if args.quick else 4)
    args.steps = args.steps or (1 if args.quick else 3)
    for name in ("context", "layers", "steps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.configs:
        configs = []
        for spec in args.configs:
            parts = spec.split(":")
            try:
                mode, clients = parts[0], int(parts[1])
                servers = int(parts[2]) if len(parts) > 2 else 0
            except (IndexError, ValueError):
                p.error(f"bad configuration {spec!r}")
            if mode not in ("inplace", "dedicated") or clients < 1 or (mode == "dedicated" and servers < 1):
                p.error(f"bad configuration {spec!r}")
            configs.append((mode, clients, servers if mode == "dedicated" else 0))
        args.configs = configs
    else:
        args.configs = list(QUICK_CONFIGS if args.quick else CONFIGS)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import ray

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    started = False
    rows = []
    start = time.perf_counter()
    try:
        started = start_local_ray(os.cpu_count() or 2, object_store_mib=200, env_vars={
            "PYTHONPATH": _this_trees_worker_pythonpath()(TREE, ROOT), "OMP_NUM_THREADS": str(args.threads)})
        ship_by_value()  # BenchClient goes to the workers with its module's code
        for mode, clients, servers in args.configs:
            t0 = time.perf_counter()
            rows.extend(bench_config(mode, clients, servers, args, log))
            log(f"{config_name(mode, clients, servers)}: {time.perf_counter() - t0:.1f} s")
    finally:
        if started:
            ray.shutdown()
        torch.set_num_threads(threads_before)
    elapsed = time.perf_counter() - start

    finish(lambda: print(render_table(rows)), headline(rows), elapsed, args.json, {
        "benchmark": "roundtrip",
        "trace": TRACE,
        "shape": dict(SHAPE, dtype=str(DTYPE).replace("torch.", "")),
        "tokens_per_rank": args.context,
        "layers": args.layers,
        "steps": args.steps,
        "warmup": args.warmup,
        "seed": args.seed,
        "epsilon": EPSILON,
        "min_shard": MIN_SHARD,
        "torch_threads": args.threads,
        "quick": args.quick,
        "phase_aggregation": "max over participants per phase (*_mean_ms: mean over participants)",
        "plan_aggregation": "ray: min over clients of the step_for round trip (plan_max_ms: max)",
        "torch": torch.__version__,
        "ray": ray.__version__,
        "cpus": os.cpu_count(),
        "rows": rows,
    })
    if not args.no_png:
        png = args.png or args.json.with_suffix(".png")
        try:
            plot(rows, png)
            print(f"wrote {png}")
        except ImportError as exc:  # matplotlib missing: the table and JSON are the results
            print(f"no chart ({exc})")
    bad = [r for r in rows if not math.isfinite(r["ratio"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
