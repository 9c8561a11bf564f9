"""bench/pingpong.py on the CPU: the three runs complete, interleaved, ping-pong's outputs equal one
nano-batch after the other's (the script's own guard), every timed exchange of every run ran
device-driven (the script fails otherwise), and the summary key is written."""

from __future__ import annotations

import json
import sys

import pytest

from scripts import load_script

MODULE = "bench_pingpong"
ARGS = ["--device", "cpu", "--tokens", "512", "--layers", "2", "--model-dim", "64", "--warmup", "1", "--repeats", "2"]


@pytest.fixture
def bench():
    yield load_script("bench/pingpong.py", MODULE)
    sys.modules.pop(MODULE, None)


def test_pingpong_quick_cpu_run(bench, tmp_path):
    out = tmp_path / "pp.json"
    assert bench.main(ARGS + ["--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [r["run"] for r in got["rows"]] == ["single", "pingpong", "signal-only"]
    for r in got["rows"]:
        assert r["ms"] > 0 and len(r["runs_ms"]) == 2
        # 2 layers x 2 nano-batches x (dispatch, return), all device-driven
        assert r["exchanges_per_run"] == r["device_driven_per_run"] == 8
    assert got["max_rel_error"] <= 1e-5 and got["device_driven"] == 2 * 8
    assert got["summary"]["pingpong_vs_signal_only"] > 0


def test_host_driven_exchanges_fail_the_run(bench, tmp_path, monkeypatch):
    """With no stream for the routes every exchange is host-driven, where signal_only does nothing:
    the script refuses to report the comparison."""
    from distca_server.transport.routed import RoutedTransport
    monkeypatch.setattr(RoutedTransport, "_pe_stream", lambda self: None)
    with pytest.raises(SystemExit, match="single: not every timed exchange ran device-driven"):
        bench.main(ARGS + ["--json", str(tmp_path / "pp.json")])


class _Endpoint:
    """Stands in for a RoutedTransport: counts the exchanges ``run`` makes, as they were driven."""

    def __init__(self):
        self._seq = self.device_exchanges = 0
        self.signal_only = False


def test_runs_interleave_and_count_their_own_exchanges(bench):
    ends, order = [_Endpoint(), _Endpoint()], []

    def run(name, device_driven):
        def fn():
            order.append((name, ends[0].signal_only))
            for t in ends:
                t._seq += 2
                t.device_exchanges += 2 if device_driven else 1
        return fn
    got = bench.timed_runs({"single": (run("single", True), False), "pingpong": (run("pingpong", False), False),
                            "signal-only": (run("signal-only", True), True)}, ends, bench.torch.device("cpu"), 1, 3)
    names = [n for n, _ in order]
    assert names == ["single", "pingpong", "signal-only",  # warm-up
                     "single", "pingpong", "signal-only", "pingpong", "signal-only", "single",
                     "signal-only", "single", "pingpong"]
    assert all(flag == (n == "signal-only") for n, flag in order) and not any(t.signal_only for t in ends)
    assert got["single"]["exchanges"] == got["single"]["device_driven"] == [6, 6]  # warm-up not counted
    assert got["pingpong"]["device_driven"] == [3, 3] and len(got["pingpong"]["times_s"]) == 3
