"""Local training as the flow runs it: claim a run folder (resuming an interrupted one), link and close the
records of the attempt it replaces, send metrics through the folder's outbox, and step down on out-of-memory."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fitburst.data import PreparedData
from fitburst.memory import Estimate
from fitburst.oom import StepDown
from fitburst.ranks import Ranks, local_ranks
from fitburst.recipe import train_and_record
from fitburst.rundir import open_run_dir, release, runs_root
from fitburst.spec import PipelineSpec
from fitburst.tracking import Tracker, replay_outboxes
from fitburst.train import MetricsFn, TrainResult

log = logging.getLogger(__name__)


def train_local_run(spec: PipelineSpec, prepared: PreparedData, tracker: Tracker | None, *,
                    estimate: Estimate | None = None, device: str | None = None, progress: bool = True,
                    on_metrics: MetricsFn | None = None,
                    on_stepdown: Callable[[StepDown], None] | None = None, nproc: int | None = None) -> TrainResult:
    """Train ``spec`` in its run folder (the newest interrupted one with the same config and data, else a new one)
    through the recipe. Each OOM step-down is recorded in MLflow and passed to ``on_stepdown`` (the flow's log).
    ``nproc``: processes to shard the run over (default :func:`fitburst.ranks.local_ranks`: one per GPU for
    ``training.distributed: fsdp``); this process keeps the MLflow run and relays rank 0's loss curve."""
    if tracker is not None:
        replay_outboxes(runs_root(spec) / spec.name, tracker.uri)
    run_dir, resumed = open_run_dir(spec, data_hash=prepared.content_hash)
    log.info("%s run folder %s", "resuming in" if resumed else "training into", run_dir)
    try:
        if tracker is not None:
            tracker.set_tags({"run_dir": str(run_dir)})
            tracker.link_previous(run_dir)
            tracker.use_outbox(run_dir)
        return train_and_record(spec, prepared, run_dir, tracker=tracker, path="local", estimate=estimate,
                                device=device, progress=progress, on_metrics=on_metrics, on_stepdown=on_stepdown,
                                ranks=Ranks(nproc or local_ranks(spec)))
    finally:
        release(run_dir)

