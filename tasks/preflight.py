"""DAG node 2: estimate peak memory on this device, plan a fit, decide local / burst / fail."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE

from fitburst.data import PreparedData
from fitburst.preflight import PreflightReport, data_facts, preflight
from fitburst.spec import PipelineSpec
from fitburst.tracking import Tracker
from tasks import artifact_key


@task(name="preflight", cache_policy=NONE)
def preflight_task(spec: PipelineSpec, prepared: PreparedData | None, tracker: Tracker) -> PreflightReport:
    # prepared is None on a dry run without a tokenizer: the longest allowed sequence, record count from the file
    seq, n_train, mean = data_facts(spec, prepared)
    report = preflight(spec, seq, n_train=n_train, mean_len=mean)
    if spec.preflight.probe and report.verdict.placement == "local" and prepared is not None:
        from fitburst.probe import probe_and_replan

        report, _ = probe_and_replan(spec, prepared, report, tracker)
    log = get_run_logger()
    log.info("preflight %s: %s (%s)", spec.name, report.verdict.placement, report.verdict.reason)
    for change in report.changes:
        log.info("plan: %s", change)
    create_markdown_artifact(key=f"preflight-{artifact_key(spec.name)}", markdown=report.to_markdown(),
                             description=f"memory preflight for {spec.name}")
    tracker.log_preflight(report)
    # what `fitburst calibrate` divides out of these estimates, so that fitting again converges
    tracker.log_metrics({"memory.calibration_factor": report.estimate.calibration_factor,
                         "memory.calibration_reserved_factor": report.estimate.reserved_calibration_factor})
    return report
