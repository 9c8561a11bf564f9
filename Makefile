# `make test` and `make demo` set up .venv themselves on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-fast demo demo-gpu bench clean

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

# The demo on one GPU (issue 22 item 5; docs/demo.md "On one GPU"): the scheduler actor and 2
# in-place clients (Ray Train workers, num_gpus 0.5 each) share the card, bf16 autocast, rows moved
# over NVSHMEM; a 23 M-parameter Llama, 16,384 tokens per rank, 20 steps with distca, then with
# local attention; exit status 1 unless the first 10 losses agree to bf16 rounding. Needs a CUDA GPU
# and nvshmem4py (pip install -e '.[nvshmem]'); `make demo-gpu PY=python3` uses an interpreter that
# has everything, without building .venv. bench/gpu_session.sh's `train` stage runs these arguments.
DEMO_GPU_ARGS := --device cuda --dtype bfloat16 --transport nvshmem --workers 2 --context 16384 --layers 8 --hidden 512 --heads 8 --kv-heads 4 --steps 20 --log-every 5 --name demo-gpu
demo-gpu: $(if $(filter command line,$(origin PY)),,$(STAMP))
	$(PY) examples/train_llama.py $(DEMO_GPU_ARGS) --summary-json runs/demo-gpu/summary.json

bench: $(STAMP)
	$(PY) bench/planner.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
