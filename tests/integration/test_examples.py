"""The quickstart runs end to end and checks itself against local attention."""

from scripts import load_script


def test_quickstart_runs(capsys):
    module = load_script("examples/quickstart.py", "quickstart")
    module.main(["--servers", "3", "--context", "1024", "--mode", "dedicated"])
    text = capsys.readouterr().out
    assert "max relative error vs local attention" in text and "imbalance" in text
