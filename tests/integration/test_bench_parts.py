"""Smoke test of bench/parts.py in --quick mode (CI): it runs, checks its parts, and writes every row."""

import json

from scripts import load_script


def test_quick_run_writes_expected_rows(tmp_path, capsys):
    bench = load_script("bench/parts.py", "bench_parts")
    out = tmp_path / "parts.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "cut+enc ms" in printed and "byte-equal" in printed

    result = json.loads(out.read_text())
    assert result["quick"] is True and result["benchmark"] == "parts"
    assert result["cost_model"] == {"num_heads_q": 32, "num_heads_kv": 8, "head_dim": 128, "dtype_bytes": 2}
    rows = result["rows"]
    assert [(r["servers"], r["tokens_per_rank"]) for r in rows] == [(16, 32768), (64, 32768)]
    for r in rows:
        assert r["participants"] == r["servers"] and r["num_tasks"] >= r["num_docs"] > 0
        for key in ("plan_ms", "old_cut_ms", "cut_ms", "cut_encode_ms", "bytes_ms"):
            assert r[key] > 0
        assert abs(r["cut_vs_plan"] - r["cut_ms"] / r["plan_ms"]) < 1e-9
        assert r["cut_encode_vs_plan"] == r["cut_encode_ms"] / r["plan_ms"]
        assert r["bytes_vs_plan"] == r["bytes_ms"] / r["plan_ms"]
        assert r["part_bytes"] > 0
        # every call timed once per round, in the same rounds
        assert {k: len(v) for k, v in r["runs_ms"].items()} == {
            k: result["repeats"] for k in ("old_cut", "plan", "cut", "cut_encode", "bytes")}


def test_timed_rounds_alternate_the_calls():
    # the ratios divide medians of calls timed side by side: each round runs every call once, in
    # order, the warm-up round untimed; make() (setting up a call) runs before its timer starts
    bench = load_script("bench/parts.py", "bench_parts")
    order = []

    def call(name):
        def make():
            order.append(f"make {name}")
            return lambda: order.append(name) or name
        return make
    results, medians, runs = bench.timed_rounds({"a": call("a"), "b": call("b")}, 3, True)
    assert order == ["make a", "a", "make b", "b"] * 4
    assert results == {"a": "a", "b": "b"}
    assert {k: len(v) for k, v in runs.items()} == {"a": 3, "b": 3}
    assert all(medians[k] == sorted(runs[k])[1] for k in runs)
    _, _, runs = bench.timed_rounds({"a": call("a")}, 2, False)
    assert len(runs["a"]) == 2
