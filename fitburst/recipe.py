"""One recipe, two callers: train -> eval -> records.

The Prefect flow runs its two stages as tasks (``tasks/train.py``, ``tasks/evaluate.py``); ``fitburst train --eval``
(the cloud node's command) runs :func:`run_recipe`. Both go through the same two functions below, so a run records
the same things wherever it trained.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from fitburst.data import PreparedData
from fitburst.evaluate import EvalResult, evaluate
from fitburst.memory import Estimate
from fitburst.oom import StepDown, train_stepping_down
from fitburst.ranks import Ranks
from fitburst.spec import PipelineSpec
from fitburst.tracking import Tracker, redact
from fitburst.train import MetricsFn, TrainResult

log = logging.getLogger(__name__)


def train_and_record(spec: PipelineSpec, prepared: PreparedData, run_dir: str | Path, *, tracker: Tracker | None,
                     path: str, estimate: Estimate | None = None, device: str | None = None,
                     progress: bool = True, on_metrics: MetricsFn | None = None,
                     on_stepdown: Callable[[StepDown], None] | None = None,
                     ranks: Ranks | None = None) -> TrainResult:
    """Train into ``run_dir`` (the loss curve streamed to ``tracker``, or to ``on_metrics`` when given, which then
    forwards it; system metrics recorded meanwhile), stepping down on out-of-memory (each step-down recorded and
    passed to ``on_stepdown``), then record the run: facts, adapter, plots, and measured vs ``estimate`` when there
    is one. ``path`` is where it trained: local or cloud. ``ranks`` of more than one process: sharded with FSDP over
    them (:class:`fitburst.ranks.Ranks`: this machine's, or several nodes' with this process as node 0's supervisor)."""

    def stepped_down(record: StepDown) -> None:
        if tracker is not None:
            tracker.log_stepdown(record)
        if on_stepdown is not None:
            on_stepdown(record)

    metrics_fn = on_metrics or (tracker.log_metrics if tracker else None)
    with tracker.system_metrics() if tracker is not None else contextlib.nullcontext():
        result = train_stepping_down(spec, prepared, run_dir, device=device, on_metrics=metrics_fn,
                                     on_stepdown=stepped_down, progress=progress, ranks=ranks)
    if tracker is not None:
        from mlflow.exceptions import MlflowException

        try:
            tracker.log_train(result, path=path)
            if estimate is not None:
                tracker.log_memory_comparison(estimate, result)
        except MlflowException as e:  # the server went away: the trained run must not be lost over its record
            log.warning("MLflow unreachable after training (%s): the result, adapter and loss curve are in %s; "
                        "metrics are replayed from its outbox when the server is back", redact(str(e))[:200],
                        result.run_dir)
    return result


def evaluate_and_record(spec: PipelineSpec, prepared: PreparedData, result: TrainResult, *,
                        tracker: Tracker | None) -> EvalResult:
    """Base vs tuned on the validation split, with the device and precision the run trained in; saved as the run
    folder's ``eval.json`` and recorded."""
    ev = evaluate(spec, prepared, result.adapter_dir, device=result.device, precision=result.precision)
    ev.save(result.run_dir)
    if tracker is not None:
        tracker.log_eval(ev)
    return ev


def run_recipe(spec: PipelineSpec, prepared: PreparedData, run_dir: str | Path, *, tracker: Tracker | None = None,
               path: str = "local", estimate: Estimate | None = None, device: str | None = None,
               evaluate_after: bool = True, progress: bool = True,
               ranks: Ranks | None = None) -> tuple[TrainResult, EvalResult | None]:
    """Train (over ``ranks``, when given), evaluate (when ``evaluate_after`` and ``spec.eval.enabled``) and record;
    returns both results."""
    result = train_and_record(spec, prepared, run_dir, tracker=tracker, path=path, estimate=estimate, device=device,
                              progress=progress, ranks=ranks)
    ev = evaluate_and_record(spec, prepared, result, tracker=tracker) if evaluate_after and spec.eval.enabled else None
    return result, ev
