"""DAG node 3 (local path): train in this process on the local device, into a run folder of its own."""

from __future__ import annotations

import sys

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from fitburst.data import PreparedData
from fitburst.memory import Estimate
from fitburst.ranks import local_ranks
from fitburst.spec import PipelineSpec
from fitburst.supervisor import train_local_run
from fitburst.tracking import Tracker
from fitburst.train import TrainResult, total_steps
from tasks.progress import TrainingProgress

LOCAL_TRAIN_TAG = "fitburst-local-train"


# The flow holds the tag's concurrency slot from the preflight on (flows.finetune.local_gpu_slot); the task itself
# carries no tag, or it would wait for the slot its own flow run holds.
@task(name="train-local", cache_policy=NONE)
def train_local(spec: PipelineSpec, prepared: PreparedData, tracker: Tracker, estimate: Estimate) -> TrainResult:
    log = get_run_logger()
    tr = spec.training
    ranks = local_ranks(spec)  # one per GPU for training.distributed: fsdp; each step takes every rank's samples
    progress = TrainingProgress(spec.name, total_steps(spec, prepared.n_train, ranks),
                                ranks * tr.micro_batch_size * tr.grad_accum * prepared.stats.get("mean", 0.0),
                                tracker.log_metrics)
    # progress bars only on a terminal; clean log lines from `progress`
    result = train_local_run(spec, prepared, tracker, estimate=estimate, on_metrics=progress, nproc=ranks,
                             progress=sys.stderr.isatty(), on_stepdown=lambda r: log.warning(
                                 "out of memory (%s) at step %d, measured peak %s bytes: stepped down: %s",
                                 r.oom_kind, r.step, r.measured_peak_bytes, r.change))
    progress.finish()
    log.info("run folder %s", result.run_dir)
    log.info("%d steps in %.1fs (%.1f steps/s) on %s; measured peak %s bytes", result.steps, result.seconds,
             result.steps_per_sec, result.device, result.peak.allocated_bytes)
    return result
