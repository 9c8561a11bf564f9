"""bench/host_path.py in --quick mode: its replayed rounds run for real first (every layer's output
and the gradients equal an eager client's), every timed round is a replay, and each row's ratios
are to the rows they name."""

import json

from scripts import load_script

from distca_server.runtime.graphed import RoundGraphs
from distca_server.transport.routed import RoutedTransport


def test_quick_run_times_replayed_rounds_that_equal_the_eager_ones(tmp_path, capsys):
    bench = load_script("bench/host_path.py", "bench_host_path")
    graph, kinds = RoutedTransport.graph, RoundGraphs.device_types
    out = tmp_path / "host.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    assert (RoutedTransport.graph, RoundGraphs.device_types) == (graph, kinds)  # the stand-in is undone
    assert "µs per layer on the host" in capsys.readouterr().out
    rows = {r["path"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["autograd.Function", "custom op", "distca attend", "distca via operator"]
    assert rows["autograd.Function"]["vs_floor"] == 1.0 and rows["distca via operator"]["vs_operator_path"] == 1.0
    for name in ("distca attend", "distca via operator"):
        assert rows[name]["max_abs_err"] <= 1e-5 and rows[name]["us_per_layer"] > rows["autograd.Function"]["us_per_layer"]
