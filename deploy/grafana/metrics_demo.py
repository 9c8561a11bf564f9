"""A real distca job on a local Ray instance whose metrics port listens on 127.0.0.1 only: run it,
read the Prometheus text endpoint, and (``--prometheus``) let Debian's ``prometheus`` scrape it
and draw the key series from Prometheus' query API.

Job: dedicated mode, 2 clients (Ray actors) and 2 attention servers (Ray restarts a killed one),
``min_shard`` 16. Each step every client takes its chunk of a batch of the Pretrain trace
(``distca_sim.workloads.sample_batch``, ``--context`` tokens per rank; 4 query heads, 2 KV heads,
head_dim 16, float32), runs ``--layers`` attends and one backward. At step ``--kill-at`` the last
server is killed between the forward and the backward rounds: that step fails on every
participant, the verdict names the server lost, the job goes on on the other server until Ray has
restarted the killed one and it registers again.

Ray binds its metrics export port to the node's address; this script makes that address
127.0.0.1 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, Ray's single-machine setting) before Ray is
imported, so nothing here listens beyond loopback; Prometheus too is bound to 127.0.0.1.

Usage::

    python deploy/grafana/metrics_demo.py --out /tmp/m                  # ~30 s: writes metrics.prom, run.json
    python deploy/grafana/metrics_demo.py --steps 60 --kill-at 25 --prometheus --png docs/img/metrics.png

Writes ``OUT/metrics.prom`` (the endpoint's text at the end), ``OUT/run.json`` (what ran: steps,
failed steps, the status at the end, the export port, whether it listened on loopback only), and
with ``--prometheus`` ``OUT/series.json`` (the queried series) and the PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

# Before Ray is imported: the node's address is loopback, and so is the metrics export port.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from scheduler.metrics import JOB_LABEL, METRICS, prometheus_series  # noqa: E402
from distca_cli.connect import worker_pythonpath  # noqa: E402

NAME = "metrics-demo"
HEADS_Q, HEADS_KV, HEAD_DIM = 4, 2, 16
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


@ray.remote(num_cpus=0)
class Trainer:
    """One training worker: a ``DistCAClient.connect`` client that runs attention layers."""

    def __init__(self, name: str, rank: int, world_size: int, timeout_s: float):
        from distca_client import DistCAClient
        self.rank = rank
        self.client = DistCAClient.connect(name, rank=rank, world_size=world_size, timeout_s=timeout_s)
        self.held = None

    def forward(self, lens: list[int], seed: int, layers: int) -> dict:
        """``layers`` grad-requiring attends, held for :meth:`backward`."""
        import torch
        from distca_client import DistCAError
        g = torch.Generator().manual_seed(seed * 100 + self.rank)
        T = sum(lens)
        try:
            outs = []
            for _ in range(layers):
                q, k, v = (torch.randn(T, h, HEAD_DIM, generator=g).requires_grad_()
                           for h in (HEADS_Q, HEADS_KV, HEADS_KV))
                outs.append(self.client.attend(q, k, v, lens))
            self.held = outs
            return {"ok": True}
        except (DistCAError, ValueError) as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

    def ping(self) -> bool:
        return True

    def backward(self) -> dict:
        from distca_client import DistCAError
        try:
            sum(o.sum() for o in self.held).backward()
            return {"ok": True}
        except (DistCAError, ValueError) as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            self.held = None


def distca_log_lines() -> list[str]:
    """The distca lines of this Ray session's worker logs (the files the Ray dashboard's log view
    and ``ray logs`` show)."""
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())  # no public call without a dashboard
    lines = []
    for f in sorted(logs.glob("worker-*.err")):
        lines += [line for line in f.read_text(errors="replace").splitlines() if " distca-" in line]
    return lines


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://{LOOPBACK}:{port}/metrics", timeout=10).read().decode()


def listening_addresses(port: int) -> list[str]:
    """The local addresses a socket listens on at ``port`` (psutil comes with Ray)."""
    import psutil
    return sorted({c.laddr.ip for c in psutil.net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN and c.laddr.port == port})


def wait_for_metrics(port: int, steps_planned: int, timeout_s: float = 30.0) -> str:
    """The endpoint's text once every distca metric is there and the step counter reached
    ``steps_planned`` (Ray's agent exports what the actors recorded about every second)."""
    want = {s for m in METRICS for s in prometheus_series(m)}
    deadline = time.monotonic() + timeout_s
    while True:
        text = scrape(port)
        seen = {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line.startswith("ray_distca_")}
        planned = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("ray_distca_steps_planned_total{") and f'{JOB_LABEL}="{NAME}"' in line]
        if want <= seen and planned and planned[0] >= steps_planned or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


# ---- Prometheus (Debian's package), loopback only -----------------------------------------------

def start_prometheus(ray_port: int, workdir: Path) -> tuple[subprocess.Popen, int]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("--prometheus needs the prometheus binary: apt-get install -y prometheus")
    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                      f"scrape_configs:\n  - job_name: ray\n    static_configs:\n"
                      f"      - targets: ['{LOOPBACK}:{ray_port}']\n")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                             f"--web.listen-address={LOOPBACK}:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(workdir / "prometheus.log", "w"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://{LOOPBACK}:{port}/-/ready", timeout=2)
            return proc, port
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"prometheus did not start; see {workdir / 'prometheus.log'}")


# The series drawn: panel title -> [(legend, PromQL)]. Per-step values come from the histograms'
# _sum/_count over 15 s windows (every step counts; _sum is at bucket resolution), as the Grafana
# dashboard draws them.
def _mean(name: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return (f"sum{group}(rate(ray_{name}_sum{{{JOB_LABEL}=\"{NAME}\"}}[15s])) / "
            f"sum{group}(rate(ray_{name}_count{{{JOB_LABEL}=\"{NAME}\"}}[15s]))")


PANELS = {
    "imbalance (max/mean FLOPs), mean per step": [
        ("before (no balancing)", _mean("distca_step_imbalance_before")),
        ("after (distca plan)", _mean("distca_step_imbalance_after"))],
    "scheduler time per step (ms)": [
        ("plan", _mean("distca_step_plan_ms")), ("cut + encode", _mean("distca_step_cut_ms"))],
    "bytes per round of one layer (KiB)": [
        ("{round}", f"({_mean('distca_step_bytes_per_round', 'round')}) / 1024")],
    "forward GFLOP per layer per server (last plan)": [
        ("server {server}", f'ray_distca_server_flops{{{JOB_LABEL}="{NAME}"}} / 1e9')],
    "rounds served per second": [
        ("server {server}", f'sum by (server) (rate(ray_distca_rounds_served_total{{{JOB_LABEL}="{NAME}"}}[15s]))')],
    "lost participants (total)": [
        ("{role}", f'sum by (role) (ray_distca_lost_participants_total{{{JOB_LABEL}="{NAME}"}})')],
}


def query_range(port: int, query: str, start: float, end: float, step: float = 1.0) -> list[dict]:
    args = urllib.parse.urlencode({"query": query, "start": start, "end": end, "step": step})
    reply = json.load(urllib.request.urlopen(f"http://{LOOPBACK}:{port}/api/v1/query_range?{args}", timeout=30))
    if reply.get("status") != "success":
        raise RuntimeError(f"prometheus query failed: {query}: {reply}")
    return reply["data"]["result"]


def draw(series: dict, start: float, end: float, kill_time: float | None, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), constrained_layout=True)
    for ax, (title, lines) in zip(axes.flat, series.items()):
        for legend, result in lines:
            for r in result:
                t = [float(x) - start for x, _ in r["values"]]
                y = [float(v) for _, v in r["values"]]
                label = legend.format(**r["metric"]) if "{" in legend else legend
                ax.plot(t, y, label=label, lw=1.6)
        if kill_time is not None:
            ax.axvline(kill_time - start, color="grey", ls="--", lw=1)
        ax.set_xlim(0, end - start)
        if title.startswith(("lost", "rounds")):
            ax.set_ylim(bottom=0)
        if title.startswith("lost"):
            ax.set_ylim(top=max(2.0, ax.get_ylim()[1]))
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("seconds into the run")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(f"distca job '{NAME}' scraped by Prometheus every 1 s (2 clients, 2 dedicated servers; "
                 f"dashed: server 1 killed mid-step, restarted by Ray)", fontsize=12)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)


# ---- the job -------------------------------------------------------------------------------------

def wait_gone(pid: int, timeout_s: float = 60.0) -> None:
    """Wait until process ``pid`` (on this node) has exited.

    Raises:
        TimeoutError: it still runs after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} still runs {timeout_s:g} s after it was killed")
        time.sleep(0.05)


def run(args) -> dict:
    from distca_server import launch, shutdown, status
    from scheduler import JobConfig, PlanConfig
    from distca_sim.workloads import sample_batch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, namespace="distca",
             log_to_driver=False, _metrics_export_port=port,
             _system_config={"metrics_report_interval_ms": 1000},
             runtime_env={"env_vars": {"PYTHONPATH": worker_pythonpath(ROOT)}})
    prom = None
    workdir = Path(tempfile.mkdtemp(prefix="distca-prometheus-"))
    try:
        if args.prometheus:
            prom, prom_port = start_prometheus(port, workdir)
        config = JobConfig(servers=2, timeout_s=args.timeout, failure_grace_s=1.0, server_restarts=1,
                           plan=PlanConfig(mode="dedicated", min_shard=16))
        job = launch(name=NAME, config=config, detached=False, server_options={"num_cpus": 0})
        trainers = [Trainer.remote(NAME, r, 2, args.timeout) for r in range(2)]
        ray.get([t.ping.remote() for t in trainers], timeout=120)  # connected
        start = time.time()
        failed, kill_time = [], None
        for step in range(args.steps):
            lens = sample_batch("pretrain", 2, args.context, seed=1, step=step)
            fwd = ray.get([t.forward.remote(lens[r], step, args.layers) for r, t in enumerate(trainers)], timeout=120)
            if step == args.kill_at:
                kill_time = time.time()
                victim = ray.get_actor(f"distca-server-{NAME}-1", namespace="distca")
                pid = ray.get(victim.stats.remote(), timeout=60)["pid"]
                ray.kill(victim, no_restart=False)
                wait_gone(pid)  # ray.kill only asks: on a busy machine the backward could still run on it
            bwd = ray.get([t.backward.remote() for t in trainers], timeout=120)
            if not all(r["ok"] for r in fwd + bwd):
                failed.append({"step": step, "errors": [r["error"] for r in fwd + bwd if not r["ok"]]})
            time.sleep(args.pause)
        st = status(NAME)
        text = wait_for_metrics(port, st["steps_planned"])
        (out / "metrics.prom").write_text(text)
        result = {"steps": args.steps, "kill_at": args.kill_at, "failed": failed, "status": st,
                  "metrics_port": port, "listening": listening_addresses(port),
                  "node_ip": ray.util.get_node_ip_address(), "seconds": time.time() - start,
                  "logs": distca_log_lines()}
        if prom is not None:
            time.sleep(3)  # the last scrapes
            end = time.time()
            series = {title: [(legend, query_range(prom_port, q, start, end)) for legend, q in lines]
                      for title, lines in PANELS.items()}
            (out / "series.json").write_text(json.dumps({"start": start, "end": end, "kill_time": kill_time,
                                                         "series": series}))
            draw(series, start, end, kill_time, Path(args.png))
            result["png"] = args.png
        (out / "run.json").write_text(json.dumps(result, indent=1, default=str))
        shutdown(NAME)
        del job  # the job's actors live as long as these handles (detached=False)
        return result
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)
        ray.shutdown()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/metrics_demo", help="folder for metrics.prom, run.json")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--kill-at", type=int, default=3, help="step whose backward loses server 1 (-1: none)")
    ap.add_argument("--context", type=int, default=1024, help="tokens per client rank")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=10.0, help="the job's timeout_s")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds between steps")
    ap.add_argument("--prometheus", action="store_true", help="scrape with Debian's prometheus and draw --png")
    ap.add_argument("--png", default="docs/img/metrics.png")
    args = ap.parse_args(argv)
    result = run(args)
    print(json.dumps({k: result[k] for k in ("steps", "failed", "metrics_port", "listening", "seconds")},
                     default=str))
    return result


if __name__ == "__main__":
    main()
