#!/usr/bin/env bash
# Do the package's own ranges resolve today, as a user installs them? Resolves (without installing) the package with
# every user-facing extra in a throw-away venv, the way `pip install "image-edit-data[...]"` would, against the live
# index: the lock pins what we test with, this checks what users get. Prints pip's resolution report summary.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${EXTRAS:-build,lora,remote,plots,ray}"
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --dry-run --ignore-installed \
  --report "$venv/report.json" "${TORCH_SPEC:-torch==2.13.0}" ".[$extras]"
"$venv/bin/python" - "$venv/report.json" <<'PY'
import json, sys
installs = json.load(open(sys.argv[1]))["install"]
names = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installs}
print(f"resolved {len(names)} packages; " + ", ".join(f"{n}=={names[n]}" for n in ("torch", "lightning", "s3fs", "botocore", "ray") if n in names))
PY
