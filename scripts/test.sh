#!/usr/bin/env bash
# `make test`: the whole suite, then the engine and cluster tests again acting as an AVX2-only CPU
# (no AVX-512, no native bf16: the engine's own class override plus the variables torch and
# oneDNN honour, so an AVX-512 or AMX machine sees an AVX2 failure before a user does;
# engine/hardware.py). Both passes always run to the end, so a red test in one does not hide the
# other; both summaries are printed last, and the exit status is non-zero if either failed.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
ENGINE_AND_CLUSTER_TESTS=(
  tests/test_hardware.py tests/test_decode_kernel.py tests/test_prefill_attention.py tests/test_model_equality.py
  tests/test_batching.py tests/test_sampling.py tests/test_scheduler.py tests/test_validation.py
  tests/test_kvtransfer.py tests/test_cluster.py tests/test_cli.py tests/test_speculative.py
  tests/test_parallel_sampling.py tests/test_combinations.py tests/test_deterministic.py tests/test_model_families.py
  tests/test_penalties.py tests/test_structured_output.py tests/test_quantization.py tests/test_gguf_blocks.py
)
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

run_pass() {  # name, log, pytest args...; the pass's exit status
  local name=$1 log=$2; shift 2
  echo "== pass: $name =="
  "$PYTHON" -m pytest -q "$@" 2>&1 | tee "$log"
  return "${PIPESTATUS[0]}"
}

run_pass "all tests" "$logs/all" "$@"; all=$?
PDSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
  run_pass "engine and cluster tests as an AVX2-only CPU" "$logs/avx2" -m "not ray" "${ENGINE_AND_CLUSTER_TESTS[@]}" "$@"
avx2=$?

summary() { grep -E '(passed|failed|error|no tests ran)' "$1" | tail -n 1; }
echo
echo "== make test: both passes =="
echo "all tests (exit $all): $(summary "$logs/all")"
echo "as an AVX2-only CPU (exit $avx2): $(summary "$logs/avx2")"
[ "$all" -eq 0 ] && [ "$avx2" -eq 0 ]
