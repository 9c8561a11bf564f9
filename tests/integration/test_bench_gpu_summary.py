"""bench/gpu_summary.py: issue 22's summary keys from a session's JSON files, each from the
benchmark that measured it, and null with a reason where nothing did."""

from __future__ import annotations

import json

from scripts import load_script


def test_summary_takes_each_key_from_its_benchmark(tmp_path):
    bench = load_script("bench/gpu_summary.py", "bench_gpu_summary")
    (tmp_path / "transport_local.json").write_text(json.dumps({"summary": {
        "exchange_us_64KiB_2pe": 31.0, "exchange_us_64KiB_2pe_host_driven": 900.0}}))
    (tmp_path / "transport_local_graph.json").write_text(json.dumps({"summary": {  # the graphs stage's run
        "exchange_us_64KiB_2pe": 35.0, "exchange_host_us_64KiB_2pe_graphed": 6.5}}))
    (tmp_path / "kernels.json").write_text(json.dumps({"overhead": [
        {"participants": 1, "exchange": "lockstep", "tokens": 8192, "host_ms": 9.0, "overhead": 0.5},
        {"participants": 2, "exchange": "heap", "tokens": 8192, "host_ms": 0.25, "overhead": 0.021},
        {"participants": 2, "exchange": "heap", "tokens": 16384, "host_ms": 0.5, "overhead": 0.01},
        {"participants": 2, "exchange": "graphs", "tokens": 8192, "host_ms": 0.04, "overhead": 0.01, "replays": 9}]}))
    (tmp_path / "dead_peer_nvshmem.json").write_text(json.dumps({"summary": {"dead_pe_error_s": 2.04}}))
    (tmp_path / "tagged_rounds.json").write_text(json.dumps({"rows": [  # the smallest 2-client context
        {"clients": 2, "tokens_per_rank": 16384, "step_ratio": 0.9, "attend_host_ratio": 0.5},
        {"clients": 2, "tokens_per_rank": 8192, "step_ratio": 0.8, "attend_host_ratio": 0.3},
        {"clients": 3, "tokens_per_rank": 1024, "step_ratio": 0.7, "attend_host_ratio": 0.2}]}))
    (tmp_path / "backends.json").write_text(json.dumps({
        "speed": [{"backend": "cudnn", "shape": "32/8/128", "doc_len": 32768, "fwd_tflops": 540.0, "bwd_tflops": 450.0},
                  {"backend": "cudnn", "shape": "64/8/128", "doc_len": 32768, "fwd_tflops": 1.0, "bwd_tflops": 1.0},
                  {"backend": "torch_varlen", "shape": "32/8/128", "doc_len": 32768, "fwd_tflops": 330.0,
                   "bwd_tflops": 310.0}],
        "plan": {"planners": {"flop": {"measured_max_mean": 1.09}, "time": {"measured_max_mean": 1.03}}}}))
    (tmp_path / "host_path_cuda.json").write_text(json.dumps({"rows": [
        {"path": "autograd.Function", "us_per_layer": 9.0}, {"path": "distca attend", "us_per_layer": 180.0}]}))
    (tmp_path / "session.log").write_text(
        "== env (limit 60 s): env_info\n== env: exit status 0 after 2 s\n"
        "== train (limit 240 s): train_run\n== train: exit status 124 after 240 s\n"
        "== kernels: skipped, 12 s of BUDGET_S left\n")
    assert bench.main([str(tmp_path)]) == 0
    got = json.loads((tmp_path / "summary.json").read_text())
    assert got["stages"] == {"env": "ok", "train": "exit status 124", "kernels": "skipped"}
    assert got["kernel_tflops_32K"] == {"cudnn": [540.0, 450.0], "torch_varlen": [330.0, 310.0]}
    assert (got["plan_max_mean_flop"], got["plan_max_mean_time"]) == (1.09, 1.03)
    assert got["exchange_us_64KiB_2pe"] == 31.0 and got["exchange_us_64KiB_2pe_host_driven"] == 900.0  # main run
    assert got["host_us_per_layer"] == 250.0 and abs(got["overhead_pct_8K_2participants"] - 2.1) < 1e-9
    assert got["host_us_per_layer_graphed"] == 40.0 and "host_us_per_layer_stateless" not in got
    assert got["host_us_per_layer_graphed_8layers"] == 180.0  # the host stage's run on the GPU
    assert got["dead_pe_error_s"] == 2.04 and got["exchange_host_us_64KiB_2pe_graphed"] == 6.5
    assert (got["tagged_step_ratio_2clients"], got["tagged_attend_host_ratio_2clients"]) == (0.8, 0.3)
    for key in ("host_us_per_layer_lockstep", "train_tokens_per_s_local",
                "pingpong_vs_signal_only", "exchange_us_64KiB_2pe_processes", "exchange_us_64KiB_2pe_graphed"):
        assert got[key] is None and got["missing"][key], key
    assert "host_us_per_layer" not in got["missing"]
    assert bench.main([str(tmp_path / "absent")]) == 2


def test_a_graphs_run_that_never_replayed_is_no_graphed_number(tmp_path):
    bench = load_script("bench/gpu_summary.py", "bench_gpu_summary")
    (tmp_path / "kernels.json").write_text(json.dumps({"overhead": [
        {"participants": 2, "exchange": "graphs", "tokens": 8192, "host_ms": 0.3, "overhead": 0.02, "replays": 0,
         "graphs_off": "RuntimeError: operation not permitted when stream is capturing"}]}))
    assert bench.main([str(tmp_path)]) == 0
    got = json.loads((tmp_path / "summary.json").read_text())
    assert got["host_us_per_layer_graphed"] is None
    assert "not permitted when stream is capturing" in got["missing"]["host_us_per_layer_graphed"]
    assert got["host_us_per_layer_graphed_8layers"] is None and got["missing"]["host_us_per_layer_graphed_8layers"]
