#!/usr/bin/env bash
# Install the package and what working on it needs into the current Python environment.
#
# Default: the development and test environment from requirements/dev.lock, every package at its pinned version
# (installed --no-deps: the lock is complete, so nothing is resolved and nothing floats), then the package itself,
# editable. Torch comes first and explicitly: TORCH_SPEC (default torch==2.13.0, the CPU build pip finds on these
# machines' disk); a bare `torch` from PyPI is a CUDA build of several GB.
#
# EXTRAS=... instead installs the package with those extras from their ranges, as a user would (no lock);
# EXTRAS= (empty) installs the package alone. The quickstart uses EXTRAS=, scripts/test_torch_range.sh EXTRAS=...
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "${TORCH_SPEC:-torch==2.13.0}"
if [[ -z "${EXTRAS+set}" ]]; then
  # The lock pins torch's own requirements too; torch itself stays as TORCH_SPEC installed it.
  grep -v '^torch==' requirements/dev.lock > "${TMPDIR:-/tmp}/image-edit-data-lock.$$.txt"
  "${pip[@]}" --no-deps -r "${TMPDIR:-/tmp}/image-edit-data-lock.$$.txt" -r requirements/no-deps.txt
  rm -f "${TMPDIR:-/tmp}/image-edit-data-lock.$$.txt"
  "${pip[@]}" --no-deps -e .
else
  "${pip[@]}" -e ".${EXTRAS:+[$EXTRAS]}"
fi
