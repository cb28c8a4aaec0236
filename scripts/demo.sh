#!/usr/bin/env bash
# Set up, then run the demo pipeline end to end (data prep -> preflight -> train -> eval) as a Prefect flow.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${FITBURST_VENV:-.venv}
export PREFECT_SERVER_ANALYTICS_ENABLED=false
"$VENV/bin/fitburst" validate pipelines.yaml
"$VENV/bin/fitburst" run demo "$@"
echo
echo "MLflow record: sqlite store $(pwd)/mlflow.db (artifacts in $(pwd)/mlruns)"
echo "Next: source $VENV/bin/activate  (puts fitburst and mlflow on PATH; see README: the five commands)"
echo "Open it with:  $VENV/bin/mlflow ui --backend-store-uri sqlite:///$(pwd)/mlflow.db   then http://127.0.0.1:5000"
