"""Smoke test of bench/roundtrip.py in --quick mode: the Ray runtime and the local client both run
the same batches, and the JSON has a timed row per configuration and round kind."""

import json
import math

import pytest

from scripts import run_ray_script

ray = pytest.importorskip("ray")

MODULE = "bench_roundtrip"


def test_quick_run_writes_timed_rows(tmp_path, capsys):
    out = tmp_path / "r.json"
    status, left_running = run_ray_script("bench/roundtrip.py", MODULE, ["--quick", "--json", str(out)])
    assert status == 0 and not left_running  # main() shut down the Ray it started
    printed = capsys.readouterr().out
    assert "ray/local" in printed and "dedicated 2c+1s" in printed
    assert out.with_suffix(".png").exists()

    result = json.loads(out.read_text())
    rows = result["rows"]
    got = {(r["config"], r["round"]) for r in rows}
    assert got == {(c, k) for c in ("inplace 2c", "dedicated 2c+1s") for k in ("forward", "backward")}
    assert len(rows) == 4 and result["quick"] is True
    for r in rows:
        for runtime in ("ray", "local"):
            phases = ["pack", "all_to_all", "kernel", "unpack", "total"]
            if r["round"] == "forward":
                phases.append("plan")
            else:
                assert r[f"{runtime}_plan_ms"] is None  # planned once per step, charged to forward
            for phase in phases:
                value = r[f"{runtime}_{phase}_ms"]
                # Rows that stay home in order are neither gathered nor scattered: 0 ms is allowed.
                positive = phase not in ("pack", "unpack")
                assert math.isfinite(value) and (value > 0 if positive else value >= 0), \
                    (r["config"], r["round"], runtime, phase, value)
            sent = r[f"{runtime}_client_bytes_per_round"]
            assert sent > 0 if r["mode"] == "dedicated" else sent >= 0  # in-place: maybe all local
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0
        assert r["same_client_bytes"]  # both runtimes ran the same plans
        assert r["participants"] == (2 if r["mode"] == "inplace" else 3)


def test_ray_benchmarks_start_their_own_ray_through_one_helper():
    """Each Ray benchmark starts Ray only through ``start_local_ray`` (``address="local"``: its own
    instance, never a running cluster it would join, where ``num_cpus`` is refused);
    test_bench_control_plane.py runs one beside a running cluster."""
    from scripts import ROOT
    helper = (ROOT / "bench" / "roundtrip_runtimes.py").read_text()
    assert helper.count("ray.init(") == 1 and 'ray.init(address="local"' in helper
    for script in ("roundtrip.py", "control_plane.py", "soak.py", "tagged_rounds.py"):
        text = (ROOT / "bench" / script).read_text()
        assert "ray.init(" not in text and "start_local_ray(" in text, script
