"""DAG node 3 (local path): train in this process on the local device, into a run folder of its own."""

from __future__ import annotations

import sys

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from fitburst.data import PreparedData
from fitburst.recipe import train_and_record
from fitburst.rundir import open_run_dir, release
from fitburst.spec import PipelineSpec
from fitburst.tracking import Tracker
from fitburst.train import TrainResult, latest_checkpoint, total_steps
from tasks.progress import TrainingProgress

LOCAL_TRAIN_TAG = "fitburst-local-train"


@task(name="train-local", cache_policy=NONE, tags=[LOCAL_TRAIN_TAG])
def train_local(spec: PipelineSpec, prepared: PreparedData, tracker: Tracker, estimate: dict) -> TrainResult:
    log = get_run_logger()
    run_dir, resumed = open_run_dir(spec)
    tracker.set_tags({"run_dir": str(run_dir)})
    log.info("%s run folder %s", "resuming in" if resumed else "training into", run_dir)
    progress = _progress(spec, prepared, run_dir, tracker)
    try:
        # progress bars only on a terminal; clean log lines from `progress`
        result = train_and_record(spec, prepared, run_dir, tracker=tracker, path="local", estimate=estimate,
                                  on_metrics=progress, progress=sys.stderr.isatty())
    finally:
        release(run_dir)
    progress.finish()
    log.info("%d steps in %.1fs (%.1f steps/s) on %s; measured peak %s bytes", result.steps, result.seconds,
             result.steps_per_sec, result.device, result.peak.get("allocated_bytes"))
    return result


def _progress(spec: PipelineSpec, prepared: PreparedData, run_dir, tracker: Tracker) -> TrainingProgress:
    ckpt = latest_checkpoint(run_dir)
    tr = spec.training
    return TrainingProgress(spec.name, total_steps(spec, prepared.n_train),
                            int(ckpt.name.split("-")[1]) if ckpt else 0,
                            tr.micro_batch_size * tr.grad_accum * prepared.stats.get("mean", 0.0), tracker.log_metrics)
