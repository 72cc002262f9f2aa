#!/usr/bin/env bash
# Set up normkit's CPU environment in ./.venv (idempotent): the CPU build of torch 2.13.0 (its wheel
# lies on these machines' disk; a plain `pip install torch` would fetch a CUDA build of several GB),
# triton 3.6.0 (kernels run in its interpreter on CPU), jax[cpu] 0.10.2, and the test, notebook and
# Hugging Face packages pinned in requirements-cpu.txt; then normkit itself, editable.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-cpu.txt
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
.venv/bin/python - <<'PY'
import torch, triton, jax, numpy

print(f"normkit env: torch {torch.__version__}, triton {triton.__version__}, jax {jax.__version__}, numpy {numpy.__version__}")
PY
