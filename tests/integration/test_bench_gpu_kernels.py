"""bench/gpu_kernels.py: the quick run on the CPU backend writes every section with sane numbers and
a passed correctness guard; a kernel that computes the wrong attention is refused, not timed; the
ProfileTables it writes load into ``distca simulate --attn-profile``. The ``gpu`` test runs the
same quick command on CUDA with distca's GPU backend."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from scripts import ROOT, load_script

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
    # any import of it fail).
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
