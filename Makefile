# Two commands from a fresh clone:
#   make demo   set up .venv, get and prepare Multi30k, train small TransF and RAN-ALL for a
#               few minutes each (BUDGET=3m), evaluate both with significance, translate a
#               sentence, serve both with the attention explorer (PORT=8080)
#   make test   set up .venv, ruff, the test suite (what CI runs)
# RANMT_DATA_DIR: a folder holding multi30k/*.gz (default ../shared/data; else downloaded).
#   make mutation  mutation testing (mutmut; not CI): the modules [tool.mutmut] in
#               pyproject.toml lists, MUTANTS='ranmt.evaluate.x_welch*' narrows it; report and
#               survivors explained in docs/MUTATION.md
.PHONY: setup demo test test-all check mutation

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
RANMT_DATA_DIR ?= $(abspath ../shared/data)
export RANMT_DATA_DIR

setup: $(VENV)/.installed

# The CPU torch pin first: a bare `torch` requirement would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q $(TORCH)
	$(VENV)/bin/pip install -q -e ".[dev]"
	touch $@

demo: setup
	BIN=$(VENV)/bin bash scripts/demo.sh

check: setup
	$(VENV)/bin/ruff check .

test: check
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile -m "not slow or ci"

test-all: check
	$(VENV)/bin/python -m pytest -q

mutation: setup
	$(VENV)/bin/pip install -q -e ".[mutation]"
	rm -rf mutants
	# one thread: mutmut forks a test process per mutant, and a fork after PyTorch has started
	# its OpenMP pool hangs at the first parallel operator (every such mutant timed out)
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(VENV)/bin/mutmut run --max-children 2 $(MUTANTS)
	$(VENV)/bin/mutmut results
