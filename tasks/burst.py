"""DAG node 3 (burst path): the same `fitburst train` on a rented GPU via SkyPilot (fitburst.cloud).

Thin: fitburst.cloud.burst_train decides nothing new here; this task streams its log lines into Prefect's log,
tags the MLflow run (path=cloud, provider, GPU, region, price, cost), logs the pulled-back outputs when the
node could not log itself, and re-raises failures so the flow ends the MLflow run FAILED.
The cluster teardown is inside burst_train (try/finally): Prefect cancellation and Ctrl-C included.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE

from fitburst.cloud import BurstFailed, BurstResult, Candidate, burst_train
from fitburst.data import PreparedData
from fitburst.history import ESTIMATE_TAG
from fitburst.memory import Estimate
from fitburst.spec import PipelineSpec
from fitburst.tracking import Tracker, redact
from fitburst.train import TrainResult  # tasks.train loads it with the flow already
from tasks import artifact_key


@task(name="train-cloud", cache_policy=NONE)
def train_cloud(spec: PipelineSpec, prepared: PreparedData | None, tracker: Tracker | None, candidates: list,
                run_dir: str | Path, *, dry_run: bool = False, local: dict | None = None) -> TrainResult | BurstResult:
    """Returns the TrainResult read from the pulled-back run folder (or the BurstResult for a dry run)."""
    log = get_run_logger()

    def emit(line: str) -> None:
        log.info("%s", redact(line))

    run_id = getattr(tracker, "run_id", None) if tracker is not None else None
    try:
        prepared_dir = prepared.dir if prepared else None
        res: BurstResult = burst_train(spec, prepared_dir, run_dir, candidates, dry_run=dry_run, log=emit,
                                       mlflow_run_id=run_id, local=local,
                                       on_ids=_tag_ids(tracker, launch_estimate(candidates)))
    except BurstFailed as e:
        if tracker is not None:
            tracker.set_tags(e.result.tags())
            tracker.log_text(redact(str(e)), "cloud/failure.txt")
        raise
    create_markdown_artifact(f"```\n{redact(res.report)}\n```", key=f"burst-{artifact_key(spec.name)}",
                             description="burst plan: local vs cloud, chosen GPU, cost, SkyPilot task")
    if dry_run:
        return res
    if tracker is not None:
        tracker.set_tags(res.tags())
        tracker.log_text(redact(res.report), "cloud/plan.txt")
    assert res.run_dir is not None  # a launched burst names its run folder
    run_dir = Path(res.run_dir)
    if res.logged_remotely and not (run_dir / "train_result.json").exists():
        _fetch_train_result(tracker, run_dir)  # the node logged it; nothing was pulled home
    result = TrainResult.load(run_dir)
    result.run_dir = str(run_dir)
    result.adapter_dir = (f"runs:/{tracker.run_id}/adapter" if res.logged_remotely and tracker is not None
                          and not (run_dir / "adapter").exists() else str(run_dir / "adapter"))
    if tracker is not None and not res.logged_remotely:
        tracker.log_train(result, path="cloud")
        estimate = run_dir / "estimate.json"  # `fitburst train --plan` on the node: its device, its settings
        if estimate.exists():
            tracker.log_memory_comparison(Estimate.from_dict(json.loads(estimate.read_text())), result)
        tracker.set_tags(res.tags())  # log_train sets device/path; keep the cloud facts on top
    log.info("cloud run %s on %s (%s): %s, ~$%.2f", res.cluster, res.accelerator, res.provider,
             res.job_status, res.cost_usd or 0.0)
    return result


def _tag_ids(tracker: Tracker | None, estimate_usd: float | None):
    """The cluster name and job id as MLflow tags the moment they exist (so a lost launcher's run says where), with
    ``path=cloud`` and the estimated cost: a burst whose end the launcher never sees counts at it in the month's
    spend (fitburst.history) until its actual cost is set."""
    if tracker is None:
        return None
    launch = {"path": "cloud", **({ESTIMATE_TAG: f"{estimate_usd:.4f}"} if estimate_usd is not None else {})}
    return lambda ids: tracker.set_tags({**launch, **{f"cloud.{k}": str(v) for k, v in ids.items()}})


def launch_estimate(candidates: list) -> float | None:
    """The estimated total of the candidate a launch tries first (the best usable one)."""
    ok = [c for c in map(Candidate.from_dict, candidates) if c.usable]
    return ok[0].est_total_usd if ok else None


def _fetch_train_result(tracker: Tracker | None, run_dir: Path) -> None:
    """Download the node's ``train/train_result.json`` (Tracker.log_train on the node) into ``run_dir``."""
    import mlflow

    if tracker is None:
        raise FileNotFoundError(f"{run_dir / 'train_result.json'}: the node logged to MLflow but no run is attached")
    run_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        got = mlflow.artifacts.download_artifacts(run_id=tracker.run_id, artifact_path="train/train_result.json",
                                                  dst_path=d, tracking_uri=tracker.uri)
        shutil.move(got, run_dir / "train_result.json")

