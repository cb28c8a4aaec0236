#!/usr/bin/env bash
# Set up, lint, type-check, and run the test suite (starts its own Prefect server and MLflow store in temp dirs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${FITBURST_VENV:-.venv}
"$VENV/bin/ruff" check .
"$VENV/bin/mypy"  # fitburst, tasks, flows as configured in pyproject.toml
"$VENV/bin/python" -m pytest -q "$@"
