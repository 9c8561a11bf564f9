"""bench/planner_guarantee.py in --quick mode: the table and JSON are complete, no missed batch is
above plain LPT's most loaded server, and every plan was measured against LPT in the same run."""

import json

from scripts import load_script


def test_quick_run_is_never_above_lpt_where_it_misses(tmp_path, capsys):
    bench = load_script("bench/planner_guarantee.py", "bench_planner_guarantee")
    out = tmp_path / "guarantee.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    assert "plain LPT misses it on" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["benchmark"] == "planner_guarantee" and result["count"] == len(result["rows"]) == 200
    overall = result["summaries"][0]
    assert overall["worse_than_lpt_and_missed"] == 0
    assert overall["misses"] < overall["lpt_misses"]
    assert all(r["lpt_ratio"] > 0 for r in result["rows"])
