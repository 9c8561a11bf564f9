# `make test` and `make demo` set up .venv themselves on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-fast demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU wheel of torch first, so the project's `torch>=` range is already met.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,bench,hf,train,megatron,monitoring]'
	touch $(STAMP)

# Everything CI runs: the unit tier (no Ray, seconds) and the integration tier (Ray, examples,
# benchmarks; marked slow by tests/conftest.py).
test: $(STAMP)
	$(PY) -m pytest -q -m "not gpu and not nvshmem" tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not gpu and not nvshmem and not slow" tests/unit

demo: $(STAMP)
	$(PY) examples/train_llama.py

bench: $(STAMP)
	$(PY) bench/planner.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
