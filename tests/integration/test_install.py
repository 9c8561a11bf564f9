"""A regular (non-editable) install works: the wheel carries every package and the traces.

Builds a wheel of a copy of the project, installs it into a fresh venv and runs ``distca simulate``
and ``examples/quickstart.py`` from a directory outside the project. The venv sees this
interpreter's site-packages (torch, numpy, msgpack, ray) through a ``.pth`` line, which adds the
directory to ``sys.path`` without running the ``.pth`` files in it, so the editable install of the
project there stays inactive; PYTHONPATH is cleared so the checkout cannot leak in either.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from scripts import ROOT

# What a checkout may hold besides sources (.gitignore); none of it belongs in the wheel.
_NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache",
                                      ".hypothesis", "runs", "results", "build", "dist")


def _run(cmd, cwd, env, timeout=120):
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{cmd} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, venv bin dir, venv site-packages, clean env, a working dir outside ROOT)."""
    tmp = tmp_path_factory.mktemp("install")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCES)  # the build writes egg-info next to sources
    # Offline with this interpreter's setuptools when it has one (Python < 3.12 venvs do); else
    # pip's isolated build environment, which needs the package index.
    has_setuptools = importlib.util.find_spec("setuptools") is not None
    offline = ["--no-build-isolation", "--no-index"] if has_setuptools else []
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *offline, "-w", tmp / "wheels", src],
         tmp, env, timeout=180)
    wheel, = (tmp / "wheels").glob("distca-*.whl")

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp, env)
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     tmp, env).strip())
    (site / "project_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
          wheel], tmp, env)
    work = tmp / "work"
    work.mkdir()
    return python, venv / "bin", site, env, work


def test_packages_and_traces_come_from_the_install(installed):
    python, _, site, env, work = installed
    code = ("import distca_sim, distca_cli, distca_client, distca_server, scheduler\n"
            "from distca_sim.workloads import load_trace, trace_file\n"
            "for m in (distca_sim, distca_cli, distca_client, distca_server, scheduler):\n"
            "    print(m.__file__)\n"
            "print(trace_file('pretrain'))\n"
            "print(len(load_trace('pretrain')), len(load_trace('prolong')))\n")
    lines = _run([python, "-c", code], work, env).splitlines()
    for path in lines[:-1]:
        assert Path(path).resolve().is_relative_to(site.resolve()), path
        assert not Path(path).resolve().is_relative_to(ROOT.resolve()), path
    assert lines[-1].split() == ["99519", "77932"]  # the document counts of data/doclens/README.md


def test_distca_simulate_runs_from_the_install(installed):
    _, bindir, _, env, work = installed
    out = _run([bindir / "distca", "simulate", "--gpus", "16", "--tp", "8", "--context", "16K",
                "--dataset", "prolong", "--json", "sim.json"], work, env)
    lines = out.splitlines()
    # The H100 tables measured for this shape ship as package data, and the default run uses them.
    assert lines[0] == "attention latency: measured tables from h100/llama3-8b-tp8", out
    start = next(i for i, line in enumerate(lines) if line.startswith("---")) + 1
    systems = [line.split()[0] for line in lines[start:start + 4]]
    assert systems == ["distca", "wlb_ideal", "per_doc_cp", "packing"], out
    assert "vs WLB-ideal" in out and (work / "sim.json").is_file()
    assert "up" in _run([bindir / "distca", "--help"], work, env)


def test_quickstart_runs_from_the_install(installed):
    python, _, _, env, work = installed
    out = _run([python, ROOT / "examples" / "quickstart.py", "--servers", "2", "--context", "1024"],
               work, env, timeout=180)
    assert "max relative error vs local attention" in out and "imbalance" in out, out
    assert "documents from the pretrain trace, 2048 tokens" in out, out
