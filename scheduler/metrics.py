"""The one list of the metrics a distca job exports, and the names Prometheus shows for them.

The scheduler actor and the dedicated attention servers build their ``ray.util.metrics`` objects
from :data:`METRICS` (this module imports no ray). Ray's metrics agent serves them on each node's
``--metrics-export-port`` with the prefix ``ray_``; counters get ``_total`` and histograms
``_bucket`` / ``_sum`` / ``_count`` (:func:`prometheus_series`), which is what dashboards query.
Every series has the label ``distca_job`` (:data:`JOB_LABEL`, the job's name), plus ``round``
(``forward``/``backward``), ``server`` (its id) or ``role`` (``client``/``server``) where they apply.

Gauges hold the last plan's value: a Prometheus scrape every 15 s sees one step in many. Every
per-step value is therefore also observed into a histogram (``distca_step_*``): its ``_count``
and buckets count every step exactly (rates, quantiles); its ``_sum`` is Ray's approximation
(each observation counted at its bucket's midpoint), so the buckets are fine where values fall.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["JOB_LABEL", "METRICS", "Metric", "PROMETHEUS_PREFIX", "prometheus_series", "metrics_of"]

PROMETHEUS_PREFIX = "ray_"  # Ray's metrics agent prefixes every application metric with this
# The distca job's name on every series. Not "job": Prometheus sets `job` to the scrape job's name
# (Ray's setup: "ray") and renames a scraped `job` label to `exported_job`.
JOB_LABEL = "distca_job"

# Bucket bounds (Ray wants them strictly positive and ascending). An imbalance is >= 1 and most
# often 1 exactly: (0.999, 1.001] holds it with midpoint 1 (Ray's _sum counts the midpoint).
_IMBALANCE = [0.999, 1.001, 1.005, 1.01, 1.02, 1.03, 1.05, 1.075, 1.1, 1.15, 1.2, 1.3, 1.5, 1.75, 2.0,
              2.5, 3.0, 4.0, 5.0, 10.0]
_MILLISECONDS = [0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]
# Bytes: a plan that moves nothing (an in-place plan keeping every row on its rank) is counted too,
# or the mean per step (_sum / _count) would be that of the plans that move something; the first
# bucket [0, 1] holds it (midpoint 0.5 byte in _sum). Then 1 KiB .. 1 TiB, by 2x.
_BYTES = [1.0] + [float(2 ** e) for e in range(10, 41)]


@dataclass(frozen=True)
class Metric:
    """One exported metric: ``kind`` is ``"gauge"``, ``"counter"`` or ``"histogram"``;
    ``source`` the actor that exports it (``"scheduler"`` or ``"server"``); ``unit`` for
    documentation and dashboards."""

    name: str
    kind: str
    help: str
    tags: tuple[str, ...]
    source: str
    unit: str = ""
    boundaries: tuple[float, ...] = ()


METRICS: tuple[Metric, ...] = (
    # the last plan (gauges)
    Metric("distca_imbalance_before", "gauge", "max/mean attention FLOPs over ranks with no balancing, last plan",
           (JOB_LABEL,), "scheduler", "ratio"),
    Metric("distca_imbalance_after", "gauge", "max/mean attention FLOPs over servers under the last plan",
           (JOB_LABEL,), "scheduler", "ratio"),
    Metric("distca_plan_ms", "gauge", "milliseconds to plan the last batch (planning only)",
           (JOB_LABEL,), "scheduler", "ms"),
    Metric("distca_cut_ms", "gauge", "milliseconds to cut and encode the last batch's per-participant parts",
           (JOB_LABEL,), "scheduler", "ms"),
    Metric("distca_bytes_per_round", "gauge", "bytes moved off-rank by one round of one layer, last plan",
           (JOB_LABEL, "round"), "scheduler", "bytes"),
    Metric("distca_server_flops", "gauge", "forward attention FLOPs per layer on a server, last plan",
           (JOB_LABEL, "server"), "scheduler", "FLOPs"),
    Metric("distca_server_tasks", "gauge", "CA-tasks on a server, last plan",
           (JOB_LABEL, "server"), "scheduler", "tasks"),
    Metric("distca_server_held_bytes", "gauge",
           "kept-activation bytes a server holds per layer from forward to backward, last plan (0 when stateless)",
           (JOB_LABEL, "server"), "scheduler", "bytes"),
    # every plan (histograms: a scrape misses no step)
    Metric("distca_step_imbalance_before", "histogram", "max/mean attention FLOPs with no balancing, every plan",
           (JOB_LABEL,), "scheduler", "ratio", tuple(_IMBALANCE)),
    Metric("distca_step_imbalance_after", "histogram", "max/mean attention FLOPs under the plan, every plan",
           (JOB_LABEL,), "scheduler", "ratio", tuple(_IMBALANCE)),
    Metric("distca_step_plan_ms", "histogram", "milliseconds to plan a batch, every plan",
           (JOB_LABEL,), "scheduler", "ms", tuple(_MILLISECONDS)),
    Metric("distca_step_cut_ms", "histogram", "milliseconds to cut a batch's parts, every plan",
           (JOB_LABEL,), "scheduler", "ms", tuple(_MILLISECONDS)),
    Metric("distca_step_bytes_per_round", "histogram", "bytes moved off-rank by one round of one layer, every plan",
           (JOB_LABEL, "round"), "scheduler", "bytes", tuple(_BYTES)),
    # counters
    Metric("distca_steps_planned", "counter", "batches planned", (JOB_LABEL,), "scheduler", "batches"),
    Metric("distca_lost_participants", "counter", "participants a failure verdict named lost (role: client or server)",
           (JOB_LABEL, "role"), "scheduler", "participants"),
    Metric("distca_rounds_served", "counter", "rounds a dedicated attention server has served",
           (JOB_LABEL, "server", "round"), "server", "rounds"),
    Metric("distca_server_bytes_sent", "counter", "bytes a dedicated attention server sent to other participants",
           (JOB_LABEL, "server", "round"), "server", "bytes"),
)


def metrics_of(source: str) -> dict[str, Metric]:
    """``{name: Metric}`` of the metrics ``source`` (``"scheduler"`` or ``"server"``) exports.

    Raises:
        ValueError: an unknown source.
    """
    out = {m.name: m for m in METRICS if m.source == source}
    if not out:
        raise ValueError(f"source must be one of {sorted({m.source for m in METRICS})}, got {source!r}")
    return out


def prometheus_series(metric: Metric) -> tuple[str, ...]:
    """The series names Prometheus shows for ``metric``: ``ray_<name>`` for a gauge,
    ``ray_<name>_total`` for a counter, ``ray_<name>_bucket`` / ``_sum`` / ``_count`` for a
    histogram."""
    base = PROMETHEUS_PREFIX + metric.name
    if metric.kind == "counter":
        return (base + "_total",)
    if metric.kind == "histogram":
        return (base + "_bucket", base + "_sum", base + "_count")
    return (base,)
