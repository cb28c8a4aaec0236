"""The task's commands executed locally exactly as a cloud node runs them: the task built by build_task (same
envs, secrets, file layout $HOME/fitburst-job/{spec.yaml,prepared,run}, cwd = the staged workdir). Trains the demo
model (CPU, a few steps) logging into the launcher's MLflow run as a node with a reachable tracking server does,
then drives tasks.burst.train_cloud in a Prefect flow (SkyPilot faked at the SDK boundary only) both ways: logged
remotely (nothing pulled home) and pulled home. A spot restart (the node killed, a fresh one on the same bucket)
resumes from the checkpoint; the setup's CUDA check refuses a machine where torch sees no GPU (this one, or a GPU
host with the GPU hidden) and passes where it sees one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cloud_sky import FakeSky, _candidates  # seeds SkyPilot's catalog before sky is imported

from fitburst import cloud
from fitburst.spec import load_pipeline

REPO = Path(__file__).resolve().parents[1]
SECRET = "hf_fitburstNODE_SECRET_987"
PLANTED = {"HF_TOKEN": SECRET, "MLFLOW_TRACKING_PASSWORD": "mlflow-NODE-planted-pw",
           "AWS_SECRET_ACCESS_KEY": "aws-NODE-planted-key"}


def _node_env(task, home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "FITBURST_", "HF_"))}
    # the model cache is shared so the demo model is not rebuilt (on a real node it is built on first use)
    env.update(task.envs, **{k: v.get_secret_value() for k, v in task.secrets.items()}, HOME=str(home),
               FITBURST_CACHE=os.environ.get("FITBURST_CACHE", str(Path.home() / ".cache" / "fitburst")),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return env


@pytest.mark.timeout(400)
def test_node_trains_demo_and_train_cloud_records_it_logged_remotely_or_pulled(tmp_path, monkeypatch, demo_prepared,
                                                                              prefect_server):
    cli_help = subprocess.run([sys.executable, "-m", "fitburst.cli", "train", "--help"], cwd=REPO,
                              capture_output=True, text=True)
    assert cli_help.returncode == 0, cli_help.stderr[-3000:]  # a broken CLI is a failure, not a skip
    from mlflow.tracking import MlflowClient
    from prefect import flow

    from fitburst import tracking
    from tasks.burst import train_cloud

    for k, v in PLANTED.items():
        monkeypatch.setenv(k, v)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    # the node can reach this store (the real rule wants an http(s) host; the node here is this machine)
    for mod in (cloud.task, cloud.launch):
        monkeypatch.setattr(mod, "remote_tracking_uri", lambda: uri)
    spec = load_pipeline(REPO / "pipelines.yaml", "demo",
                         {"training.max_steps": 6, "training.log_every": 2, "training.checkpoint_every": 3,
                          "eval.max_batches": 1, "eval.samples": 1, "eval.max_new_tokens": 4,
                          "preflight.device": "M2-Max-32GB"})  # the launcher's device must not reach the node
    prepared = Path(demo_prepared.dir)  # the launcher prepares the data; the node only trains
    remote_run = tracking.Tracker.start(spec)
    task = cloud.build_task(spec, _candidates(), prepared_dir=prepared, mlflow_run_id=remote_run.run_id)
    assert task.envs["FITBURST_MLFLOW_RUN_ID"] == remote_run.run_id

    # the node: a fresh HOME holding the file mounts, cwd = the synced workdir
    home = tmp_path / "node-home"
    for dest, src in task.file_mounts.items():
        target = home / dest.removeprefix("~/")
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if Path(src).is_dir() else shutil.copy)(src, target)
    proc = subprocess.run(["bash", "-c", task.run], cwd=task.workdir, env=_node_env(task, home), capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = home / "fitburst-job" / "run"
    node_log = (run_dir / "node.log").read_text()
    assert "fitburst node:" in proc.stdout and "gpu=A6000 provider=runpod" in proc.stdout
    assert SECRET not in proc.stdout + proc.stderr + node_log
    for name in ("adapter", "train_result.json", "eval.json", "metrics.jsonl"):
        assert (run_dir / name).exists(), f"{name} missing from {sorted(p.name for p in run_dir.iterdir())}"
    node_result = json.loads((run_dir / "train_result.json").read_text())
    import torch  # the node trains on the best device it has (the launcher's M2-Max never reaches it)

    assert node_result["device"] == ("cuda" if torch.cuda.is_available() else "cpu") and node_result["steps"] == 6

    FakeSky(monkeypatch)

    @flow(name="train-cloud-test")
    def drive(tracker, home_dir: Path):
        return train_cloud(spec, demo_prepared, tracker, _candidates(), home_dir)

    client = MlflowClient(uri)
    # 1. the node logged into the run itself: nothing is pulled home, the result comes from the run's artifact
    monkeypatch.setattr(cloud.launch, "_pull_outputs", lambda *a: pytest.fail("pulled although logged remotely"))
    got = drive(remote_run, tmp_path / "home-remote")
    assert got.steps == 6 and got.adapter_dir == f"runs:/{remote_run.run_id}/adapter"
    tags = client.get_run(remote_run.run_id).data.tags
    assert tags["path"] == "cloud" and tags["cloud.accelerator"] == "RTXA6000"

    # 2. the node could not log: its run folder is pulled home and logged here
    for mod in (cloud.task, cloud.launch):
        monkeypatch.setattr(mod, "remote_tracking_uri", lambda: None)
    monkeypatch.setattr(cloud.launch, "_pull_outputs",
                        lambda cluster, dest, log: shutil.copytree(run_dir, dest, dirs_exist_ok=True))
    pulled_run = tracking.Tracker.start(spec)
    got = drive(pulled_run, tmp_path / "home-pulled")
    assert got.steps == 6 and Path(got.adapter_dir, "adapter_config.json").exists()
    run = client.get_run(pulled_run.run_id)
    assert run.data.tags["path"] == "cloud" and run.data.tags["cloud.provider"] == "runpod"
    assert run.data.metrics["train.steps"] == 6
    if (run_dir / "estimate.json").exists():  # `fitburst train --plan` writes it (the node's device)
        assert "memory.measured_over_estimated" in run.data.metrics
    _scan_for_planted_secrets(task, node_log + proc.stdout + proc.stderr, client,
                              [run.info.run_id, remote_run.run_id], tmp_path / "artifacts")


def _scan_for_planted_secrets(task, node_output: str, client, run_ids: list[str], dst: Path) -> None:
    """No planted secret in: the uploaded workdir and mounts, the task YAML, the node's output, MLflow (params,
    tags, every artifact) and the Prefect logs of the flows above."""
    import mlflow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, LogFilter

    values = [v.encode() for v in PLANTED.values()]
    files = [p for p in Path(task.workdir).rglob("*") if p.is_file()]
    for src in task.file_mounts.values():
        files += [Path(src)] if Path(src).is_file() else [p for p in Path(src).rglob("*") if p.is_file()]
    assert files and not [p for p in files if p.name == ".env"]
    texts = {str(p): p.read_bytes() for p in files}
    texts["task yaml"] = cloud.task_yaml(task).encode()
    texts["node output"] = node_output.encode()
    assert "AWS_SECRET_ACCESS_KEY" not in task.secrets  # raw cloud keys never go to the node
    for run_id in run_ids:
        r = client.get_run(run_id)
        texts[f"mlflow {run_id} params/tags"] = json.dumps({**r.data.tags, **r.data.params}).encode()
        root = Path(mlflow.artifacts.download_artifacts(run_id=run_id, dst_path=str(dst / run_id),
                                                        tracking_uri=client.tracking_uri))
        texts.update({str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()})
    with get_client(sync_client=True) as c:
        runs = c.read_flow_runs(flow_filter=FlowFilter(name={"any_": ["train-cloud-test"]}))
        logs = c.read_logs(log_filter=LogFilter(flow_run_id={"any_": [fr.id for fr in runs]}), limit=200)
    assert runs and logs
    texts["prefect logs"] = "\n".join(entry.message for entry in logs).encode()
    leaks = [where for where, data in texts.items() if any(v in data for v in values)]
    assert not leaks, leaks


def _node_home(task, home: Path, bucket: Path | None = None) -> Path:
    """A fresh node: the file mounts copied into HOME; a bucket mount is the same local folder on every node."""
    for dest, src in task.file_mounts.items():
        target = home / dest.removeprefix("~/")
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if Path(src).is_dir() else shutil.copy)(src, target)
    for dest in task.storage_mounts:
        bucket.mkdir(parents=True, exist_ok=True)
        (home / dest.removeprefix("~/")).symlink_to(bucket, target_is_directory=True)
    return home


def _steps(ckpts: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in ckpts.glob("step-*") if (p / "state.json").exists())


@pytest.mark.timeout(400)
def test_a_spot_restart_resumes_from_the_checkpoint_in_the_bucket(tmp_path, monkeypatch, demo_prepared):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = load_pipeline(REPO / "pipelines.yaml", "demo",
                         {"training.max_steps": 100, "training.checkpoint_every": 5, "training.log_every": 50,
                          "eval.enabled": False, "burst.spot": True, "burst.bucket": "s3://fitburst-test"})
    task = cloud.build_task(spec, _candidates(), prepared_dir=Path(demo_prepared.dir), run_name="run1")
    assert task.storage_mounts["~/fitburst-job/run"].source == "s3://fitburst-test/demo/run1"
    bucket = tmp_path / "bucket" / "demo" / "run1"

    _run_node(task, tmp_path / "node1", bucket, preempt=True)  # the node and its disk are gone, the bucket stays
    kept = _steps(bucket / "checkpoints")
    assert kept and kept[-1] < 100 and not (bucket / "train_result.json").exists(), kept

    second = subprocess.run(["bash", "-c", task.run], cwd=task.workdir, capture_output=True, text=True, timeout=280,
                            env=_node_env(task, _node_home(task, tmp_path / "node2", bucket)))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    result = json.loads((bucket / "train_result.json").read_text())
    assert result["resumed_from"] == kept[-1] and result["steps"] == 100


def _run_node(task, home: Path, bucket: Path | None = None, *, preempt: bool = False) -> int:
    """The task's run command on a fresh node; ``preempt``: SIGKILL it once its first checkpoint is complete."""
    run = bucket or home / "fitburst-job" / "run"
    proc = subprocess.Popen(["bash", "-c", task.run], cwd=task.workdir, start_new_session=True,
                            env=_node_env(task, _node_home(task, home, bucket)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    if preempt:
        known = set(_steps(run / "checkpoints"))  # a resumed node starts with some
        deadline = time.monotonic() + 200
        while (not set(_steps(run / "checkpoints")) - known and proc.poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(timeout=280)


@pytest.mark.timeout(400)
def test_a_failed_job_comes_home_before_teardown_and_the_rerun_resumes_on_a_new_node(tmp_path, monkeypatch,
                                                                                      demo_prepared):
    from sky.skylet import job_lib

    from fitburst.cloud import BurstFailed, burst_train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = load_pipeline(REPO / "pipelines.yaml", "demo",
                         {"training.max_steps": 100, "training.checkpoint_every": 5, "training.log_every": 50,
                          "eval.enabled": False})

    class NodeSky(FakeSky):
        """SkyPilot at the SDK boundary; the job is the task's real command on a fresh node (a local HOME)."""

        def __init__(self, mp, preempt: bool):
            super().__init__(mp, status=job_lib.JobStatus.FAILED if preempt else job_lib.JobStatus.SUCCEEDED)
            self.preempt, self.home = preempt, tmp_path / f"node-{'failing' if preempt else 'rerun'}"

        def tail_logs(self, cluster_name, job_id, follow=True, output_stream=None, **kw):
            self.calls.append(("tail", cluster_name, job_id))
            code = _run_node(self.task, self.home, preempt=self.preempt)
            return 100 if code else 0

        def pull(self, cluster, dest, log):  # the rsync of ~/fitburst-job/run
            self.calls.append(("pull", cluster))
            shutil.copytree(self.home / "fitburst-job" / "run", dest, dirs_exist_ok=True)

    run_dir = tmp_path / "local-run"
    failing = NodeSky(monkeypatch, preempt=True)
    with pytest.raises(BurstFailed, match="ended FAILED"):
        burst_train(spec, demo_prepared.dir, run_dir, _candidates(), log=lambda s: None, pull=failing.pull)
    assert failing.names().index("pull") < failing.names().index("down")
    kept = _steps(run_dir / "checkpoints")
    assert kept and not (run_dir / "train_result.json").exists()

    rerun = NodeSky(monkeypatch, preempt=False)
    res = burst_train(spec, demo_prepared.dir, run_dir, _candidates(), log=lambda s: None, pull=rerun.pull)
    assert res.ok and rerun.task.file_mounts["~/fitburst-job/run/checkpoints"] == str(run_dir / "checkpoints")
    result = json.loads((run_dir / "train_result.json").read_text())
    assert result["resumed_from"] == kept[-1] and result["steps"] == 100


def test_node_setup_fails_fast_when_cuda_is_not_usable(demo_prepared):
    spec = load_pipeline(REPO / "pipelines.yaml", "demo")
    task = cloud.build_task(spec, _candidates(), prepared_dir=Path(demo_prepared.dir))
    setup = [line.strip() for line in task.setup.strip().splitlines()]
    check = 'PYTHONPATH="$PWD" python -m fitburst.cloud.node check-cuda'
    assert setup[0] == "set -euo pipefail" and setup[-1] == check  # a failing check fails the setup
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    import torch

    if torch.cuda.is_available():  # a GPU host: the check passes, and refuses once the GPU is hidden from torch
        ok = subprocess.run(["bash", "-c", check], cwd=task.workdir, capture_output=True, text=True, timeout=120,
                            env=env)
        assert ok.returncode == 0 and "CUDA ok" in ok.stdout, ok.stdout + ok.stderr
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(["bash", "-c", check], cwd=task.workdir, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "CUDA is not usable" in proc.stderr
    if torch.version.cuda is None:  # a CPU-only build of torch
        assert "would train on CPU at GPU prices" in proc.stderr
    else:
        assert "sees no usable GPU" in proc.stderr
