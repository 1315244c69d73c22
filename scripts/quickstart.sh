#!/usr/bin/env bash
# The main job: set up, build the demo cache if absent, train the reference model on CPU, checkpoint.
# Extra arguments go to `image-edit-data fit`, e.g. `--ckpt_path last` to resume.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="" bash scripts/setup.sh
image-edit-data fit --config configs/quickstart.yaml "$@"
