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
        assert r["part_bytes"] > 0
