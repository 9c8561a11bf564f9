"""bench/gpu_backends.py (issue 21's GPU measurements): the quick run on the CPU backend writes every
section with a passed guard (the plan run against the direct call, both planners, a time per
server); a backend that computes the wrong attention is reported, not timed; a section that fails
costs the others nothing and the JSON written so far stays."""

import json
import re
import sys

import pytest
import torch

from scripts import load_script

from bench.gpu_timing import Timer

MODULE = "bench_gpu_backends"


@pytest.fixture
def bench():
    module = load_script("bench/gpu_backends.py", MODULE)
    yield module
    sys.modules.pop(MODULE, None)


def test_quick_cpu_run_writes_every_section(bench, tmp_path, capsys):
    path = tmp_path / "b.json"
    assert bench.main(["--device", "cpu", "--quick", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["baseline"] == "torch_cpu" and result["errors"] == {} and "partial" not in result
    # speed: every (shape, length) timed, the baseline's ratio 1, median and spread of the rounds
    assert [(r["backend"], r["doc_len"]) for r in result["speed"]] == [("torch_cpu", 256), ("torch_cpu", 1024)]
    for r in result["speed"]:
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["fwd_vs_base"] == r["bwd_vs_base"] == 1.0
        assert r["baseline"] == "torch_cpu"
        for kind in ("fwd", "bwd"):
            assert 0 < r[f"{kind}_ms_min"] <= r[f"{kind}_ms"] <= r[f"{kind}_ms_max"]
    assert result["warm_up"]["calls"] >= 1 and result["warm_up"]["s"] >= 0.05
    # the guard's float64 check of sampled rows, out and dQ, at each length
    sampled = {c["check"]: c for c in result["checks"] if "sampled" in c["check"]}
    assert set(sampled) == {f"speed torch_cpu 2/1/32 L={L}: sampled {x}" for L in (256, 1024) for x in ("out", "dq")}
    assert [r["shard"] for r in result["shards"]] == ["whole", 128, 256]
    assert {r["backend"] for r in result["shards"]} == {"torch_cpu"}
    # plan: both planners ran for real (guarded) and every server's fused call was timed
    plan = result["plan"]
    assert plan["servers"] == 4 and plan["shape"]["num_heads_q"] == 4 and plan["tokens"] == 4 * 1024
    for name in ("flop", "time"):
        p = plan["planners"][name]
        assert len(p["server_ms"]) == len(p["predicted_ms"]) == 4
        assert all(t > 0 for t in p["server_ms"]) and p["measured_max_mean"] >= 1.0
        assert abs(sum(p["server_fwd_ms"]) + sum(p["server_bwd_ms"]) - sum(p["server_ms"])) < 1e-9
    # the time planner balances predicted seconds better than the FLOP planner does
    assert plan["planners"]["time"]["predicted_max_mean"] < plan["planners"]["flop"]["predicted_max_mean"]
    assert plan["target"] == pytest.approx(1.07)
    names = {c["check"] for c in result["checks"]}
    assert {"plan flop: dk", "plan time: dq", "shards 128: out"} <= names
    assert all(c["ok"] for c in result["checks"])
    assert (tmp_path / "b.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "plan run: measured max/mean" in printed
    # the shipped table is torch_varlen's, the plan ran torch_cpu: said in the JSON and the headline
    assert plan["table_backend"] == "torch_varlen" and plan["backend"] == "torch_cpu"
    assert "torch_varlen" in plan["table_warning"] and f"WARNING: {plan['table_warning']}" in result["headline"]
    assert f"WARNING: {plan['table_warning']}" in printed


class Wrong:
    """torch_cpu with a wrong forward (a kernel that must not be timed)."""

    def __init__(self, base):
        self.base, self.name = base, "wrong"

    def forward(self, *a, **kw):
        out, lse = self.base.forward(*a, **kw)
        return out * 1.5, lse

    def backward(self, *a, **kw):
        return self.base.backward(*a, **kw)


class Lazy(Wrong):
    """torch_cpu whose forward never writes its output. On CUDA the benchmark poisons freed
    blocks, so such an output holds NaN (tests/integration/test_bench_gpu_kernels.py's gpu test
    shows the allocator hands them out). The CPU's allocator promises nothing: an empty block
    could hold a stale correct out, which passed the guard in one of many runs. So here the
    never-written block is one per shape, made NaN once (what a poisoned block holds)."""

    def __init__(self, base):
        self.base, self.name, self.blocks = base, "lazy", {}

    def forward(self, q, *a, **kw):
        _, lse = self.base.forward(q, *a, **kw)
        key = (tuple(q.shape), q.dtype)
        if key not in self.blocks:
            self.blocks[key] = torch.full_like(q, float("nan"))
        return self.blocks[key], lse


def _guarded_speed(bench, bad):
    """bench_speed over torch_cpu and ``bad`` (made from it): the rows timed and the errors."""
    from distca_server.kernels import get_backend
    args = bench.parse_args(["--device", "cpu", "--quick"])
    args.device, args.dtype = torch.device("cpu"), torch.float32
    base = get_backend("torch_cpu", "cpu")
    errors = {}
    rows = bench.bench_speed(args, bench.QUICK_RUN, [base, bad(base)], Timer(args.device, 0, 1), [], errors)
    return rows, errors


def test_a_backend_that_computes_the_wrong_attention_is_reported_not_timed(bench):
    rows, errors = _guarded_speed(bench, Wrong)
    assert {r["backend"] for r in rows} == {"torch_cpu"}
    assert len(errors) == 2 and all("correctness guard failed" in e and "out" in e for e in errors.values())


def test_an_output_the_kernel_never_writes_is_refused(bench):
    rows, errors = _guarded_speed(bench, Lazy)
    assert {r["backend"] for r in rows} == {"torch_cpu"}
    assert set(errors) == {f"speed lazy 2/1/32 L={L}" for L in (256, 1024)}
    # the sampled rows against float64 or the whole out against the baseline's
    assert all("correctness guard failed" in e and "out: error" in e for e in errors.values())


class Slightly(Wrong):
    """torch_cpu 3e-5 off: within REL_TOL's 1e-4 of any float32 baseline, but 100x plain torch's
    float32 error against float64."""

    def __init__(self, base):
        self.base, self.name = base, "slightly"

    def forward(self, *a, **kw):
        out, lse = self.base.forward(*a, **kw)
        return out * (1 + 3e-5), lse


def test_every_backend_the_baseline_too_is_checked_against_float64(bench):
    from distca_server.kernels import get_backend
    args = bench.parse_args(["--device", "cpu", "--quick"])
    args.device, args.dtype = torch.device("cpu"), torch.float32
    checks, errors = [], {}
    rows = bench.bench_speed(args, bench.QUICK_RUN, [Slightly(get_backend("torch_cpu", "cpu"))],
                             Timer(args.device, 0, 1), checks, errors)
    assert rows == [] and set(errors) == {f"speed slightly 2/1/32 L={L}" for L in (256, 1024)}
    assert all("sampled out" in e for e in errors.values())


class Renamed(Wrong):
    """torch_cpu under another name, logging each call: a second backend to alternate with."""

    def __init__(self, base, name, log):
        self.base, self.name, self.log = base, name, log

    def forward(self, *a, **kw):
        self.log.append(f"{self.name} fwd")
        return self.base.forward(*a, **kw)

    def backward(self, *a, **kw):
        self.log.append(f"{self.name} bwd")
        return self.base.backward(*a, **kw)


def test_speed_guards_every_backend_then_alternates_rounds(bench):
    from distca_server.kernels import get_backend
    args = bench.parse_args(["--device", "cpu", "--quick"])
    args.device, args.dtype = torch.device("cpu"), torch.float32
    base, log = get_backend("torch_cpu", "cpu"), []
    run = dict(bench.QUICK_RUN, lengths=[256])
    rows = bench.bench_speed(args, run, [Renamed(base, "a", log), Renamed(base, "b", log)],
                             Timer(args.device, 1, 3), [], {})
    assert [r["backend"] for r in rows] == ["a", "b"]
    # both guards (a forward and a backward each), then 1 untimed and 3 timed rounds, A B A B:
    # never one backend's repeats after the other's
    assert log == ["a fwd", "a bwd", "b fwd", "b bwd"] * (1 + 1 + 3)
    assert rows[1]["baseline"] == "a" and rows[1]["fwd_vs_base"] == rows[1]["fwd_tflops"] / rows[0]["fwd_tflops"]


def test_sampled_rows_match_the_float64_reference(bench):
    from distca_server.refs import attention_ref, cu_seqlens, relative_error
    g = torch.Generator().manual_seed(3)
    lens, hq, hkv, dim = [70, 1, 130], 4, 2, 16
    q, dout = (torch.randn(sum(lens), hq, dim, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(sum(lens), hkv, dim, generator=g, dtype=torch.float64) for _ in range(2))
    cu = cu_seqlens(lens)
    leaf = q.clone().requires_grad_()
    out, _ = attention_ref(leaf, k, v, cu, cu, 0.3)
    out.backward(dout)
    rows = bench.sample_rows(sum(lens), 40, seed=0)
    assert len(rows) == 40 and rows.tolist() == sorted(set(rows.tolist()))
    for chunk in (1 << 30, 1):  # one chunk, and one row a chunk (the memory bound's path)
        bench.SAMPLE_CHUNK_BYTES, saved = chunk, bench.SAMPLE_CHUNK_BYTES
        try:
            o, dq = bench.sampled_attention(q, k, v, dout, cu, rows, 0.3, torch.float64)
        finally:
            bench.SAMPLE_CHUNK_BYTES = saved
        assert relative_error(o, out.detach()[rows]) < 1e-12 and relative_error(dq, leaf.grad[rows]) < 1e-12
    # in bf16 it is plain torch's error, far from float64's and well within the bf16 guard
    o16, dq16 = bench.sampled_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), dout.bfloat16(), cu, rows, 0.3,
                                        torch.bfloat16)
    assert 1e-4 < relative_error(o16, out.detach()[rows]) < 2e-2
    assert bench.sampled_tol(0.004, torch.bfloat16) == pytest.approx(0.008 + 2e-3)


def test_every_flag_the_doc_names_is_an_option(bench):
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", bench.__doc__))
    assert {"--shapes", "--lengths", "--min-tokens", "--plan-tokens", "--backends"} <= named
    options = set(bench.build_parser()._option_string_actions)
    assert named <= options, sorted(named - options)
    args = bench.parse_args(["--shapes", "32/8/128", "64/8/128", "--lengths", "16384", "--min-tokens", "65536",
                             "--plan-tokens", "2048"])
    assert args.shapes == [(32, 8, 128), (64, 8, 128)] and args.lengths == [16384]
    assert (args.min_tokens, args.plan_tokens) == (65536, 2048)
    with pytest.raises(SystemExit):
        bench.parse_args(["--shapes", "32/5/128"])  # H_q not a multiple of H_kv


def test_default_lengths_include_the_16k_reference_point(bench):
    assert bench.FULL_RUN["lengths"] == [8192, 16384, 32768, 65536, 131072]


def test_table_warning_names_both_kernels(bench):
    assert bench.table_warning("cudnn", "cudnn") is None
    warning = bench.table_warning("torch_varlen", "cudnn")
    assert "torch_varlen" in warning and "cudnn" in warning


def test_an_interrupted_run_keeps_the_finished_sections(bench, tmp_path, monkeypatch):
    def stopped(*a, **kw):
        raise SystemExit(143)  # what SIGTERM becomes (gpu_timing.run_sections)
    monkeypatch.setattr(bench, "bench_plan", stopped)
    path = tmp_path / "b.json"
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--quick", "--sections", "speed", "plan", "--json", str(path), "--no-png"])
    result = json.loads(path.read_text())
    assert result["partial"] is True and result["interrupted"] == "SystemExit during section plan"
    assert len(result["speed"]) == 2 and "plan" not in result


def test_a_failing_section_keeps_the_others(bench, tmp_path):
    path = tmp_path / "b.json"
    argv = ["--device", "cpu", "--quick", "--sections", "speed", "plan", "--attn-profile", str(tmp_path / "none"),
            "--json", str(path), "--no-png"]
    assert bench.main(argv) == 1
    result = json.loads(path.read_text())
    assert result["speed"] and "plan" not in result and "plan" in result["errors"]
