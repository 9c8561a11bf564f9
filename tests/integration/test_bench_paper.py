"""Smoke test of bench/paper.py: a tiny subset runs in seconds, prints the paper's numbers beside
ours, and writes JSON rows with the agreed keys and the four figures."""

import json

from scripts import load_script

KEYS = {"experiment", "model", "gpus", "context", "dataset", "system", "throughput_tokens_s",
        "speedup_vs_wlb"}


def load_bench():
    return load_script("bench/paper.py", "bench_paper")


def test_smoke_run_writes_rows_and_figures(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "paper.json"
    assert bench.main(["--smoke", "--json", str(out), "--out-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for text in ("Fig. 4", "Fig. 9", "Fig. 10", "Fig. 12", "paper", "1.07-1.20x", "differ"):
        assert text in printed

    rows = json.loads(out.read_text())
    assert isinstance(rows, list) and rows
    for r in rows:
        assert KEYS <= set(r), sorted(KEYS - set(r))
        assert r["throughput_tokens_s"] > 0
    assert {r["experiment"] for r in rows} == {"fig4", "fig9", "fig10", "fig12"}
    speed = [r for r in rows if r["experiment"] in ("fig9", "fig10")]
    systems = {r["system"] for r in speed}
    assert {"wlb_ideal", "per_doc_cp", "packing", "distca eps=0"} <= systems
    assert all(r["speedup_vs_wlb"] == 1.0 for r in speed if r["system"] == "wlb_ideal")
    assert all(r["speedup_vs_wlb"] > 0 for r in rows if r["experiment"] == "fig12")
    # 4D: distca is the best of kept-activation and stateless servers, one best per configuration
    fig10 = [r for r in speed if r["experiment"] == "fig10" and r["system"].startswith("distca")]
    assert {r["details"]["keep_activations"] for r in fig10} == {True, False}
    assert sum(r["best_distca"] for r in fig10) == len(bench.MODES["smoke"]["4d"])
    assert "servers" in printed
    for name in ("fig4", "fig9", "fig10", "fig12"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000


def test_quick_mode_has_at_least_eight_configurations():
    bench = load_bench()
    quick = bench.MODES["quick"]
    assert len(quick["3d"]) + len(quick["4d"]) >= 8
    assert {m for m, *_ in quick["3d"] + quick["4d"]} == set(bench.MODELS)
    assert {d for _, d, *_ in quick["3d"] + quick["4d"]} == set(bench.DATASETS)
