"""``distca simulate --attn-profile DIR``: measured (forward, backward) ProfileTables replace the GPU
preset's assumed attention rates, and a table for another attention shape is refused."""

import argparse
import errno
import json
import os
from pathlib import Path

import pytest

from distca_sim import cli
from distca_sim.hardware import attention_tables, get_gpu, get_model, load_attention_profile
from distca_sim.profile import ProfileTable

GRID = [128, 1024, 8192, 65536]
# --assumed-rates: the baseline is the preset's rates, not the tables shipped for the H100.
ARGS = ["--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--tp", "8", "--context", "16K",
        "--systems", "packing", "--assumed-rates"]


def parse(argv):
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    return parser.parse_args(["simulate", *argv])


def write_profile(folder, cost, rate_fwd, rate_bwd, meta_cost=None):
    """A small hand-made pair: analytic latencies at the given FLOP/s, written as the bench does."""
    folder.mkdir(parents=True, exist_ok=True)
    for kind, rate in (("forward", rate_fwd), ("backward", rate_bwd / 2.5)):
        t = ProfileTable.from_flops(rate, 0.0, GRID, GRID, cost)
        d = t.to_dict()
        d["meta"] = {"source": "hand-made", "cost": meta_cost or cost.to_dict(), "kind": kind}
        (folder / f"{kind}.json").write_text(json.dumps(d))
    return folder


def attention_seconds(argv, tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert cli.main(parse([*argv, "--json", str(out)])) == 0
    printed = capsys.readouterr().out
    return json.loads(out.read_text())[0]["attention_s"], printed


def test_measured_tables_replace_the_assumed_rates(tmp_path, capsys):
    cost = get_model("llama3-8b").cost_model(8)
    gpu = get_gpu("h100")
    fwd_rate = gpu.peak_flops * gpu.attn_fwd_efficiency
    bwd_rate = gpu.peak_flops * gpu.attn_bwd_efficiency
    same = write_profile(tmp_path / "same", cost, fwd_rate, bwd_rate)
    slow = write_profile(tmp_path / "slow", cost, fwd_rate / 4, bwd_rate / 4)

    base, printed = attention_seconds(ARGS, tmp_path, capsys)
    assert "measured tables" not in printed
    with_same, printed = attention_seconds([*ARGS, "--attn-profile", str(same)], tmp_path, capsys)
    assert f"measured tables from {same}" in printed
    with_slow, _ = attention_seconds([*ARGS, "--attn-profile", str(slow)], tmp_path, capsys)
    # The same rates on a coarser grid: the same attention time up to interpolation (< 1% here,
    # every document of the batch is far above the 128-token floor); four times slower tables:
    # four times the attention time, less the fixed kernel launches (GPUConfig.kernel_launch_s)
    # that the tables do not hold.
    assert with_same == pytest.approx(base, rel=0.02)
    assert 3.9 * with_same < with_slow < 4 * with_same


def test_loaded_pair_goes_into_the_gpu_config(tmp_path):
    cost = get_model("llama3-8b").cost_model(8)
    folder = write_profile(tmp_path / "p", cost, 1e14, 2e14)
    fwd, bwd = load_attention_profile(folder, cost)
    gpu = get_gpu("h100").with_tables(fwd, bwd)
    assert attention_tables(gpu, cost) == (fwd, bwd)
    # backward: 2.5x the forward FLOPs at twice the rate -> 1.25x the forward latency
    assert bwd.latency(1024, 8192) == pytest.approx(1.25 * fwd.latency(1024, 8192))


@pytest.mark.parametrize("case", ["other shape", "no cost", "missing backward", "not json"])
def test_bad_profiles_exit_1_with_the_reason(tmp_path, capsys, case):
    cost = get_model("llama3-8b").cost_model(8)
    folder = write_profile(tmp_path / "p", cost, 1e14, 1e14)
    if case == "other shape":  # measured at tp=4 (8 query heads), simulated at tp=8 (4)
        write_profile(folder, cost, 1e14, 1e14, meta_cost=get_model("llama3-8b").cost_model(4).to_dict())
        expect = "'num_heads_q': 8"
    elif case == "no cost":
        d = json.loads((folder / "forward.json").read_text())
        del d["meta"]["cost"]
        (folder / "forward.json").write_text(json.dumps(d))
        expect = "measured for the attention shape None"
    elif case == "missing backward":
        (folder / "backward.json").unlink()
        expect = "no backward.json"
    else:
        (folder / "forward.json").write_text("{not json")
        expect = "not valid JSON"
    assert cli.main(parse([*ARGS, "--attn-profile", str(folder)])) == 1
    err = capsys.readouterr().err
    assert "distca simulate: error" in err and expect in err, err


def test_shipped_measured_tables_are_used_by_default_for_their_gpu_and_shape(tmp_path, capsys):
    from distca_sim.hardware import measured_attention_profile
    cost = get_model("llama3-8b").cost_model(8)
    folder = measured_attention_profile("h200", cost)
    assert folder is not None and folder.name == "llama3-8b-tp8"
    fwd, bwd = load_attention_profile(folder, cost)  # a valid pair for exactly this shape
    assert fwd.meta["source"] == "measured" and fwd.meta["device"] == "NVIDIA H200"
    assert measured_attention_profile("h200", get_model("llama3-8b").cost_model(4)) is None
    args = ["--model", "llama3-8b", "--gpu", "h200", "--gpus", "8", "--tp", "8", "--context", "16K",
            "--systems", "packing"]
    measured, printed = attention_seconds(args, tmp_path, capsys)
    assert "measured tables from h200/llama3-8b-tp8" in printed
    assumed, printed = attention_seconds([*args, "--assumed-rates"], tmp_path, capsys)
    assert "assumed rates" in printed and measured != assumed


@pytest.mark.parametrize("case", ["unsearchable folder", "unreadable file", "too long a name"])
def test_unreadable_profiles_exit_1_with_the_os_reason(tmp_path, capsys, monkeypatch, case):
    # Tests may run as root, whom no permission stops: the PermissionError a user meets is
    # raised by a stand-in; a name over the file system's 255 bytes fails for real, for anyone.
    folder = write_profile(tmp_path / "p", get_model("llama3-8b").cost_model(8), 1e14, 1e14).resolve()

    def denied(*_):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    if case == "unsearchable folder":
        real_is_dir = Path.is_dir
        monkeypatch.setattr(Path, "is_dir", lambda self: denied() if self == folder else real_is_dir(self))
        expect = f"attention profile {str(folder)!r}: {os.strerror(errno.EACCES)}"
    elif case == "unreadable file":
        real_read = Path.read_text
        monkeypatch.setattr(Path, "read_text", lambda self, *a, **kw: denied() if self == folder / "forward.json"
                            else real_read(self, *a, **kw))
        expect = f"attention profile {folder}: forward.json: {os.strerror(errno.EACCES)}"
    else:
        folder = tmp_path / ("x" * 300)
        expect = f"attention profile {str(folder)!r}: {os.strerror(errno.ENAMETOOLONG)}"
    assert cli.main(parse([*ARGS, "--attn-profile", str(folder)])) == 1
    assert capsys.readouterr().err.splitlines() == [f"distca simulate: error: {expect}"]
