"""OOM step-down: an out-of-memory error inside training steps one rung down and resumes from the last checkpoint.

The rungs are the planner's ladder (:mod:`fitburst.memory.ladder`), cheapest first, those a resumed run can take:
a faster attention kernel, the 8-bit optimizer, a smaller micro-batch with the effective batch kept, gradient
checkpointing, QLoRA; each only where ``preflight.allow`` permits and the device supports it. The run folder keeps
its name (it is keyed by the planned config); the settings after the rungs taken are written to ``stepdown.json``
in it, so a later resume of the folder trains with them.
Every step-down is logged, tagged and recorded as an MLflow event, and its measured figures are appended to the
calibration history (``oom_history.jsonl`` beside the calibration file).

Recognised OOMs: CUDA ``torch.OutOfMemoryError``, the MPS allocator's ``RuntimeError`` ("MPS backend out of
memory"), CPU allocation failures (``DefaultCPUAllocator: can't allocate memory``, ``MemoryError``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from fitburst import distributed
from fitburst.data import PreparedData, images_per_record
from fitburst.device import select_device
from fitburst.hardware import resolve_device
from fitburst.memory import Device, ModelShape, estimate
from fitburst.memory.calibration import OOM_HISTORY_FILE, calibration_path
from fitburst.memory.ladder import next_rung
from fitburst.memory.planner import max_seq_len_that_fits
from fitburst.models import model_family, spec_shape
from fitburst.oom_errors import free_memory, oom_kind, requested_bytes
from fitburst.ranks import Ranks, RanksFailed
from fitburst.settings import RunSettings, settings_from_spec, spec_with_settings
from fitburst.spec import PipelineSpec
from fitburst.train import TrainError, TrainResult, drop_optimizer_state, latest_checkpoint, train

log = logging.getLogger(__name__)

STEPDOWN_FILE = "stepdown.json"
class OOMLadderExhausted(TrainError):
    """Out of memory with no rung left. ``burst_allowed`` says whether the burst policy lets the caller send the
    checkpoint to a cloud GPU (the run folder, ``run_dir``, resumes there); otherwise the message is final."""

    def __init__(self, message: str, *, run_dir: Path, step: int, device: str, peak_bytes: int | None,
                 burst_allowed: bool):
        super().__init__(message)
        self.run_dir, self.step, self.device = run_dir, step, device
        self.peak_bytes, self.burst_allowed = peak_bytes, burst_allowed


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


def _record_history(entry: StepDown) -> None:
    path = calibration_path().with_name(OOM_HISTORY_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(entry.to_dict()) + "\n")


def _estimated(settings: RunSettings, shape: ModelShape | None, dev: Device) -> int | None:
    """The analytic estimate (no calibration factor) of the figure a measured peak on ``dev`` compares with, for
    the settings that ran out of memory: what ``fitburst calibrate`` sets against the peak. None for an
    architecture only the trace knows."""
    if shape is None:
        return None
    est = estimate(shape, settings, dev, calibrate=False)
    return est.comparable_bytes(dev.kind)


def _shape(spec: PipelineSpec) -> ModelShape | None:
    try:
        return spec_shape(spec)
    except (ValueError, OSError):  # a config not readable here: the record keeps the measurement alone
        return None


def setting_that_would_fit(spec: PipelineSpec, settings: RunSettings, shape: ModelShape | None, dev: Device,
              longest: int) -> str:
    """The setting that would have fit: the longest sequence the estimate fits on this device at the last rung."""
    fit = max_seq_len_that_fits(shape, settings, dev, spec.preflight.safety_margin) if shape is not None else 0
    if fit and fit < longest:
        return f"data.max_seq_len: {fit} (the longest sample has {longest} tokens)"
    return "a device with more memory (burst.policy: auto), or fewer trainable parameters (method.rank)"


def train_stepping_down(spec: PipelineSpec, prepared: PreparedData, run_dir: str | Path, *,
                        device: str | None = None, on_metrics: Callable[[dict, int], None] | None = None,
                        on_stepdown: Callable[[StepDown], None] | None = None,
                        progress: bool = True, ranks: Ranks | None = None) -> TrainResult:
    """:func:`fitburst.train.train`, stepping one rung down the ladder (:func:`fitburst.memory.ladder.next_rung`,
    the rungs a resumed run can take) on each out-of-memory error and resuming the checkpoint the failed attempt
    saved. ``on_stepdown`` receives each record (for MLflow / Prefect). Raises :class:`OOMLadderExhausted` when no
    rung is left.

    ``ranks`` of more than one process: each attempt starts them all (:meth:`fitburst.ranks.Ranks.run`, on this
    node and the others); a rank's out-of-memory error ends them all, and the next attempt starts them all with the
    rung taken, from the last checkpoint (a sharded one cannot be written by one rank alone). Inside a rank that
    torchrun started nothing steps down here: the error ends the rank, and the supervisor above torchrun decides."""
    run_dir = Path(run_dir)
    sharded = ranks if ranks is not None and ranks.size > 1 else None
    if distributed.world().sharded:
        return train(spec, prepared, run_dir, device=device, on_metrics=on_metrics, progress=progress)
    device = device or select_device(spec.preflight.device)
    dev = resolve_device(spec.preflight.device if spec.preflight.device not in ("auto", device) else device)
    longest = int(prepared.stats["max"])

    def resolved(s: PipelineSpec) -> RunSettings:
        return settings_from_spec(s, dev, longest, images=images_per_record(s), family=model_family(s.model))

    state = load_stepdowns(run_dir, lambda fields: resolved(spec.with_overrides(fields)))
    settings = RunSettings.from_dict(state["settings"]) if state["settings"] else resolved(spec)
    current = spec_with_settings(spec, settings) if state["settings"] else spec
    if state["rungs"]:
        log.info("resuming with earlier step-downs: %s", ", ".join(state["rungs"]))
    shape = None
    while True:
        try:
            if sharded is not None:
                sharded.run(current, prepared.dir, run_dir, device=device, on_metrics=on_metrics)
                return TrainResult.load(run_dir)
            return train(current, prepared, run_dir, device=device, on_metrics=on_metrics, progress=progress)
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
            shape = shape or _shape(spec)
            record.estimated_bytes = _estimated(settings, shape, dev)
            rung = next_rung(settings, dev, spec.preflight.allow.model_dump(), midrun=True, shape=shape)
            if rung is not None:
                record.rung, record.change = rung.key, rung.explain(settings, dev)
            _record_history(record)
            if rung is None:
                fits = setting_that_would_fit(spec, settings, shape, dev, longest)
                raise _exhausted(current, record, run_dir, fits) from None
            if rung.key == "optimizer_8bit" and ckpt is not None:
                drop_optimizer_state(ckpt)
            settings = rung.take(settings, dev)
            current = spec_with_settings(spec, settings)
            state["settings"], state["rungs"] = asdict(settings), [*state["rungs"], rung.key]
            state["history"].append(record.to_dict())
            (run_dir / STEPDOWN_FILE).write_text(json.dumps(state, indent=2))
            log.warning("out of memory (%s) at step %d, peak %s bytes: stepping down: %s; resuming from %s",
                        kind, step, record.measured_peak_bytes, record.change, ckpt.name if ckpt else "the start")
            if on_stepdown:
                on_stepdown(record)


def _exhausted(spec: PipelineSpec, record: StepDown, run_dir: Path, fit: str) -> OOMLadderExhausted:
    burst = spec.burst.policy != "never"
    peak = record.measured_peak_bytes
    where = (f"the burst policy ({spec.burst.policy}) allows sending checkpoint step-{record.step} in {run_dir} "
             "to a cloud GPU" if burst else f"would have fit: {fit}")
    measured = f"measured peak {peak / 2**30:.2f} GiB" if peak else "peak not measured"
    msg = (f"{spec.name}: out of memory on {record.device} at step {record.step} with every allowed "
           f"step-down taken ({measured}); {where}. A rerun resumes from the checkpoint.")
    return OOMLadderExhausted(msg, run_dir=run_dir, step=record.step, device=record.device, peak_bytes=peak,
                              burst_allowed=burst)
