"""The task's `run` command executed locally exactly as a cloud node runs it: same env vars, same file
layout ($HOME/fitburst-job/{spec.yaml,prepared,run}), cwd = the synced workdir. Trains the demo model (CPU, a
few steps) and checks the outputs the launcher pulls back, then logs them as the flow does (path=cloud)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fitburst.cloud import BurstResult
from fitburst.cloud.task import collect_secrets, node_packages
from fitburst.spec import load_pipeline

REPO = Path(__file__).resolve().parents[1]
SECRET = "hf_fitburstNODE_SECRET_987"


def _node_task(spec, spec_file: Path, prepared: Path) -> dict:
    """What build_task puts on the node (envs, mounts, run), read from sky/train.yaml with plain YAML here so
    this test does not need SkyPilot's import-time setup (test_cloud_sky checks the same task through sky)."""
    import yaml

    doc = yaml.safe_load((REPO / "sky" / "train.yaml").read_text())
    envs = {**doc["envs"], "FITBURST_NODE_PACKAGES": node_packages(), "FITBURST_PIPELINE": spec.name,
            "FITBURST_GPU": "A6000", "FITBURST_PROVIDER": "runpod"}
    return {"run": doc["run"], "envs": envs, "secrets": collect_secrets(spec, remote_tracking=False),
            "mounts": {"~/fitburst-job/spec.yaml": spec_file, "~/fitburst-job/prepared": prepared}}


@pytest.mark.timeout(300)
def test_run_command_trains_demo_like_the_node_and_outputs_come_home(tmp_path, monkeypatch, demo_prepared):
    if subprocess.run([sys.executable, "-m", "fitburst.cli", "train", "--help"], cwd=REPO,
                      capture_output=True).returncode != 0:
        pytest.skip("`fitburst train` is not importable yet")
    monkeypatch.setenv("HF_TOKEN", SECRET)
    spec = load_pipeline(REPO / "pipelines.yaml", "demo",
                         {"training.max_steps": 6, "training.log_every": 2, "training.checkpoint_every": 3,
                          "eval.max_batches": 1, "eval.samples": 1, "eval.max_new_tokens": 4})
    prepared = Path(demo_prepared.dir)  # the launcher prepares the data; the node only trains
    launcher = tmp_path / "launcher"
    launcher.mkdir()
    spec_file = launcher / "spec.yaml"
    spec_file.write_text(spec.to_yaml())
    task = _node_task(spec, spec_file, prepared)

    # the node: a fresh HOME holding the file mounts, cwd = the synced workdir
    home = tmp_path / "node-home"
    for dest, src in task["mounts"].items():
        target = home / dest.removeprefix("~/")
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if Path(src).is_dir() else shutil.copy)(src, target)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "FITBURST_"))}
    # the model cache is shared so the demo model is not rebuilt (on a real node it is built on first use)
    env.update(task["envs"], **task["secrets"], HOME=str(home),
               FITBURST_CACHE=os.environ.get("FITBURST_CACHE", str(Path.home() / ".cache" / "fitburst")),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", "-c", task["run"]], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = home / "fitburst-job" / "run"
    node_log = (run_dir / "node.log").read_text()
    assert "fitburst node:" in proc.stdout and "gpu=A6000 provider=runpod" in proc.stdout
    assert SECRET not in proc.stdout + proc.stderr + node_log
    for name in ("adapter", "train_result.json", "eval.json", "metrics.jsonl"):
        assert (run_dir / name).exists(), f"{name} missing from {sorted(p.name for p in run_dir.iterdir())}"
    assert json.loads((run_dir / "train_result.json").read_text())

    # pulled back: log into MLflow as the flow does for a cloud run (tags path=cloud + where it ran)
    pytest.importorskip("mlflow")
    from fitburst import tracking

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    pulled = tmp_path / "pulled"
    shutil.copytree(run_dir, pulled)
    result = BurstResult(ok=True, job_status="SUCCEEDED", cluster="fitburst-demo-abc123", provider="runpod",
                         gpu="A6000", accelerator="RTXA6000", region="CA", hourly_usd=0.49, cost_usd=0.02,
                         run_dir=str(pulled))
    tracker = tracking.Tracker.start(spec, tags=result.tags())
    tracker.log_artifacts(pulled / "adapter", "adapter")
    tracker.end("FINISHED")
    import mlflow

    exp = [spec.tracking.experiment]
    runs = mlflow.search_runs(experiment_names=exp, filter_string="tags.path = 'cloud'")
    assert len(runs) == 1 and runs.iloc[0]["tags.cloud.accelerator"] == "RTXA6000"
    for col in runs.columns:
        assert SECRET not in str(runs.iloc[0][col])
