"""Smoke test of bench/tagged_rounds.py in --quick mode: both jobs run the same steps, the baseline
exchanges the header in every round and the default job only where routes install."""

import json
import math

import pytest

from scripts import run_ray_script

ray = pytest.importorskip("ray")


def test_quick_run_counts_headers_and_times_both_jobs(tmp_path, capsys):
    out = tmp_path / "t.json"
    status, left_running = run_ray_script("bench/tagged_rounds.py", "bench_tagged_rounds",
                                          ["--quick", "--steps", "1", "--json", str(out)])
    assert status == 0 and not left_running
    assert "headers/step every→tagged" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    layers = row["layers"]
    assert row["headers_per_step_every"] == 2 * layers  # one per round
    # a step's first forward and first backward round install their routes (a growth may add one)
    assert 2 <= row["headers_per_step_install"] < 2 * layers
    assert row["device_exchanges_per_step_install"] > 0
    assert (row["device"], row["transport"], row["dtype"]) == ("cpu", "shm", "float32")
    for key in ("step_ms", "attend_host_ms", "backward_host_ms"):
        assert all(math.isfinite(row[f"{key}_{j}"]) and row[f"{key}_{j}"] > 0 for j in ("every", "install"))
    assert row["step_ratio"] == row["step_ms_install"] / row["step_ms_every"]
