"""DAG node 2: estimate peak memory on this device, plan a fit, decide local / burst / fail."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE

from fitburst.data import PreparedData
from fitburst.data_facts import data_facts
from fitburst.memory import Estimate
from fitburst.preflight import PreflightReport, preflight, probe_and_replan
from fitburst.spec import PipelineSpec
from fitburst.tracking import Tracker
from tasks import artifact_key


@task(name="preflight", cache_policy=NONE)
def preflight_task(spec: PipelineSpec, prepared: PreparedData | None, tracker: Tracker) -> PreflightReport:
    # prepared is None on a dry run without a tokenizer: the longest allowed sequence, record count from the file
    facts = data_facts(spec, prepared)
    report = preflight(spec, facts.longest, n_train=facts.n_train, mean_len=facts.mean)
    if spec.preflight.probe and report.verdict.placement == "local" and prepared is not None:
        report, _ = probe_and_replan(spec, prepared, report, tracker)
    log = get_run_logger()
    log.info("preflight %s: %s (%s)", spec.name, report.verdict.placement, report.verdict.reason)
    for change in report.changes:
        log.info("plan: %s", change)
    create_markdown_artifact(key=f"preflight-{artifact_key(spec.name)}", markdown=report.to_markdown(),
                             description=f"memory preflight for {spec.name}")
    create_table_artifact(breakdown_rows(report.estimate), key=f"preflight-table-{artifact_key(spec.name)}",
                          description=f"estimated peak memory by component, {spec.name} on {report.device.name}")
    tracker.log_preflight(report)
    # what `fitburst calibrate` divides out of these estimates, so that fitting again converges
    tracker.log_metrics({"memory.calibration_factor": report.estimate.calibration_factor,
                         "memory.calibration_reserved_factor": report.estimate.reserved_calibration_factor})
    return report


def breakdown_rows(est: Estimate) -> list[dict]:
    """The estimate as table rows: each component, then the allocated peak, reserved, device total and budget."""
    gib = 1024**3
    rows = [{"item": k, "GiB": round(v / gib, 4), "kind": "component"}
            for k, v in sorted(est.components.items(), key=lambda kv: -kv[1])]
    for label, value in (("allocated peak (tensors)", est.allocated_peak_bytes),
                         ("reserved (allocator)", est.reserved_peak_bytes),
                         ("device total (+ context)", est.device_total_bytes), ("budget", est.budget_bytes)):
        rows.append({"item": label, "GiB": round(value / gib, 4), "kind": "total"})
    if est.world_size > 1:  # the figures above are one GPU's
        n = est.world_size
        rows.append({"item": f"reserved, all {n} GPUs", "GiB": round(est.reserved_peak_bytes * n / gib, 4),
                     "kind": "all GPUs"})
        rows.append({"item": f"device total, all {n} GPUs", "GiB": round(est.device_total_bytes * n / gib, 4),
                     "kind": "all GPUs"})
        if est.host_bytes:
            rows.append({"item": "host RAM per node", "GiB": round(est.host_bytes / gib, 4), "kind": "host"})
    return rows
