"""The Grafana dashboard (deploy/grafana/distca.json) queries only metrics distca exports, under
the names Prometheus shows (scheduler.metrics); tests/integration/test_monitoring.py checks that a
real job's Prometheus endpoint shows every one of them, and the dashboard's queries against it."""

import json
import re
from pathlib import Path

import pytest

from scheduler.metrics import JOB_LABEL, METRICS, PROMETHEUS_PREFIX, metrics_of, prometheus_series

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "distca.json"
SERIES = re.compile(r"\bray_distca_\w+")


def dashboard_series(path=DASHBOARD) -> dict[str, set[str]]:
    """Panel title -> the ``ray_distca_*`` series its queries name."""
    board = json.loads(path.read_text())
    return {p["title"]: {name for t in p["targets"] for name in SERIES.findall(t["expr"])}
            for p in board["panels"]}


def test_every_panel_queries_exported_metrics():
    exported = {s for m in METRICS for s in prometheus_series(m)}
    panels = dashboard_series()
    assert len(panels) >= 9
    for title, names in panels.items():
        assert names, f"panel {title!r} queries no distca metric"
        assert names <= exported, f"panel {title!r} queries {sorted(names - exported)}, which distca does not export"


def test_dashboard_covers_what_a_user_watches():
    used = {n for names in dashboard_series().values() for n in names}
    for name in ("distca_step_imbalance_before", "distca_step_imbalance_after", "distca_step_plan_ms",
                 "distca_step_cut_ms", "distca_bytes_per_round", "distca_server_flops", "distca_server_tasks",
                 "distca_server_held_bytes", "distca_rounds_served", "distca_lost_participants"):
        assert any(u.startswith(PROMETHEUS_PREFIX + name) for u in used), name


def test_dashboard_shape():
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "distca" and board["schemaVersion"] >= 30
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["definition"] == f"label_values(ray_distca_steps_planned_total, {JOB_LABEL})"
    for p in board["panels"]:
        assert p["datasource"]["uid"] == "${datasource}"
        for t in p["targets"]:
            assert f'{JOB_LABEL}=~"$job"' in t["expr"], (p["title"], t["expr"])


def test_prometheus_names():
    m = metrics_of("scheduler")
    assert prometheus_series(m["distca_plan_ms"]) == ("ray_distca_plan_ms",)
    assert prometheus_series(m["distca_steps_planned"]) == ("ray_distca_steps_planned_total",)
    assert prometheus_series(m["distca_step_plan_ms"]) == (
        "ray_distca_step_plan_ms_bucket", "ray_distca_step_plan_ms_sum", "ray_distca_step_plan_ms_count")
    assert set(metrics_of("server")) == {"distca_rounds_served", "distca_server_bytes_sent"}
    for metric in METRICS:  # Ray wants strictly positive, ascending bucket bounds
        if metric.kind == "histogram":
            assert all(0 < a < b for a, b in zip(metric.boundaries, metric.boundaries[1:]))
        else:
            assert not metric.boundaries
    with pytest.raises(ValueError, match="'client'"):
        metrics_of("client")


def test_bytes_histogram_counts_every_plan_so_the_mean_per_step_is_true():
    """The dashboard's "mean per step" is rate(_sum) / rate(_count) of distca_step_bytes_per_round:
    a plan that moves nothing (a balanced in-place step) must be counted, in a bucket of its own.
    Four plans, one moving 1 MiB per round: the mean is 256 KiB, not 1 MiB."""
    import inspect
    from types import SimpleNamespace
    pytest.importorskip("ray")
    from scheduler.actor import SchedulerActor

    class Recorded:
        def __init__(self):
            self.observed = []

        def set(self, value, tags=None):
            pass

        def inc(self, value=1, tags=None):
            pass

        def observe(self, value, tags=None):
            self.observed.append((tags.get("round"), value))

    actor = SimpleNamespace(m={name: Recorded() for name in metrics_of("scheduler")}, name="j",
                            _tags={JOB_LABEL: "j"}, coord=SimpleNamespace(servers={}))
    export = inspect.unwrap(SchedulerActor._export)  # the actor class's own method, on a stand-in
    for moved in (2**20, 0, 0, 0):
        export(actor, {"step": 0, "batch": 0, "imbalance_before": 1.2, "imbalance_after": 1.0, "plan_ms": 1.0,
                       "cut_ms": 0.1, "num_tasks": 2, "bytes": {"forward": moved, "backward": moved},
                       "server_flops": {0: 1.0}, "server_tasks": {0: 1}, "server_held_bytes": {0: 0}})
    forward = [v for kind, v in actor.m["distca_step_bytes_per_round"].observed if kind == "forward"]
    assert len(forward) == len(actor.m["distca_step_imbalance_before"].observed) == 4
    assert sum(forward) / len(forward) == 2**18
    # Ray's _sum counts each observation at its bucket's midpoint: a plan that moves nothing
    # falls in a first bucket [0, b] whose midpoint b / 2 is well under any plan that moves a row
    bounds = metrics_of("scheduler")["distca_step_bytes_per_round"].boundaries
    assert bounds[0] <= 1 < 1024 <= bounds[1]
