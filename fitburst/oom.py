"""OOM step-down: an out-of-memory error inside training steps one rung down and resumes from the last checkpoint.

The rungs keep the effective batch and the optimizer-update count: micro-batch halved with gradient accumulation
doubled (until 1), then gradient checkpointing, then the 8-bit optimizer, then QLoRA, each only where
``preflight.allow`` permits and the device supports it. The run folder keeps its name (it is keyed by the planned
config); the rungs taken are written to ``stepdown.json`` in it, so a later resume of the folder trains with them.
Every step-down is logged, tagged and recorded as an MLflow event, and its measured figures are appended to the
calibration history (``oom_history.jsonl`` beside the calibration file).

Recognised OOMs: CUDA ``torch.OutOfMemoryError``, the MPS allocator's ``RuntimeError`` ("MPS backend out of
memory"), CPU allocation failures (``DefaultCPUAllocator: can't allocate memory``, ``MemoryError``).
"""

from __future__ import annotations

import gc
import json
import logging
import re
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from fitburst.device import select_device
from fitburst.spec import PipelineSpec
from fitburst.train import TrainError, TrainResult, latest_checkpoint, train

log = logging.getLogger(__name__)

STEPDOWN_FILE = "stepdown.json"
_CPU = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory",
        "std::bad_alloc")
_REQUESTED = re.compile(r"(?:Tried to allocate|tried to allocate) ([\d.]+) ?(bytes|[KMG]i?B)")


class OOMLadderExhausted(TrainError):
    """Out of memory with no rung left. ``burst_allowed`` says whether the burst policy lets the caller send the
    checkpoint to a cloud GPU (the run folder, ``run_dir``, resumes there); otherwise the message is final."""

    def __init__(self, message: str, *, run_dir: Path, step: int, device: str, peak_bytes: int | None,
                 burst_allowed: bool):
        super().__init__(message)
        self.run_dir, self.step, self.device = run_dir, step, device
        self.peak_bytes, self.burst_allowed = peak_bytes, burst_allowed


def oom_kind(exc: BaseException | None) -> str | None:
    """"cuda", "mps" or "cpu" when ``exc`` (or an exception it was raised from) is an out-of-memory error."""
    import torch

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, torch.OutOfMemoryError):
            return "cuda"
        if isinstance(exc, MemoryError):
            return "cpu"
        if isinstance(exc, RuntimeError):
            text = str(exc)
            if "MPS backend out of memory" in text:
                return "mps"
            if any(s in text for s in _CPU):
                return "cpu"
            if "CUDA out of memory" in text:
                return "cuda"
        exc = exc.__cause__ or exc.__context__
    return None


def requested_bytes(exc: BaseException) -> int | None:
    """The allocation that failed, when the message says ("Tried to allocate 2.00 GiB", "... 123 bytes")."""
    m = _REQUESTED.search(str(exc)) or (_REQUESTED.search(str(exc.__cause__)) if exc.__cause__ else None)
    if not m:
        return None
    unit = {"bytes": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)]
    return int(float(m.group(1)) * unit)


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


def free_memory(exc: BaseException) -> None:
    """Drop the failed attempt's frames (the traceback holds the model and activations) and empty the caches."""
    import torch

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()


# --- the ladder ------------------------------------------------------------------------------------------------

def next_rung(spec: PipelineSpec, device: str) -> tuple[dict, str] | None:
    """The next rung down from ``spec``: (dotted field -> value, what changed), or None when none is left."""
    tr, m, allow = spec.training, spec.method, spec.preflight.allow
    if allow.reduce_batch and tr.micro_batch_size > 1:
        mb = tr.micro_batch_size
        smaller = max(d for d in range(1, mb) if mb % d == 0)  # half when even: the effective batch stays exact
        accum = tr.grad_accum * (mb // smaller)
        return ({"training.micro_batch_size": smaller, "training.grad_accum": accum},
                f"micro_batch_size {mb} -> {smaller}, grad_accum {tr.grad_accum} -> {accum} "
                f"(effective batch {tr.effective_batch} kept)")
    if allow.gradient_checkpointing and not tr.gradient_checkpointing:
        return {"training.gradient_checkpointing": True}, "gradient checkpointing on"
    if allow.optimizer_8bit and tr.optimizer == "adamw" and device != "mps":
        return {"training.optimizer": "adamw8bit"}, "optimizer adamw -> adamw8bit"
    if allow.quantize and m.type == "lora" and m.quant == "none" and device != "mps":
        return ({"method.type": "qlora", "method.quant": "nf4", "method.double_quant": True},
                "LoRA -> QLoRA (4-bit nf4 base)")
    return None


def apply(spec: PipelineSpec, fields: dict) -> PipelineSpec:
    """``spec`` with dotted ``section.field`` values set (validated as the section's model validates)."""
    sections: dict[str, dict] = {}
    for key, value in fields.items():
        section, name = key.split(".", 1)
        sections.setdefault(section, {})[name] = value
    update = {s: type(getattr(spec, s)).model_validate({**getattr(spec, s).model_dump(), **v})
              for s, v in sections.items()}
    return spec.model_copy(update=update)


def load_stepdowns(run_dir: Path) -> dict:
    p = Path(run_dir) / STEPDOWN_FILE
    return json.loads(p.read_text()) if p.exists() else {"fields": {}, "history": []}


def _switch_optimizer_state(ckpt: Path) -> None:
    """Keep the step, schedule and hyper-parameters of a checkpoint when its optimizer class changes (AdamW ->
    AdamW8bit): the moments cannot be carried across formats, so the new optimizer starts them fresh."""
    import torch

    state = torch.load(ckpt / "optim.pt", map_location="cpu", weights_only=False)
    state["optimizer"] = {"state": {}, "param_groups": state["optimizer"]["param_groups"]}
    torch.save(state, ckpt / "optim.pt")


def _record_history(entry: dict) -> None:
    from fitburst.memory.calibration import OOM_HISTORY_FILE, calibration_path

    path = calibration_path().with_name(OOM_HISTORY_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")


def uncalibrated_estimate(spec: PipelineSpec, device: str, seq_len: int | None) -> tuple[str, int | None]:
    """The device's name and the analytic estimate (no calibration factor) of the figure a measured peak on it
    compares with, for the settings that ran out of memory: what ``fitburst calibrate`` sets against the peak."""
    from fitburst.memory import estimate, load_shape, resolve_device, settings_from_spec
    from fitburst.memory.estimator import measured_counterpart
    from fitburst.preflight import model_ref

    dev = resolve_device(device)
    try:
        shape = load_shape(model_ref(spec))
    except (ValueError, OSError):  # an architecture only the trace knows: the record keeps the measurement alone
        return dev.name, None
    if not seq_len:
        return dev.name, None
    est = estimate(shape, settings_from_spec(spec, dev, seq_len), dev, calibrate=False)
    return dev.name, measured_counterpart(est.to_dict(), dev.kind)


def would_fit(spec: PipelineSpec, prepared, device: str) -> str:
    """The setting that would have fit: the longest sequence the estimate fits on this device at the last rung."""
    from fitburst.memory import load_shape, resolve_device, settings_from_spec
    from fitburst.memory.planner import max_seq_len_that_fits
    from fitburst.preflight import model_ref

    dev = resolve_device(spec.preflight.device if spec.preflight.device != "auto" else device)
    seq = prepared.stats["max"]
    fit = max_seq_len_that_fits(load_shape(model_ref(spec)), settings_from_spec(spec, dev, seq), dev,
                                spec.preflight.safety_margin)
    if fit and fit < seq:
        return f"data.max_seq_len: {fit} (the longest sample has {seq} tokens)"
    return "a device with more memory (burst.policy: auto), or fewer trainable parameters (method.rank)"


def train_stepping_down(spec: PipelineSpec, prepared, run_dir: str | Path, *, device: str | None = None,
                        on_metrics: Callable[[dict, int], None] | None = None,
                        on_stepdown: Callable[[dict], None] | None = None, progress: bool = True) -> TrainResult:
    """:func:`fitburst.train.train`, stepping one rung down on each out-of-memory error and resuming the
    checkpoint the failed attempt saved. ``on_stepdown`` receives each step-down record (for MLflow / Prefect).
    Raises :class:`OOMLadderExhausted` when no rung is left."""
    run_dir = Path(run_dir)
    device = device or select_device(spec.preflight.device)
    state = load_stepdowns(run_dir)
    current = apply(spec, state["fields"])
    if state["fields"]:
        log.info("resuming with earlier step-downs: %s", state["fields"])
    while True:
        try:
            return train(current, prepared, run_dir, device=device, on_metrics=on_metrics, progress=progress)
        except BaseException as exc:  # noqa: BLE001 - anything but an OOM is re-raised at once
            kind = oom_kind(exc)
            if kind is None:
                raise
            ckpt = latest_checkpoint(run_dir)
            step = int(ckpt.name.split("-")[1]) if ckpt else 0
            record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "pipeline": spec.name, "device": device,
                      "oom_kind": kind, "step": step, "measured_peak_bytes": measured_peak(device),
                      "requested_bytes": requested_bytes(exc), "error": str(exc).splitlines()[0][:300],
                      "settings": {"micro_batch_size": current.training.micro_batch_size,
                                   "grad_accum": current.training.grad_accum,
                                   "gradient_checkpointing": current.training.gradient_checkpointing,
                                   "optimizer": current.training.optimizer, "method": current.method.type,
                                   "quant": current.method.quant, "max_seq_len": prepared.stats.get("max")}}
            free_memory(exc)
            del exc
            record["device_name"], record["estimated_bytes"] = uncalibrated_estimate(current, device,
                                                                                     prepared.stats.get("max"))
            rung = next_rung(current, device)
            record["change"] = rung[1] if rung else None
            _record_history(record)
            if rung is None:
                raise _exhausted(current, prepared, run_dir, record) from None
            fields, change = rung
            if "training.optimizer" in fields and ckpt is not None:
                _switch_optimizer_state(ckpt)
            state["fields"].update(fields)
            state["history"].append(record)
            (run_dir / STEPDOWN_FILE).write_text(json.dumps(state, indent=2))
            current = apply(spec, state["fields"])
            log.warning("out of memory (%s) at step %d, peak %s bytes: stepping down: %s; resuming from %s",
                        kind, step, record["measured_peak_bytes"], change, ckpt.name if ckpt else "the start")
            if on_stepdown:
                on_stepdown(record)


def _exhausted(spec: PipelineSpec, prepared, run_dir: Path, record: dict) -> OOMLadderExhausted:
    burst = spec.burst.policy != "never"
    peak = record["measured_peak_bytes"]
    where = (f"the burst policy ({spec.burst.policy}) allows sending checkpoint step-{record['step']} in {run_dir} "
             "to a cloud GPU" if burst else f"would have fit: {would_fit(spec, prepared, record['device'])}")
    measured = f"measured peak {peak / 2**30:.2f} GiB" if peak else "peak not measured"
    msg = (f"{spec.name}: out of memory on {record['device']} at step {record['step']} with every allowed "
           f"step-down taken ({measured}); {where}. A rerun resumes from the checkpoint.")
    return OOMLadderExhausted(msg, run_dir=run_dir, step=record["step"], device=record["device"], peak_bytes=peak,
                              burst_allowed=burst)

