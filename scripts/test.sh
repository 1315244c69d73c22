#!/usr/bin/env bash
# The test command: set up, lint, run the whole suite (CPU only, no downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ruff check src tests
mypy
# Two pytest workers, a test file each at a time (module fixtures are built once); TEST_WORKERS=0 runs in one process.
python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile --durations=15 "$@"
