"""The quickstart runs end to end and checks itself against local attention."""

import pytest
from scripts import load_script


def test_quickstart_runs(capsys):
    module = load_script("examples/quickstart.py", "quickstart")
    module.main(["--servers", "3", "--context", "1024", "--mode", "dedicated"])
    text = capsys.readouterr().out
    assert "max relative error vs local attention" in text and "imbalance" in text


def test_quickstart_names_a_bad_count_flag(capsys):
    module = load_script("examples/quickstart.py", "quickstart")
    for flag in ("--servers", "--context"):
        with pytest.raises(SystemExit) as info:  # argparse's error, not a traceback about num_ranks
            module.main([flag, "0"])
        assert info.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: argument {flag}: must be a positive int, got '0'")


@pytest.mark.parametrize("flag, value, words", [
    ("--epsilon", "-1", "must be a finite number >= 0, got '-1'"),
    ("--epsilon", "nan", "must be a finite number >= 0, got 'nan'"),
    ("--epsilon", "x", "must be a finite number >= 0, got 'x'"),
    ("--step", "-1", "must be an int >= 0, got '-1'"),
    ("--step", "1.5", "must be an int >= 0, got '1.5'"),
])
def test_quickstart_names_a_bad_epsilon_or_step(capsys, flag, value, words):
    module = load_script("examples/quickstart.py", "quickstart")
    with pytest.raises(SystemExit) as info:  # argparse's error, not a ConfigError or sample_batch traceback
        module.main([flag, value])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: argument {flag}: {words}")
