"""bench/exchange_before_after.py: roundtrip.py measuring another checkout keeps this tree's bench
helpers, and the pairs of runs alternate which tree goes first within a context, their spread
reported. The pairing is tested with roundtrip.py's runs stubbed (a real pair is two Ray runs)."""

import json
import os
import subprocess
import sys

from scripts import ROOT, load_script

MODULE = "bench_exchange_before_after"


def test_roundtrip_on_another_tree_uses_this_trees_bench_helpers(tmp_path):
    """The other tree's packages come first, but not its bench/ (an older roundtrip_runtimes
    without this tree's helpers, or none) nor its distca_cli (an older one has no
    ``worker_pythonpath`` for the Ray workers' environment): the script uses its own."""
    other = tmp_path / "other"
    for name in ("bench/roundtrip_runtimes.py", "bench/report.py", "distca_cli/__init__.py",
                 "distca_cli/connect.py"):
        (other / name).parent.mkdir(parents=True, exist_ok=True)
        (other / name).write_text(f"raise ImportError('the other tree\\'s {name} was imported')\n")
    code = ("import os, runpy, sys; g = runpy.run_path(sys.argv[1]); "
            "print(g['_this_trees_worker_pythonpath']()('A', 'B').split(os.pathsep)[:2]); "
            "print(sys.modules['bench.roundtrip_runtimes'].__file__)")
    env = dict(os.environ, DISTCA_TREE=str(other))
    done = subprocess.run([sys.executable, "-c", code, str(ROOT / "bench" / "roundtrip.py")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    paths, runtimes = done.stdout.splitlines()[-2:]
    assert paths == "['A', 'B']" and runtimes == str(ROOT / "bench" / "roundtrip_runtimes.py")


def _fake_rows(total_ms: float) -> list[dict]:
    return [{"config": "inplace 2c", "participants": 2, "round": kind, "ray_total_ms": total_ms,
             "ray_all_to_all_ms": total_ms / 2, "ray_collectives_per_round": 3.0} for kind in ("forward", "backward")]


def test_runs_alternate_within_a_context_and_report_the_spread(tmp_path, monkeypatch):
    bench = load_script("bench/exchange_before_after.py", MODULE)
    try:
        calls = []
        after_ms = iter([90.0, 120.0, 100.0, 80.0, 95.0, 105.0])

        def run_roundtrip(tree, configs, context, layers, steps):
            calls.append((context, "before" if tree is not None else "after"))
            return _fake_rows(100.0 if tree is not None else next(after_ms))
        monkeypatch.setattr(bench, "run_roundtrip", run_roundtrip)
        out = tmp_path / "eba.json"
        assert bench.main(["--before-tree", str(ROOT), "--contexts", "1024", "2048", "--runs", "3",
                           "--configs", "inplace:2", "--json", str(out)]) == 0
    finally:
        sys.modules.pop(MODULE, None)
    # one context and several runs: both orders; the next context starts with the other tree
    assert [who for _, who in calls[:6]] == ["before", "after", "after", "before", "before", "after"]
    assert [who for _, who in calls[6:10]] == ["after", "before", "before", "after"]
    result = json.loads(out.read_text())
    assert result["runs"] == 3
    fwd = [r for r in result["rows"] if r["round"] == "forward"]
    first = fwd[0]  # 1024 tokens: after 90, 120, 100 against 100
    assert (first["ratio_min"], first["ratio"], first["ratio_max"]) == (0.9, 1.0, 1.2)
    assert [r["first"] for r in first["runs"]] == ["before", "after", "before"]
    assert first["after_total_ms"] == 100.0 and first["before_collectives"] == 3.0
    assert "single runs 0.80-1.20x" in result["headline"][0]
