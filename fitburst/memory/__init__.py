"""fitburst.memory: peak training memory from a model's config alone, its error band, device budgets, and a fit
planner for one device.

Pure Python (json + math): importing it never imports torch or transformers.
"""

from fitburst.hardware import Device, auto_precision, known_devices, resolve_device

from .calibration import ErrorBand, band_for
from .estimator import Estimate, TrainSettings, estimate, settings_from_spec
from .planner import Budget, EstimateFn, Plan, plan_fit
from .shapes import ModelConfigError, ModelShape, load_shape

__all__ = [
    "Budget",
    "Device",
    "ErrorBand",
    "Estimate",
    "EstimateFn",
    "ModelConfigError",
    "ModelShape",
    "Plan",
    "TrainSettings",
    "auto_precision",
    "band_for",
    "estimate",
    "known_devices",
    "load_shape",
    "plan_fit",
    "resolve_device",
    "settings_from_spec",
]
