"""DAG node 2: estimate peak memory on this device, plan a fit, decide local / burst / fail."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE

from fitburst.data import PreparedData
from fitburst.preflight import PreflightReport, attach_candidates, preflight
from fitburst.spec import PipelineSpec
from fitburst.tracking import Tracker
from tasks import artifact_key


@task(name="preflight", cache_policy=NONE)
def preflight_task(spec: PipelineSpec, prepared: PreparedData | None, tracker: Tracker) -> PreflightReport:
    if prepared is None:  # dry run without a tokenizer: the longest allowed sequence, record count from the file
        from fitburst.data import read_records

        n = len(read_records(spec.data_path(), spec.data.format, spec.data.skip_invalid)[0])
        seq = spec.data.max_seq_len
        report = preflight(spec, seq, n_train=round(n * (1 - spec.data.val_split)), mean_len=seq)
    else:
        report = preflight(spec, prepared.stats["max"], n_train=prepared.n_train, mean_len=prepared.stats["mean"])
    if spec.preflight.probe and report.verdict == "local" and prepared is not None:
        from fitburst.probe import probe_and_replan

        report, _ = probe_and_replan(spec, prepared, report, tracker)
    if report.verdict == "burst":
        attach_candidates(report, spec)
    log = get_run_logger()
    log.info("preflight %s: %s (%s)", spec.name, report.verdict, report.reason)
    for change in report.changes:
        log.info("plan: %s", change)
    create_markdown_artifact(key=f"preflight-{artifact_key(spec.name)}", markdown=report.to_markdown(),
                             description=f"memory preflight for {spec.name}")
    create_table_artifact(breakdown_rows(report.estimate), key=f"preflight-table-{artifact_key(spec.name)}",
                          description=f"estimated peak memory by component, {spec.name} on {report.device['name']}")
    tracker.log_preflight(report)
    return report



def breakdown_rows(estimate: dict) -> list[dict]:
    """The estimate as table rows: each component, then the allocated peak, reserved, device total and budget."""
    gib = 1024**3
    rows = [{"item": k, "GiB": round(v / gib, 4), "kind": "component"}
            for k, v in sorted(estimate["components"].items(), key=lambda kv: -kv[1])]
    for label, key in (("allocated peak (tensors)", "allocated_peak_bytes"), ("reserved (allocator)",
                       "reserved_peak_bytes"), ("device total (+ context)", "device_total_bytes"),
                       ("budget", "budget_bytes")):
        rows.append({"item": label, "GiB": round(estimate[key] / gib, 4), "kind": "total"})
    return rows
