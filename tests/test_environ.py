"""The environment read while other threads write it (MLflow's telemetry thread did), and third-party telemetry
off unless the user turned it on."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from fitburst.environ import TELEMETRY_OFF
from fitburst.tracking import redact


def test_redact_runs_while_another_thread_sets_and_unsets_a_variable(monkeypatch):
    """MLflow's telemetry thread sets and unsets _MLFLOW_TELEMETRY_SESSION_ID; listing the environment's keys and
    reading each value after raised KeyError for a key removed in between (2 dry runs in 5 on the 2-core box)."""
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value_123")
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            os.environ["_FITBURST_TEST_CHURN"] = "x"
            os.environ.pop("_FITBURST_TEST_CHURN", None)

    writer = threading.Thread(target=churn, daemon=True)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: the window is a few bytecodes
    writer.start()
    try:
        for _ in range(3000):
            assert redact("token hf_secret_value_123") == "token ***"
    finally:
        stop.set()
        writer.join()
        sys.setswitchinterval(old)


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment less what would turn telemetry off on its own (pytest's and CI's markers) and our switches."""
    markers = {"PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS", "DO_NOT_TRACK", *TELEMETRY_OFF}
    env = {k: v for k, v in os.environ.items() if k not in markers}
    return {**env, **extra}


TELEMETRY_STATE = (
    "import fitburst, mlflow, os; from mlflow.telemetry import get_telemetry_client; "
    "from mlflow.telemetry.utils import is_telemetry_disabled; "
    "print(is_telemetry_disabled(), get_telemetry_client() is None, os.environ['SKYPILOT_DISABLE_USAGE_COLLECTION'])"
)


def test_importing_fitburst_turns_mlflows_telemetry_off():
    r = subprocess.run([sys.executable, "-c", TELEMETRY_STATE], capture_output=True, text=True, env=_clean_env(),
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "1"]


@pytest.mark.parametrize("value", ["false", "0"])
def test_a_user_who_turned_mlflows_telemetry_on_keeps_it(value):
    r = subprocess.run([sys.executable, "-c", TELEMETRY_STATE], capture_output=True, text=True,
                       env=_clean_env(MLFLOW_DISABLE_TELEMETRY=value), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "False"


PREFECT_PATIENCE = (
    "import fitburst; from prefect.settings import get_current_settings; "
    "print(get_current_settings().server.ephemeral.startup_timeout_seconds)"
)


@pytest.mark.parametrize(("users", "expected"), [(None, "120"), ("45", "45")])
def test_prefects_temporary_server_gets_two_minutes_to_start_unless_the_user_said(users, expected):
    """Prefect's 20 s timed out once in 10 `fitburst run demo` on the loaded 2-core box (benchmarks/soak.py)."""
    extra = {} if users is None else {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": users}
    env = {k: v for k, v in _clean_env(**extra).items()
           if users is not None or k != "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"}
    r = subprocess.run([sys.executable, "-c", PREFECT_PATIENCE], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == expected
