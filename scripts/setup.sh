#!/usr/bin/env bash
# Create ./.venv (or $FITBURST_VENV) and install fitburst with its dev tools. Idempotent.
# torch is installed first, pinned to the CPU build on disk here; on a CUDA box install your CUDA torch first.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FITBURST_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "$VENV/bin/pip" install -q "torch==${FITBURST_TORCH:-2.13.0}"
fi
"$VENV/bin/pip" install -q -e '.[dev]'
echo "fitburst installed in $VENV"
