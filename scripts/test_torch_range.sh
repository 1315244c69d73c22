#!/usr/bin/env bash
# The fast test tier in a fresh venv for each torch version named, by default the oldest and the
# newest the package declares: the floor of `torch>=` in pyproject.toml and NEWEST_TORCH.
# Usage: bash scripts/test_torch_range.sh [VERSION ...]   e.g. bash scripts/test_torch_range.sh 2.13.0
# Each venv is made under VENV_ROOT (default /tmp/image-edit-data-torch-range) and reused.
# A version with no wheel on the machine is downloaded from PyPI (a CUDA build can take GBs).
set -uo pipefail
cd "$(dirname "$0")/.."
NEWEST_TORCH="${NEWEST_TORCH:-2.14.1}"
floor="$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)"
versions=("$@")
[[ ${#versions[@]} -gt 0 ]] || versions=("$floor" "$NEWEST_TORCH")
root="${VENV_ROOT:-/tmp/image-edit-data-torch-range}"
status=0
for version in "${versions[@]}"; do
  venv="$root/torch-$version"
  echo "== torch $version ($venv)"
  [[ -x "$venv/bin/python" ]] || python -m venv "$venv"
  # scripts/setup.sh with the venv's python: torch first, then the package and its test and build extras.
  if ! PATH="$venv/bin:$PATH" TORCH_SPEC="torch==$version" bash scripts/setup.sh; then
    echo "== torch $version: install failed"; status=1; continue
  fi
  "$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'
  # The venv's own editable install, not whichever checkout PYTHONPATH names.
  if env -u PYTHONPATH "$venv/bin/python" -m pytest -m "not slow" -q -p no:cacheprovider; then
    echo "== torch $version: passed"
  else
    echo "== torch $version: FAILED"; status=1
  fi
done
exit $status
