#!/usr/bin/env bash
# Create .venv and install bitnet-core with the CPU and OpenCL (PoCL) plugins, editable.
# bitnet-cuda installs without its pycuda dependency here: pycuda builds only on CUDA machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ./core -e ./plugins/cpu -e "./plugins/opencl[pocl]"
.venv/bin/python -m pip install -q --no-deps -e ./plugins/cuda
if [ "${1:-}" = "--dev" ]; then
  .venv/bin/python -m pip install -q -r requirements-dev.txt
fi
