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


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


def pytest_unconfigure(config):
    # After the summary is printed, leave without the interpreter's teardown: with Ray, gloo and
    # torch's thread pools loaded in one process, native finalisers have crashed the exit of a run
    # whose every test had passed (a segmentation fault after the summary line, exit status 139).
    # The run's own status is kept.
    if _EXIT_STATUS and os.environ.get("DISTCA_PYTEST_FAST_EXIT", "1") == "1":
        import sys
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
