"""The fine-tuning DAG: data prep -> preflight -> train (local, or burst to a cloud GPU) -> eval.

Before the preflight: the adapter ``method.init_from`` names is found and checked (before data prep), and after data
prep a run whose fingerprint matches the pipeline's last completed training ends there, Completed, when
``schedule.when`` is ``changed`` (the default for the schedule's own runs): see docs/deployments.md.

One MLflow run per flow run, opened here and closed on every exit path (FINISHED, FAILED, or KILLED on
cancellation / Ctrl-C).
"""

# ruff: noqa: E402  (the imports after the first call come after it on purpose)
from __future__ import annotations

from fitburst.collector import collect_seldom_in_a_flow_run
from fitburst.unused_imports import leave_out_in_a_flow_run

leave_out_in_a_flow_run()  # first: before the imports below bring in what asks whether scikit-learn is installed
collect_seldom_in_a_flow_run()  # and before they make their many objects

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Annotated, Any

from prefect import flow, get_run_logger, runtime
from prefect.artifacts import create_markdown_artifact
from prefect.states import Completed, Failed, State
from pydantic import BaseModel, WithJsonSchema

from fitburst.errors import UserError
from fitburst.logs import quiet_user_errors
from fitburst.preflight import PreflightFailed, PreflightReport, cloud_candidates
from fitburst.spec import DEFAULT_PIPELINES_FILE, PipelineSpec, load_pipeline
from fitburst.supervisor import OOMLadderExhausted
from fitburst.tracking import Tracker, redact
from fitburst.train import TrainResult
from tasks import artifact_key
from tasks.changed import what_changed
from tasks.data_prep import data_prep
from tasks.evaluate import evaluate_task
from tasks.preflight import preflight_task
from tasks.publish import publish_model
from tasks.start import init_source, start_from
from tasks.train import LOCAL_TRAIN_TAG, train_local

DEFAULT_FILE = DEFAULT_PIPELINES_FILE
quiet_user_errors()  # a UserError in a task or the flow: its one line in every log, no traceback
GIB = 1024**3


NOT_OVERRIDABLE = {"name", "base_dir", "schedule", "notify"}  # identity, and what only `fitburst serve` applies
OVERRIDABLE_ONLY = {"schedule": {"when"}}  # of those sections, what one run may change


def overrides_schema() -> dict:
    """JSON schema of the ``overrides`` parameter, derived from PipelineSpec: every field as a dotted key
    (``"training.max_steps": 20``) or nested (``{"training": {"max_steps": 20}}``), with its type, range and choices,
    and no unknown keys. The Prefect server checks a deployment run's parameters against it before the run exists;
    what JSON schema cannot say (cross-field rules, ${ENV} references) is checked by fitburst.spec in the flow, with
    located messages."""

    def leaf(model: type[BaseModel], name: str) -> dict:
        prop = dict(model.model_json_schema()["properties"][name])
        for k in ("default", "title"):
            prop.pop(k, None)
        return prop

    def section(model: type[BaseModel], prefix: str, flat: dict) -> dict:
        props = {}
        for name, field in model.model_fields.items():
            keep = OVERRIDABLE_ONLY.get(prefix.rstrip("."))
            if (not prefix and name in NOT_OVERRIDABLE - set(OVERRIDABLE_ONLY)) or (keep is not None and
                                                                                   name not in keep):
                continue
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                props[name] = section(ann, f"{prefix}{name}.", flat)
            else:
                props[name] = flat[f"{prefix}{name}"] = leaf(model, name)
        return {"type": "object", "properties": props, "additionalProperties": False}

    flat: dict = {}
    nested = section(PipelineSpec, "", flat)
    return {"type": "object", "title": "overrides",
            "description": 'pipeline fields to change for this run, e.g. {"training.max_steps": 20}',
            "properties": {**nested["properties"], **dict(sorted(flat.items()))}, "additionalProperties": False}


# A plain dict in Python (fitburst.spec validates it and locates mistakes); a strict schema for the Prefect server.
Overrides = Annotated[dict[str, Any] | None, WithJsonSchema(overrides_schema())]


def flow_run_name() -> str:
    """``<pipeline>-<UTC date>-<first 8 hex of the flow run id>``, e.g. ``demo-2026-11-23-1a2b3c4d``."""
    from datetime import datetime, timezone

    pipeline = runtime.flow_run.parameters.get("pipeline", "run")
    return f"{pipeline}-{datetime.now(timezone.utc):%Y-%m-%d}-{str(runtime.flow_run.id).replace('-', '')[:8]}"


@flow(name="finetune", log_prints=True, flow_run_name=flow_run_name)
def finetune(pipeline: str = "demo", overrides: Overrides = None, pipelines_file: str = DEFAULT_FILE,
             dry_run: bool = False) -> dict | State:
    """Run one pipeline from pipelines.yaml; ``overrides`` takes dotted keys, e.g. {"training.max_steps": 20}."""
    try:  # a bad spec fails here, before any compute
        spec = load_pipeline(pipelines_file, pipeline, overrides)
    except UserError as e:  # one located message in the run's log and state, no traceback (deployment params)
        get_run_logger().error("%s", e)
        return Failed(message=str(e), data=e)
    tracker = Tracker.start(spec, tags={"prefect.flow_run_id": str(runtime.flow_run.id or ""),
                                        "dry_run": str(dry_run).lower()})
    status = "FAILED"
    gpu = ExitStack()  # the local-GPU slot, held from the preflight (it budgets against free memory) to the end
    try:
        tracker.log_spec(spec)
        # checked before any compute, a dry run's too (it would fail the same way for real)
        init = init_source(spec, tracker, dry_run=dry_run) if spec.method.init_from != "none" else None
        prepared = data_prep(spec, tracker, dry_run=dry_run)
        if not dry_run:
            assert prepared is not None  # data_prep returns None only for a dry run
            unchanged = what_changed(spec, prepared, tracker, scheduled=started_by_schedule(), init=init)
            if unchanged is not None:  # the flow run ends Completed, its MLflow run FINISHED, nothing trained
                status = "FINISHED"
                return Completed(message=unchanged, data={"pipeline": spec.name, "mlflow_run_id": tracker.run_id,
                                                          "tracking_uri": tracker.uri, "trained": False,
                                                          "message": unchanged})
            if init is not None:
                spec = start_from(spec, init, tracker)
            gpu.enter_context(local_gpu_slot())
        report: PreflightReport = preflight_task(spec, prepared, tracker)
        if report.verdict.placement != "local":
            gpu.close()  # a burst or a refusal does not keep the local GPU
        summary = {"pipeline": spec.name, "mlflow_run_id": tracker.run_id, "tracking_uri": tracker.uri,
                   "verdict": report.verdict.placement, "reason": report.reason, "device": report.device.name,
                   "plan": report.changes, "estimated_peak_bytes": report.estimate.device_total_bytes,
                   "estimated_comparable_bytes": report.estimate.comparable_bytes(report.device.kind)}
        if report.verdict.placement == "fail":
            raise PreflightFailed(f"{spec.name}: {report.reason}")
        planned = report.planned_spec()
        tracker.log_planned(spec, planned)
        if planned.data != spec.data and not dry_run:  # the plan lowered the image resolution: images re-prepared
            prepared = data_prep(planned, tracker)
        if dry_run and report.verdict.placement == "local":
            status = "FINISHED"
            return summary
        placement = report.verdict.placement
        if placement == "local":
            assert prepared is not None  # data_prep returns None only for a dry run, which has returned
            try:
                result = train_local(planned, prepared, tracker, report.estimate)
            except OOMLadderExhausted as oom:
                if not oom.burst_allowed:
                    raise  # its message names the measured peak and the setting that would have fit
                gpu.close()
                placement = summary["verdict"] = "burst"
                result, ev = _burst_after_oom(spec, planned, prepared, report, tracker, oom)
            else:
                ev = evaluate_task(planned, prepared, result, tracker) if planned.eval.enabled else None
        else:
            result, ev = _burst(spec, prepared, report, tracker, dry_run)
            if dry_run:
                summary.update(candidates=[c.to_dict() for c in report.candidates[:4]], burst_plan=result.report)
                status = "FINISHED"
                return summary
        summary.update(publish_model(planned, result, ev, tracker, placement,
                                     "local" if placement == "local" else "cloud", init=init))
        summary.update(run_dir=result.run_dir, adapter_dir=result.adapter_dir, trained_on=result.device,
                       steps=result.steps, measured_peak_bytes=result.peak.allocated_bytes)
        if ev is not None:
            summary.update(eval_base_loss=ev.base_loss, eval_tuned_loss=ev.tuned_loss)
        _publish_summary(summary)
        get_run_logger().info("%s", tracker.where())
        status = "FINISHED"
        return summary
    except BaseException as exc:  # Ctrl-C, and Prefect's TerminationSignal on cancellation, are not Exceptions
        if not isinstance(exc, Exception):
            status = "KILLED"
        raise
    finally:
        gpu.close()
        tracker.end(status)  # never raises: a closing failure cannot hide the error that ended the run


def started_by_schedule() -> bool:
    """Whether the deployment's schedule created this flow run (rather than a person: `fitburst run`, `prefect
    deployment run`, the UI): ``schedule.when`` then defaults to ``changed``."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return bool(ctx and ctx.flow_run and ctx.flow_run.auto_scheduled)


@contextmanager
def local_gpu_slot() -> Iterator[None]:
    """The slot of the ``tag:fitburst-local-train`` concurrency limit (`fitburst serve` creates it, limit 1), held
    by this flow run so a second scheduled run neither budgets against this run's memory nor trains beside it.
    Without the limit (a plain `fitburst run`) nothing is held, and nothing is said about it (Prefect would log a
    warning the user has nothing to do about)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectNotFound

    name = f"tag:{LOCAL_TRAIN_TAG}"
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            yield
            return
    holder = ConcurrencyLeaseHolder(type="flow_run", id=runtime.flow_run.id) if runtime.flow_run.id else None
    with concurrency(name, occupy=1, holder=holder):
        yield


def _burst_after_oom(spec, planned, prepared, report: PreflightReport, tracker: Tracker, oom: OOMLadderExhausted):
    """Local training ran out of memory with every step-down taken and the burst policy allows the cloud: the run
    folder's checkpoint travels to a cloud GPU, which resumes it."""
    peak = f"{oom.peak_bytes / GIB:.2f} GiB" if oom.peak_bytes else "not measured"
    get_run_logger().warning("out of memory on %s at step %d with every step-down taken (measured peak %s): "
                             "bursting; the cloud node resumes checkpoint step-%d of %s", oom.device, oom.step,
                             peak, oom.step, oom.run_dir)
    tracker.set_tags({"path": "cloud", "oom.burst_from_step": str(oom.step),
                      "oom.measured_peak_bytes": str(oom.peak_bytes)})
    report.candidates = cloud_candidates(spec, report)
    return _burst(spec, prepared, report, tracker, False, folder_spec=planned)


def _burst(spec, prepared, report: PreflightReport, tracker: Tracker, dry_run: bool,
           folder_spec: PipelineSpec | None = None):
    """The cloud path: the same `fitburst train --eval` on a rented GPU; results come home into this run.
    ``folder_spec`` (default ``spec``) keys the run folder: the local plan's, to resume its checkpoints there."""
    from fitburst.evaluate import EvalResult
    from fitburst.rundir import open_run_dir, release
    from tasks.burst import train_cloud

    if spec.method.init_from != "none" and not dry_run:
        raise PreflightFailed(f"{spec.name}: method.init_from ({spec.method.init_from}) does not travel to a cloud "
                              "node yet: train it here (burst.policy: never) or set method.init_from: none")
    if prepared is None and not dry_run:
        raise PreflightFailed(f"{spec.name}: the data could not be tokenized here (tokenizer not reachable), so "
                              "there is nothing to send to the cloud node; run with network access to the hub")
    run_dir, _ = open_run_dir(folder_spec or spec, data_hash=prepared.content_hash if prepared else None)
    local = {"device": report.device.name, "fits": report.plan.fits, "hours": report.local_hours,
             "estimate": report.estimate.to_dict()}  # leaves the process with the burst record
    try:
        result = train_cloud(spec, prepared, tracker, report.candidates, run_dir, dry_run=dry_run, local=local)
    finally:
        release(run_dir)
    if dry_run:
        return result, None
    assert isinstance(result, TrainResult)  # a real burst returns the pulled-back TrainResult
    ev = EvalResult.load(result.run_dir) if (run_dir / "eval.json").exists() else None
    if ev is not None:
        tracker.log_eval(ev)
    return result, ev


def _mlflow_facts(s: dict) -> dict:
    """Experiment id and the cloud tags (provider, GPU, cost) of the run's MLflow record; {} if unreadable."""
    try:
        from mlflow.tracking import MlflowClient

        run = MlflowClient(s["tracking_uri"]).get_run(s["mlflow_run_id"])
        return {"experiment_id": run.info.experiment_id, **run.data.tags}
    except Exception:  # the summary must not fail a finished run
        return {}


def _publish_summary(s: dict) -> None:
    """The run's summary artifact (linked to its MLflow run; cost when bursted) and the events that
    `fitburst serve`'s notifications listen for: fitburst.run.completed, and fitburst.run.bursted with the cost."""
    from prefect.events import emit_event

    def gib(v):
        return f"{v / GIB:.3f} GiB" if v else "n/a"

    facts = _mlflow_facts(s)
    uri = redact(s["tracking_uri"])
    cost = facts.get("cloud.cost_usd")
    bursted = facts.get("path") == "cloud" or s["verdict"] == "burst"
    lines = [f"## Run summary: `{s['pipeline']}`", "", "| | |", "|---|---|",
             f"| verdict | {s['verdict']} on {s['device']} |", f"| trained on | {s.get('trained_on')} |",
             f"| estimated peak (device total) | {gib(s['estimated_peak_bytes'])} |",
             f"| estimated vs measured (same measure) | {gib(s['estimated_comparable_bytes'])} vs "
             f"{gib(s.get('measured_peak_bytes'))} |"]
    if "eval_base_loss" in s:
        lines.append(f"| eval loss | {s['eval_base_loss']:.4f} -> {s['eval_tuned_loss']:.4f} |")
    if bursted:
        where = " ".join(filter(None, (facts.get("cloud.provider"), facts.get("cloud.accelerator"),
                                       facts.get("cloud.region"))))
        lines.append(f"| cloud | {where or 'n/a'} |")
        lines.append(f"| cost | {'$' + cost if cost else 'n/a'} |")
    lines.append(f"| MLflow run | `{s['mlflow_run_id']}` |")
    lines.append(f"| MLflow tracking URI | `{uri}` |")
    if uri.startswith(("http://", "https://")) and facts.get("experiment_id"):
        link = (f"{uri.rstrip('/')}/#/experiments/{facts['experiment_id']}/runs/{s['mlflow_run_id']}"
                "?workflowType=machine_learning")  # MLflow 3's UI: the model-training views, not GenAI
        lines.append(f"| MLflow UI | [{s['mlflow_run_id']}]({link}) |")
    else:
        lines.append(f"| open it | `mlflow ui --backend-store-uri '{uri}'`, run `{s['mlflow_run_id']}` |")
    create_markdown_artifact(key=f"summary-{artifact_key(s['pipeline'])}", markdown="\n".join(lines),
                             description="fitburst run summary")

    text = f"{s['pipeline']}: trained on {s.get('trained_on')} ({s['verdict']})"
    if "eval_base_loss" in s:
        text += f", eval loss {s['eval_base_loss']:.4f} -> {s['eval_tuned_loss']:.4f}"
    text += f", peak {gib(s.get('measured_peak_bytes'))} (estimated {gib(s['estimated_peak_bytes'])})"
    if bursted:
        text += f", cost {'$' + cost if cost else 'n/a'}"
    text += f"; MLflow run {s['mlflow_run_id']} at {uri}"
    payload = {"text": text, "pipeline": s["pipeline"], "mlflow_run_id": s["mlflow_run_id"], "tracking_uri": uri,
               "verdict": s["verdict"], "trained_on": str(s.get("trained_on")), "cost_usd": cost,
               "eval_base_loss": s.get("eval_base_loss"), "eval_tuned_loss": s.get("eval_tuned_loss")}
    resource = {"prefect.resource.id": f"fitburst.pipeline.{s['pipeline']}", "prefect.resource.name": s["pipeline"]}
    emit_event("fitburst.run.completed", resource=resource, payload=payload)
    if bursted:
        emit_event("fitburst.run.bursted", resource=resource, payload=payload)
