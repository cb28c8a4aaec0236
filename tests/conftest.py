"""Test isolation: every outside system (Prefect, MLflow, caches, run folders) lives in a temp dir of this session.

The environment is set before prefect / mlflow are imported anywhere, so their settings pick it up.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_TMP = Path(tempfile.mkdtemp(prefix="fitburst-tests-"))
# every temp folder of this session (ours, the libraries', the subprocesses') lives in _TMP and goes with it
tempfile.tempdir = str(_TMP)
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
os.environ.update({
    "TMPDIR": str(_TMP),
    "PREFECT_HOME": str(_TMP / "prefect"),
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.3",
    "MLFLOW_TRACKING_URI": f"sqlite:///{_TMP / 'mlflow.db'}",
    "FITBURST_CACHE": os.environ.get("FITBURST_TEST_CACHE", str(_TMP / "cache")),
    "FITBURST_RUNS_DIR": str(_TMP / "runs"),
    "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
    "HF_HUB_OFFLINE": "1",
    "FITBURST_TRACE_CACHE": "0",  # tests patch kernel rules no cache key sees; test_trace_cache turns it on
    "FITBURST_OFFERS_TTL": "0",  # tests seed SkyPilot catalogs of their own: ask them every time
    "FITBURST_HUB_MISS_TTL": "0",  # a tokenizer one test could not load is tried again by the next
    "TOKENIZERS_PARALLELISM": "false",
})
os.chdir(_TMP)  # nothing a test writes by default lands in the checkout


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def pipelines_file() -> Path:
    return ROOT / "pipelines.yaml"


@pytest.fixture(scope="session")
def demo_spec(pipelines_file):
    from fitburst.spec import load_pipeline

    return load_pipeline(pipelines_file, "demo")


@pytest.fixture(scope="session")
def demo_tokenizer(demo_spec):
    from fitburst.models import load_tokenizer

    return load_tokenizer(demo_spec.model.name)


@pytest.fixture(scope="session")
def demo_prepared(demo_spec, demo_tokenizer):
    from fitburst.cache import cache_root
    from fitburst.data import prepare

    return prepare(demo_spec.data, demo_spec.data_path(), demo_tokenizer, cache_root() / "data")


@pytest.fixture(scope="session")
def prefect_server():
    """A real Prefect server (temporary database) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield
