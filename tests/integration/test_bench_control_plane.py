"""Smoke test of bench/control_plane.py in --quick mode: the in-process coordinator at 8 and 64
clients and the Ray scheduler actor at 8 clients beside 8 pings; every part checked as msgpack
bytes, the JSON complete. Timing verdicts are printed, not asserted: they belong to the benchmark."""

import json
import sys

import pytest

from scripts import load_script, run_ray_script

ray = pytest.importorskip("ray")

MODULE = "bench_control_plane"


def test_quick_run_writes_expected_rows(tmp_path, capsys):
    out = tmp_path / "cp.json"
    assert run_ray_script("bench/control_plane.py", MODULE, ["--quick", "--json", str(out)]) == (0, False)
    printed = capsys.readouterr().out
    assert "after last" in printed and "step/pings" in printed
    assert "parts: msgpack bytes, each decoded to its client's part of one plan: yes" in printed
    assert "ray step at 8 clients" in printed

    result = json.loads(out.read_text())
    assert result["benchmark"] == "control_plane" and result["quick"] is True
    assert (result["mode"], result["epsilon"], result["tokens_per_rank"]) == ("inplace", 0.05, 131072)
    rows = result["in_process"]
    assert [r["clients"] for r in rows] == [8, 64]
    for r in rows:
        assert len(r["step_ms_runs"]) == 2 and r["part_bytes"] > 0 and r["num_tasks"] >= r["num_docs"] > 0
        assert r["imbalance_after"] <= 1.05 + 1e-9
        # two runs: each median is a mean, so the parts add up to the step
        parts = r["intake_ms"] + r["plan_ms"] + r["cut_ms"] + r["other_ms"]
        assert abs(parts - r["step_ms"]) < 1e-6 * r["step_ms"]
        assert 0 < r["work_ms"] < r["after_last_ms"] <= r["step_ms"]
        assert "target_ms" not in r  # the 60 ms target is the 1024-client row's
    (ray_row,) = result["ray"]
    assert ray_row["clients"] == 8 and ray_row["target_ratio"] == 1.5
    assert len(ray_row["ratio_runs"]) == 2 and all(x > 0 for x in ray_row["ratio_runs"])
    assert ray_row["step_ms"] > 0 and ray_row["pings_ms"] > 0 and ray_row["part_bytes"] > 0
    assert ray_row["actor_plan_ms"] > 0 and ray_row["actor_cut_ms"] > 0
    assert ray_row["meets"] == (ray_row["ratio"] <= 1.5)


def test_check_answers_refuses_what_is_not_msgpack_bytes():
    bench = load_script("bench/control_plane.py", MODULE)
    try:
        with pytest.raises(AssertionError, match="not msgpack bytes"):
            bench.check_answers([{"part": bytearray(b"\x80"), "group": {}}], 0, 1)
        with pytest.raises(AssertionError, match="rank 0"):
            bench.check_answers([{"error": "DistCAError", "message": "x"}], 0, 1)
    finally:
        sys.modules.pop(MODULE, None)
