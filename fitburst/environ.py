"""The process environment, read safely while other threads write it, and the libraries' defaults fitburst sets.

``os.environ`` is shared by every thread, and libraries write it from their own threads (MLflow's telemetry
client sets and unsets ``_MLFLOW_TELEMETRY_SESSION_ID`` from a worker thread). Iterating it with ``items()``,
``dict(os.environ)`` or ``{**os.environ}`` lists the keys first and reads each value after: a key removed in
between raises ``KeyError``. :func:`snapshot` reads each listed key with ``get`` and skips the ones gone.
"""

from __future__ import annotations

import os
import re

# what fitburst turns off unless the user set it (os.environ.setdefault); set the variable yourself to undo
TELEMETRY_OFF = {
    "MLFLOW_DISABLE_TELEMETRY": "true",  # MLflow's usage telemetry (a background thread that posts events)
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # Prefect server's telemetry heartbeat
    "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",  # SkyPilot's usage logging
    "HF_HUB_DISABLE_TELEMETRY": "1",  # huggingface_hub's (transformers', datasets') request telemetry
}


# how long Prefect waits for the temporary server `fitburst run` starts when no server is configured: its 20 s
# default is too short for a fresh database on a loaded 2-core machine (benchmarks/results/soak.txt)
PREFECT_PATIENCE = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}


def snapshot() -> dict[str, str]:
    """A copy of the environment as it is now; safe while other threads set and unset variables."""
    values = ((k, os.environ.get(k)) for k in list(os.environ))
    return {k: v for k, v in values if v is not None}


def library_defaults() -> None:
    """Third-party telemetry off and Prefect's patience set, for this process and every process it starts, where
    the user has not set the variable."""
    for k, v in {**TELEMETRY_OFF, **PREFECT_PATIENCE}.items():
        os.environ.setdefault(k, v)


# environment variables whose values are never written anywhere (MLflow, logs, task YAML, uploads)
SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL)", re.I)


def secret_values() -> list[str]:
    """Values of environment variables whose names look secret (long enough to be worth scrubbing)."""
    env = snapshot()  # other threads (MLflow's) set and unset variables while this runs
    return sorted((v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= 6), key=len, reverse=True)


def redact(text: str) -> str:
    for v in secret_values():
        text = text.replace(v, "***")
    return re.sub(r"(://[^:/@\s]+:)[^@\s]+@", r"\1***@", text)  # user:password@host in URIs
