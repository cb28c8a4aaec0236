"""The Supervisor: what wraps the Recipe (:mod:`fitburst.recipe`), as torchtune keeps it apart from the recipe.

- plans the run's place: the run folder (the newest interrupted one with the same config and data, else a new
  one: :mod:`fitburst.rundir`), its MLflow records (the attempt it replaces linked, metrics through the folder's
  outbox) and the step-downs an earlier attempt took (``stepdown.json``: :func:`load_stepdowns`);
- walks the ladder after an out-of-memory error: the next rung, a resume from the last checkpoint, the records
  (:class:`StepDown`: in ``stepdown.json``, MLflow and the calibration history), :class:`OOMLadderExhausted` when no
  rung is left;
- starts the ranks of a sharded run on this node or every node (:class:`fitburst.ranks.Ranks`: torchrun, whose
  every rank runs the Recipe directly) or runs the Recipe in this process;
- evaluates after training and records both (:class:`fitburst.tracking.Tracker`).

Two callers, one path: the flow's train task (:func:`train_local_run`) and ``fitburst train`` on a cloud node
(:func:`train_and_evaluate`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from fitburst.checkpoints import drop_optimizer_state, latest_checkpoint
from fitburst.data import PreparedData, images_per_record
from fitburst.device import select_device
from fitburst.evaluate import EvalResult, evaluate
from fitburst.hardware import resolve_device
from fitburst.memory import Device, Estimate, ModelShape, estimate
from fitburst.memory.calibration import OOM_HISTORY_FILE, calibration_path
from fitburst.memory.host import host_shortfall, this_host_limit
from fitburst.memory.ladder import HOST_RUNGS, Rung, next_rung_on_host
from fitburst.memory.planner import max_seq_len_that_fits
from fitburst.models import resolve_model
from fitburst.oom_errors import free_memory, oom_kind, requested_bytes
from fitburst.outbox import replay_outboxes
from fitburst.ranks import Ranks, RanksFailed, local_ranks
from fitburst.recipe import Recipe
from fitburst.rundir import open_run_dir, release, runs_root
from fitburst.settings import RunSettings, settings_from_spec, spec_with_settings
from fitburst.spec import PipelineSpec
from fitburst.tracking import Tracker, redact
from fitburst.train import MetricsFn, TrainError, TrainResult

log = logging.getLogger(__name__)


# --- plan: the run folder --------------------------------------------------------------------------------------

def train_local_run(spec: PipelineSpec, prepared: PreparedData, tracker: Tracker | None, *,
                    estimate: Estimate | None = None, device: str | None = None, progress: bool = True,
                    on_metrics: MetricsFn | None = None,
                    on_stepdown: Callable[[StepDown], None] | None = None, nproc: int | None = None) -> TrainResult:
    """Train ``spec`` in its run folder (the newest interrupted one with the same config and data, else a new one),
    linking and closing the records of the attempt it replaces. Each OOM step-down is recorded in MLflow and passed
    to ``on_stepdown`` (the flow's log). ``nproc``: processes to shard the run over (default
    :func:`fitburst.ranks.local_ranks`: one per GPU for ``training.distributed: fsdp``); this process keeps the
    MLflow run and relays rank 0's loss curve."""
    if tracker is not None:
        replay_outboxes(runs_root(spec) / spec.name, tracker.uri)
    run_dir, resumed = open_run_dir(spec, data_hash=prepared.content_hash)
    log.info("%s run folder %s", "resuming in" if resumed else "training into", run_dir)
    try:
        if tracker is not None:
            tracker.set_tags({"run_dir": str(run_dir)})
            tracker.link_previous(run_dir)
            tracker.use_outbox(run_dir)
        return train_and_record(spec, prepared, run_dir, tracker=tracker, path="local", estimate=estimate,
                                device=device, progress=progress, on_metrics=on_metrics, on_stepdown=on_stepdown,
                                ranks=Ranks(nproc or local_ranks(spec)))
    finally:
        release(run_dir)


# --- train, evaluate, record -----------------------------------------------------------------------------------

def train_and_evaluate(spec: PipelineSpec, prepared: PreparedData, run_dir: str | Path, *,
                       tracker: Tracker | None = None, path: str = "local", estimate: Estimate | None = None,
                       device: str | None = None, evaluate_after: bool = True, progress: bool = True,
                       ranks: Ranks | None = None) -> tuple[TrainResult, EvalResult | None]:
    """Train (over ``ranks``, when given), evaluate (when ``evaluate_after`` and ``spec.eval.enabled``) and record;
    returns both results. What ``fitburst train`` runs (the cloud node's command)."""
    result = train_and_record(spec, prepared, run_dir, tracker=tracker, path=path, estimate=estimate, device=device,
                              progress=progress, ranks=ranks)
    ev = evaluate_and_record(spec, prepared, result, tracker=tracker) if evaluate_after and spec.eval.enabled else None
    return result, ev


def train_and_record(spec: PipelineSpec, prepared: PreparedData, run_dir: str | Path, *, tracker: Tracker | None,
                     path: str, estimate: Estimate | None = None, device: str | None = None,
                     progress: bool = True, on_metrics: MetricsFn | None = None,
                     on_stepdown: Callable[[StepDown], None] | None = None,
                     ranks: Ranks | None = None) -> TrainResult:
    """Train into ``run_dir`` (the loss curve streamed to ``tracker``, or to ``on_metrics`` when given, which then
    forwards it; system metrics recorded meanwhile), stepping down on out-of-memory (each step-down recorded and
    passed to ``on_stepdown``), then record the run: facts, adapter, plots, and measured vs ``estimate`` when there
    is one. ``path`` is where it trained: local or cloud. ``ranks`` of more than one process: sharded with FSDP over
    them (:class:`fitburst.ranks.Ranks`: this machine's, or several nodes' with this process as node 0's supervisor)."""

    def stepped_down(record: StepDown) -> None:
        if tracker is not None:
            tracker.log_stepdown(record)
        if on_stepdown is not None:
            on_stepdown(record)

    metrics_fn = on_metrics or (tracker.log_metrics if tracker else None)
    with tracker.system_metrics() if tracker is not None else contextlib.nullcontext():
        result = train_stepping_down(spec, prepared, run_dir, device=device, on_metrics=metrics_fn,
                                     on_stepdown=stepped_down, progress=progress, ranks=ranks)
    if tracker is not None:
        from mlflow.exceptions import MlflowException

        try:
            tracker.log_train(result, path=path)
            if estimate is not None:
                tracker.log_memory_comparison(estimate, result)
        except MlflowException as e:  # the server went away: the trained run must not be lost over its record
            log.warning("MLflow unreachable after training (%s): the result, adapter and loss curve are in %s; "
                        "metrics are replayed from its outbox when the server is back", redact(str(e))[:200],
                        result.run_dir)
    return result


def evaluate_and_record(spec: PipelineSpec, prepared: PreparedData, result: TrainResult, *,
                        tracker: Tracker | None) -> EvalResult:
    """Base vs tuned on the validation split, with the device and precision the run trained in; saved as the run
    folder's ``eval.json`` and recorded."""
    ev = evaluate(spec, prepared, result.adapter_dir, device=result.device, precision=result.precision)
    ev.save(result.run_dir)
    if tracker is not None:
        tracker.log_eval(ev)
    return ev


# --- the step-down's records: stepdown.json, the calibration history, the error when no rung is left ----------

STEPDOWN_FILE = "stepdown.json"  # the run folder's step-downs (load_stepdowns)


class OOMLadderExhausted(TrainError):
    """Out of memory with no rung left. ``burst_allowed`` says whether the burst policy lets the caller send the
    checkpoint to a cloud GPU (the run folder, ``run_dir``, resumes there); otherwise the message is final."""

    def __init__(self, message: str, *, run_dir: Path, step: int, device: str, peak_bytes: int | None,
                 burst_allowed: bool):
        super().__init__(message)
        self.run_dir, self.step, self.device = run_dir, step, device
        self.peak_bytes, self.burst_allowed = peak_bytes, burst_allowed


@dataclass
class StepDown:
    """One out-of-memory step-down: what ran out, where, what was measured and estimated, and the rung taken."""

    time: str
    pipeline: str
    device: str  # cuda | mps | cpu
    oom_kind: str
    step: int  # the checkpoint the run resumes from (0: the start)
    measured_peak_bytes: int | None
    requested_bytes: int | None
    error: str
    settings: dict  # the settings that ran out of memory (RunSettings as JSON)
    device_name: str = ""
    estimated_bytes: int | None = None  # the uncalibrated estimate of the figure the measured peak compares with
    rung: str | None = None  # the ladder's key (fitburst.memory.ladder), None when no rung was left
    change: str | None = None  # what the rung changes, in words
    # the host RAM check of the rungs that move memory to the host: the ones skipped and why, or that it could not
    # be checked (no model shape); None when no such rung came up
    host_check: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def load_stepdowns(run_dir: Path, resolve: Callable[[dict], RunSettings] | None = None) -> dict:
    """``stepdown.json`` of a run folder: the settings after every step-down taken (None: none taken; read with
    :meth:`RunSettings.from_dict`, which takes old field names), the rungs taken and their records. A folder stepped
    down by an earlier fitburst holds the changed spec fields as dotted keys ("fields"): ``resolve`` turns them
    into the settings they stand for."""
    p = Path(run_dir) / STEPDOWN_FILE
    state = {"settings": None, "rungs": [], "history": [], **(json.loads(p.read_text()) if p.exists() else {})}
    fields = state.pop("fields", None)
    if fields and not state["settings"] and resolve is not None:
        state["settings"] = asdict(resolve(fields))
    return state


def store_stepdowns(run_dir: Path, state: dict) -> None:
    """Write ``stepdown.json`` (:func:`load_stepdowns`' shape) after a step-down."""
    (Path(run_dir) / STEPDOWN_FILE).write_text(json.dumps(state, indent=2))


def record_history(entry: StepDown) -> None:
    """Append ``entry`` to the calibration history (``oom_history.jsonl`` beside the calibration file)."""
    path = calibration_path().with_name(OOM_HISTORY_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(entry.to_dict()) + "\n")


def exhausted(spec: PipelineSpec, record: StepDown, run_dir: Path, fit: str) -> OOMLadderExhausted:
    burst = spec.burst.policy != "never"
    peak = record.measured_peak_bytes
    where = (f"the burst policy ({spec.burst.policy}) allows sending checkpoint step-{record.step} in {run_dir} "
             "to a cloud GPU" if burst else f"would have fit: {fit}")
    measured = f"measured peak {peak / 2**30:.2f} GiB" if peak else "peak not measured"
    msg = (f"{spec.name}: out of memory on {record.device} at step {record.step} with every allowed "
           f"step-down taken ({measured}); {where}. A rerun resumes from the checkpoint.")
    return OOMLadderExhausted(msg, run_dir=run_dir, step=record.step, device=record.device, peak_bytes=peak,
                              burst_allowed=burst)


# --- walk the ladder after an OOM ----------------------------------------------------------------------------

def train_stepping_down(spec: PipelineSpec, prepared: PreparedData, run_dir: str | Path, *,
                        device: str | None = None, on_metrics: Callable[[dict, int], None] | None = None,
                        on_stepdown: Callable[[StepDown], None] | None = None,
                        progress: bool = True, ranks: Ranks | None = None) -> TrainResult:
    """The Recipe (:class:`fitburst.recipe.Recipe`), stepping one rung down the ladder (:func:`next_rung_within_host`:
    the rungs a resumed run can take, this host's RAM checked before one that moves memory there) on each
    out-of-memory error and resuming the checkpoint the failed attempt saved. ``on_stepdown`` receives each record
    (for MLflow / Prefect). Raises :class:`OOMLadderExhausted` when no rung is left.

    ``ranks`` of more than one process: each attempt starts them all (:meth:`fitburst.ranks.Ranks.run`, on this
    node and the others); a rank's out-of-memory error ends them all, and the next attempt starts them all with the
    rung taken, from the last checkpoint (a sharded one cannot be written by one rank alone). A rank torchrun
    started runs the Recipe alone (``fitburst train``): the error ends the rank, and this loop, above torchrun,
    decides.

    The model (its reference, family and shape: :func:`fitburst.models.resolve_model`) is resolved once here, for
    the settings, each attempt's Recipe and the step-down's estimate (a rung changes settings, never the model)."""
    run_dir = Path(run_dir)
    sharded = ranks if ranks is not None and ranks.size > 1 else None
    device = device or select_device(spec.preflight.device)
    dev = training_device(spec, device)
    longest = int(prepared.stats["max"])
    model = resolve_model(spec)

    def resolved(s: PipelineSpec) -> RunSettings:
        return settings_from_spec(s, dev, longest, images=images_per_record(s), family=model.family)

    state = load_stepdowns(run_dir, lambda fields: resolved(spec.with_overrides(fields)))
    settings = RunSettings.from_dict(state["settings"]) if state["settings"] else resolved(spec)
    current = spec_with_settings(spec, settings) if state["settings"] else spec
    if state["rungs"]:
        log.info("resuming with earlier step-downs: %s", ", ".join(state["rungs"]))
    while True:
        try:
            if sharded is not None:
                sharded.run(current, prepared.dir, run_dir, device=device, on_metrics=on_metrics)
                return TrainResult.load(run_dir)
            return Recipe(current, prepared, run_dir, resolved=model, device=device, on_metrics=on_metrics,
                          progress=progress).run()
        except BaseException as exc:  # noqa: BLE001 - anything but an OOM is re-raised at once
            kind = oom_kind(exc)
            if kind is None:
                raise
            ckpt = latest_checkpoint(run_dir)
            step = int(ckpt.name.split("-")[1]) if ckpt else 0
            record = StepDown(time=time.strftime("%Y-%m-%dT%H:%M:%S"), pipeline=spec.name, device=device,
                              oom_kind=kind, step=step, measured_peak_bytes=(
                                  exc.peak_bytes if isinstance(exc, RanksFailed) else measured_peak(device)),
                              requested_bytes=requested_bytes(exc), error=str(exc).splitlines()[0][:300],
                              settings=asdict(settings), device_name=dev.name)
            free_memory(exc)
            del exc
            record.estimated_bytes = _estimated(settings, model.shape, dev)
            rung = next_rung_within_host(settings, dev, spec, model.shape, record,
                                         sharded.per_node if sharded is not None else 1)
            record_history(record)
            if rung is None:
                fits = setting_that_would_fit(spec, settings, model.shape, dev, longest)
                raise exhausted(current, record, run_dir, fits) from None
            if rung.key == "optimizer_8bit" and ckpt is not None:
                drop_optimizer_state(ckpt)
            settings = rung.take(settings, dev)
            current = spec_with_settings(spec, settings)
            state["settings"], state["rungs"] = asdict(settings), [*state["rungs"], rung.key]
            state["history"].append(record.to_dict())
            store_stepdowns(run_dir, state)
            log.warning("out of memory (%s) at step %d, peak %s bytes: stepping down: %s; resuming from %s%s",
                        kind, step, record.measured_peak_bytes, record.change, ckpt.name if ckpt else "the start",
                        f" ({record.host_check})" if record.host_check else "")
            if on_stepdown:
                on_stepdown(record)


def training_device(spec: PipelineSpec, device: str) -> Device:
    """The device a run on this process's ``device`` (cuda | mps | cpu) trains on, as its settings and the
    step-down read it: ``preflight.device`` where it names one, and this machine's (``local``: the rungs are those
    this install can run)."""
    named = spec.preflight.device not in ("auto", device)
    return replace(resolve_device(spec.preflight.device if named else device), local=True)


def next_rung_within_host(settings: RunSettings, dev: Device, spec: PipelineSpec, shape: ModelShape | None,
                          record: StepDown, processes: int) -> Rung | None:
    """The next rung a resumed run takes (:func:`fitburst.memory.ladder.next_rung_on_host`), put in ``record``: one
    that moves memory to the host only where this host's RAM holds it by the planner's rule
    (:func:`fitburst.memory.host.host_shortfall` against :func:`fitburst.memory.host.this_host_limit`), at the
    run's sequence length (its longest sample). Without the model's shape the host is not checked, and the record
    says so."""
    allow = spec.preflight.allow.model_dump()
    if shape is None:
        rung, skipped = next_rung_on_host(settings, dev, allow, midrun=True)
        if rung is not None and rung.key in HOST_RUNGS:
            record.host_check = (f"host RAM for {rung.key} not checked: the model's shape is unknown to the analytic "
                                 "estimate")
    else:
        limit = this_host_limit(processes)
        rung, skipped = next_rung_on_host(settings, dev, allow, midrun=True, shape=shape,
                                          host_problem=lambda s: host_shortfall(shape, s, dev, limit, processes))
        record.host_check = "; ".join(skipped) or None
    if rung is not None:
        record.rung, record.change = rung.key, rung.explain(settings, dev)
    return rung


def measured_peak(device: str) -> int | None:
    """The peak this process reached on ``device``: CUDA max allocated, MPS driver memory, CPU max RSS."""
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    if device == "mps" and torch.backends.mps.is_available():
        return int(torch.mps.driver_allocated_memory())
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _estimated(settings: RunSettings, shape: ModelShape | None, dev: Device) -> int | None:
    """The analytic estimate (no calibration factor) of the figure a measured peak on ``dev`` compares with, for
    the settings that ran out of memory: what ``fitburst calibrate`` sets against the peak. None for an
    architecture only the trace knows."""
    if shape is None:
        return None
    est = estimate(shape, settings, dev, calibrate=False)
    return est.comparable_bytes(dev.kind)


def setting_that_would_fit(spec: PipelineSpec, settings: RunSettings, shape: ModelShape | None, dev: Device,
              longest: int) -> str:
    """The setting that would have fit: the longest sequence the estimate fits on this device at the last rung."""
    fit = max_seq_len_that_fits(shape, settings, dev, spec.preflight.safety_margin) if shape is not None else 0
    if fit and fit < longest:
        return f"data.max_seq_len: {fit} (the longest sample has {longest} tokens)"
    return "a device with more memory (burst.policy: auto), or fewer trainable parameters (method.rank)"
