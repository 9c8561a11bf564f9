"""bench/gpu_backends.py (issue 21's GPU measurements): the quick run on the CPU backend writes every
section with a passed guard (the plan run against the direct call, both planners, a time per
server); a backend that computes the wrong attention is reported, not timed; a section that fails
costs the others nothing and the JSON written so far stays."""

import json
import sys

import pytest
import torch

from scripts import load_script

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
    # speed: every (shape, length) timed, the baseline's ratio 1
    assert [(r["backend"], r["doc_len"]) for r in result["speed"]] == [("torch_cpu", 256), ("torch_cpu", 1024)]
    for r in result["speed"]:
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["fwd_vs_base"] == r["bwd_vs_base"] == 1.0
        assert r["baseline"] == "torch_cpu"
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
    assert "plan run: measured max/mean" in capsys.readouterr().out


class Wrong:
    """torch_cpu with a wrong forward (a kernel that must not be timed)."""

    def __init__(self, base):
        self.base, self.name = base, "wrong"

    def forward(self, *a, **kw):
        out, lse = self.base.forward(*a, **kw)
        return out * 1.5, lse

    def backward(self, *a, **kw):
        return self.base.backward(*a, **kw)


def test_a_backend_that_computes_the_wrong_attention_is_reported_not_timed(bench):
    from distca_server.kernels import get_backend
    args = bench.parse_args(["--device", "cpu", "--quick"])
    args.device, args.dtype = torch.device("cpu"), torch.float32
    base = get_backend("torch_cpu", "cpu")
    checks, errors = [], {}
    rows = bench.bench_speed(args, bench.QUICK_RUN, [base, Wrong(base)], bench.Timer(args.device, 0, 1), checks,
                             errors)
    assert {r["backend"] for r in rows} == {"torch_cpu"}
    assert len(errors) == 2 and all("correctness guard failed" in e and "out" in e for e in errors.values())


def test_a_failing_section_keeps_the_others(bench, tmp_path):
    path = tmp_path / "b.json"
    argv = ["--device", "cpu", "--quick", "--sections", "speed", "plan", "--attn-profile", str(tmp_path / "none"),
            "--json", str(path), "--no-png"]
    assert bench.main(argv) == 1
    result = json.loads(path.read_text())
    assert result["speed"] and "plan" not in result and "plan" in result["errors"]
