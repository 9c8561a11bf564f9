"""The time planner against the FLOP planner, in the same run, with the measured tables (issue 21).

Two parts, both on the CPU:

- **Speed** (``speed`` in the JSON): ``plan_batch`` at 256 and 1024 servers x 128K tokens per rank,
  in-place, ε = 0.05, both traces, Llama-3-8B's per-GPU shape at tp 8 (the shape the H200 tables
  were measured for), with and without the time model, the calls alternating (``--repeats`` pairs
  after a warm-up pair). CPU time (``time.process_time``: a busy machine does not inflate it),
  median; targets 8 / 30 ms (those of ``bench/planner.py``).
- **Cells** (``cells``): for each (model, trace, GPUs, tokens per rank), TP 8 x DP (no pipeline),
  the H200 measured tables (``distca_sim/data/profiles/h200``), ε = 0.05:
  - the plan of the step's batch (one plan of the ``dp`` ranks, what the simulator plans per
    layer) by each planner: predicted max/mean seconds (forward + backward, the time model of
    the tables), max over the level ``max(mean_s, piece_s)``, bytes of one layer's forward +
    backward rounds (``Plan.comm_bytes``), CPU ms to plan;
  - :func:`distca_sim.simulate.simulate` with ``planner="both"``: step time and speedup over
    WLB-ideal of each planner, and the simulator's breakdown (attention max and mean over ranks,
    exposed communication; WLB-ideal's exposed all-gather) to explain the cells where distca loses
    (``explain`` in each cell's JSON);
  - at ε = 0.05 (the default) and ε = 0. The time planner aims at the level in both (the FLOP plan
    at ε = 0 refined towards ``level_s``); ε, in predicted seconds, bounds what it accepts (a plan
    above ``(1 + ε) · level_s`` also refines the FLOP plan at ε; :func:`scheduler.plan_batch`).

Usage::

    python bench/time_planner.py            # 2 models x 2 traces x 64-512 GPUs x 128K, 512K
    python bench/time_planner.py --quick    # 8B only, 64 and 256 GPUs

Writes ``--json`` (default ``bench/results/time_planner.json``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from scheduler import plan_batch  # noqa: E402
from scheduler.time_cost import TimeModel  # noqa: E402
from distca_sim.hardware import get_gpu, get_model, load_attention_profile, measured_attention_profile  # noqa: E402
from distca_sim.simulate import ParallelConfig, Workload, format_table, simulate  # noqa: E402
from distca_sim.workloads import sample_batch  # noqa: E402
from bench.report import finish  # noqa: E402

K = 1024
EPSILON, TP, GPU = 0.05, 8, "h200"
EPSILONS = (0.05, 0.0)  # the default, then the tightest
TARGETS = ((256, 8.0), (1024, 30.0))
MODELS, TRACES = ("llama3-8b", "llama-34b"), ("pretrain", "prolong")
GPUS, CONTEXTS = (64, 128, 256, 512), (128 * K, 512 * K)


def tables(model: str):
    """The measured H200 tables of ``model`` at tp 8, its per-GPU cost, and their time model (with
    the simulator's kernel launch as the per-call cost)."""
    cost = get_model(model).cost_model(TP)
    folder = measured_attention_profile(GPU, cost)
    fwd, bwd = load_attention_profile(folder, cost)
    gpu = get_gpu(GPU).with_tables(fwd, bwd)
    return cost, gpu, TimeModel(fwd, bwd, call_s=gpu.kernel_launch_s)


def timed(call, repeats: int):
    """(median CPU ms, the last result) of ``repeats`` calls."""
    cpu, out = [], None
    for _ in range(repeats):
        c0 = time.process_time()
        out = call()
        cpu.append((time.process_time() - c0) * 1e3)
    return statistics.median(cpu), out


def bench_speed(repeats: int, log) -> list[dict]:
    cost, _, model = tables("llama3-8b")
    rows = []
    for trace in TRACES:
        for servers, target in TARGETS:
            batch = sample_batch(trace, servers, 128 * K, seed=0, step=0)
            calls = {"flops": lambda: plan_batch(batch, servers, cost=cost, epsilon=EPSILON),
                     "time": lambda: plan_batch(batch, servers, cost=cost, epsilon=EPSILON, time_model=model)}
            for call in calls.values():
                call()  # warm-up
            cpu = {name: [] for name in calls}
            for _ in range(repeats):
                for name, call in calls.items():
                    c0 = time.process_time()
                    call()
                    cpu[name].append((time.process_time() - c0) * 1e3)
            row = {"trace": trace, "servers": servers, "tokens_per_rank": 128 * K, "target_ms": target,
                   "num_docs": sum(len(x) for x in batch),
                   "flops_cpu_ms": statistics.median(cpu["flops"]), "time_cpu_ms": statistics.median(cpu["time"]),
                   "flops_cpu_best_ms": min(cpu["flops"]), "time_cpu_best_ms": min(cpu["time"])}
            row["meets"] = row["time_cpu_ms"] <= target
            rows.append(row)
            log(f"speed {trace:8s} {servers:4d}: flops {row['flops_cpu_ms']:.1f} ms, time {row['time_cpu_ms']:.1f} ms "
                f"(cpu, median of {repeats})")
    return rows


def plan_stats(batch, cost, model: TimeModel, time_planner: bool, epsilon: float) -> dict:
    servers = len(batch)
    ms, plan = timed(lambda: plan_batch(batch, servers, cost=cost, epsilon=epsilon,
                                        time_model=model if time_planner else None), 3)
    secs = model.server_seconds(plan.task_array, servers)
    level = model.bound(plan.doc_lens_flat, servers, plan.min_shard).level_s
    comm = plan.comm_bytes()
    return {"max_over_mean_s": float(secs.max() / secs.mean()), "max_over_level_s": float(secs.max() / level),
            "max_s": float(secs.max()), "bytes": int(comm["forward"]["total"] + comm["backward"]["total"]),
            "plan_cpu_ms": ms, "min_shard": plan.min_shard,
            "flop_max_over_mean": plan.imbalance()[1]}


def explain(row: dict, key: str) -> str:
    """Why a run is below WLB-ideal, from the simulator's breakdown: the seconds its attention
    imbalance costs (max - mean over ranks, the step waits for the slowest) against what
    WLB-ideal pays and distca does not (its exposed CP all-gather)."""
    r = row[key]
    return (f"{key}: step {r['step_s']:.3f} s vs WLB {row['wlb_step_s']:.3f} s; attention max - mean "
            f"{r['attention_s'] - r['attention_mean_s']:.3f} s (max/mean {r['attention_s'] / r['attention_mean_s']:.3f}), "
            f"exposed {r['exposed_s']:.3f} s; WLB-ideal's exposed all-gather {row['wlb_exposed_s']:.3f} s")


def bench_cells(models, gpus_list, contexts, epsilons, log) -> list[dict]:
    rows = []
    for name in models:
        cost, gpu, model = tables(name)
        for trace in TRACES:
            for gpus in gpus_list:
                for context in contexts:
                    t0 = time.perf_counter()
                    par = ParallelConfig.from_gpus(gpus, tp=TP)
                    work = Workload(trace, context)
                    batch = work.batch(par)[0]
                    cmp = simulate(name, gpu, par, work, systems=("distca", "wlb_ideal"),
                                   epsilons=epsilons, planner="both")
                    wlb = cmp.get("wlb_ideal")
                    row = {"model": name, "trace": trace, "gpus": gpus, "dp": par.dp, "context": context,
                           "recompute": cmp.recompute, "wlb_cp": wlb.details["cp"],
                           "wlb_step_s": wlb.step_time_s, "wlb_linear_s": wlb.linear_s,
                           "wlb_attention_s": wlb.attention_s, "wlb_exposed_s": wlb.comm_exposed_s}
                    for e in epsilons:
                        for which, system in (("flops", f"distca eps={e:g}"), ("time", f"distca-time eps={e:g}")):
                            r = cmp.get(system)
                            key = f"{which}@{e:g}"
                            row[key] = dict(plan_stats(batch, cost, model, which == "time", e),
                                            step_s=r.step_time_s,
                                            speedup_vs_wlb=r.throughput_tokens_s / wlb.throughput_tokens_s,
                                            linear_s=r.linear_s, attention_s=r.attention_s,
                                            attention_mean_s=float(np.mean(r.per_rank["attention_s"])),
                                            exposed_s=r.comm_exposed_s, idle_fraction=r.idle_fraction,
                                            ca_bytes_per_step=r.details["ca_bytes_per_step"])
                            if row[key]["speedup_vs_wlb"] < 1.0:
                                row.setdefault("explain", []).append(explain(row, key))
                    rows.append(row)
                    e0 = epsilons[0]
                    log(f"{name:9s} {trace:8s} {gpus:3d} GPUs {context // K:3d}K eps={e0:g}: flops "
                        f"{row[f'flops@{e0:g}']['speedup_vs_wlb']:.3f}x, time {row[f'time@{e0:g}']['speedup_vs_wlb']:.3f}x "
                        f"({time.perf_counter() - t0:.1f} s)")
    return rows


def render(speed, cells, epsilons) -> None:
    if speed:
        print("planning CPU ms (median), in-place, eps=0.05, 128K tokens per rank, llama3-8b tp8 shape:")
        print(format_table(["trace", "servers", "docs", "FLOP planner", "time planner", "target", "meets"],
                           [[r["trace"], str(r["servers"]), f"{r['num_docs']:,}", f"{r['flops_cpu_ms']:.1f}",
                             f"{r['time_cpu_ms']:.1f}", f"{r['target_ms']:g}", "yes" if r["meets"] else "NO"]
                            for r in speed]))
    for e in epsilons if cells else ():
        print(f"\ncells at eps={e:g} (h200 measured tables, TP 8 x DP; F = FLOP planner, T = time planner; "
              f"predicted max/mean seconds and GiB of one layer's plan):")
        table = []
        for r in cells:
            f, t = r[f"flops@{e:g}"], r[f"time@{e:g}"]
            table.append([r["model"], r["trace"], str(r["gpus"]), f"{r['context'] // K}K",
                          f"{f['max_over_mean_s']:.3f}", f"{t['max_over_mean_s']:.3f}",
                          f"{f['bytes'] / 2**30:.2f}", f"{t['bytes'] / 2**30:.2f}",
                          f"{f['plan_cpu_ms']:.1f}", f"{t['plan_cpu_ms']:.1f}",
                          f"{f['speedup_vs_wlb']:.3f}", f"{t['speedup_vs_wlb']:.3f}"])
        print(format_table(["model", "trace", "GPUs", "ctx", "F max/mean s", "T max/mean s", "F GiB", "T GiB",
                            "F plan ms", "T plan ms", "F vs WLB", "T vs WLB"], table))


def headline(speed, cells, epsilons) -> list[str]:
    lines = [f"time planner at {r['servers']} servers ({r['trace']}): {r['time_cpu_ms']:.1f} ms cpu "
             f"(FLOP planner {r['flops_cpu_ms']:.1f}); {'meets' if r['meets'] else 'MISSES'} the "
             f"{r['target_ms']:g} ms target" for r in speed]
    for e in epsilons if cells else ():
        f = [r[f"flops@{e:g}"]["speedup_vs_wlb"] for r in cells]
        t = [r[f"time@{e:g}"]["speedup_vs_wlb"] for r in cells]
        faster = sum(r[f"time@{e:g}"]["step_s"] <= r[f"flops@{e:g}"]["step_s"] for r in cells)
        lines.append(f"eps={e:g}, vs WLB-ideal over {len(cells)} cells: FLOP planner {min(f):.3f}-{max(f):.3f}x "
                     f"(below 1.0x in {sum(x < 1 for x in f)}), time planner {min(t):.3f}-{max(t):.3f}x "
                     f"(below 1.0x in {sum(x < 1 for x in t)}); the time planner's step at most the FLOP "
                     f"planner's in {faster} of {len(cells)}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="llama3-8b only, 64 and 256 GPUs")
    ap.add_argument("--repeats", type=int, default=9, help="alternating pairs timed per speed target")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-cells", action="store_true")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "time_planner.json")
    args = ap.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    start = time.perf_counter()
    speed = [] if args.skip_speed else bench_speed(args.repeats, log)
    models = ("llama3-8b",) if args.quick else MODELS
    gpus = (64, 256) if args.quick else GPUS
    cells = [] if args.skip_cells else bench_cells(models, gpus, CONTEXTS, EPSILONS, log)
    finish(lambda: render(speed, cells, EPSILONS), headline(speed, cells, EPSILONS), time.perf_counter() - start,
           args.json, {"benchmark": "time_planner", "gpu": GPU, "tp": TP, "epsilons": list(EPSILONS),
                       "quick": args.quick, "speed": speed, "cells": cells})
    return 0


if __name__ == "__main__":
    sys.exit(main())
