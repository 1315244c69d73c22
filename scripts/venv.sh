# Sourced by quickstart.sh and test.sh: run in the active virtual environment, or else in .venv in the checkout
# (made here with the python3 on PATH if it does not exist yet), so set-up never writes into a system Python.
if [[ -z "${VIRTUAL_ENV:-}" ]]; then
  [[ -x .venv/bin/python ]] || "${PYTHON:-python3}" -m venv .venv
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi
