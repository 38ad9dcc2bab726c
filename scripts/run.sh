#!/usr/bin/env bash
# Set up (once) and run `bitnet-select run`; with no --model, the built-in model (trained on Shakespeare).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/bitnet-select ] || scripts/setup.sh >&2
if [ $# -eq 0 ]; then set -- --prompt "ROMEO:"; fi
exec .venv/bin/bitnet-select run "$@"
