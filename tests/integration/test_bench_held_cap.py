"""bench/held_cap.py in --quick mode: every capped plan keeps its cap, and the uncapped plan of the
same batch is the reference of its ratios."""

import json

from scripts import load_script


def test_quick_run_keeps_every_cap(tmp_path, capsys):
    bench = load_script("bench/held_cap.py", "bench_held_cap")
    out = tmp_path / "cap.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    assert "plans reach max/mean" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 2 * 3  # traces x modes x (uncapped, 1.5x, 1.25x)
    for r in rows:
        if r["cap_x_mean"] is None:
            assert r["bytes_vs_free"] == 1.0 and r["ms_vs_free"] == 1.0 and r["held_max_x_mean"] > 1.0
        elif not r["refused"]:
            assert r["held_max_x_mean"] <= r["cap_x_mean"] + 1e-9 and r["imbalance"] >= 1.0
            assert r["plan_ms"] > 0
    # a cap of 1.5x the mean keeps these batches balanced (the planner weighs memory under a cap)
    assert all(r["imbalance"] <= 1.05 + 1e-9 for r in rows if r["cap_x_mean"] == 1.5)
