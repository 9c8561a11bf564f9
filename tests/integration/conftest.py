"""The Ray fixture the integration tests share: one small local Ray instance per module."""

from __future__ import annotations

import pytest

from scripts import RUNTIME_ENV


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray instance (2 CPUs, no dashboard, 80 MiB object store) for one test module."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20,
             runtime_env=RUNTIME_ENV, namespace="distca", log_to_driver=False)
    yield ray
    ray.shutdown()
