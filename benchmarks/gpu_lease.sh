#!/usr/bin/env bash
# One GPU lease's checks and figures (docs/benchmarks.md#gpu), run there through the
# device tool with the default model's config and tokenizer carried in .gpu/ (its weights are
# over the tool's size limit; the profiles time random twins, see benchmarks/random_twin.py):
#   mkdir -p .gpu && cp ~/.cache/pdserve/models/SmolLM2-*/{{config,tokenizer,tokenizer_config,generation_config}.json,chat_template.jinja} .gpu/
# and the wheels its image lacked on 2026-11-27 (its grpcio 1.84 is older than pdserve_api's
# generated code) in .whl/, both listed in .git/info/exclude:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl grpcio==1.85.3 grpcio-health-checking==1.85.1 \
#     grpcio-reflection==1.85.1 fastapi starlette pydantic pydantic-core annotated-types \
#     typing-inspection uvicorn annotated-doc     (the versions of .venv's)
# Results land in $OUT (the tool brings them back). Arguments pick parts (default: 135m 8b tests);
# `kernel` runs the Triton kernel's tests (not the C++ kernel's: no build there) and the CUDA
# tests, and stops the script if they fail; `decode` times the Triton paged decode against SDPA on
# both shapes (benchmarks/cuda_paged_decode.py); `tput` runs benchmarks/engine_throughput.py on the
# default model's random twin, the engine and transformers both on the GPU (bf16 x3, fp32 x1).
set -uo pipefail
umask 077
# what the image lacks travels as wheels in .whl/ (grpcio at the generated code's version, its health and reflection services, fastapi and uvicorn)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/gpu-lease}
mkdir -p "$OUT"
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
python3 -m pip list 2>/dev/null | grep -E "^(grpcio|protobuf|transformers) "
step() { echo "== $* ($(date +%T))"; }
parts=" ${*:-135m 8b tests} "
twin() {  # twin NAME CONFIG_JSON: a random twin of that shape in /tmp/NAME, once
  python3 benchmarks/random_twin.py "$2" .gpu "/tmp/$1" --device cuda > /dev/null
}
if [[ $parts == *" kernel "* ]]; then
  step kernel tests
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernel.py tests/test_cuda.py -k "not cpu and not refused_by_name" 2>&1 | tail -25
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "kernel tests failed: stopping"; exit 1; }
fi
if [[ $parts == *" decode "* ]]; then
  step decode 8b
  twin twin8b deploy/model_configs/llama-3.1-8b/config.json
  # 15 GB of weights and 50 GB of KV: fits an H100's 80 GB as well as an H200
  timeout 240 python3 benchmarks/cuda_paged_decode.py --model /tmp/twin8b --shapes 64x640,256x640,128x2048 \
    --kv-cache-gb 50 --json "$OUT/cuda_paged_decode_8b.json" 2>&1 | grep -v Warning
  step decode 135m
  twin twin135 .gpu/config.json
  timeout 120 python3 benchmarks/cuda_paged_decode.py --model /tmp/twin135 --shapes 64x640,256x640,256x2048 \
    --kv-cache-gb 16 --json "$OUT/cuda_paged_decode_135m.json" 2>&1 | grep -v Warning
fi
if [[ $parts == *" tput "* ]]; then
  step throughput 135m
  twin twin135 .gpu/config.json
  for run in "bfloat16 3" "float32 1"; do
    set -- $run
    timeout 200 python3 benchmarks/engine_throughput.py --model /tmp/twin135 --device cuda --dtype "$1" \
      --repeat "$2" --json "$OUT/engine_h200_twin135_$1.json" 2>&1 | grep -v Warning
  done
fi
if [[ $parts == *" 135m "* ]]; then
  step profile 135m   # (83 s, 153 s for 8b, before the decode grid took two passes: not yet timed on a GPU since)
  twin twin135 .gpu/config.json
  timeout 200 python3 -m pdserve plan profile --model /tmp/twin135 --device cuda --dtype bfloat16 --threads 1 \
    --kv-cache-gb 16 --out "$OUT/plan_profile_h200_135m.json" 2> "$OUT/profile_135m.log"
  echo "rc=$?"; tail -3 "$OUT/profile_135m.log"
fi
if [[ $parts == *" 8b "* ]]; then
  step profile 8b
  twin twin8b deploy/model_configs/llama-3.1-8b/config.json
  timeout 330 python3 -m pdserve plan profile --model /tmp/twin8b --device cuda --dtype bfloat16 --threads 1 \
    --kv-cache-gb 40 --out "$OUT/plan_profile_h200_8b.json" 2> "$OUT/profile_8b.log"
  echo "rc=$?"; tail -3 "$OUT/profile_8b.log"
fi
if [[ $parts == *" tests "* ]]; then
  step tests
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -25
fi
step done
