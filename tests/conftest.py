"""Test isolation: every outside system (Prefect, MLflow, caches, run folders) lives in a temp dir of this session.

The environment is set before prefect / mlflow are imported anywhere, so their settings pick it up.

The suite runs on pytest-xdist workers (addopts in pyproject.toml: ``-n auto --dist loadgroup``). Each worker is a
session of its own: its own temp dir, Prefect server and MLflow store, so tests need no locks between workers. A
module whose tests share a module-scoped fixture (a trained run, a served stack) runs on one worker, so the
fixture is built once. ``-n 0`` or ``-p no:xdist`` runs it all in this one process.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_TMP = Path(tempfile.mkdtemp(prefix="fitburst-tests-"))
# every temp folder of this session (ours, the libraries', the subprocesses') lives in _TMP and goes with it
tempfile.tempdir = str(_TMP)
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
# one cache of built demo models and prepared data for the session, xdist workers included: they start after this
# ran in the controller and inherit it (writes into it are atomic; fitburst.cache.build_once builds under a lock).
# Everything else under FITBURST_CACHE (the calibration file, the OOM history, data facts, offers, traces) is what a
# test writes and reads back: each process keeps its own, and links the shared folders into it.
_SHARED_CACHE = Path(os.environ.setdefault("FITBURST_TEST_CACHE", str(_TMP / "cache")))
_CACHE = _TMP / "cache"
for _shared in ("models", "data"):
    (_SHARED_CACHE / _shared).mkdir(parents=True, exist_ok=True)
    if not (_CACHE / _shared).exists():
        _CACHE.mkdir(exist_ok=True)
        (_CACHE / _shared).symlink_to(_SHARED_CACHE / _shared, target_is_directory=True)
# and one torch.compile cache, as a single process has (its default lives in TMPDIR, which is per worker below)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_TMP / "torchinductor"))
os.environ.update({
    "TMPDIR": str(_TMP),
    "PREFECT_HOME": str(_TMP / "prefect"),
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.3",
    "MLFLOW_TRACKING_URI": f"sqlite:///{_TMP / 'mlflow.db'}",
    "FITBURST_CACHE": str(_CACHE),
    "FITBURST_RUNS_DIR": str(_TMP / "runs"),
    "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
    "HF_HUB_OFFLINE": "1",
    "FITBURST_TRACE_CACHE": "0",  # tests patch kernel rules no cache key sees; test_trace_cache turns it on
    "FITBURST_OFFERS_TTL": "0",  # tests seed SkyPilot catalogs of their own: ask them every time
    "FITBURST_HUB_MISS_TTL": "0",  # a tokenizer one test could not load is tried again by the next
    "TOKENIZERS_PARALLELISM": "false",
})
os.chdir(_TMP)  # nothing a test writes by default lands in the checkout

def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# xdist workers split the cores between them: torch (and the subprocesses a test starts) would otherwise each run as
# many intra-op threads as there are cores, and two workers' spinning OpenMP threads slow both down
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    _threads = max(1, _cpus() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(_threads)


def pytest_addoption(parser, pluginmanager) -> None:
    """With ``-p no:xdist`` the addopts' ``-n`` and ``--dist`` are still accepted, and run everything in-process."""
    if not pluginmanager.hasplugin("xdist"):
        group = parser.getgroup("xdist", "xdist is disabled: these options are accepted and ignored")
        group._addoption("-n", "--numprocesses", dest="numprocesses", default=None)  # lowercase: as xdist does
        group.addoption("--dist", dest="dist", default="no")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "xdist_group(name): run these tests on one xdist worker")
    if getattr(config.option, "tx", None) and config.option.dist != "no":
        os.chdir(config.invocation_params.dir)  # xdist's controller runs no test; its workers start where it is


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown with -p no:xdist
def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per core, at least 2 (tests wait on servers and subprocesses as much as they
    compute), at most 4 (each worker holds its own Prefect server and models in RAM). PYTEST_XDIST_AUTO_NUM_WORKERS
    overrides it."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").isdigit():
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return min(4, max(2, _cpus()))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the node ids
def pytest_collection_modifyitems(config, items) -> None:
    """Keep a module's tests on one worker where they share a module-scoped fixture (built once, not per worker);
    every other test is scheduled on its own."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        defs = getattr(item, "_fixtureinfo", None)
        scopes = {d.scope for fd in (defs.name2fixturedefs.values() if defs else ()) for d in fd}
        if "module" in scopes or "class" in scopes:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    items.sort(key=lambda item: _start_rank(item.path.name))  # stable: each module's own order kept


# modules of long tests that share no fixture, first: xdist hands out its groups first (the largest first), then the
# other tests in this order, one at a time as a worker frees; long tests last leave one worker idle while the other
# finishes them (measured: 43 s of one worker's time at the end of a run, test_warm_preflight's two 20 s tests)
START_FIRST = ("test_distributed.py", "test_warm_preflight.py", "test_cloud_node.py", "test_outage.py",
               "test_crash_resume.py", "test_local_slot.py", "test_oom.py", "test_first_hour.py", "test_nightly.py")


def _start_rank(module: str) -> int:
    return START_FIRST.index(module) if module in START_FIRST else len(START_FIRST)


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


# the server's loop services no test of the session server uses (tests/test_serve.py starts a server of its own, with
# every service): each polls the database every few seconds, about half of an idle server's CPU (measured: 8.5-10.9 s
# of CPU per 90 s idle with them, 4.0-6.1 s without; the task-run recorder and event persister stay: the flow's task
# runs are recorded through them)
IDLE_SERVICES = ("late_runs", "pause_expirations", "cleanup_reconciler", "foreman", "repossessor",
                 "cancellation_cleanup", "scheduler", "triggers")


@pytest.fixture(scope="session")
def prefect_server():
    """A real Prefect server (temporary database) for the whole session, without :data:`IDLE_SERVICES`."""
    from unittest import mock

    from prefect.testing.utilities import prefect_test_harness

    off = {f"PREFECT_SERVER_SERVICES_{name.upper()}_ENABLED": "false" for name in IDLE_SERVICES}
    with contextlib.ExitStack() as stack:
        with mock.patch.dict(os.environ, off):  # read by the server process as it starts; not by later ones
            stack.enter_context(prefect_test_harness(server_startup_timeout=90))
        yield


def config_folder(tmp_path_factory, name: str, config: dict) -> Path:
    """A model folder holding only ``config``'s config.json: what the estimates and the trace read."""
    import json

    d = tmp_path_factory.mktemp(name)
    (d / "config.json").write_text(json.dumps(config))
    return d


def random_model_folder(tmp_path_factory, name: str, config: dict) -> Path:
    """``config``'s model saved with random weights (seed 0), for the real loaders to load."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d = tmp_path_factory.mktemp(name)
    cfg = dict(config)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).save_pretrained(d)
    return d


def fake_cuda_card(monkeypatch, name: str, major: int, minor: int) -> type:
    """torch.cuda answering as one card ``name`` of compute capability ``major.minor`` would, on this CPU box
    (torch's own bf16 probe answering yes, as it does by default on such a card). Returns the card's properties
    class: set its ``major`` / ``minor`` to make it another card."""
    import torch

    props = type("Props", (), dict(major=major, minor=minor, name=name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: props())
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda d: True, raising=False)
    return props


def op_outputs_mode(inputs):
    """A TorchDispatchMode recording the bytes of the storages ops create (views and in-place or ``out=`` results of
    live storages are not new), each freed when its storage dies: ``.trail``, the live bytes after each allocation
    or free, as a caching allocator would see them. ``inputs``: tensors live before the mode (not counted)."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class OpOutputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = {t.untyped_storage()._cdata for t in inputs}
            self.cur = 0
            self.trail: list[int] = []

        def _freed(self, key: int, size: int) -> None:
            self.live.discard(key)
            self.cur -= size
            self.trail.append(self.cur)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and (st := t.untyped_storage())._cdata not in self.live:
                    self.live.add(st._cdata)
                    self.cur += st.nbytes()
                    self.trail.append(self.cur)
                    weakref.finalize(st, self._freed, st._cdata, st.nbytes())
            return out

    return OpOutputs()


@pytest.fixture
def no_compiler(monkeypatch):
    """A CPU where inductor finds no C++ compiler: the fused loss is fitburst's chunked one (traced as it runs)."""
    from fitburst import hardware

    monkeypatch.setattr(hardware, "cpu_compiler", lambda: False)
