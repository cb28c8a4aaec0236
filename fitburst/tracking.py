"""MLflow: the one place fitburst writes run records (local and cloud paths alike).

Every call names its run id explicitly (no thread-local active run), so a record can be written from a Prefect
task thread, a subprocess or the cloud node. Values of secret-looking environment variables are scrubbed from
everything written here.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import tempfile
import threading
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from fitburst import __version__
from fitburst.data import DataError, iter_records, load_split
from fitburst.device import torch_dtype
from fitburst.environ import redact
from fitburst.memory import Estimate
from fitburst.models import load_model, load_tokenizer, resolve_model_ref
from fitburst.outbox import OUTBOX_FILE, OUTBOX_FLUSH_S, Outbox
from fitburst.plots import loss_curve, memory_bar_chart, memory_comparison
from fitburst.spec import PipelineSpec, resolve_env

if TYPE_CHECKING:  # the training side (torch) stays out of tracking's imports
    from fitburst.supervisor import StepDown

RUN_ID_ENV = "FITBURST_MLFLOW_RUN_ID"
OWNER_TAG = "fitburst.owner"  # host:pid:process start time of the process that opened the run
PREVIOUS_TAG = "fitburst.closed_stale_runs"  # runs of this pipeline found open with a dead owner, closed on start
RESUMED_TAG = "fitburst.resumed_from_run"  # the run whose checkpoint this run resumed
INIT_TAG = "fitburst.init_from"  # the adapter a run started from (method.init_from): models:/NAME/VERSION or a folder
SYSTEM_METRICS_CLOSE_S = 5.0  # the wait for the system metrics' last samples: two requests to a live server

log = logging.getLogger(__name__)


def tracking_uri(spec: PipelineSpec | None = None) -> str:
    """MLFLOW_TRACKING_URI, else the pipeline's tracking.uri, else sqlite in the working directory."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if spec is not None and spec.tracking.uri:
        return spec.tracking.uri
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


class RunRecord(TypedDict):
    """One MLflow run as plain data: its id, metrics and tags."""

    run_id: str
    metrics: dict[str, float]
    tags: dict[str, str]


def first_use_lock(uri: str) -> AbstractContextManager:
    """A lock beside a sqlite store, held while a run finds or creates its experiment: MLflow creates the store's
    tables on first use, and two runs starting together on a fresh file (two deployments triggered at once) would
    otherwise both create them, one failing with sqlite's OperationalError. Other stores need none."""
    if not uri.startswith("sqlite:///"):
        return nullcontext()
    from filelock import FileLock

    return FileLock(uri[len("sqlite:///"):] + ".lock")


def memory_runs(uri: str, experiment: str | None = None) -> list[RunRecord]:
    """The runs in the store at ``uri`` (one ``experiment``, or all) that measured a peak
    (``memory.measured_peak_bytes`` > 0): what ``fitburst calibrate`` fits from."""
    from mlflow.tracking import MlflowClient  # mlflow: heavy, loaded only when the store is read

    client = MlflowClient(tracking_uri=uri)
    if experiment:
        exp = client.get_experiment_by_name(experiment)
        ids = [exp.experiment_id] if exp else []
    else:
        ids = [e.experiment_id for e in client.search_experiments()]
    if not ids:
        return []
    found = client.search_runs(ids, "metrics.`memory.measured_peak_bytes` > 0", max_results=50000)
    return [RunRecord(run_id=r.info.run_id, metrics=dict(r.data.metrics), tags=dict(r.data.tags)) for r in found]


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
        from mlflow.tracking import MlflowClient  # heavy: loaded only to log

        self.run_id, self.uri = run_id, uri
        self.client = MlflowClient(tracking_uri=uri)
        self.outbox: Outbox | None = None  # set by use_outbox(): metrics then go to the run folder first
        self.stepdowns = 0

    @classmethod
    def start(cls, spec: PipelineSpec, tags: dict[str, str] | None = None) -> Tracker:
        from mlflow.tracking import MlflowClient  # heavy: loaded only to log

        uri = tracking_uri(spec)
        with first_use_lock(uri):
            client = MlflowClient(tracking_uri=uri)
            exp = client.get_experiment_by_name(spec.tracking.experiment)
            exp_id = exp.experiment_id if exp else client.create_experiment(spec.tracking.experiment)
            mark_model_training(client, exp_id, exp.tags if exp else {})
        base = {"pipeline": spec.name, "fitburst.version": __version__, "config_hash": spec.config_hash(),
                "model": spec.model.name, "method": spec.method.type, **spec.tags}
        if sha := git_sha():
            base["git_sha"] = sha
        base[OWNER_TAG] = owner_id()
        closed = close_stale_runs(client, exp_id, spec.name)
        if closed:
            base[PREVIOUS_TAG] = ",".join(closed)
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
        from mlflow.entities import Param  # heavy: loaded only to log

        items = [Param(k, redact(v)[:6000]) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:

        from mlflow.entities import Metric  # heavy: loaded only to log

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items() if v is not None]
        if items and self.outbox is not None:
            self.outbox.put(self.run_id, items)
        elif items:
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

    def end(self, status: str = "FINISHED", flush_timeout: float = OUTBOX_FLUSH_S) -> None:
        """Close the run. Never raises: a closing failure (server down) must not hide the error that ended the run;
        with an outbox the close is queued there (after waiting up to ``flush_timeout`` s for the metrics to go)
        and replayed with the metrics by the next start."""
        if self.outbox is not None:
            self.outbox.flush(timeout=flush_timeout)
        try:
            self.client.set_terminated(self.run_id, status)
        except Exception as e:  # noqa: BLE001 - any transport/store failure
            log.warning("could not close MLflow run %s as %s (%s)%s", self.run_id, status, redact(str(e))[:300],
                        "; queued in the run folder's outbox" if self.outbox is not None else "")
            if self.outbox is not None:
                self.outbox.put_end(self.run_id, status)
        if self.outbox is not None:
            self.outbox.close()

    def use_outbox(self, run_dir: str | Path) -> Outbox:
        """From now on metrics are written to ``run_dir``'s outbox first and sent by a background thread, so an
        MLflow outage never stops training; whatever was left unsent by an earlier attempt is sent too."""
        if self.outbox is None or self.outbox.path != Path(run_dir) / OUTBOX_FILE:
            if self.outbox is not None:
                self.outbox.close()
            self.outbox = Outbox(Path(run_dir) / OUTBOX_FILE, self.uri)
        return self.outbox

    def log_stepdown(self, record: StepDown) -> None:
        """An OOM step-down: tags ``oom.stepdowns`` (count) and ``oom.stepdown.<n>`` (the change), the event as
        ``oom/stepdown-<n>.json``, the measured peak as metric ``oom.measured_peak_bytes`` at its step. Never
        raises (training goes on while MLflow is down; the metric waits in the outbox)."""
        self.stepdowns += 1
        self.log_metrics({"oom.measured_peak_bytes": record.measured_peak_bytes}, step=record.step)
        try:
            self.set_tags({"oom.stepdowns": self.stepdowns, f"oom.stepdown.{self.stepdowns}": record.change})
            self.log_dict(record.to_dict(), f"oom/stepdown-{self.stepdowns}.json")
        except Exception as e:  # noqa: BLE001
            log.warning("could not record the step-down in MLflow (%s)", redact(str(e))[:200])

    def link_previous(self, run_dir: str | Path) -> str | None:
        """Record this run as the owner of ``run_dir`` (``run.json``); when the folder was left by an earlier run
        (a resume), close that run if it is still open and tag this one with its id. Returns the earlier run id."""
        meta_path = Path(run_dir) / "run.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        previous = meta.get("mlflow_run_id")
        if previous and previous != self.run_id:
            try:
                if self.client.get_run(previous).info.status == "RUNNING":
                    self.client.set_terminated(previous, "KILLED")
                    log.warning("closed MLflow run %s of the interrupted attempt as KILLED", previous)
            except Exception as e:  # noqa: BLE001 - another store, deleted run: the link is still worth keeping
                log.warning("could not close the earlier MLflow run %s (%s)", previous, redact(str(e))[:200])
            self.set_tags({RESUMED_TAG: previous})
        meta.update(mlflow_run_id=self.run_id, tracking_uri=redact(self.uri))
        meta_path.write_text(json.dumps(meta))
        return previous if previous != self.run_id else None

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

    def log_prepared(self, prepared, source: str | Path | None = None) -> None:
        """Split sizes and token statistics as params (one value each, not one-point metrics), the statistics as a
        table, and the splits as MLflow dataset inputs (see :meth:`log_dataset_inputs`)."""
        self.log_params({"data.content_hash": prepared.content_hash, "data.n_train": prepared.n_train,
                         "data.n_val": prepared.n_val, "data.n_skipped": prepared.n_skipped})
        self.log_params({f"data.tokens.{k}": round(v, 2) if isinstance(v, float) else v
                         for k, v in prepared.stats.items()})
        self.client.log_table(self.run_id, {"statistic": list(prepared.stats),
                                            "tokens": [prepared.stats[k] for k in prepared.stats]},
                              "data/token_stats.json")
        if source is not None:
            self.log_dataset_inputs(prepared, source)

    def log_preflight(self, report) -> None:
        rep = report.to_dict()  # the report leaves the process here
        est = rep["estimate"]
        band = report.estimate.band
        self.set_tags({"device": rep["device"]["name"], "verdict": rep["verdict"],
                       "memory.band": band.describe() if band else "",
                       "memory.band_measured": str(bool(band and band.measured)).lower(),
                       # what of the run lies outside the GPU's measured runs ("" : inside, or nothing measured)
                       "memory.band_outside": band.outside if band else "",
                       "planned.loss": rep["loss"],
                       "planned.activation_offloading": str(rep["activation_offloading"]).lower(),
                       # the GPUs the plan trains on: the memory.* figures below are one GPU's, *_total all of them
                       "world_size": str(rep["world_size"]), "nodes": str(est["nodes"])})
        self.log_metrics({"memory.estimated_peak_bytes": est["device_total_bytes"],
                          "memory.estimated_allocated_bytes": est["allocated_peak_bytes"],
                          # the figure memory.measured_peak_bytes compares with on this device kind
                          "memory.estimated_comparable_bytes": report.estimate.comparable_bytes(report.device.kind),
                          "memory.estimated_reserved_bytes": est["reserved_peak_bytes"],
                          "memory.budget_bytes": est["budget_bytes"],
                          "memory.estimated_peak_bytes_total": est["totals"]["device_total_bytes"],
                          "memory.estimated_reserved_bytes_total": est["totals"]["reserved_peak_bytes"],
                          "memory.estimated_host_bytes": est["host_bytes"]})
        self.log_dict(rep, "preflight/report.json")
        self.log_text(report.to_markdown(), "preflight/report.md")
        with tempfile.TemporaryDirectory() as d:
            title = f"{rep['pipeline']} on {rep['device']['name']}"
            memory_bar_chart(report.estimate, Path(d) / "memory_breakdown.png", title=title)
            self.log_artifacts(Path(d) / "memory_breakdown.png", "preflight")

    def log_train(self, result, path: str = "local") -> None:
        """Measured peak, run facts, the adapter folder and the loss / memory plots."""
        peak = result.peak
        self.set_tags({"path": path, "device": result.device, "precision": result.precision, "loss": result.loss,
                       "activation_offloading": str(result.activation_offloading).lower()})
        self.log_metrics({"memory.measured_peak_bytes": peak.allocated_bytes,
                          "memory.measured_reserved_bytes": peak.reserved_bytes,
                          "memory.measured_rss_peak_bytes": peak.rss_peak_bytes,
                          "train.steps": result.steps, "train.seconds": result.seconds,
                          "train.steps_per_sec": result.steps_per_sec, "train.tokens": result.tokens,
                          "train.tokens_per_sec": result.tokens_per_sec,
                          "train.final_loss": result.final_loss, "params.trainable": result.trainable_params,
                          "params.total": result.total_params})
        if result.mfu is not None:  # the device's peak is known (fitburst.hours.peak_tflops)
            self.log_metrics({"train.mfu": result.mfu})
        if result.world_size > 1:  # several ranks: the figures above are the highest rank's; each rank's here
            self.set_tags({"train.world_size": str(result.world_size)})
            self.log_metrics({f"memory.rank{r}.measured_peak_bytes": p.allocated_bytes
                              for r, p in enumerate(result.rank_peaks)})
        self.log_dict(asdict(result), "train/train_result.json")
        self.log_artifacts(result.adapter_dir, "adapter")
        metrics = Path(result.run_dir) / "metrics.jsonl"
        if metrics.exists():
            self.log_artifacts(metrics, "train")
            self.log_loss_curve(result.run_dir)

    def log_memory_comparison(self, estimate: Estimate, result) -> None:
        measured, kind = result.peak.allocated_bytes, result.peak.kind or result.device
        comparable = estimate.comparable_bytes(kind)
        self.log_metrics({"memory.estimated_comparable_bytes": comparable,
                          "memory.measured_over_estimated": measured / comparable if measured and comparable else None})

        with tempfile.TemporaryDirectory() as d:
            memory_comparison(estimate, result.peak, Path(d) / "memory.png",
                              title=f"estimated vs measured on {result.device}, same quantity per row")
            self.log_artifacts(Path(d) / "memory.png", "train")

    def log_eval(self, ev) -> None:
        self.log_metrics({"eval.base_loss": ev.base_loss, "eval.base_ppl": ev.base_ppl,
                          "eval.tuned_loss": ev.tuned_loss, "eval.tuned_ppl": ev.tuned_ppl,
                          "eval.delta_loss": ev.delta_loss, "eval.n_tokens": ev.n_tokens,
                          "eval.init_loss": ev.init_loss})
        if ev.samples:
            cols = list(ev.samples[0])
            self.client.log_table(self.run_id, {c: [redact(str(s[c])) for s in ev.samples] for c in cols},
                                  "eval/samples.json")

    # --- model training: lineage, system metrics, the logged and registered model -------------------------
    def log_init_source(self, uri: str, run_id: str | None, model: str | None, version: str | None) -> None:
        """Lineage of a run that starts from an adapter (method.init_from): tags naming it, and a registered
        version's logged model as this run's input model (MLflow's model lineage, shown on both)."""
        self.set_tags({INIT_TAG: uri, **({f"{INIT_TAG}.run_id": run_id} if run_id else {})})
        if model and version:
            from mlflow.entities import LoggedModelInput  # heavy: loaded only to log

            mv = self.client.get_model_version(model, version)
            # the SQL registry keeps a version's logged model only in its source, models:/<model id>
            source = mv.source or ""
            model_id = mv.model_id or (source.removeprefix("models:/") if re.match(r"^models:/m-\w+$", source)
                                       else None)
            if model_id:
                self.client.log_inputs(self.run_id, models=[LoggedModelInput(model_id)])

    def log_dataset_inputs(self, prepared, source: str | Path) -> None:
        """Each prepared split as an MLflow dataset input: the data file as source, the content hash (file, data
        settings and tokenizer) as digest, the split's rows (profile: num_rows) and its token columns (schema)."""
        from mlflow.data.huggingface_dataset import from_huggingface  # heavy: loaded only to log
        from mlflow.entities import DatasetInput, InputTag

        inputs = []
        for split, context in (("train", "training"), ("val", "validation")):
            ds = load_split(prepared, split)
            if split == "val" and not len(ds):
                continue
            d = from_huggingface(ds, source=str(Path(source).resolve()), name=f"{Path(source).stem}-{split}",
                                 digest=prepared.content_hash, targets="labels")
            inputs.append(DatasetInput(d._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)]))
        self.client.log_inputs(self.run_id, datasets=inputs)

    @contextmanager
    def system_metrics(self, interval_s: float = 1.0):
        """CPU, RAM, disk, network (psutil) and GPU (NVML, when nvidia-ml-py and a GPU are present) as
        ``system/*`` metrics of this run while the block runs."""
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor  # heavy: loaded only to log

        monitor = SystemMetricsMonitor(self.run_id, sampling_interval=interval_s, samples_before_logging=1,
                                       resume_logging=True, tracking_uri=self.uri)
        monitor.start()
        try:
            yield monitor
        finally:
            # finish() sends the samples its thread has not logged from the calling thread: with the server gone,
            # that is the training thread waiting on a dead server (MLflow's retries take minutes). It runs on a
            # thread of its own, waited for SYSTEM_METRICS_CLOSE_S, as long as a live server needs.
            closing = threading.Thread(target=monitor.finish, name="mlflow-system-metrics-close", daemon=True)
            closing.start()
            closing.join(SYSTEM_METRICS_CLOSE_S)
            if closing.is_alive():
                log.warning("the last system metrics are still on their way to MLflow after %.0f s; the run goes on",
                            SYSTEM_METRICS_CLOSE_S)

    def log_model(self, spec: PipelineSpec, adapter_dir: str | Path, *, precision: str = "fp32",
                  tags: dict | None = None):
        """The tuned model as an MLflow model (transformers flavor, task ``llm/v1/chat``: chat messages in, the
        tokenizer's chat template applied, greedy decoding). A LoRA/QLoRA adapter is saved alone and references its
        base (a local folder by path, a hub model by id), so the base weights are not copied. The base is loaded on
        CPU in the training dtype to log it, and once more by MLflow to check the input example: for a base too big
        for this machine's RAM set ``tracking.log_model: false``. Returns MLflow's ModelInfo."""
        import mlflow  # heavy: loaded only to log
        from peft import PeftModel

        m = spec.model
        token = resolve_env(m.hf_token)
        tok = load_tokenizer(str(adapter_dir))
        base_ref = resolve_model_ref(m.name)
        dtype = torch_dtype(precision)
        if spec.method.type == "full":
            model = load_model(str(adapter_dir), dtype=dtype, device="cpu")
        else:  # unquantized base on CPU: what the flavor records and reloads (QLoRA trains on a 4-bit copy of it)
            base = load_model(m.name, dtype=dtype, device="cpu", revision=m.revision, token=token,
                              trust_remote_code=m.trust_remote_code)
            model = PeftModel.from_pretrained(base, str(adapter_dir))
        example = None
        # the first usable record of the pipeline's data as it reads it (a hub dataset and data.columns included)
        conv = next((c for _, c in iter_records(spec.data_source(), spec.data) if not isinstance(c, DataError)), None)
        if conv:  # its conversation up to its last reply
            last = max((i for i, msg in enumerate(conv) if msg["role"] == "assistant"), default=len(conv))
            prompt = [{"role": msg["role"], "content": redact(msg["content"])} for msg in conv[:last]]
            example = {"messages": prompt, "max_tokens": spec.eval.max_new_tokens}
        local_base = Path(base_ref).is_dir() and spec.method.type != "full"
        run = self.client.get_run(self.run_id)
        with self._process_uri():
            # created here in the run's experiment: log_model alone files it under MLflow's active experiment
            # (Default, as no run is active in this process), where the run's experiment never shows it
            logged = mlflow.initialize_logged_model(
                name=spec.name, source_run_id=self.run_id, experiment_id=run.info.experiment_id,
                params=dict(run.data.params), tags={k: redact(str(v)) for k, v in (tags or {}).items()})
            return mlflow.transformers.log_model(
                {"model": model, "tokenizer": tok}, name=spec.name, task="llm/v1/chat", run_id=self.run_id,
                model_id=logged.model_id, base_model_path=base_ref if local_base else None, torch_dtype=dtype,
                input_example=example, model_config={"do_sample": False, "max_new_tokens": spec.eval.max_new_tokens},
                pip_requirements=pip_requirements())

    def log_loss_curve(self, run_dir: str | Path, ev=None) -> None:
        """``train/loss.png``: the train loss curve, with the base and tuned validation losses when evaluated."""
        metrics = Path(run_dir) / "metrics.jsonl"
        if not metrics.exists():
            return
        points = {"base": ev.base_loss, "tuned": ev.tuned_loss} if ev is not None else None
        if ev is not None:  # the same two points as a metric beside train_loss: base at step 0, tuned at the last step
            last = json.loads(metrics.read_text().strip().splitlines()[-1])["step"]
            self.log_metrics({"val_loss": ev.base_loss}, step=0)
            self.log_metrics({"val_loss": ev.tuned_loss}, step=last)
        with tempfile.TemporaryDirectory() as d:
            loss_curve(metrics, Path(d) / "loss.png", title=Path(run_dir).name, eval_points=points)
            self.log_artifacts(Path(d) / "loss.png", "train")

    @contextmanager
    def _process_uri(self):
        """Model.log and a ``models:/`` version source resolve the store from MLflow's process-wide URI: set it to
        this run's store for the call only, then put back exactly what was there. MLflow keeps that state in two
        places (its module global, which its public API cannot report as unset, and MLFLOW_TRACKING_URI, which
        ``set_tracking_uri`` writes and unsets), so both are saved and restored."""
        import mlflow  # heavy: loaded only to log
        from mlflow.tracking._tracking_service import utils

        old_global, old_env = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
        mlflow.set_tracking_uri(self.uri)
        try:
            yield
        finally:
            # None (unset) included: mlflow's annotation leaves it out, its code unsets the URI for it
            mlflow.set_tracking_uri(old_global)  # type: ignore[arg-type]
            if old_env is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = old_env

    def register_model(self, name: str, model_id: str, tags: dict, tuned_loss: float | None,
                       same_split: tuple[str, float] | None = None) -> dict:
        """A new version of registered model ``name`` tagged with ``tags``; alias ``champion`` moves to it only when
        its eval loss is lower than the current champion's (or there is none). The champion's loss is the one its
        own run recorded, or ``same_split`` (version, loss) when that version is still the champion: the run
        started from it and measured it on this run's validation split. Returns version, champion, moved."""
        from mlflow.exceptions import MlflowException  # heavy: loaded only to log

        reg = self.client
        try:
            reg.get_registered_model(name)
        except MlflowException:
            reg.create_registered_model(name, description="fine-tuned by fitburst; alias 'champion': best eval loss")
        with self._process_uri():
            version = reg.create_model_version(name, f"models:/{model_id}", run_id=self.run_id, model_id=model_id,
                                               tags={k: redact(str(v)) for k, v in tags.items()})
        try:
            holder = reg.get_model_version_by_alias(name, CHAMPION)
            held: float | str | None = holder.tags.get("eval.tuned_loss")
            if same_split is not None and str(holder.version) == same_split[0]:
                held = same_split[1]
                self.set_tags({"registry.champion_loss_same_split": f"{held:.6f}"})
        except MlflowException:
            holder, held = None, None
        better = tuned_loss is not None and (holder is None or held is None or tuned_loss < float(held))
        if better:
            reg.set_registered_model_alias(name, CHAMPION, version.version)
        champion = version.version if better else holder.version if holder else None
        self.set_tags({"registry.model": name, "registry.version": version.version,
                       "registry.champion": champion})
        return {"version": int(version.version), "champion": int(champion) if champion else None, "moved": better}

    def where(self) -> str:
        """How to open this run: the store and an `mlflow ui` command."""
        store = redact(self.uri)
        return f"MLflow run {self.run_id} in {store}\n  open it with: mlflow ui --backend-store-uri {store}"


# --- model training, lineage and the logged model (issue 12) -------------------------------------------------

EXPERIMENT_KIND = "mlflow.experimentKind"  # read by MLflow 3's UI to choose the GenAI or the model-training views
MODEL_TRAINING = "custom_model_development"
CHAMPION = "champion"


def mark_model_training(client, experiment_id: str, tags: dict) -> None:
    """Mark the experiment as model training, unless someone already chose a kind for it."""
    if EXPERIMENT_KIND not in tags:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)


def pip_requirements() -> list[str]:
    """Pinned requirements of a logged model (MLflow's own inference imports torchvision, absent here)."""
    from importlib.metadata import version

    return [f"{p}=={version(p).split('+')[0]}" for p in ("torch", "transformers", "peft", "accelerate", "tokenizers")]


# --- stale runs --------------------------------------------------------------------------------------------------

def owner_id(pid: int | None = None) -> str:
    """``host:pid:start`` of a process (start time tells a live owner from a recycled pid)."""
    import psutil

    proc = psutil.Process(pid)
    return f"{socket.gethostname()}:{proc.pid}:{proc.create_time():.0f}"


def owner_alive(owner: str) -> bool:
    """False only when ``owner`` ran on this host and that process is gone; another host's owner counts as alive."""
    import psutil

    host, pid, _ = owner.rsplit(":", 2)
    if host != socket.gethostname():
        return True
    try:
        return owner_id(int(pid)) == owner
    except psutil.NoSuchProcess:
        return False


def close_stale_runs(client, experiment_id: str, pipeline: str) -> list[str]:
    """Close as KILLED the runs of ``pipeline`` still RUNNING whose owner process died (SIGKILL, power loss).
    Returns their ids."""
    closed = []
    runs = client.search_runs([experiment_id], f"tags.pipeline = '{pipeline}' and attributes.status = 'RUNNING'",
                              max_results=200)
    for run in runs:
        owner = run.data.tags.get(OWNER_TAG)
        if owner and not owner_alive(owner):
            client.set_terminated(run.info.run_id, "KILLED")
            client.set_tag(run.info.run_id, "fitburst.closed_by", "stale-run sweep: owner process gone")
            closed.append(run.info.run_id)
            log.warning("closed MLflow run %s as KILLED: its process %s is gone", run.info.run_id, owner)
    return closed
