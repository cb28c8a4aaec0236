"""How far a peak estimate may be from the measured peak: one error band per estimator and device family.

The verdict plans for the band's upper edge (the most the run may really need), and ``preflight.safety_margin``
is extra headroom on top of that. The band is relative to the estimate's reserved figure (what decides an
OOM): ``measured / estimate - 1`` lies in ``[low, high]`` on the benchmark rows named in ``source``.
All band constants live here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ErrorBand:
    low: float  # measured may be this fraction below the estimate (<= 0)
    high: float  # ... and this fraction above it (>= 0)
    source: str  # the benchmark and group the figures come from

    def upper(self, nbytes: int) -> int:
        """The band's upper edge for an estimated ``nbytes``: what the run may really need."""
        return int(nbytes * (1 + self.high))


# Analytic estimate (fitburst.memory.estimator), from the figures issue 8 reports for
# benchmarks/preflight_accuracy.py (held out: none of these rows were used to fit the analytic terms):
# - cuda: group "T4 reserved + context" (32 real T4 runs): worst under-prediction -23.5 % (estimate = 0.765 x
#   measured), so measured <= estimate / 0.765 = 1.31 x; worst over-prediction about +10 %.
# - cpu: group "CPU-measured training steps": all over-predictions, +13 % median, +28 % worst (measured >=
#   estimate / 1.28 = 0.78 x); the README's in-sample CPU group has worst 4.4 %, taken as the upper edge.
# - mps: nothing measured: CUDA's band (the wider one).
# Traced estimate (fitburst.memory.trace, branch i8-trace): until its benchmark rows are in, the analytic
# bands stand for it too; replace them with the benchmark's "T4 reserved" / "CPU tensor peak" groups.
_CUDA = ErrorBand(-0.10, 0.31, "preflight_accuracy: T4 reserved + context, 32 runs, worst -23.5 % (issue 8)")
_CPU = ErrorBand(-0.22, 0.05, "preflight_accuracy: CPU steps +13..+28 % (issue 8); README CPU group worst 4.4 %")
_MPS = ErrorBand(_CUDA.low, _CUDA.high, "no MPS measurements: CUDA's band")
BANDS: dict[tuple[str, str], ErrorBand] = {
    ("analytic", "cuda"): _CUDA,
    ("analytic", "cpu"): _CPU,
    ("analytic", "mps"): _MPS,
    ("traced", "cuda"): _CUDA,
    ("traced", "cpu"): _CPU,
    ("traced", "mps"): _MPS,
}
# What the user's safety_margin adds on top of the band by default: the band covers the estimate's own error,
# so the margin only has to cover what no estimate sees (other processes on the device, run-to-run jitter of
# the allocator). 3 % of the budget is ~1.4 GiB of a 48 GB card. Mirrored by PreflightSpec.safety_margin.
DEFAULT_HEADROOM = 0.03


def band_for(method: str, kind: str) -> ErrorBand:
    """The band of estimates made by ``method`` (analytic | traced) on a ``kind`` (cuda | mps | cpu) device."""
    return BANDS[(method, kind)]
