"""DAG node 4: base vs tuned validation loss / perplexity and sample generations."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from fitburst.data import PreparedData
from fitburst.evaluate import EvalResult
from fitburst.spec import PipelineSpec
from fitburst.supervisor import evaluate_and_record
from fitburst.tracking import Tracker
from fitburst.train import TrainResult


@task(name="evaluate", cache_policy=NONE)
def evaluate_task(spec: PipelineSpec, prepared: PreparedData, result: TrainResult, tracker: Tracker) -> EvalResult:
    ev = evaluate_and_record(spec, prepared, result, tracker=tracker)
    get_run_logger().info("eval loss %.4f -> %.4f (ppl %.2f -> %.2f)", ev.base_loss, ev.tuned_loss,
                          ev.base_ppl, ev.tuned_ppl)
    return ev
