"""bench/host_path.py in --quick mode: its replayed rounds run for real first (every layer's output
and the gradients equal an eager client's), every timed round is a replay, each row's ratios are
to the rows they name, and --profile names where the time goes."""

import json

import pytest
import torch

from scripts import load_script

from distca_server.runtime.graphed import RoundGraphs
from distca_server.transport.routed import RoutedTransport


def test_quick_run_times_replayed_rounds_that_equal_the_eager_ones(tmp_path, capsys):
    bench = load_script("bench/host_path.py", "bench_host_path")
    graph, kinds, exchange = RoutedTransport.graph, RoundGraphs.device_types, RoutedTransport.exchange
    out = tmp_path / "host.json"
    assert bench.main(["--quick", "--profile", "3", "--json", str(out)]) == 0
    # the stand-in and the exchange counter are undone
    assert (RoutedTransport.graph, RoundGraphs.device_types, RoutedTransport.exchange) == (graph, kinds, exchange)
    printed, result = capsys.readouterr().out, json.loads(out.read_text())
    assert "µs per layer on the host" in printed and "under cProfile (3 steps)" in printed
    rows = {r["path"]: r for r in result["rows"]}
    # the profile: the top functions by own time, the replays' among them, shares of the whole
    profile = result["profile"]
    assert 0 < len(profile) <= 30 and sum(r["share"] for r in profile) <= 1 + 1e-9
    assert [r["own_us_per_layer"] for r in profile] == sorted((r["own_us_per_layer"] for r in profile), reverse=True)
    replay = next(r for r in profile if r["function"].startswith("graphed.py:") and r["function"].endswith("(replay)"))
    assert replay["calls_per_layer"] == 2  # a forward and a backward round per layer
    assert list(rows) == ["autograd.Function", "custom op", "distca attend", "distca via operator",
                          "transport's part of the replays", "distca attend + transport"]
    transport = rows["transport's part of the replays"]
    # each participant's forward and backward round exchanges rows out and back (this plan moves rows)
    assert transport["exchanges_per_round"] == {"forward": [2, 2], "backward": [2, 2]}
    assert transport["us_per_layer"] == pytest.approx(4 * transport["us_per_participant_replay"]["2"])
    assert transport["us_per_layer"] > 0
    assert rows["distca attend + transport"]["us_per_layer"] == pytest.approx(rows["distca attend"]["us_per_layer"]
                                                                              + transport["us_per_layer"])
    assert rows["autograd.Function"]["vs_floor"] == 1.0 and rows["distca via operator"]["vs_operator_path"] == 1.0
    for name in ("distca attend", "distca via operator"):
        assert rows[name]["max_abs_err"] <= 1e-5 and rows[name]["us_per_layer"] > rows["autograd.Function"]["us_per_layer"]


def test_a_device_without_graphs_to_replay_is_refused_before_anything_runs(capsys):
    bench = load_script("bench/host_path.py", "bench_host_path")
    refused = ["meta"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in refused:
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--quick", "--device", device])
        assert exit_.value.code == 2 and f"--device {device}" in capsys.readouterr().err
