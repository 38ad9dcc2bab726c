#!/usr/bin/env bash
# Create .venv and install bitnet-core with the CPU, OpenCL (PoCL and, on x86-64 Linux, Intel's CPU
# runtime) and CUDA plugins, editable. bitnet-cuda comes without pycuda, which builds only on CUDA
# machines: there `pip install "./plugins/cuda[pycuda]"` adds it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e "./core[server]" -e ./plugins/cpu -e "./plugins/opencl[pocl,intel]"
.venv/bin/python -m pip install -q -e ./plugins/cuda
# Byte-compile the editable sources: where the environment forbids writing .pyc at run time
# (PYTHONDONTWRITEBYTECODE), every load would otherwise compile ~30 modules again (~0.1 s).
.venv/bin/python -m compileall -q core/bitnet plugins/*/bitnet_* >/dev/null
# Compile the CPU kernels for this machine now (about 70 s on a 2-core Zen 5, cached on disk), not in the first run.
.venv/bin/bitnet-select --device cpu warmup
if [ "${1:-}" = "--dev" ]; then
  .venv/bin/python -m pip install -q -r requirements-dev.txt
  # Ray Serve for tests/test_server_ray.py (about 1 minute and 0.5 GB on a fresh machine).
  .venv/bin/python -m pip install -q -e "./core[ray]"
fi
