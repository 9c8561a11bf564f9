"""bench/transport.py on the CPU: host-driven, device-driven and captured exchanges over the
shared-memory heap (processes) and the in-process heap (threads) deliver the baseline's bytes, the
device-driven ones ran device-driven, and the summary keys are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("transport", ["local", "shm"])
def test_transport_quick_cpu_run(tmp_path, transport):
    out = tmp_path / "t.json"
    # a process of its own: the shm participants are processes that import the script's module
    subprocess.run([sys.executable, "bench/transport.py", "--transport", transport, "--device", "cpu", "--procs",
                    "2", "--min-size", "64KiB", "--max-size", "256KiB", "--iters", "3", "--warmup", "2",
                    "--json", str(out)], cwd=ROOT, check=True, timeout=300)
    got = json.loads(out.read_text())
    assert [r["size"] for r in got["rows"]] == [64 << 10, 256 << 10]
    for r in got["rows"]:
        # every timed exchange (warm-up excluded) ran device-driven, on every participant
        assert r["equal"] and r["device_driven"] == r["graph_device_driven"] == r["iters"] == 3
        assert min(r["sym_ms"], r["routed_ms"], r["graph_ms"], r["base_ms"]) > 0
        assert 0 < r["issue_graph_us"] and 0 < r["issue_routed_us"]
    where = "" if transport == "local" else "_processes"
    assert set(got["summary"]) == {f"exchange_us_64KiB_2pe{where}{k}" for k in ("", "_host_driven", "_graphed")} | {
        f"exchange_host_us_64KiB_2pe{where}{k}" for k in ("", "_graphed")}


def test_device_driven_count_is_the_rows_own_timed_exchanges(tmp_path):
    """At 64 MiB a row times 32 exchanges (at most ~2 GiB per size), not --iters: the count is
    read after the warm-up and compared with that row's own number, so the run passes and notes
    nothing (it read 33 against 40 before and printed a false NOTE)."""
    out = tmp_path / "t.json"
    done = subprocess.run([sys.executable, "bench/transport.py", "--transport", "local", "--device", "cpu",
                           "--procs", "2", "--min-size", "64MiB", "--max-size", "64MiB", "--iters", "40",
                           "--graph", "off", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["iters"] == row["device_driven"] == 32 and row["graph_device_driven"] is None
    assert "DEVICE-DRIVEN" not in done.stdout and "NOTE" not in done.stdout


def test_host_driven_timings_fail_the_run(tmp_path, monkeypatch):
    """With no stream for the routes (every exchange host-driven), the device-driven rows are not
    what they claim: the headline names them and the script exits 1."""
    from distca_server.transport.routed import RoutedTransport

    from scripts import load_script
    bench = load_script("bench/transport.py", "bench_transport")
    monkeypatch.setattr(RoutedTransport, "_pe_stream", lambda self: None)
    out = tmp_path / "t.json"
    try:
        with pytest.raises(SystemExit) as failed:
            bench.main(["--transport", "local", "--device", "cpu", "--procs", "2", "--min-size", "64KiB",
                        "--max-size", "64KiB", "--iters", "3", "--warmup", "2", "--graph", "off",
                        "--json", str(out)])
    finally:
        sys.modules.pop("bench_transport", None)
    assert failed.value.code == 1
    got = json.loads(out.read_text())
    assert got["rows"][0]["device_driven"] == 0
    assert any(line.startswith("NOT DEVICE-DRIVEN") and "P=2 64 KiB (0 of 3)" in line for line in got["headline"])
