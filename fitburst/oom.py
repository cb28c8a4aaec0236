"""OOM step-down records: what one step-down measured and took (:class:`StepDown`), the run folder's
``stepdown.json`` (the settings after every rung taken, so a later resume of the folder trains with them), the
calibration history every step-down appends to (``oom_history.jsonl`` beside the calibration file), and the error
when no rung is left. The ladder walk itself is the supervisor's (:func:`fitburst.supervisor.train_stepping_down`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from fitburst.memory.calibration import OOM_HISTORY_FILE, calibration_path
from fitburst.settings import RunSettings
from fitburst.spec import PipelineSpec
from fitburst.train import TrainError

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
