#!/usr/bin/env bash
# The main job: set up (the package alone), build the demo cache if absent, train the reference model on CPU and
# checkpoint to runs/quickstart/. Runs in the active virtual environment, or in .venv in the checkout (made if
# missing). Extra arguments go to `image-edit-data fit`, e.g. `--ckpt_path last` to resume.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
EXTRAS="" bash scripts/setup.sh
image-edit-data quickstart "$@"   # fit with the config shipped in the package (configs/quickstart.yaml links to it)
