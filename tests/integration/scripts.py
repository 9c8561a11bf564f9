"""What the integration tests share besides fixtures: the project root, the Ray runtime
environment of its workers, and loading the project's scripts (bench/, examples/) as modules."""

import importlib.util
import sys
from pathlib import Path

from distca_cli.connect import worker_pythonpath

ROOT = Path(__file__).resolve().parents[2]
# Ray workers import the project, the test helpers (ray_workers.py) and the examples by path.
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": worker_pythonpath(
    ROOT, ROOT / "tests" / "integration", ROOT / "examples")}}


def load_script(relative_path: str, module_name: str):
    """Import ``ROOT/relative_path`` as ``module_name`` (registered in ``sys.modules``, so Ray can
    ship classes defined in it by value)."""
    spec = importlib.util.spec_from_file_location(module_name, ROOT / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def run_ray_script(relative_path: str, module_name: str, argv: list[str]) -> tuple[int, bool]:
    """``main(argv)`` of a script that starts its own Ray: ``(exit status, whether main left a Ray
    it started running)``. Afterwards such a Ray is shut down and the module forgotten, so the
    next test starts clean."""
    import ray
    was_running = ray.is_initialized()
    left_running = False
    try:
        status = load_script(relative_path, module_name).main(argv)
        left_running = not was_running and ray.is_initialized()
        return status, left_running
    finally:
        if not was_running and ray.is_initialized():
            ray.shutdown()
        sys.modules.pop(module_name, None)
