"""MLflow: the one place fitburst writes run records (local and cloud paths alike).

Every call names its run id explicitly (no thread-local active run), so a record can be written from a Prefect
task thread, a subprocess or the cloud node. Values of secret-looking environment variables are scrubbed from
everything written here.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import asdict
from pathlib import Path

from fitburst import __version__
from fitburst.spec import PipelineSpec

SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL)", re.I)
RUN_ID_ENV = "FITBURST_MLFLOW_RUN_ID"


def secret_values() -> list[str]:
    """Values of environment variables whose names look secret (long enough to be worth scrubbing)."""
    return sorted((v for k, v in os.environ.items() if SECRET_NAME.search(k) and len(v) >= 6), key=len, reverse=True)


def redact(text: str) -> str:
    for v in secret_values():
        text = text.replace(v, "***")
    return re.sub(r"(://[^:/@\s]+:)[^@\s]+@", r"\1***@", text)  # user:password@host in URIs


def tracking_uri(spec: PipelineSpec | None = None) -> str:
    """MLFLOW_TRACKING_URI, else the pipeline's tracking.uri, else sqlite in the working directory."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if spec is not None and spec.tracking.uri:
        return spec.tracking.uri
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, list | dict) else str(v)
    return out


def git_sha() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


class Tracker:
    """One MLflow run. Create with :meth:`start` (new run) or :meth:`attach` (existing run id)."""

    def __init__(self, run_id: str, uri: str):
        from mlflow.tracking import MlflowClient

        self.run_id, self.uri = run_id, uri
        self.client = MlflowClient(tracking_uri=uri)

    @classmethod
    def start(cls, spec: PipelineSpec, tags: dict[str, str] | None = None) -> Tracker:
        from mlflow.tracking import MlflowClient

        uri = tracking_uri(spec)
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(spec.tracking.experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(spec.tracking.experiment)
        base = {"pipeline": spec.name, "fitburst.version": __version__, "config_hash": spec.config_hash(),
                "model": spec.model.name, "method": spec.method.type, **spec.tags}
        if sha := git_sha():
            base["git_sha"] = sha
        run = client.create_run(exp_id, run_name=spec.name, tags={k: redact(str(v)) for k, v in
                                                                    {**base, **(tags or {})}.items()})
        return cls(run.info.run_id, uri)

    @classmethod
    def attach(cls, run_id: str, uri: str | None = None) -> Tracker:
        return cls(run_id, uri or tracking_uri())

    # --- plain records ---------------------------------------------------------------------------------
    def set_tags(self, tags: dict) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, redact(str(v)))

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, redact(v)[:6000]) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items() if v is not None]
        if items:
            self.client.log_batch(self.run_id, metrics=items)

    def log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, redact(text), name)

    def log_dict(self, d: dict, name: str) -> None:
        self.log_text(json.dumps(d, indent=2, default=str), name)

    def log_artifacts(self, path: str | Path, dest: str | None = None) -> None:
        p = Path(path)
        if p.is_dir():
            self.client.log_artifacts(self.run_id, str(p), dest)
        else:
            self.client.log_artifact(self.run_id, str(p), dest)

    def end(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status)

    # --- fitburst records -------------------------------------------------------------------------------
    def log_spec(self, spec: PipelineSpec) -> None:
        """The resolved config: params (flattened) and the YAML as an artifact; ${ENV} refs stay refs."""
        self.log_params(spec.model_dump(mode="json", exclude={"base_dir", "description"}))
        self.log_text(spec.to_yaml(), "config/pipeline.yaml")

    def log_planned(self, spec: PipelineSpec, planned: PipelineSpec) -> None:
        """What the preflight changed: ``planned.<field>`` params for each changed field, and the YAML that trains
        (``config/planned.yaml``). MLflow params cannot be overwritten, so the declared config stays as logged."""
        exclude = {"base_dir", "description"}
        before = flatten(spec.model_dump(mode="json", exclude=exclude))
        after = flatten(planned.model_dump(mode="json", exclude=exclude))
        changed = {f"planned.{k}": v for k, v in after.items() if before.get(k) != v}
        if changed:
            self.log_params(changed)
        self.log_text(planned.to_yaml(), "config/planned.yaml")

    def log_prepared(self, prepared) -> None:
        self.log_params({"data.content_hash": prepared.content_hash, "data.n_train": prepared.n_train,
                         "data.n_val": prepared.n_val, "data.n_skipped": prepared.n_skipped})
        self.log_metrics({f"data.tokens_{k}": v for k, v in prepared.stats.items()
                          if isinstance(v, int | float)})

    def log_preflight(self, report) -> None:
        rep = report.to_dict()  # the report leaves the process here
        est = rep["estimate"]
        self.set_tags({"device": rep["device"]["name"], "verdict": rep["verdict"]})
        from fitburst.memory.estimator import measured_counterpart

        self.log_metrics({"memory.estimated_peak_bytes": est["device_total_bytes"],
                          "memory.estimated_allocated_bytes": est["allocated_peak_bytes"],
                          # the figure memory.measured_peak_bytes compares with on this device kind
                          "memory.estimated_comparable_bytes": measured_counterpart(est, rep["device"]["kind"]),
                          "memory.estimated_reserved_bytes": est["reserved_peak_bytes"],
                          "memory.budget_bytes": est["budget_bytes"]})
        self.log_dict(rep, "preflight/report.json")
        self.log_text(report.to_markdown(), "preflight/report.md")
        with tempfile.TemporaryDirectory() as d:
            from fitburst.plots import memory_bar_chart

            title = f"{rep['pipeline']} on {rep['device']['name']}"
            memory_bar_chart(est, Path(d) / "memory_breakdown.png", title=title)
            self.log_artifacts(Path(d) / "memory_breakdown.png", "preflight")

    def log_train(self, result, path: str = "local") -> None:
        """Measured peak, run facts, the adapter folder and the loss / memory plots."""
        peak = result.peak
        self.set_tags({"path": path, "device": result.device, "precision": result.precision})
        self.log_metrics({"memory.measured_peak_bytes": peak.get("allocated_bytes"),
                          "memory.measured_reserved_bytes": peak.get("reserved_bytes"),
                          "memory.measured_rss_peak_bytes": peak.get("rss_peak_bytes"),
                          "train.steps": result.steps, "train.seconds": result.seconds,
                          "train.steps_per_sec": result.steps_per_sec, "train.tokens": result.tokens,
                          "train.final_loss": result.final_loss, "params.trainable": result.trainable_params,
                          "params.total": result.total_params})
        self.log_dict(asdict(result), "train/train_result.json")
        self.log_artifacts(result.adapter_dir, "adapter")
        metrics = Path(result.run_dir) / "metrics.jsonl"
        if metrics.exists():
            self.log_artifacts(metrics, "train")
            from fitburst.plots import loss_curve

            with tempfile.TemporaryDirectory() as d:
                loss_curve(metrics, Path(d) / "loss.png", title=result.run_dir)
                self.log_artifacts(Path(d) / "loss.png", "train")

    def log_memory_comparison(self, estimate: dict, result) -> None:
        from fitburst.memory.estimator import measured_counterpart
        from fitburst.plots import memory_bar_chart

        measured, kind = result.peak.get("allocated_bytes"), result.peak.get("kind") or result.device
        comparable = measured_counterpart(estimate, kind)
        self.log_metrics({"memory.estimated_comparable_bytes": comparable,
                          "memory.measured_over_estimated": measured / comparable if measured and comparable else None})

        with tempfile.TemporaryDirectory() as d:
            memory_bar_chart(estimate, Path(d) / "memory.png", measured=result.peak, title="estimated vs measured")
            self.log_artifacts(Path(d) / "memory.png", "train")

    def log_eval(self, ev) -> None:
        self.log_metrics({"eval.base_loss": ev.base_loss, "eval.base_ppl": ev.base_ppl,
                          "eval.tuned_loss": ev.tuned_loss, "eval.tuned_ppl": ev.tuned_ppl,
                          "eval.delta_loss": ev.delta_loss, "eval.n_tokens": ev.n_tokens})
        if ev.samples:
            cols = list(ev.samples[0])
            self.client.log_table(self.run_id, {c: [redact(str(s[c])) for s in ev.samples] for c in cols},
                                  "eval/samples.json")

    def where(self) -> str:
        """How to open this run: the store and an `mlflow ui` command."""
        store = redact(self.uri)
        return f"MLflow run {self.run_id} in {store}\n  open it with: mlflow ui --backend-store-uri {store}"
