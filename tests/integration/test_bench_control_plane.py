"""Smoke test of bench/control_plane.py in --quick mode: the in-process coordinator at 8 and 64
clients and the Ray scheduler actor at 8 clients beside 8 pings; every part checked as msgpack
bytes, the JSON complete. Timing verdicts are printed, not asserted: they belong to the benchmark."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from scripts import load_script, run_ray_script

ray = pytest.importorskip("ray")

MODULE = "bench_control_plane"

# A driver's own instance, not `ray start`: that would make every later plain ray.init() on this
# machine (other tests, other sessions) join it.
_CLUSTER = """import sys, ray
ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=80 * 2**20)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""


@pytest.fixture
def running_cluster(monkeypatch):
    """Another Ray instance running on this machine and named by ``RAY_ADDRESS``, as on a node of a
    cluster: a plain ``ray.init(num_cpus=...)`` joins it and raises."""
    proc = subprocess.Popen([sys.executable, "-c", _CLUSTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        address = proc.stdout.readline().strip()
        assert address, "the other Ray instance did not start"
        monkeypatch.setenv("RAY_ADDRESS", address)
        yield address
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_quick_run_writes_expected_rows(tmp_path, capsys, running_cluster):
    """Beside a running cluster (``RAY_ADDRESS``): the benchmark starts and measures its own Ray
    (``start_local_ray``: ``address="local"``), leaving the other alone."""
    out = tmp_path / "cp.json"
    assert run_ray_script("bench/control_plane.py", MODULE, ["--quick", "--json", str(out)]) == (0, False)
    printed = capsys.readouterr().out
    assert "after last" in printed and "step/pings" in printed
    assert "parts: msgpack bytes, each decoded to its client's part of one plan: yes" in printed
    assert "ray step at 8 clients" in printed

    result = json.loads(out.read_text())
    assert result["benchmark"] == "control_plane" and result["quick"] is True
    assert (result["mode"], result["epsilon"], result["tokens_per_rank"]) == ("inplace", 0.05, 131072)
    rows = result["in_process"]
    assert [r["clients"] for r in rows] == [8, 64]
    for r in rows:
        assert len(r["step_ms_runs"]) == 2 and r["part_bytes"] > 0 and r["num_tasks"] >= r["num_docs"] > 0
        assert r["imbalance_after"] <= 1.05 + 1e-9
        # two runs: each median is a mean, so the parts add up to the step
        parts = r["intake_ms"] + r["plan_ms"] + r["cut_ms"] + r["other_ms"]
        assert abs(parts - r["step_ms"]) < 1e-6 * r["step_ms"]
        assert 0 < r["work_ms"] < r["after_last_ms"] <= r["step_ms"]
        assert "target_ms" not in r  # the 60 ms target is the 1024-client row's
    (ray_row,) = result["ray"]
    assert ray_row["clients"] == 8 and ray_row["target_ratio"] == 1.5
    assert len(ray_row["ratio_runs"]) == 2 and all(x > 0 for x in ray_row["ratio_runs"])
    assert ray_row["step_ms"] > 0 and ray_row["pings_ms"] > 0 and ray_row["part_bytes"] > 0
    assert ray_row["actor_plan_ms"] > 0 and ray_row["actor_cut_ms"] > 0
    assert ray_row["meets"] == (ray_row["ratio"] <= 1.5)


def test_check_answers_refuses_what_is_not_msgpack_bytes():
    bench = load_script("bench/control_plane.py", MODULE)
    try:
        with pytest.raises(AssertionError, match="not msgpack bytes"):
            bench.check_answers([{"part": bytearray(b"\x80"), "group": {}}], 0, 1)
        with pytest.raises(AssertionError, match="rank 0"):
            bench.check_answers([{"error": "DistCAError", "message": "x"}], 0, 1)
    finally:
        sys.modules.pop(MODULE, None)


def test_process_cpu_clock_counts_every_thread_in_nanoseconds():
    """The actor's CPU time: the whole process's, ended threads included, finer than the 10 ms
    clock ticks of /proc/<pid>/stat (which made a few-ms step read 0 or 10 ms)."""
    bench = load_script("bench/control_plane.py", MODULE)
    try:
        clock = bench.process_cpu_clock(os.getpid())
        # this whole process, read the way time.process_time() reads it (ticks would be up to 10 ms off)
        assert abs(bench.process_cpu_s(clock) - time.process_time()) < 2e-3
        before = bench.process_cpu_s(clock)

        def spin():
            end = time.thread_time() + 0.03
            while time.thread_time() < end:
                pass
        worker = threading.Thread(target=spin)
        worker.start()
        worker.join()
        used = bench.process_cpu_s(clock) - before
        assert 0.03 <= used < 1.0  # the ended thread's CPU time is still the process's
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            assert bench.process_cpu_s(bench.process_cpu_clock(child.pid)) > 0  # another process's
        finally:
            child.stdin.close()
            child.wait(timeout=30)
    finally:
        sys.modules.pop(MODULE, None)
