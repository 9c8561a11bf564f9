"""Smoke test of bench/soak.py in --quick mode: 40 steps with a server killed, a client paused
past the timeout and a late client; every fault survived, no wrong output, the JSON complete."""

import json

import pytest

from scripts import run_ray_script

ray = pytest.importorskip("ray")

MODULE = "bench_soak"
# The job's timeout: 5 s, not --quick's 2 s. Each injected fault fails the step it strikes (3 of the
# 6 failed steps allowed below); with 2 s a healthy step on a loaded 2-core machine could miss its
# deadline often enough to use up the rest. A fault still has to be survived within --recover steps.
TIMEOUT_S = 5


def test_quick_soak_survives_every_fault(tmp_path, capsys):
    out = tmp_path / "soak.json"  # Ray ships the script's client actor class by value
    argv = ["--quick", "--timeout", str(TIMEOUT_S), "--json", str(out)]
    assert run_ray_script("bench/soak.py", MODULE, argv) == (0, False)
    printed = capsys.readouterr().out
    assert "faults survived" in printed and "RSS start MiB" in printed

    result = json.loads(out.read_text())
    assert result["benchmark"] == "soak" and result["quick"] is True and result["steps"] == 40
    assert result["timeout_s"] == TIMEOUT_S
    assert [f["fault"] for f in result["faults"]] == ["server kill", "client pause", "late client"]
    assert result["faults_survived"] == result["faults_injected"] == 3
    assert result["wrong_outputs"] == 0 and result["outputs_checked"] >= 4 * 30
    assert 1 <= result["failed_steps"] <= 6 and result["exact_steps"] >= 34
    assert result["worst_relative_error"] < 1e-4
    assert "server 1" in result["restarted"]
    assert set(result["rss_mib"]) == {"scheduler", "server 0", "server 1", "client 0", "client 1"}
