# Two commands from a fresh clone with only python3:
#   make train    the tiny recipe (a small LLaMA on the embedded corpus, CPU is enough)
#   make test     the test suite
# `make test-extended` runs the long checks the suite leaves out (marked extended; CI runs them too).
# Each creates and fills the project's virtual environment (.venv) on first use, as the README's set-up does:
# torch 2.13.0 first (set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu where plain pip would pick a
# CUDA build), then megacann itself with its dev extra. ARGS passes more arguments, e.g.
#   make train ARGS="--nproc_per_node 2"      make test ARGS="tests/test_config.py -x"
PYTHON ?= python3
VENV ?= .venv
TORCH_INDEX_URL ?=
VENV_PY := $(VENV)/bin/python
STAMP := $(VENV)/.megacann-installed

.PHONY: train test test-extended fuzz venv

train: $(STAMP)
	PYTHON=$(abspath $(VENV_PY)) bash scripts/run_pretrain.sh --config examples/configs/llama/tiny.yaml $(ARGS)

test: $(STAMP)
	$(VENV_PY) -m pytest tests $(ARGS)

# the long checks `make test` leaves out (tests marked extended); .ci/run runs them after the suite
test-extended: $(STAMP)
	$(VENV_PY) -m pytest tests --extended $(ARGS)

# layout fuzzing beyond the fixed sample, e.g. make fuzz ARGS="--world 4 --count 20 --first-seed 2000";
# CI runs ARGS="--world 2 --world 4 --count 3 --key <commit>" (seeds drawn from the commit, printed)
fuzz: $(STAMP)
	$(VENV_PY) scripts/fuzz_layouts.py $(ARGS)

venv: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV_PY) -m pip install "torch==2.13.0" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(VENV_PY) -m pip install -e ".[dev]"
	touch $(STAMP)
