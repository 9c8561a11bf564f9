"""Soak: hundreds of small steps of a distca job on a local Ray instance while faults are injected;
every output checked against the float64 reference, actor memory measured at the start and end.

Job: dedicated mode, 2 clients and 2 attention servers (Ray restarts a killed server, and a
killed scheduler), timeout ``--timeout`` (3 s; quick 2 s), failure grace 0.5 s, ``min_shard`` 8. Each step,
every client draws its own batch (1-4 documents of 8-160 tokens, seeded by step and rank; 4
query heads, 2 KV heads, head_dim 16, float32), runs ``--layers`` attends and one backward, and
compares out, dQ, dK, dV with the float64 reference: an output whose max error is more than 1e-4
of its max magnitude is *wrong* (a correct float32 run is ~1e-7).

Faults, one every ``--every`` steps (25; quick: 10), in this order, over and over (``--quick``: the
three ``QUICK_FAULTS``). The driver runs the clients in lock-step, as DDP forces a
training loop to: each step starts on both clients together and waits for both.

- ``client kill idle``: client 1's actor is killed between two steps; client 0's next step fails
  (client 1 never reports it), and the driver starts a new client 1 meanwhile (a restarted training
  worker), which registers while client 0 still waits in that step and joins the loop at the next
  one (before the step protocol, the two stayed a step apart from then on: every later step failed);
- ``client kill``: the same, with client 1 killed during a step (both clients hold its plan);
- ``server kill``: server 1's process is killed during a step; Ray restarts it, it registers again
  and rejoins a later step (meanwhile the steps run on server 0);
- ``scheduler kill idle``: the scheduler is killed between two steps; Ray restarts it and the next
  step must run (a restart with no step in flight costs no step);
- ``scheduler kill mid-step``: the scheduler is killed while both clients hold the step's plan,
  before its rounds; the step in flight fails on every participant, Ray restarts the scheduler and
  every participant registers again;
- ``client pause``: client 0's process is stopped (SIGSTOP) during a step for the timeout + 1 s,
  then continued: its peers fail the step naming it, it fails too, all go on;
- ``late client``: client 1 has its plan but starts its round the timeout + 1 s after client 0.

Faults that strike a step in flight let both clients get the step's plan and hold it for a moment
(``HOLD_S``) before the rounds while the fault strikes.

A fault's *lost steps* are the steps from the one it struck until the next exact step; the target
is the struck step alone (0 for the idle scheduler kill). A fault is *survived* when, within
``--recover`` steps after it, a step runs on every client with every output exact. A step whose
client does not answer within 120 s is a *hang* (target 0). Failed steps are the steps in which a
client raised (``DistCAError`` naming the lost participant); a wrong output is never acceptable,
failed step or not.

Usage::

    python bench/soak.py            # 500 steps, 19 faults (about 2 minutes on 2 CPU cores)
    python bench/soak.py --quick    # 40 steps, 3 faults (CI smoke)

Prints a table of the faults (lost steps per fault kind) and a summary (steps, faults injected and
survived, wrong outputs, hangs, each actor's RSS at the start and end; the JSON also has it every
100 steps) and writes JSON to ``--json`` (default ``bench/results/soak.json``).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.report import finish  # noqa: E402
from bench.roundtrip_runtimes import start_local_ray  # noqa: E402
from distca_cli.connect import worker_pythonpath  # noqa: E402

NAME = "soak"
WRONG = 1e-4  # relative max error above which an output is wrong (float32 runs are ~1e-7)
FAULTS = ("client kill idle", "client kill", "server kill", "scheduler kill idle", "scheduler kill mid-step",
          "client pause", "late client")
QUICK_FAULTS = ("server kill", "client pause", "late client")
# Seconds both clients hold the step's plan before its rounds while the fault strikes (a third of
# the way in): a Ray actor's death reaches the calls in flight to it ~1.7 s after the kill.
HOLD_S = {"server kill": 0.6, "client pause": 0.6, "client kill": 0.6, "scheduler kill mid-step": 3.0}
HANG_S = 120.0  # a client that does not answer a step within this hangs


class SoakClient:
    """One training worker of the soak (a Ray actor; shipped by value)."""

    def __init__(self, name: str, rank: int, world_size: int, timeout_s: float):
        from distca_client import DistCAClient
        self.rank = rank
        self.client = DistCAClient.connect(name, rank=rank, world_size=world_size, timeout_s=timeout_s)

    def pid(self) -> int:
        return os.getpid()

    def step(self, step: int, layers: int, late_s: float = 0.0) -> dict:
        """One step on this rank's batch of ``step``; returns ``ok``, the number of ``wrong``
        outputs and the worst relative error, or the error raised."""
        import torch

        from distca_client import DistCAError
        from distca_server.refs import attend_with_grads_ref
        from distca_server.wire import RowFormat
        rng = random.Random(step * 1000 + self.rank)
        lens = [rng.randint(8, 160) for _ in range(rng.randint(1, 4))]
        g = torch.Generator().manual_seed(step * 1000 + self.rank)
        T = sum(lens)
        cases = [[torch.randn(T, h, 16, generator=g) for h in (4, 2, 2, 4)] for _ in range(layers)]
        leaves = [[t.clone().requires_grad_() for t in c[:3]] for c in cases]
        try:
            if late_s:
                self.client._runtime.step_for(lens, RowFormat.of(*leaves[0][:2]), torch.device("cpu"))
                time.sleep(late_s)
            outs = [self.client.attend(q, k, v, lens) for q, k, v in leaves]
            sum((o * c[3]).sum() for o, c in zip(outs, cases)).backward()
        except (DistCAError, ValueError) as exc:
            return {"ok": False, "type": type(exc).__name__, "message": str(exc)[:300]}
        wrong, worst = 0, 0.0
        for (q, k, v), out, c in zip(leaves, outs, cases):
            want = attend_with_grads_ref(c[0], c[1], c[2], lens, c[3], 16 ** -0.5)
            for got, ref in zip((out, q.grad, k.grad, v.grad), want):
                err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
                worst = max(worst, err)
                wrong += err > WRONG
        return {"ok": True, "wrong": wrong, "error": worst, "outputs": 4 * layers}


def rss_mib(pid: int) -> float | None:
    """Resident set size of process ``pid`` in MiB (Linux ``/proc``), None if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Soak:
    """The job, its clients and the step loop."""

    def __init__(self, args, log):
        import ray

        from distca_server import launch
        self.ray, self.args, self.log = ray, args, log
        from scheduler.config import JobConfig, PlanConfig
        config = JobConfig(servers=2, timeout_s=args.timeout, failure_grace_s=0.5, server_restarts=20,
                           plan=PlanConfig(mode="dedicated", min_shard=8))
        self.job = launch(name=NAME, config=config, detached=False, server_options={"num_cpus": 0})
        self.actor = ray.remote(num_cpus=0)(SoakClient)
        self.clients = [self._client(r) for r in range(2)]
        self.ok = self.failed = self.wrong = self.outputs = self.hangs = 0
        self.worst = 0.0

    def _client(self, rank: int):
        handle = self.actor.remote(NAME, rank, 2, self.args.timeout)
        self.ray.get(handle.pid.remote(), timeout=120)  # constructed: registered with the job
        return handle

    def pids(self) -> dict[str, int]:
        ray = self.ray
        out = {"scheduler": ray.get(self.job["scheduler"].status.remote(), timeout=60)["pid"]}
        for i, s in enumerate(self.job["servers"]):
            out[f"server {i}"] = ray.get(s.stats.remote(), timeout=60)["pid"]
        for r, c in enumerate(self.clients):
            out[f"client {r}"] = ray.get(c.pid.remote(), timeout=60)
        return out

    def step(self, i: int, fault: str | None = None) -> bool:
        """Run step ``i`` (injecting ``fault`` into it); True if every client ran it exactly."""
        ray, T = self.ray, self.args.timeout
        # Faults hit a step in flight: both clients get the step's plan, then hold it for HOLD_S
        # before the rounds while the fault strikes (a late client holds past the timeout instead).
        hold = HOLD_S.get(fault, 0.0)
        late = [0.0, T + 1.0] if fault == "late client" else [hold, hold]
        pid = ray.get(self.clients[0].pid.remote()) if fault == "client pause" else None
        if fault == "scheduler kill idle":  # between two steps: the clients find it gone at their report
            ray.kill(self.job["scheduler"], no_restart=False)
        elif fault == "client kill idle":  # between two steps: its call of this step fails as "killed"
            gone = ray.get(self.clients[1].pid.remote(), timeout=60)
            ray.kill(self.clients[1], no_restart=True)
            while Path(f"/proc/{gone}").exists():  # ray.kill only asks: the step must not reach it
                time.sleep(0.05)
        refs = [c.step.remote(i, self.args.layers, late[r]) for r, c in enumerate(self.clients)]
        if hold:
            time.sleep(hold / 3)
        if fault == "client pause":
            os.kill(pid, signal.SIGSTOP)
            time.sleep(T + 1.0)
            os.kill(pid, signal.SIGCONT)
        elif fault == "server kill":
            ray.kill(self.job["servers"][1], no_restart=False)
        elif fault == "scheduler kill mid-step":
            ray.kill(self.job["scheduler"], no_restart=False)
        if fault in ("client kill", "client kill idle"):
            if fault == "client kill":
                ray.kill(self.clients[1], no_restart=True)
            # a restarted training worker registers again while client 0 still waits in this step
            self.clients[1] = self._client(1)
        results = []
        for ref in refs:
            try:
                results.append(ray.get(ref, timeout=HANG_S))
            except ray.exceptions.RayActorError:  # the killed client
                results.append({"ok": False, "type": "killed", "message": "killed"})
            except ray.exceptions.GetTimeoutError:
                self.hangs += 1
                results.append({"ok": False, "type": "hang", "message": f"no answer within {HANG_S:g} s"})
        if fault and fault.startswith("scheduler kill"):
            self._wait_scheduler()
        for r in results:
            if r["ok"]:
                self.wrong += r["wrong"]
                self.outputs += r["outputs"]
                self.worst = max(self.worst, r["error"])
        exact = all(r["ok"] and r["wrong"] == 0 for r in results)
        self.ok += exact
        self.failed += not all(r["ok"] for r in results)
        if not all(r["ok"] for r in results) and self.args.verbose:
            self.log(f"step {i}: " + " | ".join(r.get("message", "ok")[:160] for r in results))
        return exact

    def _wait_scheduler(self) -> None:
        deadline = time.monotonic() + 120
        while True:
            try:
                self.ray.get(self.job["scheduler"].ping.remote(), timeout=60)
                return
            except self.ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def close(self) -> None:
        from distca_server import shutdown
        shutdown(NAME)


def schedule(steps: int, every: int, quick: bool) -> dict[int, str]:
    """``{step index: fault}``: one fault every ``every`` steps, cycling through the kinds."""
    kinds = QUICK_FAULTS if quick else FAULTS
    at = range(every, steps - 1, every)  # the last step is left to show the last recovery
    return {i: kinds[n % len(kinds)] for n, i in enumerate(at) if not quick or n < len(kinds)}


def lost_per_kind(rows: list[dict]) -> dict[str, dict]:
    """Per fault kind: how often it struck, and the steps lost each time (min, max, mean)."""
    out = {}
    for kind in dict.fromkeys(r["fault"] for r in rows):
        lost = [r["failed_steps"] for r in rows if r["fault"] == kind]
        out[kind] = {"faults": len(lost), "lost_min": min(lost), "lost_max": max(lost),
                     "lost_mean": sum(lost) / len(lost),
                     "survived": sum(r["survived"] for r in rows if r["fault"] == kind)}
    return out


def run(args, log) -> dict:
    soak = Soak(args, log)
    try:
        for i in range(args.warmup):
            soak.step(i)
        soak.ok = soak.failed = soak.wrong = soak.outputs = soak.hangs = 0
        pids = soak.pids()
        rss_start = {who: rss_mib(pid) for who, pid in pids.items()}
        faults = schedule(args.steps, args.every, args.quick)
        rows, pending, trace = [], None, []
        t0 = time.perf_counter()
        for i in range(args.warmup, args.warmup + args.steps):
            fault = faults.get(i - args.warmup)
            if fault is not None:
                log(f"step {i}: {fault}")
                pending = {"fault": fault, "step": i, "failed_steps": 0, "survived": False, "recovered_at": None}
                rows.append(pending)
            exact = soak.step(i, fault)
            if pending is not None:  # survived: an exact step after the fault's own step
                if not exact:
                    pending["failed_steps"] += 1
                elif i > pending["step"]:
                    pending.update(survived=True, recovered_at=i)
                    pending = None
                if pending is not None and i - pending["step"] >= args.recover:
                    pending = None  # not survived
            if (i + 1 - args.warmup) % 100 == 0:
                trace.append({"step": i + 1 - args.warmup, **{who: rss_mib(pid) for who, pid in soak.pids().items()}})
                log(f"{i + 1 - args.warmup} steps, {soak.failed} failed, {soak.wrong} wrong outputs, RSS MiB "
                    + ", ".join(f"{who} {v:.0f}" for who, v in trace[-1].items() if who != "step" and v))
        elapsed = time.perf_counter() - t0
        pids_end = soak.pids()
        rss_end = {who: rss_mib(pid) for who, pid in pids_end.items()}
    finally:
        soak.close()
    restarted = sorted(who for who in pids if pids_end.get(who) != pids[who])
    return {"benchmark": "soak", "quick": args.quick, "steps": args.steps, "warmup_steps": args.warmup,
            "layers": args.layers, "timeout_s": args.timeout, "recover_steps": args.recover,
            "every": args.every, "fault_kinds": lost_per_kind(rows), "hangs": soak.hangs,
            "exact_steps": soak.ok, "failed_steps": soak.failed, "wrong_outputs": soak.wrong,
            "outputs_checked": soak.outputs, "worst_relative_error": soak.worst,
            "faults": rows, "faults_injected": len(rows), "faults_survived": sum(r["survived"] for r in rows),
            "rss_mib": {who: {"start": rss_start[who], "end": rss_end.get(who)} for who in rss_start},
            "rss_trace_mib": trace,
            "restarted": restarted, "steps_per_s": args.steps / elapsed, "loop_s": elapsed}


def render(result: dict) -> str:
    lines = [f"{'fault':<23}  {'faults':>6}  {'lost steps min':>14}  {'max':>4}  {'mean':>5}  {'survived':>8}",
             f"{'-' * 23}  {'-' * 6}  {'-' * 14}  {'-' * 4}  {'-' * 5}  {'-' * 8}"]
    for kind, k in result["fault_kinds"].items():
        lines.append(f"{kind:<23}  {k['faults']:>6}  {k['lost_min']:>14}  {k['lost_max']:>4}  "
                     f"{k['lost_mean']:>5.2f}  {k['survived']:>8}")
    lines.append("")
    rss = result["rss_mib"]
    head = ["steps", "exact", "failed", "faults injected", "faults survived", "wrong outputs", "hangs",
            "outputs checked"]
    vals = [result["steps"], result["exact_steps"], result["failed_steps"], result["faults_injected"],
            result["faults_survived"], result["wrong_outputs"], result["hangs"], result["outputs_checked"]]
    widths = [max(len(h), len(f"{v:,}")) for h, v in zip(head, vals)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines.append("  ".join(f"{v:,}".rjust(w) for v, w in zip(vals, widths)))
    lines.append("")
    lines.append(f"{'actor':<10}  {'RSS start MiB':>13}  {'RSS end MiB':>11}  restarted")
    lines.append(f"{'-' * 10}  {'-' * 13}  {'-' * 11}  ---------")

    def mib(x):
        return "?" if x is None else f"{x:,.0f}"
    for who, v in rss.items():
        lines.append(f"{who:<10}  {mib(v['start']):>13}  {mib(v['end']):>11}  {'yes' if who in result['restarted'] else ''}")
    return "\n".join(lines)


def headline(result: dict) -> list[str]:
    survived = f"{result['faults_survived']} of {result['faults_injected']} faults survived"
    return [f"{result['steps']} steps in {result['loop_s']:.0f} s ({result['steps_per_s']:.1f} steps/s), "
            f"{survived}, {result['failed_steps']} failed steps, {result['hangs']} hangs, "
            f"{result['wrong_outputs']} wrong outputs of "
            f"{result['outputs_checked']:,} checked (worst relative error {result['worst_relative_error']:.1e})"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="40 steps, 3 faults (CI smoke)")
    p.add_argument("--steps", type=int, help="measured steps (default 500, quick 40)")
    p.add_argument("--warmup", type=int, help="steps before the RSS baseline, as buffers grow (default 20, quick 5)")
    p.add_argument("--layers", type=int, default=1, help="attends per step")
    p.add_argument("--timeout", type=float, help="the job's timeout in seconds (default 3, quick 2)")
    p.add_argument("--recover", type=int, default=5, help="steps a fault may take to be survived")
    p.add_argument("--every", type=int, help="steps between faults (default 25, quick 10)")
    p.add_argument("--verbose", action="store_true", help="log every failed step's messages")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "soak.json",
                   help="where to write the results (default: bench/results/soak.json)")
    args = p.parse_args(argv)
    args.steps = args.steps or (40 if args.quick else 500)
    args.timeout = args.timeout or (2.0 if args.quick else 3.0)
    args.warmup = args.warmup if args.warmup is not None else (5 if args.quick else 20)
    args.every = args.every or (10 if args.quick else 25)
    if args.steps < 10 or args.layers < 1 or args.timeout <= 0 or args.recover < 1 or args.every < 2:
        p.error("need --steps >= 10, --layers >= 1, --timeout > 0, --recover >= 1 and --every >= 2")
    return args


def _start_ray() -> bool:
    """Start this benchmark's own local Ray instance unless this process is connected to one
    (:func:`~bench.roundtrip_runtimes.start_local_ray`); True if this call started it."""
    import ray
    if ray.is_initialized():
        return False
    module = sys.modules.get(__name__)
    if __name__ != "__main__" and module is not None:  # imported (e.g. by a test): ship SoakClient by value
        ray.cloudpickle.register_pickle_by_value(module)
    return start_local_ray(2, {"PYTHONPATH": worker_pythonpath(ROOT), "OMP_NUM_THREADS": "1"},
                           object_store_mib=100)


def main(argv=None) -> int:
    args = parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)
    start = time.perf_counter()
    started = _start_ray()
    try:
        result = run(args, log)
    finally:
        if started:
            import ray
            ray.shutdown()
    finish(lambda: print(render(result)), headline(result), time.perf_counter() - start, args.json, result)
    ok = result["wrong_outputs"] == 0 and result["hangs"] == 0
    return 0 if ok and result["faults_survived"] == result["faults_injected"] else 1


if __name__ == "__main__":
    sys.exit(main())
