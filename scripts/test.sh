#!/usr/bin/env bash
# Set up (once) with the dev tools, then lint and run the whole suite in parallel.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -n auto "$@"
