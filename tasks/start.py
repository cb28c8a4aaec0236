"""DAG node 1b (``method.init_from``): the adapter the run starts from, found and checked before data prep, fetched
once the run is known to train; recorded in MLflow as the run's input model and tags (lineage)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from fitburst.init_adapter import InitSource, fetch_init, resolve_init
from fitburst.spec import PipelineSpec
from fitburst.tracking import INIT_TAG, Tracker


@task(name="init-source", cache_policy=NONE)
def init_source(spec: PipelineSpec, tracker: Tracker, *, dry_run: bool = False) -> InitSource | None:
    """The checked starting adapter (InitMismatch says what differs); recorded as lineage unless ``dry_run``."""
    src = resolve_init(spec, tracker.uri)
    if src is None:
        if spec.method.init_from == "champion":
            get_run_logger().info("%s has no champion yet: this run trains a fresh LoRA",
                                  spec.tracking.register_as)
        return None
    if dry_run:  # a run that trains nothing has no lineage
        get_run_logger().info("would start from %s", src.uri)
        return src
    tracker.log_init_source(src.uri, src.run_id, src.model, src.version)
    get_run_logger().info("starting from %s%s", src.uri, f" (run {src.run_id})" if src.run_id else "")
    return src


@task(name="fetch-init", cache_policy=NONE)
def start_from(spec: PipelineSpec, src: InitSource, tracker: Tracker) -> PipelineSpec:
    """``spec`` with ``method.init_from`` the adapter folder on this machine."""
    started = fetch_init(spec, src, tracker.uri)
    tracker.set_tags({f"{INIT_TAG}.folder": started.method.init_from})
    return started
