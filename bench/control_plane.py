"""Control-plane benchmark: one step of N in-place clients through the scheduler, in one process
and through the real Ray ``SchedulerActor``.

Every step, each of N clients reports its documents (``sample_batch(trace, N, tokens, seed=0,
step=s)``, Pretrain by default, 128K tokens per rank) and the Llama-3-8B attention shape
(``CostModel(32, 8, 128, 2)``, as in ``bench/planner.py``); the scheduler plans the batch
(``plan_batch``, in-place, ε = 0.05, ``min_shard`` 128), cuts every participant's part and encodes
it as msgpack, and each client gets its part back. A step is timed from the first report to the
last part returned; every measured step is a new batch, after one warm-up step.

1. ``in-process`` (N = 8 ... 1024): the pure :class:`~scheduler.coordinator.Coordinator` driven
   the way ``SchedulerActor.report`` drives it: N ``report`` calls, ``plan_work()`` (the actor runs
   it on a worker thread; here it runs inline), ``plan(cut=...)``, N ``answer`` calls. Columns
   (ms, median over steps): ``step`` (``best``; ``cpu ms``, ``time.process_time``, which other
   processes on a busy machine do not inflate) and its parts: ``intake`` (the N reports, the shape
   check of the last), ``plan`` and ``cut+enc`` (the coordinator's own ``plan_ms`` / ``cut_ms``:
   the scheduler's work as issue 9 counts it), ``other`` (the rest: the group epoch, the record
   of the plan, the answers); ``after last``: from the last report to the last part (what a step
   waits for once every client reported; through Ray, reports arrive one RPC at a time and the
   intake overlaps them). Target (issue 9): at most 60 ms at 1024 clients, verdicts for the whole
   step and for plan + cut + encode.
2. ``ray`` (N = 8 ... 64): a job started with :func:`distca_server.launch` (in-place, not
   detached) on a local Ray instance of its own (2 CPUs; a Ray this process is connected to
   already, e.g. a test's, is used as it is); the driver registers N
   clients, then per step makes the call ``RayClientRuntime.step_for`` makes,
   ``scheduler.report.remote(encode_report(step, 0, rank, doc_lens, shape, token))``, from N asyncio
   tasks and awaits every answer. Beside each step, in the same run and alternating which goes
   first, N plain ``scheduler.ping.remote()`` calls from N asyncio tasks. Columns: ``step ms`` and
   ``pings ms`` (medians, and bests), ``step/pings`` (the median over steps of each step's time over
   its pings' time: the target, at most 1.5x), ``cpu step/pings`` (CPU seconds of the driver and
   the scheduler actor's whole process, every thread, in nanoseconds from the process's CPU-time
   clock, over all steps against over all ping rounds: what a loaded machine's scheduling does
   not change), and the actor's own ``plan`` and ``cut+enc`` ms
   of the last step.

Parts travel as msgpack bytes: the benchmark checks that every answer (through Ray, the answer
message itself, :mod:`scheduler.messages`) is ``bytes`` and that each part decodes with
:meth:`PlanPart.from_msgpack` to that client's part of one plan (same plan id).

Usage::

    python bench/control_plane.py            # in-process N = 8..1024, Ray N = 8..64
    python bench/control_plane.py --quick    # in-process N = 8, 64; Ray N = 8; 2 steps (CI smoke)
    python bench/control_plane.py --no-ray   # the in-process part alone

Writes JSON to ``--json`` (default ``bench/results/control_plane.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scheduler.config import JobConfig, PlanConfig  # noqa: E402
from scheduler.coordinator import Coordinator  # noqa: E402
from scheduler.messages import decode_answer, encode_report  # noqa: E402
from scheduler.parts import PlanPart  # noqa: E402
from distca_sim.workloads import TRACE_NAMES, sample_batch  # noqa: E402
from bench.planner import COST, MIN_SHARD, render_small  # noqa: E402
from bench.report import finish  # noqa: E402
from bench.roundtrip_runtimes import start_local_ray  # noqa: E402
from distca_cli.connect import worker_pythonpath  # noqa: E402

CLIENTS = (8, 16, 32, 64, 128, 256, 512, 1024)
RAY_CLIENTS = (8, 16, 32, 64)
QUICK_CLIENTS, QUICK_RAY_CLIENTS = (8, 64), (8,)
TOKENS, EPSILON = 131072, 0.05
PLAN = PlanConfig(mode="inplace", epsilon=EPSILON, min_shard=MIN_SHARD)
TARGET_CLIENTS, TARGET_MS = 1024, 60.0  # in-process step at 1024 clients
RAY_TARGET_RATIO = 1.5  # Ray step / N plain pings, N <= 64
SHAPE = {"cost": COST.to_wire(), "device_type": "cuda"}
JOB = "bench-control-plane"


def check_answers(answers: list[dict], step: int, num_clients: int) -> int:
    """Check that each client ``r`` got msgpack bytes decoding to its own part of one plan of
    ``step``; returns the total part bytes.

    Raises:
        AssertionError: an error answer, a part that is not bytes, or parts that disagree.
    """
    ids, total = set(), 0
    for rank, answer in enumerate(answers):
        assert "error" not in answer, f"rank {rank}: {answer}"
        data = answer["part"]
        assert type(data) is bytes, f"rank {rank}: part is {type(data).__name__}, not msgpack bytes"
        part = PlanPart.from_msgpack(data)
        assert (part.step, part.batch, part.rank, part.num_ranks) == (step, 0, rank, num_clients)
        assert answer["group"]["world_rank"] == rank and answer["group"]["world_size"] == num_clients
        ids.add(part.plan_id)
        total += len(data)
    assert len(ids) == 1, f"parts of {len(ids)} different plans in one step"
    return total


def _summary(row: dict, key: str, runs: list[float]) -> None:
    row[f"{key}_ms"] = statistics.median(runs)
    row[f"{key}_best_ms"] = min(runs)
    row[f"{key}_ms_runs"] = runs


# ---- in-process -----------------------------------------------------------------------------------
def bench_in_process(trace: str, num_clients: int, steps: int) -> dict:
    """Median (and best, CPU) ms of one step of ``num_clients`` in-place clients through the pure
    coordinator, with its parts; every answer checked after the step's timing."""
    coord = Coordinator(JOB, config=JobConfig(plan=PLAN))
    for rank in range(num_clients):
        coord.register_client(rank, num_clients, {"incarnation": f"bench-{rank}"})
    batches = [sample_batch(trace, num_clients, TOKENS, seed=0, step=s) for s in range(steps + 1)]
    runs = {k: [] for k in ("step", "cpu", "intake", "plan", "cut", "other", "after_last", "work")}
    part_bytes = 0
    for step, batch in enumerate(batches):
        w0, c0 = time.perf_counter(), time.process_time()
        planned = False
        for rank in range(num_clients):
            last = time.perf_counter()
            planned = coord.report(step, 0, rank, batch[rank], SHAPE).plan or planned
        intake = time.perf_counter()
        work = coord.plan_work(step, 0)
        cut = work() if work is not None else None
        coord.plan(step, 0, cut=cut)
        answers = [coord.answer(step, 0, rank) for rank in range(num_clients)]
        end = time.perf_counter()
        wall, cpu = (end - w0) * 1e3, (time.process_time() - c0) * 1e3
        assert planned and cut is not None and cut.error is None
        part_bytes = check_answers(answers, step, num_clients)
        if step == 0:  # warm-up
            continue
        intake_ms = (intake - w0) * 1e3
        for key, value in (("step", wall), ("cpu", cpu), ("intake", intake_ms), ("plan", cut.plan_ms),
                           ("cut", cut.cut_ms), ("other", wall - intake_ms - cut.plan_ms - cut.cut_ms),
                           ("after_last", (end - last) * 1e3), ("work", cut.plan_ms + cut.cut_ms)):
            runs[key].append(value)
    row = {"path": "in-process", "trace": trace, "clients": num_clients, "tokens_per_rank": TOKENS,
           "num_docs": sum(len(x) for x in batches[-1]), "steps": steps, "part_bytes": part_bytes,
           "imbalance_after": coord.last["imbalance_after"], "num_tasks": coord.last["num_tasks"]}
    for key, values in runs.items():
        _summary(row, key, values)
    if num_clients == TARGET_CLIENTS:
        row["target_ms"] = TARGET_MS
        row["meets"] = row["step_ms"] <= TARGET_MS
        row["work_meets"] = row["work_ms"] <= TARGET_MS
    return row


# ---- through Ray ----------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)


def process_cpu_clock(pid: int) -> int:
    """The CPU-time clock of process ``pid`` (``clock_getcpuclockid``), for ``time.clock_gettime``.

    Not ``/proc/<pid>/stat``: its utime + stime count clock ticks (10 ms), and a step or a round
    of pings takes a few ms, so each interval read 0 or 10 ms and the ratio was mostly
    quantization. Nor the threads' ``schedstat``: a thread that ended between two readings would
    take its time with it. The process clock counts every thread of the process, ended ones
    too, in nanoseconds (Linux lets any process read another's)."""
    clock = ctypes.c_int()
    if _libc.clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"clock_getcpuclockid({pid}): {os.strerror(err)}")
    return clock.value


def process_cpu_s(clock: int) -> float:
    """CPU seconds (user + system, every thread) of the process whose ``process_cpu_clock`` this is."""
    return time.clock_gettime(clock)


async def _gather_ms(calls, actor_clock: int) -> tuple[float, float, list]:
    """Start every call (a ``.remote()`` ref factory) from its own asyncio task; ms until the last
    answer, CPU ms the driver and the actor (``actor_clock``: its ``process_cpu_clock``) used
    meanwhile, and the answers."""
    async def one(call):
        return await call()
    cpu0 = time.process_time() + process_cpu_s(actor_clock)
    t0 = time.perf_counter()
    answers = await asyncio.gather(*(one(call) for call in calls))
    wall = (time.perf_counter() - t0) * 1e3
    return wall, (time.process_time() + process_cpu_s(actor_clock) - cpu0) * 1e3, answers


async def _ray_rounds(scheduler, actor_clock: int, batches, num_clients: int, tokens: list[str]) -> dict:
    runs = {"step": [], "pings": [], "ratio": [], "step_cpu": [], "pings_cpu": []}
    part_bytes = 0
    for step, batch in enumerate(batches):
        reports = [lambda r=r: scheduler.report.remote(encode_report(step, 0, r, batch[r], SHAPE, tokens[r]))
                   for r in range(num_clients)]
        pings = [scheduler.ping.remote for _ in range(num_clients)]
        if step % 2:  # alternate which goes first: both see the same machine load
            ping_ms, ping_cpu, _ = await _gather_ms(pings, actor_clock)
            step_ms, step_cpu, answers = await _gather_ms(reports, actor_clock)
        else:
            step_ms, step_cpu, answers = await _gather_ms(reports, actor_clock)
            ping_ms, ping_cpu, _ = await _gather_ms(pings, actor_clock)
        assert all(type(a) is bytes for a in answers), "the answer message must be msgpack bytes"
        part_bytes = check_answers([decode_answer(a) for a in answers], step, num_clients)
        if step > 0:  # step 0 warms up
            for key, value in (("step", step_ms), ("pings", ping_ms), ("ratio", step_ms / ping_ms),
                               ("step_cpu", step_cpu), ("pings_cpu", ping_cpu)):
                runs[key].append(value)
    return {"runs": runs, "part_bytes": part_bytes}


def bench_ray(trace: str, num_clients: int, steps: int) -> dict:
    """A fresh in-place job (its scheduler actor alone); ``num_clients`` clients registered by
    the driver; ``steps`` measured steps after a warm-up, each beside ``num_clients`` pings."""
    import ray

    from distca_server import launch, shutdown
    job = launch(JOB, config=JobConfig(plan=PLAN), detached=False)
    scheduler = job["scheduler"]
    try:
        tokens = [cfg["token"] for cfg in ray.get([
            scheduler.register_client.remote(r, num_clients, {"incarnation": f"bench-{r}"})
            for r in range(num_clients)])]
        pid = ray.get(scheduler.status.remote())["pid"]
        batches = [sample_batch(trace, num_clients, TOKENS, seed=0, step=s) for s in range(steps + 1)]
        out = asyncio.run(_ray_rounds(scheduler, process_cpu_clock(pid), batches, num_clients, tokens))
        last = ray.get(scheduler.status.remote())["last"]
    finally:
        shutdown(JOB)
    row = {"path": "ray", "trace": trace, "clients": num_clients, "tokens_per_rank": TOKENS,
           "num_docs": sum(len(x) for x in batches[-1]), "steps": steps, "part_bytes": out["part_bytes"],
           "actor_plan_ms": last["plan_ms"], "actor_cut_ms": last["cut_ms"]}
    runs = out["runs"]
    for key in ("step", "pings"):
        _summary(row, key, runs[key])
    row["ratio"] = statistics.median(runs["ratio"])  # of each step over the pings beside it
    row["ratio_runs"] = runs["ratio"]
    row["cpu_ratio"] = sum(runs["step_cpu"]) / sum(runs["pings_cpu"])
    row["step_cpu_ms"], row["pings_cpu_ms"] = (statistics.fmean(runs["step_cpu"]),
                                               statistics.fmean(runs["pings_cpu"]))
    row["target_ratio"] = RAY_TARGET_RATIO
    row["meets"] = row["ratio"] <= RAY_TARGET_RATIO
    return row


# ---- output ---------------------------------------------------------------------------------------
def _verdict(row: dict) -> str:
    return "" if "meets" not in row else ("meets" if row["meets"] else "MISSES")


IN_PROCESS_COLUMNS = [("clients", "clients", "{}"), ("docs", "num_docs", "{:,}"),
                      ("step ms", "step_ms", "{:.2f}"), ("best", "step_best_ms", "{:.2f}"),
                      ("cpu ms", "cpu_ms", "{:.2f}"), ("intake", "intake_ms", "{:.2f}"),
                      ("plan", "plan_ms", "{:.2f}"), ("cut+enc", "cut_ms", "{:.2f}"),
                      ("other", "other_ms", "{:.2f}"), ("after last", "after_last_ms", "{:.2f}"),
                      ("part KiB", "part_kib", "{:,.0f}"), ("target", "target", "{}")]
RAY_COLUMNS = [("clients", "clients", "{}"), ("step ms", "step_ms", "{:.2f}"),
               ("best", "step_best_ms", "{:.2f}"), ("pings ms", "pings_ms", "{:.2f}"),
               ("best", "pings_best_ms", "{:.2f}"), ("step/pings", "ratio", "{:.2f}"),
               ("cpu step/pings", "cpu_ratio", "{:.2f}"),
               ("actor plan", "actor_plan_ms", "{:.2f}"), ("actor cut+enc", "actor_cut_ms", "{:.2f}"),
               ("target", "target", "{}")]


def _cells(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        target = (f"<= {r['target_ms']:g} ms: step {_verdict(r)}, plan+cut+enc "
                  f"{'meets' if r['work_meets'] else 'MISSES'}" if "target_ms" in r else
                  f"<= {r['target_ratio']:g}x: {_verdict(r)}" if "target_ratio" in r else "-")
        out.append(dict(r, part_kib=r["part_bytes"] / 1024, target=target))
    return out


def headline(in_process: list[dict], ray_rows: list[dict]) -> list[str]:
    lines = []
    for r in in_process:
        if "target_ms" in r:
            lines.append(f"in-process step at {r['clients']} clients x {r['tokens_per_rank'] // 1024}K "
                         f"tokens ({r['trace']}): {r['step_ms']:.1f} ms median (best {r['step_best_ms']:.1f}, "
                         f"cpu {r['cpu_ms']:.1f}; {r['after_last_ms']:.1f} after the last report); "
                         f"{_verdict(r)} the {r['target_ms']:g} ms target")
            lines.append(f"scheduler's work (plan + cut + encode) at {r['clients']} clients: {r['work_ms']:.1f} ms "
                         f"median (plan {r['plan_ms']:.1f} + cut+enc {r['cut_ms']:.1f}); "
                         f"{'meets' if r['work_meets'] else 'MISSES'} the {r['target_ms']:g} ms target")
    for r in ray_rows:
        lines.append(f"ray step at {r['clients']} clients: {r['step_ms']:.1f} ms, {r['ratio']:.2f} x the "
                     f"{r['clients']} pings beside it (median of per-step ratios; pings {r['pings_ms']:.1f} ms; "
                     f"cpu {r['cpu_ratio']:.2f} x); {_verdict(r)} the {r['target_ratio']:g}x target")
    lines.append("parts: msgpack bytes, each decoded to its client's part of one plan: yes")
    return lines


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="in-process 8 and 64 clients, Ray 8 clients, 2 measured steps (CI smoke)")
    p.add_argument("--trace", choices=TRACE_NAMES, default="pretrain")
    p.add_argument("--clients", nargs="+", type=int, help="override the in-process client counts")
    p.add_argument("--ray-clients", nargs="+", type=int, help="override the Ray client counts")
    p.add_argument("--steps", type=int, help="measured steps after a warm-up (default 9, quick 2)")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray part")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "control_plane.json",
                   help="where to write the results (default: bench/results/control_plane.json)")
    args = p.parse_args(argv)
    args.steps = args.steps or (2 if args.quick else 9)
    args.clients = args.clients or list(QUICK_CLIENTS if args.quick else CLIENTS)
    args.ray_clients = [] if args.no_ray else (args.ray_clients or list(QUICK_RAY_CLIENTS if args.quick
                                                                          else RAY_CLIENTS))
    if args.steps < 1 or min(args.clients + args.ray_clients) < 1:
        p.error("need --steps >= 1 and client counts >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)
    start = time.perf_counter()
    in_process, ray_rows = [], []
    for n in args.clients:
        in_process.append(bench_in_process(args.trace, n, args.steps))
        log(f"in-process {n:5d} clients: {in_process[-1]['step_ms']:.1f} ms")
    if args.ray_clients:
        started = start_local_ray(2, {"PYTHONPATH": worker_pythonpath(ROOT)}, object_store_mib=100)
        try:
            for n in args.ray_clients:
                ray_rows.append(bench_ray(args.trace, n, args.steps))
                log(f"ray {n:5d} clients: {ray_rows[-1]['step_ms']:.1f} ms, pings {ray_rows[-1]['pings_ms']:.1f} ms")
        finally:
            if started:
                import ray
                ray.shutdown()
    elapsed = time.perf_counter() - start

    def show():
        print(f"in-process: one step of N in-place clients through the Coordinator "
              f"({args.trace}, {TOKENS // 1024}K tokens per rank, eps={EPSILON:g}; ms, median of "
              f"{args.steps} steps):")
        print(render_small(_cells(in_process), IN_PROCESS_COLUMNS))
        if ray_rows:
            print()
            print("ray: one step through SchedulerActor from N asyncio tasks, beside N plain pings "
                  "(ms, median):")
            print(render_small(_cells(ray_rows), RAY_COLUMNS))

    finish(show, headline(in_process, ray_rows), elapsed, args.json, {
        "benchmark": "control_plane", "cost_model": COST.to_dict(), "mode": "inplace",
        "epsilon": EPSILON, "min_shard": MIN_SHARD, "trace": args.trace, "tokens_per_rank": TOKENS,
        "steps": args.steps, "quick": args.quick, "seed": 0,
        "in_process": in_process, "ray": ray_rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
