#!/usr/bin/env bash
# CI bench step (issue 6). 1) A short bench on the CPU and OpenCL backends with the determinism
# gate; each backend's receipt must verify as a real run. 2) The gates are seen failing on broken
# input in this same run (docs/design.md section 7). 3) The GPU receipt step: "skipped (no CUDA)" and
# success when no CUDA device is present, else a CUDA bench whose receipt must show GPU kernels.
# Output goes to $BITNET_CI_OUT (default: a temporary directory). Python: $PYTHON, else .venv's.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${BITNET_CI_OUT:-$(mktemp -d)}
SHORT=(-n 8 -r 2 --seed 1 --determinism)

bitnet() { "$PY" -m bitnet "$@"; }

# Runs a command that must exit with the given code (a gate must fail on broken input).
expect_exit() {
    local want=$1; shift
    local got=0
    "$@" >/dev/null 2>"$OUT/expect.err" || got=$?
    if [ "$got" -ne "$want" ]; then
        echo "ci-bench: expected exit $want, got $got: $*" >&2
        cat "$OUT/expect.err" >&2
        exit 1
    fi
}

echo "== bench: cpu, opencl (determinism gate) -> $OUT"
# --require: an OpenCL that silently went missing must fail CI, not be skipped.
bitnet bench --device cpu,opencl --require cpu,opencl "${SHORT[@]}" --out "$OUT/bench" --receipts "$OUT/receipts"
for backend in cpu opencl; do
    bitnet receipt verify "$OUT/receipts/receipt-$backend.json" --require-real --require-backend "$backend"
done

echo "== gates fail on broken input"
# Sampling at temperature 1 with no seed is not reproducible: the determinism gate must catch it.
expect_exit 5 bitnet bench --device cpu --prompt "Hello there" -n 8 -r 2 --warmup 0 --temperature 1 --determinism
# A run on a fake device leaves a fake receipt (and exits 3); --require-real must reject it.
expect_exit 3 env BITNET_GPU_FAKE=cuda "$PY" -m bitnet --device cuda run -p hi --receipt "$OUT/fake.json"
expect_exit 5 bitnet receipt verify "$OUT/fake.json" --require-real
# OpenCL on PoCL is a CPU device: its receipt must not pass for GPU kernels.
expect_exit 5 bitnet receipt verify "$OUT/receipts/receipt-opencl.json" --require-gpu-kernels
echo "ok: each gate failed on its broken input"

echo "== gpu receipt"
# Strict mode ignores BITNET_GPU_FAKE: a fake CUDA device is no CUDA device. Exit 3 means none.
cuda=0
BITNET_STRICT_MODE=1 "$PY" -m bitnet --device cuda >/dev/null 2>&1 || cuda=$?
if [ "$cuda" -eq 3 ]; then
    echo "gpu receipt: skipped (no CUDA)"
elif [ "$cuda" -ne 0 ]; then
    echo "gpu receipt: bitnet-select --device cuda failed with exit $cuda" >&2
    exit 1
else
    BITNET_STRICT_MODE=1 bitnet bench --device cuda --require cuda "${SHORT[@]}" --receipts "$OUT/gpu"
    bitnet receipt verify "$OUT/gpu/receipt-cuda.json" --require-real --require-gpu-kernels --require-backend cuda
fi
