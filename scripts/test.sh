#!/usr/bin/env bash
# Set up, lint, and run the test suite (starts its own Prefect server and MLflow store in temp dirs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${FITBURST_VENV:-.venv}
"$VENV/bin/ruff" check .
"$VENV/bin/python" -m pytest -q "$@"
