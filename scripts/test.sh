#!/usr/bin/env bash
# The test command: set up (from requirements/dev.lock), lint, run the whole suite (CPU only, no downloads).
# Runs in the active virtual environment, or in .venv in the checkout (made if missing). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
bash scripts/setup.sh
ruff check src tests benchmarks
ruff format --check src tests benchmarks
mypy
# Two pytest workers, a test file each at a time (module fixtures are built once), taken longest first in the order
# tests/conftest.py gives (not xdist's own, by number of tests); TEST_WORKERS=0 runs in one process.
python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=25 "$@"
