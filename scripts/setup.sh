#!/usr/bin/env bash
# Install the package on a fresh machine. Torch is installed first and explicitly: a bare `torch`
# requirement can pull a multi-GB CUDA build. Override with TORCH_SPEC="torch==X" on other machines.
# EXTRAS picks the optional dependency groups (default: test,build; empty for the package alone).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${EXTRAS-test,build}"
python -m pip install --quiet --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}"
python -m pip install --quiet --disable-pip-version-check -e ".${extras:+[$extras]}"
