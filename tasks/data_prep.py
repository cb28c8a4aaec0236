"""DAG node 1: tokenize and split the pipeline's data (cached by content hash)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from fitburst.data import PreparedData, prepare_pipeline
from fitburst.data_facts import known_miss, remember_miss
from fitburst.models import tokenizer_for
from fitburst.spec import PipelineSpec
from fitburst.tracking import Tracker


@task(name="data-prep", cache_policy=NONE)
def data_prep(spec: PipelineSpec, tracker: Tracker, dry_run: bool = False) -> PreparedData | None:
    """Prepared splits; for a dry run whose tokenizer cannot be fetched (offline), None: the preflight then
    plans for the worst case, data.max_seq_len."""
    log = get_run_logger()
    m = spec.model
    if dry_run and (why := known_miss(spec)) is not None:  # asked within the hour: the hub's retries not again
        log.warning("dry run: the tokenizer of %s could not be loaded within the hour (%s); planning for "
                    "data.max_seq_len=%d", m.name, why, spec.data.max_seq_len)
        return None
    try:
        tok = tokenizer_for(m)
    except OSError as e:
        if not dry_run:
            raise
        remember_miss(spec, e)
        log.warning("dry run: cannot load the tokenizer of %s (%s); planning for data.max_seq_len=%d",
                    m.name, type(e).__name__, spec.data.max_seq_len)
        return None
    prepared = prepare_pipeline(spec, tok)
    s = prepared.stats
    log.info("%d train / %d val records (%d skipped); tokens p50 %d, p95 %d, max %d; cache %s",
             prepared.n_train, prepared.n_val, prepared.n_skipped, s["p50"], s["p95"], s["max"], prepared.dir)
    tracker.log_prepared(prepared, source=spec.data_path())
    return prepared
