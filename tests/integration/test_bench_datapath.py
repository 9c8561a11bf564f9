"""bench/datapath.py in --quick mode: the data path's copies and memory, kernel stubbed.

The assertions are structural (bytes, not seconds): one in-place server copies nothing (eager
calls return the LSE as a transposed view: no copy into the operator's [Hq, T] layout) and holds
what varlen_attention holds; a dedicated server's data path copies each byte once each way beside
the transfer itself, plus the server's copy of the kept Q, K, V rows (kept activations, the
default: 4.35x Q+K+V for this GQA shape, see the script's docstring); with ``--before-tree`` both
trees are measured alike, each configuration in fresh processes, alternating which goes first."""

import json
import os

import pytest

from scripts import ROOT, load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/datapath.py", "bench_datapath")


@pytest.fixture(scope="module")
def rows(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("datapath") / "d.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    return {(r["mode"], r["servers"]): r for r in json.loads(out.read_text())["rows"]}


def test_one_inplace_server_copies_nothing(rows):
    one, ref = rows[("inplace", 1)], rows[("varlen_attention", 0)]
    assert one["copied_by_op"] == {} and one["moved_x_qkv"] == 0
    assert one["peak_x_qkv"] <= 1.3 * ref["peak_x_qkv"] + 0.2


def test_each_byte_is_gathered_and_scattered_once(rows):
    ded = rows[("dedicated", 1)]
    # q-units, hkv = hq/4 (Q+K+V = 1.5), kept activations: forward Q, K, V out and O back, backward
    # dO out and dQ, dK, dV back (the LSE's few bytes aside), each gathered or scattered once ...
    moved = (1 + 0.25 + 0.25) + 1 + 1 + (1 + 0.25 + 0.25)
    assert abs(ded["moved_x_qkv"] - moved / 1.5) < 0.03
    # ... and the server's one copy of the Q, K, V rows it keeps for the backward
    floor = moved + (1 + 0.25 + 0.25)
    assert ded["copied_x_qkv"] - ded["moved_x_qkv"] <= floor / 1.5 + 0.05
    assert ded["copied_by_op"]["clone"] == ded["qkv_bytes"]
    for r in rows.values():
        assert r["copied_x_qkv"] < 15  # the previous data path copied 23-32x


def test_replayed_rounds_copy_what_the_eager_ones_do_and_more(bench, tmp_path):
    """``--graphs``: over the in-process routed heap, a step whose rounds are replayed (CPU stand-in:
    each recording run again) copies everything the eager step does, plus the static inputs and
    outputs and the kept rows in and out of the recordings (``_foreach_copy_``); the script itself
    fails unless the counted step's two rounds were replays."""
    out = tmp_path / "g.json"
    assert bench.main(["--quick", "--graphs", "--servers", "2", "--json", str(out)]) == 0
    rows = {(r["mode"], r["servers"]): r for r in json.loads(out.read_text())["rows"]}
    for mode in ("inplace", "dedicated"):
        eager, graphed = rows[(f"{mode} shm", 2)], rows[(f"{mode} shm+graphs", 2)]
        assert graphed["counted_replays"] == 2 and eager["counted_replays"] is None
        assert "_foreach_copy_" in graphed["copied_by_op"] and "_foreach_copy_" not in eager["copied_by_op"]
        extra = graphed["copied_x_qkv"] - eager["copied_x_qkv"]
        assert abs(extra * graphed["qkv_bytes"] - graphed["copied_by_op"]["_foreach_copy_"]) <= 0.01 * graphed["qkv_bytes"]
        assert extra >= 3.3  # at least q, k, v in, out and lse out, dout in, dq, dk, dv out


def test_before_tree_measures_both_trees_alike(bench, tmp_path):
    """``--before-tree`` (here this very tree): every configuration of either tree in a fresh
    process of its own, the two alternating which goes first; identical trees copy and launch the
    same (times are the machine's noise)."""
    out = tmp_path / "b.json"
    assert bench.main(["--before-tree", str(ROOT), "--tokens", "1024", "--servers", "1", "2", "--modes", "inplace",
                       "--repeats", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    compared = [r for r in got["rows"] if r["mode"] != "varlen_attention"]
    assert [r["first"] for r in compared] == ["current", "before"]
    processes = [p for r in got["rows"] for p in (r["process"], r.get("process_before")) if p is not None]
    assert len(set(processes)) == len(processes) == 5 and os.getpid() not in processes
    for r in compared:
        assert r["copied_before"] == r["copied_x_qkv"] and r["launches_before"] == r["launches"]
    assert "both in fresh processes, alternating" in got["headline"][1]
