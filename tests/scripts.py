"""Load the project's scripts (bench/, examples/) as modules, for the tests that run them."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_script(relative_path: str, module_name: str):
    """Import ``ROOT/relative_path`` as ``module_name`` (registered in ``sys.modules``, so Ray can
    ship classes defined in it by value)."""
    spec = importlib.util.spec_from_file_location(module_name, ROOT / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
