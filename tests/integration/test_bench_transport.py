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
        assert r["equal"] and r["device_driven"] >= 3
        assert min(r["sym_ms"], r["routed_ms"], r["graph_ms"], r["base_ms"]) > 0
        assert 0 < r["issue_graph_us"] and 0 < r["issue_routed_us"]
    where = "" if transport == "local" else "_processes"
    assert set(got["summary"]) == {f"exchange_us_64KiB_2pe{where}{k}" for k in ("", "_host_driven", "_graphed")} | {
        f"exchange_host_us_64KiB_2pe{where}{k}" for k in ("", "_graphed")}
