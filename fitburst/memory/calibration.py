"""How far the estimate is from measured memory: its error band, and the corrections fitted from measured runs.

Error bands (one per estimator and device family, constants below): the verdict plans for the band's upper edge
(the most the run may really need) and ``preflight.safety_margin`` is extra headroom on top. A band is relative
to the estimate's reserved figure (what decides an OOM): ``measured / estimate - 1`` lies in ``[low, high]`` on
the benchmark rows named in ``source``.

Corrections (``fitburst calibrate``, read by the estimator): a small JSON file at
``$FITBURST_CACHE/calibration.json`` (default ``~/.cache/fitburst``): a multiplicative factor per device family
(cuda / mps / cpu) and per GPU name where enough runs were seen, for the figure a run's measured peak compares
with (``factor``) and, on CUDA, for the allocator's reserved figure (``reserved_factor``). No file, no change.
Pure Python (json, os): importing it stays light.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ErrorBand:
    low: float  # measured may be this fraction below the estimate (<= 0)
    high: float  # ... and this fraction above it (>= 0)
    source: str  # the benchmark and group the figures come from

    def upper(self, nbytes: int) -> int:
        """The band's upper edge for an estimated ``nbytes``: what the run may really need."""
        return int(nbytes * (1 + self.high))


# All band constants. ``high`` is how much more than the estimate the run may need.
# "analytic": the analytic estimate (fitburst.memory.estimator) as a predictor of the device, from the figures
# issue 8 reports for benchmarks/preflight_accuracy.py (held out: no row was used to fit the analytic terms):
# - cuda: group "T4 reserved + context" (32 real T4 runs): worst under-prediction -23.5 % (estimate = 0.765 x
#   measured), so measured <= estimate / 0.765 = 1.31 x; worst over-prediction about +10 %.
# - cpu: group "CPU-measured training steps": all over-predictions, +13 % median, +28 % worst (measured >=
#   estimate / 1.28 = 0.78 x); the README's in-sample CPU group has worst 4.4 %, taken as the upper edge.
# - mps: nothing measured: CUDA's band (the wider one).
# "traced": the traced estimate (fitburst.memory.trace) as a predictor of the device, and "analytic-vs-traced":
# the analytic estimate as a predictor of the trace (what the planner's search needs when the trace verifies its
# choice). Both from branch i8-trace, commit 6503ff8 (estimator.EXACT_BAND / ANALYTIC_BAND): traced vs T4
# reserved + context on the held-out rows of ../shared/memory/t4_dev.csv (benchmarks/preflight_accuracy.py part
# b) -0.4 % .. +0.1 %, vs CPU live tensor bytes of the project's step within 0.5 % (tests/test_trace.py), MPS
# +-15 % (not measured); analytic vs trace on a grid of small llama/qwen2 configs -0.04 % .. +1.39 %, kept at
# +-2 %. Here each ``high`` is the larger magnitude of the two signs (the sign convention differs there).
_CUDA = ErrorBand(-0.10, 0.31, "preflight_accuracy: T4 reserved + context, 32 runs, worst -23.5 % (issue 8)")
_CPU = ErrorBand(-0.22, 0.05, "preflight_accuracy: CPU steps +13..+28 % (issue 8); README CPU group worst 4.4 %")
_MPS = ErrorBand(_CUDA.low, _CUDA.high, "no MPS measurements: CUDA's band")
_VS_TRACE = ErrorBand(-0.02, 0.02, "analytic vs traced step, grid of small llama/qwen2 configs (i8-trace)")
BANDS: dict[tuple[str, str], ErrorBand] = {
    ("analytic", "cuda"): _CUDA,
    ("analytic", "cpu"): _CPU,
    ("analytic", "mps"): _MPS,
    ("traced", "cuda"): ErrorBand(-0.004, 0.004, "preflight_accuracy part b: traced vs T4 reserved + context, "
                                                 "held-out rows of t4_dev.csv (i8-trace)"),
    ("traced", "cpu"): ErrorBand(-0.005, 0.005, "test_trace: traced vs CPU live tensor bytes (i8-trace)"),
    ("traced", "mps"): ErrorBand(-0.15, 0.15, "no MPS measurements: i8-trace's +-15 %"),
    ("analytic-vs-traced", "cuda"): _VS_TRACE,
    ("analytic-vs-traced", "cpu"): _VS_TRACE,
    ("analytic-vs-traced", "mps"): _VS_TRACE,
}
# What the user's safety_margin adds on top of the band by default: the band covers the estimate's own error,
# so the margin only has to cover what no estimate sees (other processes on the device, run-to-run jitter of
# the allocator). 3 % of the budget is ~1.4 GiB of a 48 GB card. Mirrored by PreflightSpec.safety_margin.
DEFAULT_HEADROOM = 0.03


def band_for(method: str, kind: str) -> ErrorBand:
    """The band of estimates made by ``method`` (analytic | traced | analytic-vs-traced) on a ``kind`` (cuda | mps |
    cpu) device."""
    return BANDS[(method, kind)]


FILE_NAME = "calibration.json"
_cache: dict[str, tuple[float, dict]] = {}


def calibration_path() -> Path:
    root = os.environ.get("FITBURST_CACHE") or str(Path.home() / ".cache" / "fitburst")
    return Path(root) / FILE_NAME


def load() -> dict:
    """The calibration file's content ({} when there is none or it cannot be read)."""
    p = calibration_path()
    try:
        mtime = p.stat().st_mtime
    except OSError:
        return {}
    hit = _cache.get(str(p))
    if hit and hit[0] == mtime:
        return hit[1]
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        data = {}
    _cache[str(p)] = (mtime, data)
    return data


def gpu_key(name: str) -> str:
    """A GPU name as runs record it ("cuda (NVIDIA A100-SXM4-80GB)", "A100-80GB") reduced to a stable key."""
    n = name.strip()
    if "(" in n and n.endswith(")"):
        n = n[n.index("(") + 1 : -1]
    return n.upper().replace("NVIDIA ", "").replace(" ", "-")


def factor_for(name: str, kind: str) -> tuple[float, str]:
    """(factor, what it was fitted on) for a device; (1.0, "") when uncalibrated."""
    data = load()
    g = data.get("gpus", {}).get(gpu_key(name))
    if g and g.get("factor"):
        return float(g["factor"]), f"{gpu_key(name)}, {g.get('n', '?')} runs"
    f = data.get("families", {}).get(kind)
    if f and f.get("factor"):
        return float(f["factor"]), f"{kind}, {f.get('n', '?')} runs"
    return 1.0, ""


def reserved_factor_for(name: str, kind: str) -> float:
    """The factor for the reserved figure: fitted on measured reserved memory (CUDA) where there is one, else the
    same as :func:`factor_for` (on CPU and MPS the measured figure is the reserved one)."""
    data = load()
    for group in (data.get("gpus", {}).get(gpu_key(name)), data.get("families", {}).get(kind)):
        if group and group.get("factor"):
            return float(group.get("reserved_factor") or group["factor"])
    return 1.0
