"""How far the estimate is from measured memory: its error band, and the corrections fitted from measured runs.

Error bands (per estimator, device family and, where runs were measured on it, GPU model; constants below): the
verdict plans for the band's upper edge (the most the run may really need) and ``preflight.safety_margin`` is extra
headroom on top. A band is relative to the estimate's reserved figure (what decides an OOM): ``measured / estimate
- 1`` lies in ``[low, high]`` on the ``rows`` measured runs named in ``source``. A GPU's measured band holds only
inside what its runs span (:class:`Envelope`: parameters, vocabulary, fraction of the card, attention, quantization,
sharding); a run outside it, or on a GPU nothing was measured on, gets a wider band marked ``measured=False``, and
the band says why. How each figure was measured, and which rows were fit, looked at or held out: docs/preflight.md,
"Error bands".

Corrections (``fitburst calibrate``, read by the estimator): a small JSON file at
``$FITBURST_CACHE/calibration.json`` (default ``~/.cache/fitburst``): a multiplicative factor per device family
(cuda / mps / cpu) and per GPU name where enough runs were seen, for the figure a run's measured peak compares
with (``factor``) and, on CUDA, for the allocator's reserved figure (``reserved_factor``). No file, no change.
Pure Python (json, os): importing it stays light.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ErrorBand:
    low: float  # measured may be this fraction below the estimate (<= 0)
    high: float  # ... and this fraction above it (>= 0)
    source: str  # where the figures come from, in words
    rows: int = 0  # measured runs behind the figures (0: none on this device)
    measured: bool = True  # False: nothing was measured on this GPU or device kind, or for runs like this one
    outside: str = ""  # why a measured GPU's band does not apply: what of the run lies outside its runs

    def upper(self, nbytes: int) -> int:
        """The band's upper edge for an estimated ``nbytes``: what the run may really need."""
        return int(nbytes * (1 + self.high))

    def describe(self) -> str:
        """The band in one line for a report: its edges, how many measured runs stand behind it, and where from."""
        # an unmeasured band's source says so; a band between two estimates (analytic-vs-traced) counts no runs
        what = f", {self.rows} measured runs" if self.measured and self.rows else ""
        return f"{self.low:+.1%} / {self.high:+.1%}{what}: {self.source}"


@dataclass(frozen=True)
class RunFacts:
    """What of a run decides whether a measured band covers it; None: not known (not checked)."""

    params: int | None = None  # the base model's parameters
    vocab: int | None = None
    card: float | None = None  # the estimated reserved figure as a fraction of the card's memory
    attention: str | None = None  # eager | sdpa | flash
    quant: str | None = None  # none | int8 | nf4 | fp4, "+dq" with double quantization
    world_size: int = 1


@dataclass(frozen=True)
class Envelope:
    """What a measured band's runs span: a run outside any of it is not one the band was measured on."""

    params: tuple[int, int]
    vocab: tuple[int, int]
    card: float  # the largest reserved figure (measured or estimated) of the runs, as a fraction of the card
    attention: tuple[str, ...]
    quant: tuple[str, ...]
    world_size: int = 1

    def outside(self, run: RunFacts) -> list[str]:
        """What of ``run`` lies outside, in words ([]: inside)."""
        why = []
        if run.params is not None and not self.params[0] <= run.params <= self.params[1]:
            why.append(f"{_count(run.params)} parameters (runs: {_count(self.params[0])} .. {_count(self.params[1])})")
        if run.vocab is not None and not self.vocab[0] <= run.vocab <= self.vocab[1]:
            span = f"{self.vocab[0]:,}" + (f" .. {self.vocab[1]:,}" if self.vocab[1] != self.vocab[0] else "")
            why.append(f"a vocabulary of {run.vocab:,} (runs: {span})")
        if run.card is not None and run.card > self.card:
            why.append(f"{run.card:.1%} of the card (runs: at most {self.card:.1%})")
        for name, value, seen in (("attention", run.attention, self.attention), ("quantization", run.quant,
                                                                                 self.quant)):
            if value is not None and value not in seen:
                why.append(f"{name} {value} (runs: {', '.join(seen)})")
        if run.world_size > self.world_size:
            why.append(f"sharded over {run.world_size} GPUs (runs: one GPU)")
        return why


def _count(n: int) -> str:
    return next(f"{n / d:.3g} {u}" for d, u in ((1e9, "B"), (1e6, "M"), (1e3, "k"), (1, "")) if n >= d or d == 1)


RUN_TO_RUN = 0.0145  # the largest difference between two sessions' measurements of one configuration (T4 rows)
UNMEASURED_GPU_LOW = 0.03  # an unmeasured GPU's band: its T4 band widened by these (docs/preflight.md)
UNMEASURED_GPU_HIGH = 0.05
MEASURED_GPUS = ("T4", "H100")  # gpu_key()s with measured CUDA rows


def _outward(low: float, high: float) -> tuple[float, float]:
    """[low, high] at four decimals, rounded away from the middle (a row on an edge stays inside)."""
    return math.floor(round(low * 1e4, 6)) / 1e4, math.ceil(round(high * 1e4, 6)) / 1e4


def _measured(low: float, high: float, source: str, rows: int, floor: float = RUN_TO_RUN) -> ErrorBand:
    """A band from ``estimate / measured - 1`` in [low, high] (what the benchmarks print), as ``measured / estimate
    - 1``, at least ``floor`` wide on either side."""
    return ErrorBand(*_outward(min(1 / (1 + high) - 1, -floor), max(1 / (1 + low) - 1, floor)), source, rows)


def _unmeasured_gpu(band: ErrorBand, why: str = "not measured on this GPU") -> ErrorBand:
    """``band`` (measured on a T4) as it applies where nothing was measured: ``why``."""
    return ErrorBand(round(band.low - UNMEASURED_GPU_LOW, 4), round(band.high + UNMEASURED_GPU_HIGH, 4),
                     f"{why}: {band.source}, widened by -{UNMEASURED_GPU_LOW:.0%} / "
                     f"+{UNMEASURED_GPU_HIGH:.0%} for another card's kernels, workspaces and context", 0,
                     measured=False)


# CUDA, a Tesla T4: the published archive's 29 runs (each band's rows, edges and evidence file: docs/preflight.md,
# "Error bands")
T4_ANALYTIC = _measured(-0.1853, 0.110, "analytic estimate vs a Tesla T4's reserved + context (29 runs of "
                                       "TinyLlama-1.1B and SmolLM2-135M, looked-at)", 29)
T4_16 = _measured(0.0, 0.0026, "traced estimate vs a Tesla T4's reserved + context, 16-bit LoRA (6 held-out runs "
                               "of TinyLlama-1.1B)", 6)
T4_4BIT = _measured(-0.0509, 0.0424, "traced estimate vs a Tesla T4's reserved + context, 4-bit QLoRA nf4 (19 "
                                     "in-sample runs of TinyLlama-1.1B and SmolLM2-135M: 4 fit, 15 looked-at)", 19)
# 4-bit runs of other models on a T4: a reading whose rows are not in this repository, so it sets only the
# unmeasured 4-bit band (docs/preflight.md), never a measured one
T4_4BIT_REPORTED = ErrorBand(-0.1304, 0.15, "traced estimate, 4-bit QLoRA: T4 runs of other models reported at "
                                            "-12 % .. +15 % (their rows are not in this repository)", 0,
                             measured=False)
_MPS = ErrorBand(T4_ANALYTIC.low, T4_ANALYTIC.high, "not measured on MPS: the widest band measured on any device "
                                                  "(the analytic estimate on a T4)", 0, measured=False)
_VS_TRACE = ErrorBand(-0.02, 0.19, "analytic vs traced estimate, grid of small llama/qwen2 configurations "
                                   "(tests/test_trace.py) and 6 held-out configurations (seed 27)", 0)


def _gpu_rows(low: float, high: float, source: str, rows: int) -> ErrorBand:
    """A band read as ``measured / estimate - 1`` in [low, high] on a GPU's rows, at least the run-to-run floor."""
    return ErrorBand(*_outward(min(low, -RUN_TO_RUN), max(high, RUN_TO_RUN)), source, rows)


_H100 = "an H100 80GB's reserved memory, fitburst's own loop (benchmarks/gpu_check.py"
GPU_BANDS: dict[tuple[str, str, str], ErrorBand] = {
    ("analytic", "cuda", "T4"): T4_ANALYTIC,
    ("traced", "cuda", "T4"): T4_16,
    ("traced", "cuda-kbit", "T4"): T4_4BIT,
    ("analytic", "cuda", "H100"): _gpu_rows(-0.179, 0.029, f"analytic estimate vs {_H100}: 5 fit, 5 held-out)", 10),
    ("traced", "cuda", "H100"): _gpu_rows(-0.0161, 0.0, f"traced estimate vs {_H100}, 16-bit and fp32: 3 fit, 4 "
                                                        "held-out)", 7),
    ("traced", "cuda-kbit", "H100"): _gpu_rows(-0.0169, 0.0433, f"traced estimate vs {_H100}, QLoRA nf4: 2 fit, 1 "
                                                                "held-out)", 3),
}
# What each measured band's runs span (the card's fraction rounded up at two significant digits): a band claims only
# what its rows span (tests/test_bands.py, tests/test_gpu_evidence.py check each row lies inside, none wider)
_T4_RUNS = Envelope(params=(134_515_008, 1_100_048_384), vocab=(32_000, 49_152), card=0.76,
                    attention=("eager", "sdpa"), quant=("none", "nf4"))
_H100_RUNS = Envelope(params=(499_584, 203_036_672), vocab=(826, 826), card=0.028, attention=("sdpa",),
                      quant=("none", "nf4", "nf4+dq"))
ENVELOPES: dict[tuple[str, str, str], Envelope] = {
    ("analytic", "cuda", "T4"): _T4_RUNS,
    ("traced", "cuda", "T4"): replace(_T4_RUNS, card=0.52, quant=("none",)),
    ("traced", "cuda-kbit", "T4"): replace(_T4_RUNS, quant=("nf4",)),
    ("analytic", "cuda", "H100"): _H100_RUNS,
    ("traced", "cuda", "H100"): replace(_H100_RUNS, card=0.026, quant=("none",)),
    ("traced", "cuda-kbit", "H100"): replace(_H100_RUNS, params=(101_526_528, 101_526_528), card=0.014,
                                             quant=("nf4", "nf4+dq")),
}
# what a CUDA run no measured band covers gets: these T4 bands widened by _unmeasured_gpu
_UNMEASURED_FROM = {("analytic", "cuda"): T4_ANALYTIC, ("traced", "cuda"): T4_16,
                    ("traced", "cuda-kbit"): T4_4BIT_REPORTED}
# the CPU steps each estimate was scored on: benchmarks/results/preflight_accuracy.txt part (a) (looked-at) and
# preflight_accuracy-fresh27.txt (seed 27's, held-out); tests/test_bands.py counts them, and their edges, there
CPU_STEP_ROWS = {"analytic": {"looked-at": 21, "held-out": 6}, "traced": {"looked-at": 27, "held-out": 12}}


def _cpu_steps(method: str, low: float, high: float) -> ErrorBand:
    """A band over the real CPU steps of the training loop (:data:`CPU_STEP_ROWS`) read as ``low .. high``."""
    rows = CPU_STEP_ROWS[method]
    said = ", ".join(f"{n} {kind}" for kind, n in rows.items())
    return _measured(low, high, f"{method} estimate vs live tensor bytes of real CPU steps of the training loop "
                                f"({said})", sum(rows.values()), floor=0.0)


BANDS: dict[tuple[str, str], ErrorBand] = {  # per device family; on CUDA: no measured runs like this one
    **{k: _unmeasured_gpu(b) for k, b in _UNMEASURED_FROM.items()},
    ("analytic", "cpu"): _cpu_steps("analytic", -0.159, 0.048),
    ("analytic", "mps"): _MPS,
    ("traced", "cpu"): _cpu_steps("traced", 0.0, 0.0059),
    ("traced", "mps"): _MPS,
    # not measurements: how far the instant figure lies from the trace of the same run (the planner's scout)
    ("analytic-vs-traced", "cuda"): ErrorBand(-0.081, 0.095, "analytic vs traced estimate, reserved, 150 full-size "
                                                             "configurations of 10 models on T4 / L4 / A100 "
                                                             "(benchmarks/analytic_vs_traced.py)", 0),
    ("analytic-vs-traced", "cpu"): _VS_TRACE,
    ("analytic-vs-traced", "mps"): ErrorBand(-0.04, 0.02, "analytic vs traced estimate, reserved, 70 full-size "
                                                          "configurations of 10 models on MPS "
                                                          "(benchmarks/analytic_vs_traced.py --mps)", 0),
}

# the sliced estimate against the full trace of the same run, sliced / traced - 1, reserved (docs/preflight.md); a
# sliced estimate's band is the traced band widened by it
SLICED_ROWS = {"cpu": 9, "cuda": 27}
SLICED_CPU = (0.0, 0.0)
SLICED_CUDA = (-0.081, 0.0308)
_SLICED_SOURCE = "sliced vs full trace of the same run (benchmarks/sliced_vs_traced.py, {n} configurations)"
BANDS.update({
    ("sliced-vs-traced", "cpu"): _measured(*SLICED_CPU, _SLICED_SOURCE.format(n=SLICED_ROWS["cpu"]), 0, floor=0.0),
    ("sliced-vs-traced", "cuda"): _measured(*SLICED_CUDA, _SLICED_SOURCE.format(n=SLICED_ROWS["cuda"]), 0,
                                            floor=0.0),
    # MPS has no allocator model: its sliced figure is tensor bytes as on the CPU, but nothing was compared there
    ("sliced-vs-traced", "mps"): _measured(*SLICED_CUDA, _SLICED_SOURCE.format(n=SLICED_ROWS["cuda"]) + ", CUDA's "
                                           "band: nothing compared on MPS", 0, floor=0.0),
})
# FSDP, per GPU, against each rank of real gloo runs on the CPU (docs/preflight.md); on CUDA nothing sharded was
# measured: the one-GPU unmeasured band widened by UNMEASURED_SHARDED_HIGH for FSDP's collective streams
UNMEASURED_SHARDED_HIGH = 0.05
_SHARDED_VS_TRACE = (-0.224, 0.099)  # traced / analytic - 1, per GPU (docs/preflight.md)
SHARDED_BANDS: dict[tuple[str, str], ErrorBand] = {
    ("traced", "cpu"): _measured(0.0, 0.004, "traced estimate (rank 0 of N) vs each rank's live tensor bytes in real "
                                             "gloo runs, FSDP (14 configurations, 4 architectures, 2 and 4 ranks; "
                                             "gloo's reduce-scatter copy left out)", 14, floor=0.0),
    ("analytic", "cpu"): _measured(0.039, 0.2874, "analytic per-GPU estimate vs each rank's live tensor bytes in real "
                                                  "gloo runs, FSDP (14 configurations, 4 architectures)", 14,
                                   floor=0.0),
    ("analytic-vs-traced", "cpu"): ErrorBand(*_SHARDED_VS_TRACE, "analytic vs traced per-GPU estimate, FSDP at 2, 4 "
                                             "and 8 ranks (benchmarks/distributed.py, tests/test_sharded.py)", 0),
    # the scout's low edge: the CPU rows' (the analytic FSDP terms are the same arithmetic on every device), or the
    # one-GPU CUDA band's, whichever is lower
    ("analytic-vs-traced", "cuda"): ErrorBand(min(_SHARDED_VS_TRACE[0], -0.081),
                                              round(max(_SHARDED_VS_TRACE[1], 0.095 + UNMEASURED_SHARDED_HIGH), 4),
                                              "analytic vs traced per-GPU estimate, FSDP: the CPU rows and the one-GPU "
                                              "CUDA band widened for FSDP's streams", 0),
}


def _sharded_gpu(band: ErrorBand) -> ErrorBand:
    """A one-GPU CUDA ``band`` as it applies per GPU to a run sharded with FSDP (nothing sharded measured on GPUs)."""
    return replace(band, high=round(band.high + UNMEASURED_SHARDED_HIGH, 4), rows=0, measured=False,
                   source=f"{band.source}; FSDP's collective streams not modelled, widened by "
                          f"+{UNMEASURED_SHARDED_HIGH:.0%}")


def measured_gpu(name: str | None) -> str | None:
    """The measured GPU ``name`` is ("T4" for "T4" or "cuda (Tesla T4)"), or None."""
    if not name:
        return None
    key = gpu_key(name)
    return next((g for g in MEASURED_GPUS if key == g or key.endswith(f"-{g}") or key.startswith(f"{g}-")), None)


def band_for(method: str, kind: str, kbit: bool = False, gpu: str | None = None, world_size: int = 1,
             run: RunFacts | None = None) -> ErrorBand:
    """The band of estimates made by ``method`` (analytic | traced | sliced | analytic-vs-traced | sliced-vs-traced)
    on a ``kind`` (cuda | mps | cpu) device; ``kbit`` (quantized base weights) picks a k-bit band where one exists;
    ``gpu`` (a device name) picks that GPU's measured band where it has one and ``run`` (what is known of the run;
    None: only ``world_size``) lies inside what its runs span (:data:`ENVELOPES`), else the wider band of an
    unmeasured GPU that says why; a run sharded over ``world_size`` > 1 GPUs its FSDP band (:data:`SHARDED_BANDS`)."""
    if method == "sliced":  # the slicing's band on top of the full trace's
        t, v = band_for("traced", kind, kbit, gpu, world_size, run), band_for("sliced-vs-traced", kind, kbit)
        return ErrorBand(round((1 + t.low) * (1 + v.low) - 1, 4), round((1 + t.high) * (1 + v.high) - 1, 4),
                         f"{v.source}, on top of the traced band ({t.source})", t.rows, t.measured, t.outside)
    if world_size > 1:
        if (method, kind) in SHARDED_BANDS:
            return SHARDED_BANDS[(method, kind)]
        if kind == "cuda":
            return _sharded_gpu(band_for(method, kind, kbit, gpu, 1, replace(run or RunFacts(), world_size=world_size)))
    family = f"{kind}-kbit" if kbit and (method, f"{kind}-kbit") in BANDS else kind
    g = (measured_gpu(gpu) if kind == "cuda" else None) or ""
    if (method, family, g) not in GPU_BANDS:
        return BANDS[(method, family)]
    why = ENVELOPES[(method, family, g)].outside(run or RunFacts(world_size=world_size))
    if not why:
        return GPU_BANDS[(method, family, g)]
    outside = "; ".join(why)
    return replace(_unmeasured_gpu(_UNMEASURED_FROM[(method, family)], f"not measured for this run on the {g}, "
                                   f"outside what its runs span ({outside})"), outside=outside)


FILE_NAME = "calibration.json"
_cache: dict[str, tuple[float, dict]] = {}


OOM_HISTORY_FILE = "oom_history.jsonl"  # fitburst.supervisor appends each out-of-memory step-down beside the fit


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
