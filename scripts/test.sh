#!/usr/bin/env bash
# The test command: set up, lint, run the whole suite (CPU only, no downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ruff check src tests
mypy
python -m pytest -q --durations=15 "$@"
