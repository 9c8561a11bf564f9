"""bench/pingpong.py on the CPU: the three runs complete, ping-pong's outputs equal one nano-batch
after the other's (the script's own guard), the exchanges ran device-driven, and the summary key is
written."""

from __future__ import annotations

import json

from scripts import load_script


def test_pingpong_quick_cpu_run(tmp_path):
    bench = load_script("bench/pingpong.py", "bench_pingpong")
    out = tmp_path / "pp.json"
    assert bench.main(["--device", "cpu", "--tokens", "512", "--layers", "2", "--model-dim", "64",
                       "--warmup", "1", "--repeats", "2", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [r["run"] for r in got["rows"]] == ["single", "pingpong", "signal-only"]
    assert all(r["ms"] > 0 for r in got["rows"])
    assert got["max_rel_error"] <= 1e-5 and got["device_driven"] > 0
    assert got["summary"]["pingpong_vs_signal_only"] > 0
