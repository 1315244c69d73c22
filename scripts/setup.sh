#!/usr/bin/env bash
# Install the package on a fresh machine. Torch is installed first and explicitly: a bare `torch`
# requirement can pull a multi-GB CUDA build. Override with TORCH_SPEC="torch==X" on other machines.
# EXTRAS picks the optional dependency groups (default: test,build,remote; empty for the package alone; add bench
# for `image-edit-data bench versus-litdata`).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${EXTRAS-test,build,remote}"
python -m pip install --quiet --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}"
python -m pip install --quiet --disable-pip-version-check -e ".${extras:+[$extras]}"
# NeMo Automodel's Qwen-Image-Edit preprocessor, which tests/integration/preprocess/test_nemo_equivalence.py runs to compare caches.
# --no-deps: importing the preprocessor needs only the build extra, and its own pins would replace our transformers.
if [[ ",$extras," == *",test,"* ]]; then
  python -m pip install --quiet --disable-pip-version-check --no-deps "nemo-automodel==0.7.0"
fi
# litdata for `bench versus-litdata` and its smoke test (tests/unit/bench/test_versus_litdata.py).
# --no-deps: its metadata requires torchvision, which would replace the torch installed above; what it imports
# (boto3, filelock, obstore, lightning-utilities, requests) comes with the test and bench extras.
if [[ ",$extras," == *",test,"* || ",$extras," == *",bench,"* ]]; then
  python -m pip install --quiet --disable-pip-version-check --no-deps "litdata==0.2.76"
fi
