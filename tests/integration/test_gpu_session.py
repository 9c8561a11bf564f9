"""bench/gpu_session.sh's first step on the GPU machine, run here: the carried wheels (a pack, or
.whl/ as they are) are installed with ``pip --target`` into $SITE, which goes on PYTHONPATH, and the
install is logged in session.log as the stage ``wheels`` (its outcome in summary.json), also when
it fails or nothing was carried; a wheel pip refuses does not cost the others. The session runs only the ``mps`` stage,
which needs no GPU (without nvidia-cuda-mps-control on PATH it says so)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import carry_wheels  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None
    or subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0,
    reason="needs bash and pip")


def _wheel(folder: Path, name: str, tag: str = "py3-none-any") -> Path:
    """A pure-Python wheel of one module ``name`` (``value = 1``)."""
    path = folder / f"{name}-1.0-{tag}.whl"
    path.parent.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-1.0.dist-info"
    files = {f"{name}.py": "value = 1\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{dist}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    files[f"{dist}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in files.items():
            zf.writestr(member, text)
    return path


def _session(tmp_path: Path, repo: Path) -> tuple[subprocess.CompletedProcess, str, dict, list[str]]:
    """Run the copied gpu_session.sh's mps stage; returns the run, session.log, summary.json and
    the PYTHONPATH each Python call of the script saw."""
    py = tmp_path / "py"  # the script's Python, recording the PYTHONPATH it is called with
    py.write_text(f'#!/bin/sh\necho "${{PYTHONPATH:-}}" >> "{tmp_path}/pythonpath.txt"\nexec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    env = dict(os.environ, PYTHON=str(py), OUT=str(tmp_path / "out"), RES=str(tmp_path / "res"),
               SITE=str(tmp_path / "site"), WHEELS_DIR=str(tmp_path / "unpacked"), BUDGET_S="120",
               PATH="/usr/bin:/bin")
    env.pop("PYTHONPATH", None)
    run = subprocess.run(["bash", str(repo / "bench" / "gpu_session.sh"), "mps"], env=env, capture_output=True,
                         text=True, timeout=300)
    log = (tmp_path / "out" / "session.log").read_text()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    paths = (tmp_path / "pythonpath.txt").read_text().splitlines()
    return run, log, summary, paths


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    for name in ("gpu_session.sh", "carry_wheels.py", "gpu_summary.py"):
        shutil.copy(ROOT / "bench" / name, repo / "bench" / name)
    return repo


def test_the_carried_pack_is_installed_logged_and_on_pythonpath(tmp_path):
    repo = _repo(tmp_path)
    _wheel(tmp_path / "whl", "carried_one")
    _wheel(tmp_path / "whl", "carried_two")
    carry_wheels.pack(tmp_path / "whl", repo / ".carry" / "wheels.tar.xz")
    run, log, summary, paths = _session(tmp_path, repo)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "== wheels: installing 2 wheels into" in log and "== wheels: exit status 0 after" in log, log
    assert (tmp_path / "site" / "carried_one.py").exists() and (tmp_path / "site" / "carried_two.py").exists()
    assert paths[-1].split(":")[:2] == [str(repo), str(tmp_path / "site")]  # gpu_summary's call
    assert summary["stages"] == {"wheels": "ok", "mps": "ok"}
    assert "mps: nvidia-cuda-mps-control is not on PATH" in log


def test_a_wheel_pip_refuses_does_not_cost_the_others(tmp_path):
    repo = _repo(tmp_path)
    _wheel(repo / ".whl", "good_one")
    _wheel(repo / ".whl", "foreign", tag="cp27-cp27m-win32")  # pip refuses the whole install for it
    run, log, summary, paths = _session(tmp_path, repo)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "installing them one by one" in log and "== wheels: FAILED foreign-1.0-cp27-cp27m-win32.whl" in log, log
    assert (tmp_path / "site" / "good_one.py").exists()
    assert str(tmp_path / "site") in paths[-1].split(":")
    assert summary["stages"]["wheels"] == "exit status 1" and summary["stages"]["mps"] == "ok"


def test_a_broken_pack_is_logged_and_the_session_goes_on(tmp_path):
    repo = _repo(tmp_path)
    (repo / ".carry").mkdir()
    (repo / ".carry" / "wheels.tar.xz").write_bytes(b"not an xz stream")
    run, log, summary, paths = _session(tmp_path, repo)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "== wheels: unpacking" in log and "== wheels: exit status 1 after" in log, log
    assert "Error" in log  # unpack's traceback is in the log, not only on the terminal
    assert summary["stages"] == {"wheels": "exit status 1", "mps": "ok"}
    assert str(tmp_path / "site") not in paths[-1]


def test_no_wheels_carried_is_said_in_the_log(tmp_path):
    repo = _repo(tmp_path)
    run, log, summary, paths = _session(tmp_path, repo)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "== wheels: skipped, none carried" in log, log
    assert summary["stages"] == {"wheels": "skipped", "mps": "ok"}
    assert str(tmp_path / "site") not in paths[-1]
