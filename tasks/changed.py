"""DAG node 1c (``schedule.when``): did anything the adapter depends on change since the pipeline's last completed
training? The fingerprint and what changed go to the MLflow run; a run with nothing to do says since when."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE

from fitburst.data import PreparedData
from fitburst.history import (
    TRAINED_TAG,
    UNCHANGED_TAG,
    fingerprint,
    fingerprint_parts,
    fingerprint_tags,
    last_trained,
    unchanged_message,
)
from fitburst.init_adapter import InitSource
from fitburst.spec import PipelineSpec
from fitburst.tracking import Tracker
from tasks import artifact_key


@task(name="what-changed", cache_policy=NONE)
def what_changed(spec: PipelineSpec, prepared: PreparedData, tracker: Tracker, *, scheduled: bool,
                 init: InitSource | None) -> str | None:
    """"nothing changed since run <id> (<date>)" when the run has nothing to train, else None (it trains)."""
    log = get_run_logger()
    parts = fingerprint_parts(spec, prepared.content_hash, init.fingerprint if init else None)
    tracker.set_tags(fingerprint_tags(parts))
    when = spec.schedule.when or ("changed" if scheduled else "always")
    past = last_trained(tracker.uri, spec.tracking.experiment, spec.name) if when == "changed" else None
    if past is not None and past.fingerprint == fingerprint(parts):
        message = unchanged_message(past)
        tracker.set_tags({TRAINED_TAG: "false", UNCHANGED_TAG: past.run_id, "mlflow.note.content": message})
        create_markdown_artifact(
            key=f"unchanged-{artifact_key(spec.name)}", description=f"{spec.name}: nothing to train",
            markdown=f"## `{spec.name}`: {message}\n\nData, settings, base model and revision, training code and "
                     f"starting adapter are those of MLflow run `{past.run_id}` (fingerprint `{past.fingerprint}`); "
                     "nothing was trained. `fitburst run --force` (or `schedule.when: always`) trains anyway.")
        log.info("%s: %s; not training (schedule.when: %s)", spec.name, message, when)
        return message
    tracker.set_tags({TRAINED_TAG: "true"})
    if past is not None:
        log.info("changed since run %s: %s", past.run_id, ", ".join(past.changed(parts)))
    return None
