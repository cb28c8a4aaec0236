"""fitburst.memory: peak training memory from a model's config alone, its error band, device budgets, and a fit
planner for one device.

Pure Python (json + math): importing it never imports torch or transformers.
"""

from fitburst.hardware import Device, known_devices, resolve_device
from fitburst.settings import RunSettings

from .budget import Budget
from .calibration import ErrorBand, band_for
from .estimator import Estimate, estimate
from .planner import EstimateFn, Plan, plan_fit
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
    "RunSettings",
    "band_for",
    "estimate",
    "known_devices",
    "load_shape",
    "plan_fit",
    "resolve_device",
]
