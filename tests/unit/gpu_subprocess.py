"""Running a gpu test's body in a fresh Python: several in-process PEs hold waits on CUDA streams of
their own, which needs ``CUDA_DEVICE_MAX_CONNECTIONS`` raised before CUDA starts
(distca_server/transport/memop_stream.py), and a wait that is never ended must fail the test, not
hang it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def run_fresh(module: str, function: str, timeout_s: float, what: str) -> None:
    """``module.function()`` (a module of this folder) in a fresh Python with 32 CUDA connections;
    fails the test with its output on a non-zero exit, or when it runs past ``timeout_s``
    (``what`` did not finish: a wait was never ended)."""
    code = f"import sys; sys.path.insert(0, {HERE!r}); import {module} as t; t.{function}()"
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(HERE)),
                             capture_output=True, text=True, timeout=timeout_s,
                             env={"CUDA_DEVICE_MAX_CONNECTIONS": "32", **os.environ})
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not finish within {timeout_s:g} s (a wait was never ended)")
    assert out.returncode == 0, out.stdout + out.stderr
