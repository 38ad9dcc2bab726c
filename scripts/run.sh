#!/usr/bin/env bash
# Set up (once) and run `bitnet-select run`; with no --model, the built-in model (trained on Shakespeare).
# Without a prompt of its own (--prompt, -p, or a file: --file, -f), the run starts from "ROMEO:", whatever else is given.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/bitnet-select ] || scripts/setup.sh >&2
for arg in "$@"; do
  case "$arg" in -p | -p?* | --prompt | --prompt=* | -f | -f?* | --file | --file=* | --help)
    exec .venv/bin/bitnet-select run "$@" ;;
  esac
done
exec .venv/bin/bitnet-select run --prompt "ROMEO:" "$@"
