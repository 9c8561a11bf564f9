"""Test tiers and shared settings.

``tests/unit``: no Ray, seconds. ``tests/integration``: Ray, examples, benchmarks; every test there
is marked ``slow`` automatically (``make test-fast`` deselects them). Hypothesis profiles:
``default`` (CI), ``thorough`` (``HYPOTHESIS_PROFILE=thorough``, 20x the examples) and ``quick``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent

# Ray starts its worker processes (every scheduler, server and client actor) at niceness 15: on a
# machine with other work beside the tests (CI under load), each such process then gets about a
# tenth of a busy process's CPU, and an actor restart takes minutes. The tests time distca's own
# deadlines, so its processes run at the tests' priority. Set before any test starts Ray.
os.environ.setdefault("RAY_worker_niceness", "0")

settings.register_profile("default", deadline=None)
settings.register_profile("quick", deadline=None, max_examples=10)
settings.register_profile("thorough", deadline=None, max_examples=2000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_collection_modifyitems(config, items):
    integration = ROOT / "tests" / "integration"
    for item in items:
        if integration in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)


def pytest_runtest_setup(item):
    """``gpu`` tests skip without CUDA, ``nvshmem`` tests without nvshmem4py and a CUDA device.

    Asked here, as a selected test is about to run, not in a ``skipif`` evaluated at import: so
    collecting the suite (and running its CPU tiers) never queries CUDA.
    """
    if item.get_closest_marker("gpu") is not None:
        import torch
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
    if item.get_closest_marker("nvshmem") is not None:
        from distca_server.transport.nvshmem import available
        if not available():
            pytest.skip("needs nvshmem4py and a CUDA device")


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


def pytest_unconfigure(config):
    # What this hides: with Ray, gloo and torch's thread pools loaded in one process, native
    # finalisers have crashed the interpreter's teardown of a run whose every test had passed (a
    # segmentation fault after the summary line, exit status 139, seen on the whole `make test`,
    # not on slices). So, after the summary, the process leaves with the run's own status and
    # skips that teardown. DISTCA_PYTEST_FAST_EXIT=0 keeps the normal exit (e.g. for a program
    # that calls pytest.main() and goes on).
    if _EXIT_STATUS and os.environ.get("DISTCA_PYTEST_FAST_EXIT", "1") == "1":
        import sys
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
