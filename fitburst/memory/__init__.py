"""fitburst.memory: peak training memory from a model's config alone, device budgets, and a fit planner.

Pure Python (json + math): importing it never imports torch or transformers.
"""

from .devices import Device, auto_precision, known_devices, resolve_device
from .estimator import Estimate, TrainSettings, estimate, settings_from_spec
from .planner import Plan, plan_fit
from .shapes import ModelShape, load_shape

__all__ = [
    "Device",
    "Estimate",
    "ModelShape",
    "Plan",
    "TrainSettings",
    "auto_precision",
    "estimate",
    "known_devices",
    "load_shape",
    "plan_fit",
    "resolve_device",
    "settings_from_spec",
]
