#!/usr/bin/env bash
# The GPU check, run on the H200 machine from the repository root:
#   1. install the carried wheels (jax-triton 0.3.1, liger-kernel 0.8.5) without touching the stack;
#   2. the whole test suite, compiled, with the larger "gpu" shapes too;
#   3. a short timing table of frozen against full backward.
# Logs go to $OUT (or ./gpu-check-out). Usage: bash scripts/gpu-check.sh [tests|timing|all|bench|tune] [args...]
#   bench: the full benchmark (benchmarks/bench.py); tune: the launch-configuration sweep.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache} HOME=${HOME:-/tmp} PYTHONUNBUFFERED=1
what=${1:-all}; shift || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  NORMKIT_TEST_SHAPES=gpu python3 -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark tests "$@" 2>&1 | tee "$OUT/tests.log" | tail -30
  status=${PIPESTATUS[0]}
fi
if [ "$what" = bench ]; then
  python3 benchmarks/bench.py --out "$OUT/h200.json" "$@" 2>&1 | tee "$OUT/bench.log" | tail -60
fi
if [ "$what" = tune ]; then
  python3 scripts/tune.py "$@" 2>&1 | tee "$OUT/tune.log"
fi
if [ "$what" = timing ] || [ "$what" = all ]; then
  python3 scripts/quick_timing.py 2>&1 | tee "$OUT/timing.log"
fi
exit $status
