"""fitburst: declarative LoRA/QLoRA fine-tuning that knows whether a run fits before it starts."""

import os

# Idle OpenMP threads spin-wait by default. Beside Prefect's and MLflow's background threads on a small CPU
# that made CPU training up to 10x slower (demo model on the 2-core dev box: 6.5 vs 42 steps/s inside a Prefect
# task). Passive waiting costs little; it only takes effect when set before torch loads, and a value the user
# set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from fitburst.allocator_env import configure as _configure_allocators  # noqa: E402

_configure_allocators()  # CUDA expandable segments, MPS fail-fast watermark (unless the user set them)

from fitburst.environ import library_defaults as _library_defaults  # noqa: E402

_library_defaults()  # before MLflow, Prefect or SkyPilot is imported: telemetry off, Prefect's server start patient

__version__ = "0.1.0"
