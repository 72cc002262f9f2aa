#!/usr/bin/env bash
# The GPU check, run on the H200 machine from the repository root. Targets (default: compare, notebooks
# and tests):
#   compare    the main job (scripts/compare.py): frozen vs full backward, both frontends, with timings;
#   notebooks  every notebook source run as a script at full size;
#   tests      the whole test suite, compiled, with the larger "gpu" shapes too (the notebook test needs
#              jupytext/nbclient, which that machine lacks: the notebooks target runs them instead);
#              about 560 s on one H200 with 16 workers. TEST_PART=parity runs tests/test_parity.py alone
#              (about 60% of the work), TEST_PART=rest everything else: two calls that each end well
#              inside a 10-minute limit; rest also splits in two of about 250 s each on one H100,
#              TEST_PART=rest-jax (the JAX, rope, NNX, Pallas, property and math files) and
#              TEST_PART=rest-torch (every other file); TEST_PART=files runs only the files or node ids given after
#              the target (`TEST_PART=files bash scripts/gpu-check.sh tests tests/test_nnx.py`);
#   timing     time per call where the host sets it (bf16 4096x1024), normkit through autograd against
#              Liger, eager and torch.compile: benchmarks/bench.py at that shape, results in $OUT/timing.json;
#   bench      the full benchmark (benchmarks/bench.py); results in $OUT/h200.json;
#   tune       the launch-configuration sweep (scripts/tune.py; --write-tiles updates normkit/tiles.json);
#   multi      the two-GPU check (scripts/multi_gpu.py: torchrun + NCCL, then JAX on a 2-device mesh);
#   host-ab    host time of two checkouts' Torch calls, alternately (benchmarks/host_ab.py; name them
#              with --tree NAME=PATH, e.g. a `git archive` of an older commit carried in build/;
#              --same-process interleaves them in one process, the steadier comparison; --rope adds
#              rms_norm_rope, for trees that have it);
#   lora       the LoRA training-step benchmark (benchmarks/lora_step.py);
#   nnx        the Flax NNX LoRA training-step benchmark (benchmarks/nnx_lora_step.py);
#   build-notebooks  regenerate the executed .ipynb at full size (notebooks/build.py --size full [names]),
#              written to $OUT/notebooks/. Needs the Jupyter wheels the machine lacks: fetch them here
#              with `bash ../shared/tools/gpu-wheels.sh` plus `-d`-style extras into .whl/nb (see below);
#              only the distributions the machine does not already have are installed.
# With several GPUs the test workers spread over them (tests/conftest.py, NORMKIT_TEST_GPUS), one
# worker per CPU core by default.
# It first installs the carried wheels (jax-triton 0.3.1, liger-kernel 0.8.5, tabulate 0.10.0 for the
# reports' Markdown tables and their tests) without touching the machine's stack. Logs go to $OUT (or
# ./gpu-check-out). Results files take their commit from NORMKIT_GIT_COMMIT when set (a copied tree has
# no history of its own; benchmarks/env.py). Usage: bash scripts/gpu-check.sh [target] [args...]
set -uo pipefail
OUT=${OUT:-$PWD/gpu-check-out}
if [ -n "${NORMKIT_GIT_COMMIT:-}" ] && ! [[ "$NORMKIT_GIT_COMMIT" =~ ^[0-9a-f]{7,40}(-dirty)?$ ]]; then
  echo "NORMKIT_GIT_COMMIT=$NORMKIT_GIT_COMMIT is not a commit hash (results files would record it as one)"; exit 2
fi
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  # GPU_CHECK_INSTALLED=1: already installed (two targets running side by side must not both install)
  [ -n "${GPU_CHECK_INSTALLED:-}" ] || \
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache} HOME=${HOME:-/tmp} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several test workers share the GPU with torch
what=${1:-all}; shift || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton, jax; print('torch', torch.__version__, 'triton', triton.__version__, 'jax', jax.__version__, jax.devices())" | tee -a "$OUT/device.txt"
status=0
gpus=${NORMKIT_TEST_GPUS:-$(nvidia-smi --list-gpus | wc -l)}  # set it (with CUDA_VISIBLE_DEVICES) to leave GPUs free
if [ "$what" = compare ] || [ "$what" = all ]; then
  timeout 120 python3 scripts/compare.py 2>&1 | tee "$OUT/compare.log" || status=1
fi
if [ "$what" = notebooks ] || [ "$what" = all ]; then
  for nb in notebooks/[0-9][0-9]_*.py; do
    name=$(basename "$nb" .py)
    (cd notebooks && NORMKIT_NOTEBOOK_SIZE=full MPLBACKEND=Agg timeout 400 python3 "$name.py") > "$OUT/nb_$name.log" 2>&1
    rc=$?; echo "notebook $name: exit $rc ($(wc -l < "$OUT/nb_$name.log") lines of output)"; [ $rc = 0 ] || status=1
  done
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  # Failures are written to $OUT/failures.txt as they happen (tests/conftest.py), so a run cut by
  # the time limit still names them; the JUnit XML is written at the end.
  # $OUT/failures.outcomes.txt gets every test's outcome and duration as it ends. worksteal (xdist >= 3.2)
  # hands out contiguous blocks, so a parity case's frontends share its inputs (tests/test_parity.py).
  # -m "slow or not slow": both tiers (a plain run leaves the slow one out: pyproject.toml); a -m in
  # the arguments overrides it.
  dist=$(python3 -c "import xdist; print('worksteal' if tuple(map(int, xdist.__version__.split('.')[:2])) >= (3, 2) else 'load')")
  jax_files=(tests/test_jax.py tests/test_rope.py tests/test_nnx.py tests/test_pallas_impl.py
             tests/test_jax_implementations.py tests/test_distributed_jax.py tests/test_compat_jax.py
             tests/test_math.py tests/test_properties.py)
  case "${TEST_PART:-all}" in
    all) part=(tests) ;;
    parity) part=(tests/test_parity.py) ;;
    rest) part=(tests --ignore=tests/test_parity.py) ;;
    rest-jax) part=("${jax_files[@]}") ;;
    rest-torch) part=(tests --ignore=tests/test_parity.py "${jax_files[@]/#/--ignore=}") ;;
    files) part=() ;;  # only the test files (or node ids) given as arguments
    *) echo "TEST_PART must be all, parity, rest, rest-jax, rest-torch or files, not ${TEST_PART}"; exit 2 ;;
  esac
  NORMKIT_FAILURE_LOG="$OUT/failures.txt" NORMKIT_TEST_SHAPES=gpu NORMKIT_TEST_GPUS=$gpus timeout ${TEST_TIMEOUT:-570} \
    python3 -m pytest -q -n ${TEST_WORKERS:-$(nproc)} --dist $dist -p no:cacheprovider -p no:benchmark --durations=15 \
    --junitxml="$OUT/tests.xml" --ignore=tests/test_notebooks.py -m "slow or not slow" ${part[@]+"${part[@]}"} "$@" 2>&1 | tee "$OUT/tests.log" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$what" = timing ]; then
  python3 benchmarks/bench.py --shapes 4096x1024 --dtypes bf16 --peers liger,torch_eager,torch_compile \
    --budget-s 0 --no-report --out "$OUT/timing.json" "$@" 2>&1 | tee "$OUT/timing.log" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$what" = bench ]; then
  python3 benchmarks/bench.py --out "$OUT/h200.json" "$@" 2>&1 | tee "$OUT/bench.log" | tail -60
fi
if [ "$what" = tune ]; then
  python3 scripts/tune.py "$@" 2>&1 | tee "$OUT/tune.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$what" = multi ]; then
  [ "$gpus" -ge 2 ] || { echo "multi needs 2 GPUs, found $gpus"; exit 1; }
  timeout ${MULTI_TIMEOUT:-400} python3 scripts/multi_gpu.py --out "$OUT/multi_gpu.json" "$@" 2>&1 | tee "$OUT/multi_gpu.log" | tail -60
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$what" = host-ab ]; then
  timeout ${HOST_AB_TIMEOUT:-300} python3 benchmarks/host_ab.py --out "$OUT" "$@" 2>&1 | tee "$OUT/host_ab.log" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$what" = lora ]; then
  timeout ${LORA_TIMEOUT:-300} python3 benchmarks/lora_step.py --out "$OUT" "$@" 2>&1 | tee "$OUT/lora_step.log" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$what" = nnx ]; then
  timeout ${NNX_TIMEOUT:-300} python3 benchmarks/nnx_lora_step.py --out "$OUT" "$@" 2>&1 | tee "$OUT/nnx_lora_step.log" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$what" = build-notebooks ]; then
  # Install from .whl/nb only what the machine lacks, into a folder of its own (the machine's
  # packages stay in charge), then execute the notebooks at full size.
  missing=$(python3 - <<'PY'
import glob, importlib.metadata as md, os
for w in sorted(glob.glob(".whl/nb/*.whl")):
    name = os.path.basename(w).split("-")[0]
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(w)
PY
)
  [ -z "$missing" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/nbsite $missing || exit 1
  export PYTHONPATH=$PYTHONPATH:/tmp/nbsite
  mkdir -p "$OUT/notebooks"
  timeout ${NB_TIMEOUT:-500} python3 notebooks/build.py --size full "$@" 2>&1 | tee "$OUT/build_notebooks.log" | tail -20
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  cp notebooks/*.ipynb "$OUT/notebooks/"
fi
echo "gpu-check $what: status $status"
exit $status
