"""fitburst.cloud against SkyPilot itself: task validation, the optimizer and a dry-run launch on a seeded
catalog, and the launch lifecycle at the SDK boundary (the only fakes: no cloud is reachable from here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FIXTURES = HERE / "fixtures" / "sky"
SECRET = "hf_fitburstTEST_SECRET_0123456789"

# SkyPilot fixes its catalog directory when first imported: seed one for this process (SKY_RUNTIME_DIR, not
# HOME, so nothing else in the test session moves) before anything imports sky.
if "sky" not in sys.modules:
    _runtime = tempfile.mkdtemp(prefix="fitburst-sky-runtime-")
    shutil.copytree(FIXTURES / "catalogs", Path(_runtime) / ".sky" / "catalogs")
    os.environ["SKY_RUNTIME_DIR"] = _runtime
os.environ["SKYPILOT_DISABLE_USAGE_COLLECTION"] = "1"

import sky  # noqa: E402
from sky import exceptions as sx  # noqa: E402
from sky.skylet import job_lib  # noqa: E402

from fitburst import cloud  # noqa: E402
from fitburst.cloud import BurstFailed, build_task, burst_train, dry_run_report, task_yaml  # noqa: E402
from fitburst.cloud.rank import Candidate  # noqa: E402
from fitburst.spec import load_pipeline  # noqa: E402


def offline(request: dict, timeout: int = 120) -> dict:
    """Run tests/fixtures/sky/offline.py (a fresh process with a seeded HOME) and return its JSON result."""
    env = {k: v for k, v in os.environ.items() if k != "SKY_RUNTIME_DIR"}
    cmd = [sys.executable, str(FIXTURES / "offline.py"), json.dumps(request)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.split("@@RESULT@@")[-1])


# --- SkyPilot's optimizer and dry run on a seeded catalog ---------------------------------------------------

def test_optimizer_picks_runpod_a6000_for_7b_lora_and_dry_run_launch_completes():
    out = offline({"pipeline": "qwen7b-lora", "settings": {"micro_batch_size": 1, "gradient_checkpointing": True},
                   "tokens": 3_000_000, "dryrun": True,
                   "overrides": {"burst.gpus": ["A6000", "T4"], "preflight.allow.quantize": False,
                                 "burst.providers": ["runpod", "lambda", "azure"]}})
    assert out["best"]["cloud"] == "RunPod" and out["best"]["accelerators"] == {"RTXA6000": 1}
    assert out["best"]["hourly_usd"] == pytest.approx(0.49)
    cands = {(c["gpu"], c["provider"]): c for c in out["candidates"]}
    assert cands[("A6000", "runpod")]["price_source"] == "skypilot-catalog"  # priced from SkyPilot's catalog
    assert not cands[("T4", "azure")]["fits"]
    assert "SkyPilot optimizer pick: RunPod {'RTXA6000': 1}" in out["report"]


def test_optimizer_picks_azure_t4_for_a_short_small_qlora():
    out = offline({"pipeline": "qwen1.5b-qlora", "tokens": 200_000,
                   "overrides": {"burst.gpus": ["T4", "A6000"], "burst.providers": ["azure", "lambda"]}})
    assert out["best"]["cloud"] == "Azure" and out["best"]["accelerators"] == {"T4": 1}
    assert out["candidates"][0]["settings"]["precision"] == "fp16"


# --- the generated task --------------------------------------------------------------------------------

def _candidates() -> list[Candidate]:
    return [Candidate("A6000", "runpod", "RTXA6000", 48, True, 0.49, 1.0, 0.49, region="CA"),
            Candidate("A6000", "lambda", "A6000", 48, True, 0.80, 1.0, 0.80, region="us-east-1"),
            Candidate("T4", "azure", "T4", 16, False, 0.53, reason="does not fit in T4")]


@pytest.fixture
def demo(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", SECRET + "pw")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = load_pipeline(REPO / "pipelines.yaml", "qwen7b-lora")
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "prepared.json").write_text("{}")
    return spec, prepared


def test_generated_task_passes_skypilot_validation_and_round_trips(demo):
    spec, prepared = demo
    task = build_task(spec, _candidates(), prepared_dir=prepared)
    assert isinstance(task.resources, list)  # ordered: cheapest total first, SkyPilot fails over in order
    assert [(str(r.cloud), r.accelerators) for r in task.resources] == [
        ("RunPod", {"RTXA6000": 1}), ("Lambda", {"A6000": 1})]
    assert all(r.autostop_config.down and r.autostop_config.idle_minutes == 30 for r in task.resources)
    assert task.file_mounts["~/fitburst-job/prepared"] == str(prepared)
    spec_file = Path(task.file_mounts["~/fitburst-job/spec.yaml"])
    assert "qwen7b-lora" in spec_file.read_text() and SECRET not in spec_file.read_text()
    assert task.secrets["HF_TOKEN"].get_secret_value() == SECRET
    assert "python -m fitburst.cli train --spec" in task.run and "--plan --eval" in task.run
    assert task.num_nodes == 1
    # the workdir is a staged copy of the fitburst package only
    assert sorted(p.name for p in Path(task.workdir).iterdir()) == ["fitburst"]
    assert (Path(task.workdir) / "fitburst" / "cloud" / "train.yaml").exists()
    # SkyPilot's own schema validation, both ways
    text = task_yaml(task)
    again = sky.Task.from_yaml_str(text)
    assert [(str(r.cloud), r.accelerators) for r in again.resources] == [
        ("RunPod", {"RTXA6000": 1}), ("Lambda", {"A6000": 1})]
    assert again.envs["FITBURST_JOB_DIR"] == "fitburst-job" and again.run == task.run


def test_a_multi_gpu_multi_node_task_passes_skypilot_validation(demo):
    """The plan's GPU count and node count reach SkyPilot: <GPU>:N per node, num_nodes, and a node spec that
    shards (the run block itself runs in tests/test_distributed.py)."""
    spec, prepared = demo
    task = build_task(spec, _candidates(), prepared_dir=prepared, gpus_per_node=4, nodes=2)
    again = sky.Task.from_yaml_str(task_yaml(task))
    assert again.num_nodes == 2
    assert [(str(r.cloud), r.accelerators) for r in again.resources] == [
        ("RunPod", {"RTXA6000": 4}), ("Lambda", {"A6000": 4})]
    assert "--nproc-per-node \"${SKYPILOT_NUM_GPUS_PER_NODE:-1}\"" in again.run and "SKYPILOT_NODE_IPS" in again.run
    node_spec = Path(task.file_mounts["~/fitburst-job/spec.yaml"]).read_text()
    assert "distributed: fsdp" in node_spec
    one = build_task(spec, _candidates(), prepared_dir=prepared)
    assert "distributed: auto" in Path(one.file_mounts["~/fitburst-job/spec.yaml"]).read_text()
    with pytest.raises(ValueError, match="gpus_per_node and nodes"):
        build_task(spec, _candidates(), prepared_dir=prepared, nodes=0)


def test_a_task_asks_only_for_candidates_planned_over_its_number_of_nodes(demo):
    """SkyPilot's task has one num_nodes: a 4-GPU candidate on one node is not asked for as 2 nodes of 4 (8 GPUs,
    a plan nobody made, at twice the price) behind a best candidate of 2 nodes."""
    spec, prepared = demo
    two_nodes = Candidate("H100", "lambda", "H100", 80, True, 2 * 8 * 2.99, 1.0, 47.84, gpus_per_node=8, nodes=2)
    one_node = Candidate("A6000", "runpod", "RTXA6000", 48, True, 4 * 0.49, 1.5, 2.94, gpus_per_node=4)
    task = build_task(spec, [two_nodes, one_node], prepared_dir=prepared, gpus_per_node=8, nodes=2)
    again = sky.Task.from_yaml_str(task_yaml(task))
    assert again.num_nodes == 2
    assert [(str(r.cloud), r.accelerators) for r in again.resources] == [("Lambda", {"H100": 8})]
    alone = build_task(spec, [one_node], prepared_dir=prepared, gpus_per_node=4)
    assert [r.accelerators for r in alone.resources] == [{"RTXA6000": 4}]


def test_every_node_of_a_multi_node_cluster_is_pulled_home():
    from fitburst.cloud.launch import every_node

    pulled: list[str] = []
    every_node(lambda host, run_dir, log: pulled.append(host), 3)("fb-c", Path("run"), print)
    assert pulled == ["fb-c", "fb-c-worker1", "fb-c-worker2"]  # the ssh names SkyPilot writes for its nodes
    pulled.clear()
    every_node(lambda host, run_dir, log: pulled.append(host), 1)("fb-c", Path("run"), print)
    assert pulled == ["fb-c"]


def test_no_secret_value_in_task_yaml_or_dry_run_report(demo):
    spec, prepared = demo
    task = build_task(spec, _candidates(), prepared_dir=prepared)
    report = dry_run_report(spec, _candidates(), task)
    for text in (task_yaml(task), report, cloud.TASK_YAML.read_text()):
        assert SECRET not in text
    assert "HF_TOKEN: <redacted>" in report


def test_spec_validation_errors_surface_from_skypilot_for_a_broken_task_yaml(tmp_path, demo):
    spec, prepared = demo
    bad = tmp_path / "train.yaml"
    bad.write_text(cloud.TASK_YAML.read_text().replace("run: |", "runn: |"))
    with pytest.raises(ValueError, match="run"):
        build_task(spec, _candidates(), prepared_dir=prepared, task_yaml=bad)


# --- lifecycle at the SDK boundary --------------------------------------------------------------------------

class FakeSky:
    """Records SkyPilot SDK calls; each behaviour is set per test."""

    def __init__(self, monkeypatch, *, launch_error=None, log_code=0, status=job_lib.JobStatus.SUCCEEDED,
                 tail_error=None, down_error=None, clusters=None):
        self.calls: list[tuple] = []
        self.launch_error, self.log_code, self.job_final = launch_error, log_code, status
        self.tail_error, self.down_error = tail_error, down_error
        self.clusters = clusters or {}  # name -> ClusterStatus name, for sky.status
        handle = type("Handle", (), {"launched_resources": sky.Resources(infra="runpod/CA",
                                                                          accelerators={"RTXA6000": 1})})()
        self.handle = handle
        for name in ("launch", "stream_and_get", "tail_logs", "job_status", "down", "api_cancel", "status", "queue",
                     "start"):
            monkeypatch.setattr(sky, name, getattr(self, name))

    def launch(self, task, cluster_name=None, **kw):
        self.calls.append(("launch", cluster_name, kw))
        self.task = task
        return "req-launch"

    def stream_and_get(self, request_id=None, output_stream=None, **kw):
        self.calls.append(("get", request_id))
        if request_id == "req-launch":
            if output_stream is not None:
                output_stream.write("provisioning RunPod RTXA6000 ...\n")
            if self.launch_error:
                raise self.launch_error
            return 1, self.handle
        if request_id == "req-status":
            return {1: self.job_final}
        if isinstance(request_id, tuple) and request_id[0] == "req-cluster-status":
            return [{"name": n, "status": sky.ClusterStatus[self.clusters[n]]} for n in request_id[1]
                    if n in self.clusters]
        if isinstance(request_id, tuple) and request_id[0] == "req-queue":
            return [{"job_id": 1, "status": self.job_final}] if request_id[1] in self.clusters else []
        if request_id == "req-down" and self.down_error:
            raise self.down_error
        return None

    def tail_logs(self, cluster_name, job_id, follow=True, output_stream=None, **kw):
        self.calls.append(("tail", cluster_name, job_id))
        output_stream.write("step 10 loss 2.1\nstep 20 loss 1.7")
        if self.tail_error:
            raise self.tail_error
        return self.log_code

    def job_status(self, cluster_name, job_ids=None):
        self.calls.append(("job_status", cluster_name, job_ids))
        return "req-status"

    def down(self, cluster_name, **kw):
        self.calls.append(("down", cluster_name))
        return "req-down"

    def api_cancel(self, request_ids=None, **kw):
        self.calls.append(("cancel", request_ids))

    def status(self, cluster_names=None, **kw):
        self.calls.append(("status", cluster_names))
        return ("req-cluster-status", tuple(cluster_names or ()))

    def queue(self, cluster_name, **kw):
        self.calls.append(("queue", cluster_name))
        return ("req-queue", cluster_name)

    def start(self, cluster_name, **kw):
        self.calls.append(("start", cluster_name))
        self.clusters[cluster_name] = "UP"
        return "req-start"

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


def _pull(cluster, run_dir, log):
    (run_dir / "adapter").mkdir(parents=True, exist_ok=True)
    (run_dir / "train_result.json").write_text("{}")


def test_success_streams_logs_pulls_outputs_and_tears_down(demo, tmp_path, monkeypatch):
    spec, prepared = demo
    fake, lines = FakeSky(monkeypatch), []
    res = burst_train(spec, prepared, tmp_path / "run", _candidates(), log=lines.append, pull=_pull)
    assert res.ok and res.job_status == "SUCCEEDED" and res.torn_down
    assert fake.names()[-2:] == ["down", "get"] and fake.calls[0][2]["down"] is True
    assert fake.calls[0][2]["idle_minutes_to_autostop"] == 30
    assert "step 20 loss 1.7" in lines  # the last partial line is flushed too
    assert (tmp_path / "run" / "train_result.json").exists()
    assert res.provider == "runpod" and res.accelerator == "RTXA6000" and res.region == "CA"
    tags = res.tags()
    assert tags["path"] == "cloud" and tags["cloud.gpu"] == "A6000" and "cloud.cost_usd" in tags
    assert not any(SECRET in line for line in lines)


@pytest.mark.parametrize("code, status, expected", [
    (100, job_lib.JobStatus.FAILED, "FAILED"),
    (100, job_lib.JobStatus.FAILED_SETUP, "FAILED_SETUP"),
])
def test_job_failure_tears_down_and_raises(demo, tmp_path, monkeypatch, code, status, expected):
    spec, prepared = demo
    fake = FakeSky(monkeypatch, log_code=code, status=status)
    with pytest.raises(BurstFailed) as e:
        burst_train(spec, prepared, tmp_path / "run", _candidates(), log=lambda s: None, pull=_pull)
    assert e.value.result.job_status == expected and e.value.result.torn_down
    assert ("down", e.value.result.cluster) in fake.calls
    if expected == "FAILED_SETUP":
        assert "setup" in str(e.value)


@pytest.mark.parametrize("error, expected", [
    (sx.ResourcesUnavailableError("Failed to provision all possible launchable resources."),
     "no GPU available in any region for: A6000 on runpod (RTXA6000), A6000 on lambda (A6000)"),
    (sx.NoCloudAccessError("No cloud is enabled."), "`sky check runpod`"),
    (RuntimeError("InsufficientQuota: GPU quota exceeded"), "quota"),
])
def test_launch_errors_are_explained_and_tear_down(demo, tmp_path, monkeypatch, error, expected):
    spec, prepared = demo
    fake = FakeSky(monkeypatch, launch_error=error)
    with pytest.raises(BurstFailed) as e:
        burst_train(spec, prepared, tmp_path / "run", _candidates(), log=lambda s: None)
    assert expected in str(e.value)
    assert "down" in fake.names() and e.value.result.job_status == "LAUNCH_FAILED"


def test_ctrl_c_cancels_the_request_and_tears_down(demo, tmp_path, monkeypatch):
    spec, prepared = demo
    fake = FakeSky(monkeypatch, tail_error=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        burst_train(spec, prepared, tmp_path / "run", _candidates(), log=lambda s: None)
    assert ("cancel", "req-launch") in fake.calls and "down" in fake.names()


def test_an_error_in_our_code_still_tears_down(demo, tmp_path, monkeypatch):
    spec, prepared = demo

    def broken_pull(cluster, run_dir, log):
        raise OSError("rsync: connection closed")

    fake = FakeSky(monkeypatch)
    with pytest.raises(BurstFailed, match="pulling outputs .* failed"):
        burst_train(spec, prepared, tmp_path / "run", _candidates(), log=lambda s: None, pull=broken_pull)
    assert "down" in fake.names()


def test_failed_teardown_is_reported_not_hidden(demo, tmp_path, monkeypatch):
    spec, prepared = demo
    lines = []
    FakeSky(monkeypatch, log_code=100, status=job_lib.JobStatus.FAILED, down_error=RuntimeError("api down"))
    with pytest.raises(BurstFailed) as e:
        burst_train(spec, prepared, tmp_path / "run", _candidates(), log=lines.append)
    assert not e.value.result.torn_down
    assert any("may still be running: run `sky down" in line for line in lines)


def test_dry_run_launches_nothing(demo, tmp_path, monkeypatch):
    spec, prepared = demo
    fake, lines = FakeSky(monkeypatch), []
    res = burst_train(spec, prepared, tmp_path / "run", _candidates(), dry_run=True, log=lines.append)
    assert res.ok and res.job_status == "DRY_RUN" and fake.calls == []
    assert "chosen: A6000 on runpod as RTXA6000, $0.49/h" in res.report and "ordered:" in res.report
    assert SECRET not in "\n".join(lines)


def test_spot_uses_a_managed_job_and_cancels_it_on_interrupt(demo, tmp_path, monkeypatch):
    spec, prepared = demo
    with pytest.raises(ValueError, match="set burst.bucket"):  # checkpoints would be lost with the node
        spec.with_overrides({"burst.spot": True})

    spec = _spot(spec)
    synced = []
    monkeypatch.setattr(cloud.launch, "_sync_bucket", lambda url, run_dir, log: synced.append(url))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.com")
    calls = []
    monkeypatch.setattr(sky.jobs, "launch", lambda task, **kw: calls.append(("launch", task)) or "j")
    monkeypatch.setattr(sky, "stream_and_get", lambda rid=None, **kw: ([7], None) if rid == "j" else None)

    def tail(**kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(sky.jobs, "tail_logs", tail)
    monkeypatch.setattr(sky.jobs, "cancel", lambda job_ids=None, **kw: calls.append(("cancel", job_ids)))
    with pytest.raises(KeyboardInterrupt):
        burst_train(spec, prepared, tmp_path / "run", _candidates(), log=print, mlflow_run_id="abc123")
    task = calls[0][1]
    assert task.envs["FITBURST_MLFLOW_RUN_ID"] == "abc123"
    assert task.secrets["MLFLOW_TRACKING_URI"].get_secret_value() == "https://mlflow.example.com"
    assert all(r.use_spot and r.job_recovery["strategy"] == "FAILOVER" for r in task.resources)
    assert ("cancel", [7]) in calls
    # RUN_DIR is the bucket, mounted so that the atomic checkpoint rename works; what it held comes home
    mount = task.storage_mounts["~/fitburst-job/run"]
    assert mount.mode == sky.StorageMode.MOUNT_CACHED and mount.source == "s3://fitburst-test/qwen7b-lora/run"
    assert synced == [mount.source]
    rec = cloud.launch.read_record(tmp_path / "run")
    assert rec["job_id"] == 7 and rec["managed"] and rec["state"] == "torn_down" and rec["bucket"] == mount.source
    assert rec["cluster"].startswith("fitburst-qwen7b-lora-")


def test_local_checkpoints_go_into_the_bucket_before_the_node_starts(demo, tmp_path, monkeypatch):
    """With burst.bucket the node's RUN_DIR is the bucket: checkpoints made here (a local run that ran out of
    memory) are synced into it before the launch, so the node resumes them instead of starting over."""
    spec, prepared = _spot(demo[0]), demo[1]
    run = tmp_path / "run"
    (run / "checkpoints" / "step-6").mkdir(parents=True)
    (run / "checkpoints" / "step-6" / "state.json").write_text("{}")
    calls = tmp_path / "aws-calls"
    aws = tmp_path / "bin" / "aws"
    aws.parent.mkdir()
    aws.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    aws.chmod(0o755)
    monkeypatch.setenv("PATH", f"{aws.parent}{os.pathsep}{os.environ['PATH']}")
    order = []
    monkeypatch.setattr(sky.jobs, "launch", lambda task, **kw: order.append(calls.read_text()) or "j")
    monkeypatch.setattr(sky, "stream_and_get", lambda rid=None, **kw: ([7], None))
    monkeypatch.setattr(sky.jobs, "tail_logs", lambda **kw: 0)
    res = burst_train(spec, prepared, run, _candidates(), log=lambda s: None)
    assert res.ok
    url = "s3://fitburst-test/qwen7b-lora/run"
    assert order == [f"s3 sync {run / 'checkpoints'} {url}/checkpoints\n"]  # seeded before the launch
    assert calls.read_text().splitlines()[-1] == f"s3 sync {url} {run}"  # and the outputs pulled home after


# --- review fixes: the node's spec, interrupts, redaction, the flow's burst branch -----------------------------

def test_node_spec_trains_for_its_own_device_and_holds_no_tracking_uri(demo, tmp_path, monkeypatch):
    spec, prepared = demo
    uri = "https://alice:pw-in-uri-123@mlflow.example.com"
    spec = spec.model_copy(update={"preflight": spec.preflight.model_copy(update={"device": "M2-Max-32GB"}),
                                   "tracking": spec.tracking.model_copy(update={"uri": uri})})
    task = build_task(spec, _candidates(), prepared_dir=prepared)
    node = load_pipeline_yaml(Path(task.file_mounts["~/fitburst-job/spec.yaml"]))
    assert node["preflight"]["device"] == "auto" and node["tracking"]["uri"] is None
    assert "pw-in-uri-123" not in Path(task.file_mounts["~/fitburst-job/spec.yaml"]).read_text()

    # burst_train writes it to a temp file that is gone after the launch, dry runs included
    written = []
    real = cloud.launch.write_node_spec
    monkeypatch.setattr(cloud.launch, "write_node_spec",
                        lambda s, d, **kw: written.append(real(s, d, **kw)) or written[-1])
    burst_train(spec, prepared, tmp_path / "run", _candidates(), dry_run=True, log=lambda s: None)
    FakeSky(monkeypatch)
    burst_train(spec, prepared, tmp_path / "run", _candidates(), log=lambda s: None, pull=_pull)
    assert len(written) == 2 and not any(p.exists() for p in written)


def load_pipeline_yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def _spot(spec):
    return spec.model_copy(update={"burst": spec.burst.model_copy(update={"spot": True,
                                                                          "bucket": "s3://fitburst-test"})})


@pytest.mark.parametrize("cancel_works", [True, False])
def test_interrupt_during_managed_job_launch_cancels_the_request_and_the_job(demo, tmp_path, monkeypatch,
                                                                              cancel_works):
    spec, prepared = demo
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.com")
    calls, lines = [], []
    monkeypatch.setattr(sky.jobs, "launch", lambda task, **kw: "req-jobs-launch")

    def get(rid=None, **kw):
        if rid == "req-jobs-launch":
            raise KeyboardInterrupt  # Ctrl-C while SkyPilot is still provisioning: no job id yet
        if rid == "req-jobs-cancel" and not cancel_works:
            raise RuntimeError("API server unreachable")

    def cancel(name=None, job_ids=None, **kw):
        calls.append(("jobs.cancel", name, job_ids))
        return "req-jobs-cancel"

    monkeypatch.setattr(sky, "stream_and_get", get)
    monkeypatch.setattr(sky, "api_cancel", lambda rid, **kw: calls.append(("api_cancel", rid)))
    monkeypatch.setattr(sky.jobs, "cancel", cancel)
    with pytest.raises(KeyboardInterrupt):
        burst_train(_spot(spec), prepared, tmp_path / "run", _candidates(), log=lines.append, mlflow_run_id="r1")
    assert calls[0] == ("api_cancel", "req-jobs-launch")
    assert calls[1][0] == "jobs.cancel" and calls[1][1].startswith("fitburst-qwen7b-lora-") and calls[1][2] is None
    warned = any("cancelling managed job" in line and "failed" in line for line in lines)
    assert warned is not cancel_works


def test_managed_job_error_reports_torn_down_from_the_cancel(demo, tmp_path, monkeypatch):
    spec, prepared = demo
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.com")
    monkeypatch.setattr(sky.jobs, "launch", lambda task, **kw: "req-jobs-launch")

    def get(rid=None, **kw):
        raise RuntimeError("controller unreachable")

    monkeypatch.setattr(sky, "stream_and_get", get)
    monkeypatch.setattr(sky, "api_cancel", lambda rid, **kw: None)
    monkeypatch.setattr(sky.jobs, "cancel", lambda **kw: "req-jobs-cancel")
    with pytest.raises(BurstFailed) as e:
        burst_train(_spot(spec), prepared, tmp_path / "run", _candidates(), log=lambda s: None, mlflow_run_id="r1")
    assert e.value.result.job_status == "ERROR" and not e.value.result.torn_down  # the cancel itself failed


def test_prefect_termination_is_cancelled_torn_down_and_re_raised_unchanged(demo, tmp_path, monkeypatch):
    from prefect.exceptions import TerminationSignal

    spec, prepared = demo
    fake = FakeSky(monkeypatch, tail_error=TerminationSignal(15))
    with pytest.raises(TerminationSignal):
        burst_train(spec, prepared, tmp_path / "run", _candidates(), log=lambda s: None)
    assert ("cancel", "req-launch") in fake.calls and "down" in fake.names()

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.com")
    calls = []
    monkeypatch.setattr(sky.jobs, "launch", lambda task, **kw: "j")
    monkeypatch.setattr(sky, "stream_and_get", lambda rid=None, **kw: ([7], None) if rid == "j" else None)
    monkeypatch.setattr(sky.jobs, "tail_logs", lambda **kw: (_ for _ in ()).throw(TerminationSignal(15)))
    monkeypatch.setattr(sky.jobs, "cancel", lambda job_ids=None, **kw: calls.append(job_ids))
    with pytest.raises(TerminationSignal):  # not wrapped into BurstFailed (an ordinary Exception)
        burst_train(_spot(spec), prepared, tmp_path / "run", _candidates(), log=lambda s: None, mlflow_run_id="r")
    assert calls == [[7]]


@pytest.mark.parametrize("spot", [False, True])
def test_skypilot_error_text_is_redacted_in_burst_failed(demo, tmp_path, monkeypatch, spot):
    spec, prepared = demo
    error = RuntimeError(f"request failed: Authorization header 'Bearer {SECRET}' rejected")
    if spot:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.com")
        monkeypatch.setattr(sky.jobs, "launch", lambda task, **kw: "req-jobs-launch")
        monkeypatch.setattr(sky, "stream_and_get",
                            lambda rid=None, **kw: (_ for _ in ()).throw(error) if rid == "req-jobs-launch" else None)
        monkeypatch.setattr(sky, "api_cancel", lambda rid, **kw: None)
        monkeypatch.setattr(sky.jobs, "cancel", lambda **kw: "c")
        spec = _spot(spec)
    else:
        FakeSky(monkeypatch, launch_error=error)
    with pytest.raises(BurstFailed) as e:
        burst_train(spec, prepared, tmp_path / "run", _candidates(), log=lambda s: None, mlflow_run_id="r")
    assert SECRET not in str(e.value) and SECRET not in e.value.result.message
    assert "***" in str(e.value)


@pytest.mark.timeout(300)
def test_flow_burst_branch_ends_the_mlflow_run_failed_when_the_launch_fails(prefect_server, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from flows.finetune import finetune

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    fake = FakeSky(monkeypatch, launch_error=sx.ResourcesUnavailableError("Failed to provision"))
    with pytest.raises(BurstFailed, match="no GPU available"):
        finetune(pipeline="demo", pipelines_file=str(REPO / "pipelines.yaml"),
                 overrides={"burst.policy": "always", "training.max_steps": 2})
    assert "launch" in fake.names() and "down" in fake.names()
    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("fitburst").experiment_id], "tags.pipeline = 'demo'")
    assert [r.info.status for r in runs] == ["FAILED"]
    assert runs[0].data.tags["cloud.job_status"] == "LAUNCH_FAILED" and runs[0].data.tags["path"] == "cloud"
    # the cluster name reached MLflow the moment it was chosen (a lost launcher's run says where it ran)
    assert runs[0].data.tags["cloud.cluster"].startswith("fitburst-demo-")
    # and the estimate it launched with: what the month's spend counts if the launcher never sees the end
    assert float(runs[0].data.tags["cloud.estimated_usd"]) > 0 and "cloud.cost_usd" in runs[0].data.tags


# --- nothing lost: pull before teardown on every exit path, reattach after the launcher died --------------------

def _pull_checkpoint(fake):
    def pull(cluster, run_dir, log):
        fake.calls.append(("pull", cluster))
        (run_dir / "checkpoints" / "step-3").mkdir(parents=True)
        (run_dir / "checkpoints" / "step-3" / "state.json").write_text("{}")
    return pull


@pytest.mark.parametrize("how", ["job failed", "ctrl-c", "prefect cancel", "our bug"])
def test_the_checkpoints_of_a_failing_run_come_home_before_teardown(demo, tmp_path, monkeypatch, how):
    from prefect.exceptions import TerminationSignal

    spec, prepared = demo
    raised = {"job failed": BurstFailed, "ctrl-c": KeyboardInterrupt, "prefect cancel": TerminationSignal,
              "our bug": RuntimeError}[how]
    fake = FakeSky(monkeypatch, log_code=100 if how == "job failed" else 0, status=job_lib.JobStatus.FAILED,
                   tail_error={"ctrl-c": KeyboardInterrupt(), "prefect cancel": TerminationSignal(15),
                               "our bug": RuntimeError("boom")}.get(how))
    ids, run_dir = [], tmp_path / "run"
    with pytest.raises(raised):
        burst_train(spec, prepared, run_dir, _candidates(), log=lambda s: None, pull=_pull_checkpoint(fake),
                    on_ids=ids.append)
    names = fake.names()
    assert names.index("pull") < names.index("down")  # home first, then the cluster goes
    assert (run_dir / "checkpoints" / "step-3" / "state.json").exists()
    rec = cloud.launch.read_record(run_dir)
    assert rec["state"] == "collected" and rec["job_id"] == 1 and rec["cluster"] == fake.calls[0][1]
    assert ids[-1] == {"cluster": rec["cluster"], "job_id": 1, "managed": False}  # the MLflow tags

    # the rerun sends those checkpoints to the new node, which resumes from them
    fake2 = FakeSky(monkeypatch)
    burst_train(spec, prepared, run_dir, _candidates(), log=lambda s: None, pull=_pull)
    assert fake2.task.file_mounts["~/fitburst-job/run/checkpoints"] == str((run_dir / "checkpoints").resolve())
    assert "launch" in fake2.names()  # collected: nothing to reattach to


KILLED_LAUNCHER = """
import os, signal, sys
sys.path[:0] = [{tests!r}, {repo!r}]
from pytest import MonkeyPatch
from test_cloud_sky import FakeSky, _candidates, _pull
from fitburst.cloud import burst_train
from fitburst.rundir import open_run_dir
from fitburst.spec import load_pipeline

spec = load_pipeline({pipelines!r}, "qwen7b-lora")
run_dir, _ = open_run_dir(spec)
print(run_dir, flush=True)
fake = FakeSky(MonkeyPatch())
fake.tail_logs = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # the laptop sleeps, the worker dies
import sky
sky.tail_logs = fake.tail_logs
burst_train(spec, {prepared!r}, run_dir, _candidates(), log=print, pull=_pull)
"""


@pytest.mark.timeout(120)
def test_a_rerun_after_the_launcher_died_reattaches_instead_of_launching(demo, tmp_path, monkeypatch):
    spec, prepared = demo
    monkeypatch.setenv("FITBURST_RUNS_DIR", str(tmp_path / "runs"))
    script = KILLED_LAUNCHER.format(tests=str(HERE), repo=str(REPO), pipelines=str(REPO / "pipelines.yaml"),
                                    prepared=str(prepared))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "SKY_RUNTIME_DIR": os.environ["SKY_RUNTIME_DIR"]})
    assert proc.returncode == -9, proc.stdout[-2000:] + proc.stderr[-2000:]
    first_dir = Path(proc.stdout.splitlines()[0])
    rec = cloud.launch.read_record(first_dir)
    assert rec["state"] == "running" and rec["job_id"] == 1  # written before the launcher died

    from fitburst.rundir import open_run_dir, release

    run_dir, resumed = open_run_dir(spec)  # the rerun finds the same folder: its cluster may still be running
    release(run_dir)
    assert run_dir == first_dir and resumed
    fake, lines = FakeSky(monkeypatch, clusters={rec["cluster"]: "UP"}), []
    res = burst_train(spec, prepared, run_dir, _candidates(), log=lines.append, pull=_pull)
    assert res.ok and res.reattached and res.cluster == rec["cluster"] and res.job_id == 1, (lines, fake.calls)
    assert "launch" not in fake.names()
    assert ("tail", rec["cluster"], 1) in fake.calls and ("down", rec["cluster"]) in fake.calls
    assert (run_dir / "train_result.json").exists() and cloud.launch.read_record(run_dir)["state"] == "collected"
    assert any("reattaching to job 1" in line for line in lines)


def test_a_recorded_cluster_that_is_gone_is_launched_again_and_a_stopped_one_started(demo, tmp_path, monkeypatch):
    spec, prepared = demo
    run_dir = tmp_path / "run"
    cloud.launch._record(run_dir, None, cluster="fitburst-qwen7b-lora-old", job_id=4, managed=False, state="running")
    fake = FakeSky(monkeypatch)  # no such cluster any more
    res = burst_train(spec, prepared, run_dir, _candidates(), log=lambda s: None, pull=_pull)
    assert "launch" in fake.names() and res.cluster != "fitburst-qwen7b-lora-old" and not res.reattached

    cloud.launch._record(run_dir, None, cluster="fitburst-qwen7b-lora-old", job_id=1, state="running")
    fake = FakeSky(monkeypatch, clusters={"fitburst-qwen7b-lora-old": "STOPPED"})  # autostop stopped it
    res = burst_train(spec, prepared, run_dir, _candidates(), log=lambda s: None, pull=_pull)
    assert res.reattached and fake.names().index("start") < fake.names().index("tail")

    # the launcher died while launching: the job it submitted is found on the cluster
    cloud.launch._record(run_dir, None, cluster="fitburst-qwen7b-lora-mid", job_id=None, state="launching")
    fake = FakeSky(monkeypatch, clusters={"fitburst-qwen7b-lora-mid": "UP"})
    res = burst_train(spec, prepared, run_dir, _candidates(), log=lambda s: None, pull=_pull)
    assert res.reattached and res.job_id == 1 and "launch" not in fake.names()


def test_autostop_keeps_the_disk_where_the_provider_can_stop_and_no_bucket_holds_the_outputs(demo):
    spec, prepared = demo
    aws = Candidate("A6000", "aws", "A10G", 24, True, 1.0, 1.0, 1.0, region="us-east-1")
    task = build_task(spec, [aws, *_candidates()], prepared_dir=prepared)
    assert [r.autostop_config.down for r in task.resources] == [False, True, True]  # RunPod/Lambda cannot stop
    spec = spec.model_copy(update={"burst": spec.burst.model_copy(update={"bucket": "gs://b/x"})})
    task = build_task(spec, [aws, *_candidates()], prepared_dir=prepared, run_name="20261123-1200-ab-cd")
    assert [r.autostop_config.down for r in task.resources] == [True, True, True]  # outputs live in the bucket
    mount = task.storage_mounts["~/fitburst-job/run"]
    assert mount.source == "gs://b/x/qwen7b-lora/20261123-1200-ab-cd" and mount.mode == sky.StorageMode.MOUNT_CACHED


def test_task_yaml_is_package_data_found_through_importlib_resources_and_in_the_wheel(tmp_path):
    import zipfile
    from importlib import resources

    found = resources.files("fitburst.cloud").joinpath("train.yaml")
    assert found.is_file() and Path(str(found)) == cloud.TASK_YAML
    assert sky.Task.from_yaml(str(found)).run  # SkyPilot reads it
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(REPO / "fitburst", src / "fitburst", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PIP_NO_INDEX": "1"})
    assert wheel.returncode == 0, wheel.stderr[-2000:]
    names = zipfile.ZipFile(next(tmp_path.glob("fitburst-*.whl"))).namelist()
    assert "fitburst/cloud/train.yaml" in names


def test_the_node_gets_no_raw_cloud_keys_and_the_uploaded_workdir_holds_no_secret_or_local_state(demo, tmp_path,
                                                                                                 monkeypatch):
    spec, prepared = demo
    planted = {"AWS_SECRET_ACCESS_KEY": "aws-PLANTED-secret-1", "AWS_ACCESS_KEY_ID": "AKIAPLANTED000",
               "GOOGLE_APPLICATION_CREDENTIALS": "/home/me/gcp-PLANTED.json",
               "MLFLOW_TRACKING_PASSWORD": "mlflow-PLANTED-pw"}
    for k, v in planted.items():
        monkeypatch.setenv(k, v)
    # a package folder as a developer's checkout may leave it: a .env, caches, run folders, an MLflow store
    package = tmp_path / "pkg"
    shutil.copytree(REPO / "fitburst", package, ignore=shutil.ignore_patterns("__pycache__"))
    for junk, text in {".env": f"HF_TOKEN={SECRET}", "runs/demo/x/adapter.bin": SECRET, "mlruns/0/meta.yaml": SECRET,
                       "__pycache__/spec.cpython-311.pyc": SECRET, ".venv-gpu/pyvenv.cfg": SECRET,
                       "mlflow.db": SECRET, "key.pem": SECRET}.items():
        (package / junk).parent.mkdir(parents=True, exist_ok=True)
        (package / junk).write_text(text)
    workdir = cloud.task.stage_workdir(tmp_path / "workdir", package)
    task = build_task(spec, _candidates(), prepared_dir=prepared, workdir=workdir)
    uploaded = [p for p in Path(task.workdir).rglob("*") if p.is_file()]
    uploaded += [Path(src) for src in task.file_mounts.values() if Path(src).is_file()]
    assert len(uploaded) > 20 and not [p for p in uploaded if p.name in (".env", "mlflow.db", "key.pem")
                                       or {"runs", "mlruns", "__pycache__", ".venv-gpu"} & set(p.parts)]
    secrets = [SECRET, SECRET + "pw", *planted.values()]
    for p in uploaded:
        assert not any(v.encode() in p.read_bytes() for v in secrets), p
    text = task_yaml(task)
    assert not any(v in text for v in secrets)
    # HF token only: MLflow credentials go only to a node that logs to the server, raw cloud keys never
    assert set(task.secrets) == {"HF_TOKEN"}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.com")
    task = build_task(spec, _candidates(), prepared_dir=prepared, workdir=workdir, mlflow_run_id="r1")
    assert set(task.secrets) == {"HF_TOKEN", "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_PASSWORD"}
    # the checkout's .skyignore keeps the same things out of a manual `sky launch`
    ignored = set((REPO / ".skyignore").read_text().split())
    assert {".env", "runs/", "mlruns/", ".venv*/", "__pycache__/", "mlflow.db"} <= ignored


# --- out of memory locally with every step-down taken: burst from the checkpoint -----------------------------

def _oom_from_step(monkeypatch, step: int) -> None:
    """An empty step-down ladder, and a CUDA-typed OOM from inside every optimizer step after ``step`` (a
    checkpoint exists by then); the real training loop runs up to it."""
    import torch

    import fitburst.recipe
    import fitburst.supervisor

    real, calls = fitburst.recipe.optimizer_step, []

    def step_or_oom(*a, **k):
        calls.append(1)
        if len(calls) > step:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*a, **k)

    monkeypatch.setattr(fitburst.recipe, "optimizer_step", step_or_oom)
    monkeypatch.setattr(fitburst.supervisor, "next_rung_on_host", lambda *a, **kw: (None, []))  # no rung left


def _node(tmp_path, fake):
    """The cloud node, run here: its RUN_DIR gets the mounted checkpoints, it runs the task's own command line
    (`fitburst train --spec ... --plan`, a fresh process without the forced OOM); its outputs are pulled home."""
    def pull(cluster, run_dir, log):
        mounts = fake.task.file_mounts
        node = tmp_path / "node" / "fitburst-job" / "run"
        shutil.copytree(mounts["~/fitburst-job/run/checkpoints"], node / "checkpoints")
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-m", "fitburst.cli", "train", "--spec", mounts["~/fitburst-job/spec.yaml"],
               "--prepared", mounts["~/fitburst-job/prepared"], "--run-dir", str(node), "--plan"]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        shutil.copytree(node, run_dir, dirs_exist_ok=True)
    return pull


@pytest.mark.timeout(300)
def test_an_exhausted_oom_ladder_bursts_from_the_checkpoint_and_the_node_resumes_it(prefect_server, tmp_path,
                                                                                    monkeypatch):
    from mlflow.tracking import MlflowClient

    from fitburst.supervisor import OOMLadderExhausted
    from fitburst.train import TrainResult
    from flows.finetune import finetune

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("FITBURST_RUNS_DIR", str(tmp_path / "runs"))
    _oom_from_step(monkeypatch, 2)
    # preflight.exact off: the preflight's trace runs the same (patched) step function on fake tensors
    overrides = {"training.max_steps": 4, "training.checkpoint_every": 2, "training.log_every": 1,
                 "eval.enabled": False, "tracking.register_as": None, "preflight.exact": False}

    # burst.policy never: the flow fails with the measured peak, nothing is launched
    fake = FakeSky(monkeypatch)
    with pytest.raises(OOMLadderExhausted, match=r"at step 2 .*measured peak [\d.]+ GiB.*would have fit"):
        finetune(pipeline="demo", pipelines_file=str(REPO / "pipelines.yaml"), overrides=overrides)
    assert "launch" not in fake.names()

    # burst.policy auto: the checkpoint travels to the node, which resumes it
    fake = FakeSky(monkeypatch)
    monkeypatch.setattr(cloud.launch, "_pull_outputs", _node(tmp_path, fake))
    out = finetune(pipeline="demo", pipelines_file=str(REPO / "pipelines.yaml"),
                   overrides={**overrides, "burst.policy": "auto"})
    assert "launch" in fake.names() and fake.names()[-2:] == ["down", "get"]
    run_dir = Path(out["run_dir"])
    assert fake.task.file_mounts["~/fitburst-job/run/checkpoints"] == str((run_dir / "checkpoints").resolve())
    assert (run_dir / "checkpoints" / "step-2").is_dir()
    result = TrainResult.load(run_dir)
    assert result.resumed_from == 2 and result.steps == 4 and out["steps"] == 4  # the node went on from step 2
    assert out["verdict"] == "burst"
    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("fitburst").experiment_id], "tags.pipeline = 'demo'",
                              order_by=["attributes.start_time DESC"])
    assert [r.info.status for r in runs] == ["FINISHED", "FAILED"]
    tags = runs[0].data.tags
    assert tags["path"] == "cloud" and tags["oom.burst_from_step"] == "2" and tags["cloud.gpu"]
    assert int(tags["oom.measured_peak_bytes"]) > 0
