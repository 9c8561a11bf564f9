"""Every stage of bench/gpu_session.sh would start on the GPU machine: run here with a Python that
only records its command lines (and exits 0), the session's default order calls each benchmark
with flags its own parser accepts, and its pytest stages name test files that exist and hold tests
of the marker they select. Every gpu- or nvshmem-marked test file is run by some stage, so a test
written for the GPU session cannot be left out of it (a lent GPU is rare: 15 minutes, one call).

No GPU is needed: the flags are parsed, nothing is run."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SEP = "\x1f"  # between one call's arguments; calls are separated by "\x1e" (a -c script has newlines)

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")

# Marked files no pytest stage runs, and why (a stage runs the same code for real)
RUN_ELSEWHERE = {
    "tests/integration/test_bench_gpu_kernels.py": "the kernels stage runs bench/gpu_kernels.py on the GPU",
}


class _Parsed(BaseException):
    """Raised right after a benchmark's parser accepted its flags (BaseException: no script's
    ``except Exception`` swallows it)."""


@pytest.fixture(scope="module")
def calls(tmp_path_factory) -> list[list[str]]:
    """The command lines the session's default order gives its Python, in order."""
    tmp = tmp_path_factory.mktemp("session")
    repo = tmp / "repo"
    (repo / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "bench" / "gpu_session.sh", repo / "bench")
    shutil.copy(ROOT / "Makefile", repo)  # the train stage reads DEMO_GPU_ARGS from it
    record = tmp / "calls.txt"
    py = tmp / "py"
    py.write_text(f'#!/bin/sh\n{{ for a in "$@"; do printf \'%s{SEP}\' "$a"; done; printf \'\\036\'; }}'
                  f' >> "{record}"\nexit 0\n')
    py.chmod(0o755)
    env = dict(os.environ, PYTHON=str(py), OUT=str(tmp / "out"), RES=str(tmp / "res"), SITE=str(tmp / "site"),
               BUDGET_S="100000", PATH="/usr/bin:/bin")
    run = subprocess.run(["bash", str(repo / "bench" / "gpu_session.sh")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert "unknown stage" not in run.stderr, run.stderr
    found = [c.split(SEP)[:-1] for c in record.read_text().split("\x1e") if c]
    assert found, run.stdout + run.stderr
    return found


def _scripts(calls: list[list[str]]) -> list[list[str]]:
    return [c for c in calls if c and re.fullmatch(r"(bench|examples)/\w+\.py", c[0])
            and c[0] not in ("bench/carry_wheels.py", "bench/gpu_summary.py")]


def _pytest_runs(calls: list[list[str]]) -> list[tuple[str, list[str]]]:
    """(the marker selected, the test files) of each pytest call."""
    runs = []
    for c in calls:
        if c[:2] == ["-m", "pytest"]:
            marker = c[c.index("-m", 2) + 1]
            runs.append((marker, [a for a in c[2:] if a.endswith(".py")]))
    return runs


def _load(script: str):
    spec = importlib.util.spec_from_file_location(f"_stage_{Path(script).stem}", ROOT / script)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str((ROOT / script).parent))  # the benchmarks import their siblings
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module


def test_the_default_order_runs_every_stage(calls):
    scripts = {c[0] for c in _scripts(calls)}
    assert {"bench/transport.py", "bench/gpu_kernels.py", "bench/gpu_backends.py", "bench/dead_peer.py",
            "bench/pingpong.py", "bench/host_path.py", "bench/tagged_rounds.py", "examples/train_llama.py"} <= scripts
    assert {m for m, _ in _pytest_runs(calls)} == {"gpu", "nvshmem"}


def test_every_benchmark_accepts_its_stages_flags(calls, monkeypatch):
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    checked = []
    for argv in _scripts(calls):
        script, args = argv[0], argv[1:]
        module = _load(script)
        if script == "examples/train_llama.py":
            # its own checks too (TrainConfig: a bad setting is a ValueError naming it)
            config, compare, summary = module.parse_command_line(args)
            assert config.device == "cuda" and compare and summary
            checked.append(script)
            continue
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        monkeypatch.setattr(sys, "argv", argv)  # dead_peer.py's main() reads sys.argv
        entry = module.main
        try:
            entry(args) if entry.__code__.co_argcount else entry()
        except _Parsed as parsed:
            namespace = parsed.args[0]
        except SystemExit as exc:  # argparse refused a flag: its message is on stderr
            pytest.fail(f"{' '.join(argv)}: the parser exited ({exc.code})")
        else:
            pytest.fail(f"{script}: main() returned without parsing its flags")
        finally:
            monkeypatch.setattr(argparse.ArgumentParser, "parse_args", original)
        if "--device" in args:
            assert str(namespace.device) == args[args.index("--device") + 1]
        checked.append(script)
    assert len(checked) == len(_scripts(calls))


def test_every_pytest_stage_names_marked_files_that_exist(calls):
    for marker, files in _pytest_runs(calls):
        assert files
        for f in files:
            text = (ROOT / f).read_text()
            assert re.search(rf"pytest\.mark\.{marker}\b", text), f"{f} holds no {marker}-marked test"


def test_every_marked_test_file_is_run_by_a_stage(calls):
    staged = {f for _, files in _pytest_runs(calls) for f in files}
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if re.search(r"pytest\.mark\.(gpu|nvshmem)\b", p.read_text())}
    assert marked, "no marked test files found"
    missing = marked - staged - set(RUN_ELSEWHERE)
    assert not missing, f"gpu/nvshmem-marked tests no stage of bench/gpu_session.sh runs: {sorted(missing)}"
