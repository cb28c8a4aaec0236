#!/usr/bin/env bash
# Set up, lint, type-check, and run the test suite (starts its own Prefect server and MLflow store in temp dirs).
# mypy (a minute or more on a fresh clone, with no cache yet, on one core) runs beside the tests, whose workers leave a
# core free while they wait; its report follows the tests' and the command fails if either fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${FITBURST_VENV:-.venv}
mypy_log=$(mktemp)
"$VENV/bin/mypy" >"$mypy_log" 2>&1 &  # fitburst, tasks, flows as configured in pyproject.toml
mypy_pid=$!
trap 'kill "$mypy_pid" 2>/dev/null || true; rm -f "$mypy_log"' EXIT
"$VENV/bin/ruff" check .
tests=0
"$VENV/bin/python" -m pytest -q "$@" || tests=$?
mypy=0
wait "$mypy_pid" || mypy=$?
echo "mypy:"
cat "$mypy_log"
exit $((tests ? tests : mypy))
