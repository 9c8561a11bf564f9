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
