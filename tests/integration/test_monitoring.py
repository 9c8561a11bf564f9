"""Monitoring: a real job on a Ray instance whose metrics export port listens on 127.0.0.1, read
through the Prometheus text endpoint; every distca metric is there with its labels and plausible
values, and every actor logs timestamped, levelled lines into the Ray worker logs.

The job runs in a subprocess (``deploy/grafana/metrics_demo.py``): Ray reads whether its node
address is loopback when it is imported, which this test process did long ago.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from scheduler.metrics import JOB_LABEL, METRICS, prometheus_series
from scripts import ROOT

parser = pytest.importorskip("prometheus_client.parser", reason="needs the monitoring extra (ray[default])")

STEPS, KILL_AT, LAYERS = 4, 2, 2
JOB = "metrics-demo"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("metrics")
    proc = subprocess.run([sys.executable, str(ROOT / "deploy/grafana/metrics_demo.py"), "--out", str(out),
                           "--steps", str(STEPS), "--kill-at", str(KILL_AT), "--layers", str(LAYERS)],
                          capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    samples = [s for fam in parser.text_string_to_metric_families((out / "metrics.prom").read_text())
               for s in fam.samples if s.labels.get(JOB_LABEL) == JOB]
    return run, samples


def _values(samples, name, **labels):
    return [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def test_metrics_port_on_loopback_and_the_kill_seen(demo):
    run, _ = demo
    assert run["listening"] == ["127.0.0.1"] and run["node_ip"] == "127.0.0.1"
    assert [f["step"] for f in run["failed"]] == [KILL_AT]
    assert all("attention server 1" in e for e in run["failed"][0]["errors"])


def test_every_metric_with_its_labels(demo):
    _, samples = demo
    seen = {s.name for s in samples}
    for m in METRICS:
        for series in prometheus_series(m):
            assert series in seen, f"{series} missing from the Prometheus endpoint"
            for s in samples:
                if s.name == series:
                    assert all(s.labels.get(t) for t in m.tags), (series, s.labels)
    assert {s.labels["round"] for s in samples if "round" in s.labels} == {"forward", "backward"}
    assert {s.labels["server"] for s in samples if "server" in s.labels} == {"0", "1"}
    assert {s.labels["role"] for s in samples if "role" in s.labels} == {"server"}


def test_plausible_values(demo):
    _, samples = demo
    v = lambda name, **labels: _values(samples, name, **labels)  # noqa: E731
    assert v("ray_distca_steps_planned_total") == [STEPS]  # the failed step was planned too
    for key in ("imbalance_before", "imbalance_after", "plan_ms", "cut_ms"):
        assert v(f"ray_distca_step_{key}_count") == [STEPS], key  # every plan, not only the last
    # _sum is Ray's bucket-midpoint approximation: means within a bucket of the truth
    before = v("ray_distca_step_imbalance_before_sum")[0] / STEPS
    after = v("ray_distca_step_imbalance_after_sum")[0] / STEPS
    assert 0.999 <= after <= 1.1 and after <= before + 0.01
    assert 1.0 <= v("ray_distca_imbalance_after")[0] <= max(v("ray_distca_imbalance_before")[0], 1.1)
    assert 0 < v("ray_distca_plan_ms")[0] < 5000 and 0 < v("ray_distca_cut_ms")[0] < 5000
    fwd, bwd = v("ray_distca_bytes_per_round", round="forward")[0], v("ray_distca_bytes_per_round", round="backward")[0]
    # kept activations (the default): forward moves q, k, v, out, lse; backward dout, dq, dk, dv,
    # the same rows less the LSE (a stateless backward would move more than the forward)
    assert 0 < bwd < fwd
    assert v("ray_distca_step_bytes_per_round_count", round="forward") == [STEPS]
    # the last plans ran on server 0 alone (server 1 was killed, and may have come back since)
    assert v("ray_distca_server_flops", server="0")[0] > 0 and v("ray_distca_server_tasks", server="0")[0] >= 1
    assert v("ray_distca_server_held_bytes", server="0")[0] > 0  # kept activations are on by default
    assert v("ray_distca_lost_participants_total", role="server") == [1]
    rounds = lambda server, kind: sum(v("ray_distca_rounds_served_total", server=server, round=kind))  # noqa: E731
    assert rounds("0", "forward") == STEPS * LAYERS
    assert rounds("0", "backward") == (STEPS - 1) * LAYERS  # the backward of the killed step failed
    # server 1 served every round before the kill, but a killed process loses what it counted since
    # its last report (every second): its series hold at least the steps before the killed one
    assert rounds("1", "forward") >= KILL_AT * LAYERS and rounds("1", "backward") >= (KILL_AT - 1) * LAYERS
    sent = lambda kind: sum(v("ray_distca_server_bytes_sent_total", server="0", round=kind))  # noqa: E731
    assert 0 < sent("forward") < sent("backward")
    buckets = [s for s in samples if s.name == "ray_distca_step_plan_ms_bucket"]
    assert max(s.value for s in buckets) == STEPS and any(s.labels["le"] == "+Inf" for s in buckets)


LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) (distca-\S+) (\S+): ")


def test_every_actor_logs_timestamped_levelled_lines(demo):
    run, _ = demo
    parsed = [LINE.match(line) for line in run["logs"]]
    assert parsed and all(parsed), [line for line, p in zip(run["logs"], parsed) if not p][:3]
    components = {p.group(2) for p in parsed}
    assert {f"distca-scheduler-{JOB}", f"distca-server-{JOB}-0", f"distca-server-{JOB}-1",
            f"distca-client-{JOB}-0", f"distca-client-{JOB}-1"} <= components
    text = "\n".join(run["logs"])
    assert f"INFO distca-scheduler-{JOB} scheduler.actor: job {JOB}: client rank 1 of 2 registered" in text
    assert re.search(rf"WARNING distca-scheduler-{JOB} scheduler.actor: job {JOB}: group epoch \d+ failed .*"
                     r"lost: attention server 1", text)
    assert re.search(rf"WARNING distca-client-{JOB}-0 distca_server.runtime.ray_client: rank 0: .*step {KILL_AT}", text)


def test_every_dashboard_query_names_a_metric_seen(demo):
    _, samples = demo
    board = json.loads((ROOT / "deploy" / "grafana" / "distca.json").read_text())
    seen = {s.name for s in samples}
    for panel in board["panels"]:
        names = {n for t in panel["targets"] for n in re.findall(r"\bray_distca_\w+", t["expr"])}
        assert names and names <= seen, (panel["title"], sorted(names - seen))
