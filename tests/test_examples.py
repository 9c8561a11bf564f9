"""The quickstart runs end to end and checks itself against local attention."""

import importlib.util
from pathlib import Path


def test_quickstart_runs(capsys):
    path = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"
    spec = importlib.util.spec_from_file_location("quickstart", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--servers", "3", "--context", "1024", "--mode", "dedicated"])
    text = capsys.readouterr().out
    assert "max relative error vs local attention" in text and "imbalance" in text
