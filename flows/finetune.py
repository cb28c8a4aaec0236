"""The fine-tuning DAG: data prep -> preflight -> train (local, or burst to a cloud GPU) -> eval.

One MLflow run per flow run, opened here and closed on every exit path (FINISHED, FAILED, or KILLED on
cancellation / Ctrl-C).
"""

from __future__ import annotations

import os
from typing import Any

from prefect import flow, get_run_logger, runtime
from prefect.artifacts import create_markdown_artifact

from fitburst.preflight import PreflightReport
from fitburst.spec import load_pipeline
from fitburst.tracking import Tracker
from tasks.data_prep import data_prep
from tasks.evaluate import evaluate_task
from tasks.preflight import _key, preflight_task
from tasks.train import train_local

DEFAULT_FILE = os.environ.get("FITBURST_PIPELINES", "pipelines.yaml")
GIB = 1024**3


class PreflightFailed(RuntimeError):
    """The run does not fit anywhere it is allowed to run."""


@flow(name="finetune", log_prints=True)
def finetune(pipeline: str = "demo", overrides: dict[str, Any] | None = None, pipelines_file: str = DEFAULT_FILE,
             dry_run: bool = False) -> dict:
    """Run one pipeline from pipelines.yaml; ``overrides`` takes dotted keys, e.g. {"training.max_steps": 20}."""
    spec = load_pipeline(pipelines_file, pipeline, overrides)  # a bad spec fails here, before any compute
    tracker = Tracker.start(spec, tags={"prefect.flow_run_id": str(runtime.flow_run.id or ""),
                                        "dry_run": str(dry_run).lower()})
    status = "FAILED"
    try:
        tracker.log_spec(spec)
        prepared = data_prep(spec, tracker, dry_run=dry_run)
        report: PreflightReport = preflight_task(spec, prepared, tracker)
        summary = {"pipeline": spec.name, "mlflow_run_id": tracker.run_id, "tracking_uri": tracker.uri,
                   "verdict": report.verdict, "reason": report.reason, "device": report.device["name"],
                   "plan": report.changes, "estimated_peak_bytes": report.estimate["device_total_bytes"]}
        if report.verdict == "fail":
            raise PreflightFailed(f"{spec.name}: {report.reason}")
        planned = report.planned_spec()
        if dry_run and report.verdict == "local":
            status = "FINISHED"
            return summary
        if report.verdict == "local":
            result = train_local(planned, prepared, tracker, report.estimate)
            ev = evaluate_task(planned, prepared, result, tracker) if planned.eval.enabled else None
        else:
            result, ev = _burst(spec, prepared, report, tracker, dry_run)
            if dry_run:
                summary.update(candidates=report.candidates[:4], burst_plan=result.report)
                status = "FINISHED"
                return summary
        summary.update(run_dir=result.run_dir, adapter_dir=result.adapter_dir, trained_on=result.device,
                       steps=result.steps, measured_peak_bytes=result.peak.get("allocated_bytes"))
        if ev is not None:
            summary.update(eval_base_loss=ev.base_loss, eval_tuned_loss=ev.tuned_loss)
        _publish_summary(summary)
        get_run_logger().info("%s", tracker.where())
        status = "FINISHED"
        return summary
    except (KeyboardInterrupt, SystemExit):
        status = "KILLED"
        raise
    finally:
        tracker.end(status)


def _burst(spec, prepared, report: PreflightReport, tracker: Tracker, dry_run: bool):
    """The cloud path: the same `fitburst train --eval` on a rented GPU; results come home into this run."""
    from fitburst.evaluate import EvalResult
    from fitburst.rundir import open_run_dir, release
    from tasks.burst import train_cloud

    if prepared is None and not dry_run:
        raise PreflightFailed(f"{spec.name}: the data could not be tokenized here (tokenizer not reachable), so "
                              "there is nothing to send to the cloud node; run with network access to the hub")
    run_dir, _ = open_run_dir(spec)
    local = {"device": report.device["name"], "fits": bool(report.estimate.get("fits")), "hours": report.local_hours,
             "estimate": report.estimate}
    try:
        result = train_cloud(spec, prepared, tracker, report.candidates, run_dir, dry_run=dry_run, local=local)
    finally:
        release(run_dir)
    if dry_run:
        return result, None
    ev = EvalResult.load(result.run_dir) if (run_dir / "eval.json").exists() else None
    if ev is not None:
        tracker.log_eval(ev)
    return result, ev


def _publish_summary(s: dict) -> None:
    def gib(v):
        return f"{v / GIB:.3f} GiB" if v else "n/a"

    lines = [f"## Run summary: `{s['pipeline']}`", "", "| | |", "|---|---|",
             f"| verdict | {s['verdict']} on {s['device']} |", f"| trained on | {s.get('trained_on')} |",
             f"| estimated peak | {gib(s['estimated_peak_bytes'])} |",
             f"| measured peak | {gib(s.get('measured_peak_bytes'))} |"]
    if "eval_base_loss" in s:
        lines.append(f"| eval loss | {s['eval_base_loss']:.4f} -> {s['eval_tuned_loss']:.4f} |")
    lines.append(f"| MLflow run | `{s['mlflow_run_id']}` |")
    create_markdown_artifact(key=f"summary-{_key(s['pipeline'])}", markdown="\n".join(lines),
                             description="fitburst run summary")
