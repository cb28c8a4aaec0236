"""DAG node 5: the tuned model into MLflow (logged model; a registry version with the champion alias when
``tracking.register_as`` is set) and, opt-in, the adapter with a model card to the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from fitburst.evaluate import EvalResult
from fitburst.init_adapter import InitSource
from fitburst.models import model_family
from fitburst.spec import PipelineSpec, resolve_env
from fitburst.tracking import Tracker
from fitburst.train import TrainResult


@task(name="publish-model", cache_policy=NONE)
def publish_model(spec: PipelineSpec, result: TrainResult, ev: EvalResult | None, tracker: Tracker,
                  verdict: str, path: str, init: InitSource | None = None) -> dict:
    """``init``: the registered version the run started from; while it is the champion, the new version must beat
    its loss on this run's validation split (measured by the eval) to take the alias."""
    log = get_run_logger()
    out: dict = {}
    tr = spec.tracking
    if not Path(result.adapter_dir).is_dir():  # a cloud node that logged its outputs itself, nothing pulled home
        log.info("adapter not on this machine (%s): no MLflow model logged here", result.adapter_dir)
        return out
    if ev is not None:
        tracker.log_loss_curve(result.run_dir, ev)  # the loss curve again, now with the validation points
    tags = {"pipeline": spec.name, "verdict": verdict, "path": path, "method": spec.method.type}
    if ev is not None:
        tags.update({"eval.tuned_loss": f"{ev.tuned_loss:.6f}", "eval.base_loss": f"{ev.base_loss:.6f}",
                     "eval.delta_loss": f"{ev.delta_loss:.6f}"})
    family = model_family(spec.model) if tr.log_model or tr.register_as else None
    if family is not None and not family.logs_model:
        log.warning("tracking.log_model: fitburst logs chat (causal) models with MLflow's transformers flavor; this "
                    "%s model's adapter stays a run artifact (tracking.log_model: false silences this)", family.name)
    elif family is not None:
        info = tracker.log_model(spec, result.adapter_dir, precision=result.precision, tags=tags)
        out["model_uri"] = info.model_uri
        log.info("logged model %s", info.model_uri)
        if tr.register_as:
            same = None
            if init is not None and init.model == tr.register_as and init.version and ev is not None and \
                    ev.init_loss is not None:
                same = (init.version, ev.init_loss)
            reg = tracker.register_model(tr.register_as, info.model_id, tags,
                                         ev.tuned_loss if ev is not None else None, same_split=same)
            out.update(registered_model=tr.register_as, **reg)
            log.info("registered %s version %d; champion: version %s%s", tr.register_as, reg["version"],
                     reg["champion"], " (moved)" if reg["moved"] else "")
    if tr.push_to_hub:
        from fitburst.share import model_card, push_adapter

        metrics = tracker.client.get_run(tracker.run_id).data.metrics
        card = model_card(spec, base=spec.model.name, run_id=tracker.run_id, metrics=metrics,
                          tags={"path": path, "device": result.device, "precision": result.precision})
        out["hub_commit"] = push_adapter(tr.push_to_hub, result.adapter_dir, card,
                                         token=resolve_env(spec.model.hf_token))
        tracker.set_tags({"hub.repo": tr.push_to_hub})
        log.info("pushed the adapter to %s", tr.push_to_hub)
    return out
