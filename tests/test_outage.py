"""MLflow outages: a real `mlflow server` on loopback stopped during training and started again; training never
waits for it, every metric reaches it afterwards, and closing a run never hides the error that ended it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import fitburst.recipe as train_mod  # the loop looks its step up in the recipe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(db: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    return subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{db}", "--default-artifact-root", str(db.parent / "a"),
                             "--workers", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def healthy(port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200
    except OSError:
        return False


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not healthy(port):
        assert proc.poll() is None, "mlflow server exited"
        assert time.monotonic() < deadline, "mlflow server did not start"
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def tries_to_reach(port: int, monkeypatch) -> list[str]:
    """The names of the threads that open a connection to ``port`` from now on, in order (urllib3's, under
    MLflow's client)."""
    from urllib3.util import connection

    tries: list[str] = []
    real = connection.create_connection

    def create_connection(address, *a, **kw):
        if address[1] == port:
            tries.append(threading.current_thread().name)
        return real(address, *a, **kw)

    monkeypatch.setattr(connection, "create_connection", create_connection)
    return tries


@pytest.fixture
def fast_failing_http(monkeypatch):
    """The client fails fast while the server is down (the outbox does the retrying)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")


def test_server_stopped_mid_training_gets_every_metric_after_restart(tmp_path, demo_spec, demo_prepared,
                                                                     monkeypatch, fast_failing_http):
    from mlflow.tracking import MlflowClient

    from fitburst.supervisor import train_local_run
    from fitburst.tracking import Tracker

    port, db = free_port(), tmp_path / "mlflow.db"
    uri = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("FITBURST_RUNS_DIR", str(tmp_path / "runs"))
    server = start_server(db, port)
    try:
        wait_healthy(port, server)
        spec = demo_spec.with_overrides({"training.max_steps": 30, "training.log_every": 1, "eval.enabled": False})
        tries = tries_to_reach(port, monkeypatch)
        tracker = Tracker.start(spec)
        real, seen = train_mod.optimizer_step, {"n": 0, "down_at": None}

        def step(*a, **kw):
            seen["n"] += 1
            if seen["n"] == 5:  # the server goes away after 4 steps were logged
                stop(server)
                seen["down_at"] = len(tries)
            out = real(*a, **kw)
            seen["trained_at"] = len(tries)
            return out

        monkeypatch.setattr(train_mod, "optimizer_step", step)
        result = train_local_run(spec, demo_prepared, tracker, device="cpu", progress=False)
        assert result.steps == 30 and not healthy(port)  # finished with the server still down
        # no waiting on the dead server: while the steps ran, the training thread never tried to reach it (the
        # outbox's own thread did); recording the result afterwards tried it at most once and went on (the
        # client fails fast; the outbox replays)
        main = threading.main_thread().name
        assert main in tries[:seen["down_at"]]  # starting the run did, so a try of the training thread is seen
        assert main not in tries[seen["down_at"]:seen["trained_at"]]
        assert tries[seen["trained_at"]:].count(main) <= 1
        outbox = tracker.outbox
        assert outbox.pending() > 0 and outbox.failures > 0

        server = start_server(db, port)
        wait_healthy(port, server)
        tracker.end("FINISHED")  # flushes the outbox first
        run = MlflowClient(uri).get_run(tracker.run_id)
        assert run.info.status == "FINISHED"
        assert [m.step for m in MlflowClient(uri).get_metric_history(tracker.run_id, "train_loss")] == list(
            range(1, 31))
        local = [float(x.split('"train_loss": ')[1].split(",")[0])
                 for x in Path(result.run_dir, "metrics.jsonl").read_text().splitlines()]
        remote = [m.value for m in sorted(MlflowClient(uri).get_metric_history(tracker.run_id, "train_loss"),
                                          key=lambda m: m.step)]
        assert remote == pytest.approx(local)
    finally:
        stop(server)


def test_closing_a_run_never_hides_the_original_error(tmp_path, demo_spec, fast_failing_http, caplog):
    from fitburst.tracking import Tracker

    tracker = Tracker.start(demo_spec)  # the session's sqlite store
    tracker.uri = f"http://127.0.0.1:{free_port()}"  # ...which then becomes unreachable
    from mlflow.tracking import MlflowClient

    tracker.client = MlflowClient(tracking_uri=tracker.uri)
    outbox = tracker.use_outbox(tmp_path)
    tracker.log_metrics({"train_loss": 1.0}, step=1)
    with pytest.raises(RuntimeError, match="the real failure"):
        try:
            raise RuntimeError("the real failure")
        finally:
            tracker.end("FAILED", flush_timeout=1)
    assert "could not close MLflow run" in caplog.text
    # the close waits in the outbox with the metric, for a replay once the server answers
    assert '"end": "FAILED"' in outbox.path.read_text() and outbox.pending() > 0
