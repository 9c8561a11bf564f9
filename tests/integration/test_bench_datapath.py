"""bench/datapath.py in --quick mode: the data path's copies and memory, kernel stubbed.

The assertions are structural (bytes, not seconds): one in-place server copies nothing (eager
calls return the LSE as a transposed view: no copy into the operator's [Hq, T] layout) and holds
what varlen_attention holds; a dedicated server's data path copies each byte once each way beside
the transfer itself (one gather and one scatter per byte and direction: 5.04x Q+K+V for this GQA
shape, see the script's docstring)."""

import json

import pytest

from scripts import load_script


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
    floor = (1 + 0.25 + 0.25) + (1 + 0.25 + 0.25 + 1 + 1) + 1 + (1 + 0.25 + 0.25)  # q-units, hkv = hq/4
    assert ded["copied_x_qkv"] - ded["moved_x_qkv"] <= floor / 1.5 + 0.05
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
