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


# All band constants. ``high`` is how much more than the estimate the run may need. The figures are
# ``estimate / measured - 1`` as benchmarks/preflight_accuracy.py prints them (re-run 2026-11-24), converted here to
# ``measured / estimate - 1`` (a range [l, h] becomes [1/(1+h) - 1, 1/(1+l) - 1]).
# "traced": the traced estimate (fitburst.memory.trace) as a predictor of the device:
# - cuda (16-bit LoRA): traced reserved + context vs the T4's, HELD-OUT rows (TinyLlama, never used to choose a
#   CUDA rule) of ../shared/memory/t4_dev.csv (part t4): 0.00 % .. +0.26 %, 6 rows (5 exact to the MiB).
# - cuda-kbit (4-bit QLoRA): the same, held-out TinyLlama rows: -4.89 % .. +4.23 %, 15 rows, median |error| 1.56 %
#   over all 21 held-out rows (allocated: -0.12 % .. +0.25 %), with transformers' caching_allocator_warmup (one
#   segment of the weights' size before the quantize-on-load, which the bnb quantizer's device map always
#   triggers) and bitsandbytes' gemm_4bit dequant fallback as CUDA rules, the load in checkpoint-key order, each
#   session's peft (k-bit preparation emptying the cache from 0.20). The same configuration measured in the two
#   sessions differs by 1.1 % / 1.4 % in reserved (2-3 MiB in allocated): a floor no model of these rows gets
#   under (versions, or the loader's timing).
# - cpu: traced vs live tensor bytes of 27 real steps of the project's loop, 9 architectures (part a; the trace
#   has no fitted terms on CPU): 0.00 % .. +0.58 % (the largest on QLoRA); re-run after the merge (the loop's AMP
#   traced, --quick, 14 steps, 7 architectures): 0.00 % .. +0.59 %.
# - mps: nothing measured: the widest band measured on another device kind (analytic cuda).
# "analytic": the analytic estimate (fitburst.memory.estimator) as a predictor of the device (never fitted to
# these rows): cuda: device total vs all 29 T4 rows, estimated as the harness stepped them (a 16-bit model with
# no autocast, the trace's harness step too; until 2026-11-25 the benchmark estimated them with the loop's
# autocast: -24.7 % .. +10.7 %): -18.5 % .. +11.0 %, median |error| 7.0 % (its reserved term fitted on traced
# replays, see estimator.RESERVED_PER_LOGITS). Its allocated figure on these rows is now within -1.3 % .. +0.5 %
# of the trace (which is within 0.25 % of the measured allocated), after the block backward was split into MLP
# and attention and eager attention's backward was modelled per kernel (2026-11-25; it was -2.2 % .. +10.4 %,
# and the over-counted allocated hid part of the allocator's fragmentation: -17.2 % .. +10.5 % before): what is
# left is fragmentation the linear reserved term does not follow (eager attention's b*h*s*s blocks).
# cpu: allocated vs the measured CPU steps of part a (--quick, 14 steps, 7 architectures, 11 the analytic path
# models), after its mixed-precision terms were set from traces of tests/test_trace.py's grid and of
# analytic_vs_traced configurations (not from these rows): -0.1 % .. +4.8 %, median 0.20 % (2026-11-25, once
# each adapter's own 16-bit input copy under autocast was counted; -2.6 % .. +4.8 %, median 0.82 %, before; the
# worst is QLoRA with checkpointing and AdamW8bit). mps: nothing measured, cuda's band.
# "analytic-vs-traced": the analytic estimate as a predictor of the trace (what the planner's search needs when
# the trace verifies its choice): the grid of small llama/qwen2 configs in tests/test_trace.py (fp32, bf16 and fp16
# LoRA, full fp32 and bf16 with fp32 master weights, QLoRA), traced through the loop's AMP step: trace /
# analytic - 1 in -1.48 % .. +0.22 % (2026-11-25; -1.48 % .. +1.87 % before each adapter's own 16-bit input copy
# under autocast was counted), after the mixed-precision terms (master weights, 16-bit adapters under autocast,
# autocast's weight copies) were set from traces of that grid; kept at -2 % .. +2 %. On CUDA
# (benchmarks/analytic_vs_traced.py, reserved, full-size configurations of 10 models on T4 / L4 / A100), after the
# autocast terms were corrected (2026-11-25; read from traces, no constant fitted): k-bit runs keep 16-bit copies
# (attention's q/k/v and probabilities, LoRA dropout outputs) and the eager softmax backward; CUDA autocast runs
# layer_norm and gelu_new's pow in fp32 (phi); and (2026-11-25) a block's backward in two steps (the MLP's tensors
# freed before the attention's backward), eager softmax backward per kernel, each adapter's own 16-bit input copy
# under autocast, the cuBLAS workspaces: seed 1 (100 configurations, two of which were read to find the k-bit
# terms) with checkpointing -5.6 % .. +9.5 % (median 2.1 %), without -5.9 % .. +6.3 % (median 3.5 %), allocated
# -1.7 % .. +1.7 % (was -5.0 % .. +3.8 %); seed 2 (50 configurations, read only for the phi-1.5 row that showed
# the MLP term) with checkpointing -8.1 % .. +4.3 % (was -13.2 %), without -5.9 % .. -0.5 %, allocated
# -1.3 % .. +0.6 % (was -5.6 % .. +1.3 %): the union is the CUDA band. Re-scored on the traced figures both seeds
# printed on 2026-11-25 (the trace has not changed since); what is left is the reserved term. The planner's search
# traces a plan when the band's LOW edge (the most favourable trace the analytic figure allows) fits, so a plan the
# analytic figure over-estimates is still tried, and the trace decides (it rejects any plan the analytic figure
# under-estimated).
# On MPS (2026-11-25, once the trace ran SDPA's math composite and MPS's autocast, and the analytic math terms
# were read from that composite: fp32 q, k, v and probabilities, no 16-bit copy; no constant fitted):
# benchmarks/analytic_vs_traced.py --mps, seed 3 (40 configurations) reserved with checkpointing -3.1 % .. +0.1 %,
# without -0.3 % .. 0.0 %; seed 4 (30) -1.3 % .. 0.0 % both ways; a grid of 96 small llama / phi configurations
# (the one the terms were read against) -1.9 % .. +0.6 %. Kept at -4 % .. +2 %.


def _measured(low: float, high: float, source: str) -> ErrorBand:
    """A band from ``estimate / measured - 1`` in [low, high], as ``measured / estimate - 1``."""
    return ErrorBand(round(1 / (1 + high) - 1, 4), round(1 / (1 + low) - 1, 4), source)


_CUDA = _measured(-0.185, 0.110, "preflight_accuracy t4: analytic (no autocast, as the harness ran) vs T4 "
                                 "reserved + context, all 29 rows")
_VS_TRACE = ErrorBand(-0.02, 0.02, "analytic vs traced step, grid of small llama/qwen2 configs (tests/test_trace.py)")
_VS_TRACE_CUDA = ErrorBand(-0.081, 0.095, "benchmarks/analytic_vs_traced.py: traced / analytic - 1, reserved, 150 "
                                          "full-size configurations of 10 models on T4 / L4 / A100 (seeds 1, 2)")
BANDS: dict[tuple[str, str], ErrorBand] = {
    ("analytic", "cuda"): _CUDA,
    ("analytic", "cpu"): _measured(-0.001, 0.048, "preflight_accuracy a --quick: analytic vs 11 measured CPU steps "
                                                  "(LoRA/QLoRA/full, fp32/bf16)"),
    ("analytic", "mps"): ErrorBand(_CUDA.low, _CUDA.high, "no MPS measurements: analytic CUDA's band"),
    ("traced", "cuda"): _measured(0.0, 0.0026, "preflight_accuracy t4: traced vs T4 reserved + context, 16-bit "
                                               "LoRA, 6 held-out TinyLlama rows"),
    ("traced", "cuda-kbit"): _measured(-0.0489, 0.0423, "preflight_accuracy t4: traced vs T4 reserved + context, "
                                                        "4-bit QLoRA, 15 held-out TinyLlama rows"),
    ("traced", "cpu"): _measured(0.0, 0.0059, "preflight_accuracy a: traced vs live tensor bytes, 27 CPU steps of "
                                              "the loop, 9 architectures (0.59 % worst after the AMP merge)"),
    ("traced", "mps"): ErrorBand(_CUDA.low, _CUDA.high, "no MPS measurements: the widest band measured elsewhere"),
    ("analytic-vs-traced", "cuda"): _VS_TRACE_CUDA,
    ("analytic-vs-traced", "cpu"): _VS_TRACE,
    ("analytic-vs-traced", "mps"): ErrorBand(-0.04, 0.02, "benchmarks/analytic_vs_traced.py --mps: traced / "
                                                          "analytic - 1, reserved, 70 full-size configurations "
                                                          "of 10 models (seeds 3, 4)"),
}

def band_for(method: str, kind: str, kbit: bool = False) -> ErrorBand:
    """The band of estimates made by ``method`` (analytic | traced | analytic-vs-traced) on a ``kind`` (cuda | mps |
    cpu) device; ``kbit`` (quantized base weights) picks a k-bit band where one was measured."""
    return BANDS.get((method, f"{kind}-kbit"), BANDS[(method, kind)]) if kbit else BANDS[(method, kind)]


FILE_NAME = "calibration.json"
_cache: dict[str, tuple[float, dict]] = {}


OOM_HISTORY_FILE = "oom_history.jsonl"  # fitburst.oom appends each out-of-memory step-down beside the fit


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
