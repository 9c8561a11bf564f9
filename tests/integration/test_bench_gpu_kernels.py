"""bench/gpu_kernels.py: the quick run on the CPU backend writes every section with sane numbers and
a passed correctness guard; a kernel that computes the wrong attention is refused, not timed; the
ProfileTables it writes load into ``distca simulate --attn-profile``. The ``gpu`` test runs the
same quick command on CUDA with distca's GPU backend."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

from scripts import ROOT, load_script

from bench.gpu_timing import Timer, kv_row_limit, poison_freed, spread_ms, usable_bytes
from distca_sim.hardware import load_attention_profile
from scheduler.cost import CostModel, causal_pairs

MODULE = "bench_gpu_kernels"


@pytest.fixture
def bench():
    module = load_script("bench/gpu_kernels.py", MODULE)
    yield module
    sys.modules.pop(MODULE, None)


def check_result(result, device, backend, dtype, json_path):
    assert (result["device_type"], result["backend"], result["dtype"]) == (device, backend, dtype)
    assert result["errors"] == {} and result["quick"] is True
    # shards: the whole-document row, then one row per shard size, every ratio a positive number
    rows = result["shards"]
    assert [r["shard"] for r in rows] == ["whole", 128, 256]
    for r in rows:
        for key in ("fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "fwd_ratio", "bwd_ratio"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["shard"], key, r[key])
        for kind in ("fwd", "bwd"):  # the median of the timed rounds, and their spread
            assert 0 < r[f"{kind}_ms_min"] <= r[f"{kind}_ms"] <= r[f"{kind}_ms_max"]
        assert r["backend"] == backend
    for r in rows[1:]:  # quick sizes fit: every head–tail pair ran
        assert r["pairs_run"] == r["pairs_all"] == result["docs"] * result["doc_len"] // r["shard"] // 2
        assert r["tasks"] == 2 * r["pairs_run"]
    # overhead: both paths timed, the ratio finite, for 1 participant and for 2 exchanging rows
    # in lock step and over the in-process heap
    runs = [(1, "lockstep"), (2, "lockstep"), (2, "heap"), (2, "graphs")]
    assert [(r["participants"], r["exchange"], r["tokens"]) for r in result["overhead"]] == [
        (p, x, t) for p, x in runs for t in (512, 1024)]
    for r in result["overhead"]:
        assert r["direct_ms"] > 0 and r["distca_ms"] > 0 and math.isfinite(r["overhead"]) and r["overhead"] > -1
        assert 0 < r["host_ms"] and math.isfinite(r["host_ms"])
        if device == "cuda":  # the host's part of a step; on the CPU both are wall times of the same
            # work, taken at different moments, which a loaded machine can make differ by any ratio
            assert r["host_ms"] <= r["distca_ms"] * 1.5 + 5
        assert r["replays"] == 0 if device == "cpu" else (r["replays"] > 0) == (r["exchange"] == "graphs")
    # the guard ran before timing: 5 checks per shard size (out, lse, dq, dk, dv), 4 per batch and
    # run, 1 per profile point
    names = [c["check"] for c in result["checks"]]
    assert len(names) == 5 * 2 + 4 * 2 * 4 + 2 and all(c["ok"] and c["error"] <= c["tol"] for c in result["checks"])
    assert {"shards 128: dk", "overhead 1024 2xheap: dv", "profile llama3-8b:8 128x256: out"} <= set(names)
    # profile: a (forward, backward) pair the simulator's hook reads for its shape
    (prof,) = result["profile"]
    assert prof["model"] == "llama3-8b:8" and prof["corner_fwd_tflops"] > 0 and prof["corner_bwd_tflops"] > 0
    assert prof["first_call_s"] > 0 and math.isfinite(prof["first_call_extra_s"])
    assert prof["graph_builds"] is None if backend != "cudnn" else prof["graph_builds"] >= 0
    cost = CostModel.from_wire([prof["cost"][k] for k in ("num_heads_q", "num_heads_kv", "head_dim", "dtype_bytes")])
    assert (cost.num_heads_q, cost.num_heads_kv, cost.head_dim) == (4, 1, 128)
    assert str(json_path.parent) in prof["dir"]
    fwd, bwd = load_attention_profile(prof["dir"], cost)
    assert fwd.meta["source"] == "measured" and fwd.meta["backend"] == backend
    assert fwd.q_lens == [128] and fwd.kv_lens == [128, 256]
    for t in (fwd, bwd):
        assert all(x > 0 for row in t.latency_s for x in row)


def test_quick_cpu_run_writes_every_section(bench, tmp_path, capsys):
    out = tmp_path / "k.json"
    assert bench.main(["--quick", "--device", "cpu", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fwd ratio" in printed and "overhead %" in printed and "44 of 44 checks passed" in printed
    result = json.loads(out.read_text())
    check_result(result, "cpu", "torch_cpu", "float32", out)
    assert result["device"] == "cpu" and result["torch"] == torch.__version__
    assert "partial" not in result and "interrupted" not in result  # the last write is the whole run's
    assert out.with_suffix(".png").exists()


def test_shard_pairs_are_exact_samples_of_the_work(bench):
    tasks, total = bench.shard_tasks(4, 1024, 128, math.inf)
    assert total == 16 and len(tasks) == 32
    # every shard of every document once, keys [0, q_end)
    assert sorted(tasks) == [(d, i * 128, (i + 1) * 128) for d in range(4) for i in range(8)]
    # a budget for 5 pairs: 5 evenly spaced head–tail pairs, each (n + 1) * s KV rows and the
    # same causal pairs, so the subset is an exact sample of the documents' work
    few, _ = bench.shard_tasks(4, 1024, 128, 5 * 9 * 128)
    assert len(few) == 10
    for (d, a, b), (d2, a2, b2) in zip(few[::2], few[1::2]):
        assert d == d2 and a + a2 == 1024 - 128 and b + b2 == 1024 + 128
        assert causal_pairs(a, b, 0, b) + causal_pairs(a2, b2, 0, b2) == 128 * 1025
    with pytest.raises(ValueError, match="even number of shards"):
        bench.shard_tasks(1, 1000, 128, math.inf)


class WrongKernel:
    """distca's CPU backend with a bug that only shows when a call holds partial prefixes (shards):
    the guard must catch it before any timing."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, **kw):
        return self.inner.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale * (1.1 if max_q < max_k else 1.0), **kw)

    def backward(self, *args, **kw):
        return self.inner.backward(*args, **kw)


def test_a_wrong_kernel_is_refused_not_timed(bench, tmp_path, capsys, monkeypatch):
    real = bench.get_backend
    monkeypatch.setattr(bench, "get_backend", lambda name, device: WrongKernel(real(name, device)))
    out = tmp_path / "k.json"
    assert bench.main(["--quick", "--device", "cpu", "--sections", "shards", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    result = json.loads(out.read_text())
    assert "shards" not in result  # no numbers of a wrong kernel
    assert "correctness guard failed: shards 128: out" in result["errors"]["shards"]
    assert [c["ok"] for c in result["checks"]] == [False]
    assert "FAILED shards" in captured.err


def test_the_bench_imports_no_ray():
    # The GPU machine has no Ray: importing it must not be needed (sys.modules[...] = None makes
    # any import of it fail), nor by bench/gpu_timing.py, which it imports.
    code = ("import sys; sys.modules['ray'] = None; sys.argv = ['x', '--help']; "
            "import runpy; runpy.run_path('bench/gpu_kernels.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    assert "--sections" in done.stdout


@pytest.mark.gpu
def test_quick_gpu_run_with_distcas_gpu_backend(bench, tmp_path):
    out = tmp_path / "k.json"
    assert bench.main(["--quick", "--device", "cuda", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    check_result(result, "cuda", result["backend"], "bfloat16", out)
    assert result["backend"] in ("torch_varlen", "flash_attn")
    assert result["device"] == torch.cuda.get_device_name() and result["cuda"] == torch.version.cuda


def test_trace_profiles_the_smallest_overhead_case(bench, tmp_path, capsys):
    out, trace = tmp_path / "k.json", tmp_path / "trace.json"
    assert bench.main(["--quick", "--device", "cpu", "--sections", "overhead", "--trace", str(trace),
                       "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Self CPU time total" in printed and f"wrote {trace}" in printed
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"direct", "distca"} <= names  # both paths' steps are marked in the trace


def test_every_flag_the_doc_names_is_an_option(bench):
    doc = re.sub(r"distca simulate --[\w-]+", "", bench.__doc__)  # another command's flag
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", doc))
    assert {"--docs", "--doc-len", "--profile-rows", "--max-kv-rows"} <= named
    options = set(bench.build_parser()._option_string_actions)
    assert named <= options, sorted(named - options)


def test_profile_runs_before_overhead(bench):
    # the backends stage reads the tables profile writes: a run stopped during the costly overhead
    # section must already have them
    assert bench.SECTIONS.index("profile") < bench.SECTIONS.index("overhead")


def test_usable_memory_counts_the_allocators_cached_blocks(monkeypatch):
    gib = 1 << 30
    assert usable_bytes(free=10 * gib, reserved=50 * gib, allocated=20 * gib) == 40 * gib
    # the committed H200 run's case: after a large section freed its tensors, the driver sees
    # little free memory, but the allocator holds the rest unused
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * gib, 141 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 100 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * gib)
    args = types.SimpleNamespace(max_kv_rows=None, device=torch.device("cuda"), dtype=torch.bfloat16)
    row_bytes = 2 * 128 * (4 * 8 + 2 * 32)
    assert kv_row_limit(args, 32, 8, 128) == pytest.approx(0.6 * 94 * gib / row_bytes)
    args.max_kv_rows = 1000
    assert kv_row_limit(args, 32, 8, 128) == 1000


def test_rounds_alternate_over_the_callables():
    calls = []
    timer = Timer(torch.device("cpu"), warmup=1, repeats=2)
    times = timer.rounds_s({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")})
    assert calls == ["a", "b"] * 3  # one untimed round, then two timed ones, A B A B
    assert {k: len(v) for k, v in times.items()} == {"a": 2, "b": 2}
    assert spread_ms("fwd", [0.003, 0.001, 0.002]) == pytest.approx(
        {"fwd_ms": 2.0, "fwd_ms_min": 1.0, "fwd_ms_max": 3.0})


class CountingKernel:
    """torch_cpu, counting one 'graph' per new (kind, max_q, max_k), as the cudnn backend counts its
    builds (``graph_builds``), and sleeping on a build: a first call that costs more than the rest."""

    BUILD_S = 0.05

    def __init__(self, inner):
        self.inner, self.name, self.graph_builds, self.seen = inner, inner.name, 0, set()

    def _build(self, key):
        if key not in self.seen:
            self.seen.add(key)
            self.graph_builds += 1
            time.sleep(self.BUILD_S)

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, **kw):
        self._build(("fwd", max_q, max_k))
        return self.inner.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, **kw)

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, **kw):
        self._build(("bwd", max_q, max_k))
        return self.inner.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, **kw)


def test_profile_records_graph_builds_and_first_calls(bench, tmp_path, monkeypatch):
    real = bench.get_backend
    monkeypatch.setattr(bench, "get_backend", lambda name, device: CountingKernel(real(name, device)))
    out = tmp_path / "k.json"
    assert bench.main(["--quick", "--device", "cpu", "--sections", "profile", "--json", str(out), "--no-png"]) == 0
    (row,) = json.loads(out.read_text())["profile"]
    assert row["graph_builds"] == 4  # 2 points, a forward and a backward graph each
    assert row["first_call_s"] >= 4 * CountingKernel.BUILD_S
    # extra = first calls - their medians: the builds' sleeps, less however much a median call
    # outlasts a first one (noise on a loaded machine, never near 0.1 s at these sizes)
    assert 2 * CountingKernel.BUILD_S <= row["first_call_extra_s"] < row["first_call_s"]
    fwd, _ = load_attention_profile(row["dir"], CostModel.from_wire(
        [row["cost"][k] for k in ("num_heads_q", "num_heads_kv", "head_dim", "dtype_bytes")]))
    assert set(fwd.meta["first_call_ms"]) == set(fwd.meta["copies_per_call"]) == {"128x128", "128x256"}


def test_sigterm_keeps_every_finished_row(tmp_path):
    # the session's `timeout -k 5` sends SIGTERM at the stage's limit: what finished must be in the
    # JSON, marked partial, and the kill noted. Many repeats make overhead outlast the signal.
    out = tmp_path / "k.json"
    proc = subprocess.Popen([sys.executable, "bench/gpu_kernels.py", "--quick", "--device", "cpu", "--sections",
                             "profile", "overhead", "--repeats", "200", "--json", str(out), "--no-png"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:  # the file is replaced whole (a rename), so a read sees one complete version
                if json.loads(out.read_text()).get("overhead"):
                    break
            except FileNotFoundError:
                pass
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.stderr.close()
    result = json.loads(out.read_text())
    assert result["partial"] is True and result["interrupted"] == "SystemExit during section overhead"
    assert len(result["profile"]) == 1 and result["overhead"]  # the finished section and rows so far
    assert all(c["ok"] for c in result["checks"])


@pytest.mark.gpu
def test_poisoned_blocks_are_what_the_allocator_hands_out_next():
    # CUDA's caching allocator gives a freed block to the next request of its size: after
    # poison_freed that block holds NaN, not the result it held, so an unwritten output shows
    shape = (4096, 8, 128)
    correct = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    ptr = correct.data_ptr()
    del correct
    poison_freed(torch.device("cuda"), [(shape, torch.bfloat16)])
    unwritten = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
    assert unwritten.data_ptr() == ptr and torch.isnan(unwritten).all()
