"""Crash resume with closed records: a real training process SIGKILLed after its first checkpoint; the rerun
resumes it, ends where an uninterrupted run ends, closes the killed attempt's MLflow run and links to it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fitburst.tracking import PREVIOUS_TAG, RESUMED_TAG

CHILD = Path(__file__).with_name("fault_child.py")


def adapter(run_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "adapter" / "adapter_model.safetensors"))


def saved_checkpoint(runs: Path) -> Path | None:
    """A checkpoint the rerun resumes from, in any run folder under ``runs`` (a ``step-N.tmp`` being written, whose
    state.json may already exist, is not one: killed there, the rerun starts afresh)."""
    from fitburst.checkpoints import latest_checkpoint

    return next(filter(None, map(latest_checkpoint, runs.glob("*"))), None)


def test_sigkill_then_rerun_resumes_and_closes_the_killed_run(tmp_path, pipelines_file, root, demo_prepared,
                                                              monkeypatch):
    from mlflow.tracking import MlflowClient

    from fitburst.spec import load_pipeline
    from fitburst.supervisor import train_local_run
    from fitburst.tracking import Tracker

    overrides = {"training.max_steps": 24, "training.checkpoint_every": 6, "training.log_every": 6,
                 "tracking.experiment": "crash-resume", "eval.enabled": False}
    monkeypatch.setenv("FITBURST_RUNS_DIR", str(tmp_path / "runs"))
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    killed = subprocess.Popen([sys.executable, str(CHILD), json.dumps(
        {"pipelines_file": str(pipelines_file), "overrides": overrides, "mlflow": True, "step_sleep": 0.15})],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = json.loads(killed.stdout.readline())["mlflow_run_id"]
    deadline = time.monotonic() + 120
    while not saved_checkpoint(tmp_path / "runs" / "demo"):
        assert killed.poll() is None, killed.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    client = MlflowClient()
    assert client.get_run(first).info.status == "RUNNING"  # nobody closed it: the process died with it

    # the rerun (here, in this process), exactly as the flow's local path does it
    spec = load_pipeline(pipelines_file, "demo", overrides)
    tracker = Tracker.start(spec)
    rerun = train_local_run(spec, demo_prepared, tracker, progress=False)
    tracker.end("FINISHED")
    assert rerun.resumed_from and rerun.resumed_from >= 6 and rerun.steps == 24
    assert client.get_run(first).info.status == "KILLED"
    second = client.get_run(tracker.run_id)
    assert second.info.status == "FINISHED"
    assert second.data.tags[RESUMED_TAG] == first and first in second.data.tags[PREVIOUS_TAG].split(",")
    logged = client.get_metric_history(tracker.run_id, "train_loss")
    assert sorted(m.step for m in logged) == [s for s in (6, 12, 18, 24) if s > rerun.resumed_from]

    monkeypatch.setenv("FITBURST_RUNS_DIR", str(tmp_path / "clean"))
    clean = train_local_run(spec, demo_prepared, None, progress=False)
    assert clean.resumed_from is None and clean.steps == 24
    a, b = adapter(rerun.run_dir), adapter(clean.run_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max().item() == pytest.approx(0, abs=1e-4), k
    assert rerun.final_loss == pytest.approx(clean.final_loss, rel=1e-4)
