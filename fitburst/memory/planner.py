"""The fit planner for one device: the ladder of changes people try by hand, cheapest slowdown first.

It searches with the fast analytic estimate. Without an ``exact`` estimate function the analytic figure decides;
with one (the traced estimate), the search only picks the plans worth checking, cheapest first (those the
analytic figure leaves room for, given how far it may be from the trace: calibration's analytic-vs-traced band),
and the first plan the exact estimate says fits is taken; after a few rejections, the plan that needs least is
checked last. A plan fits when the upper edge of the estimate's error band (:mod:`fitburst.memory.calibration`)
stays within the device budget less the extra headroom. Where to run (local, cloud, nowhere) is not decided here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from .calibration import DEFAULT_HEADROOM, band_for
from .devices import Device, GiB
from .estimator import Estimate, TrainSettings, estimate
from .shapes import ModelShape

# An estimate of one run on one device: (settings, device) -> Estimate. The analytic one is
# ``lambda s, d: estimate(shape, s, d)``; the preflight passes the traced one as ``exact``.
EstimateFn = Callable[[TrainSettings, Device], Estimate]

# relative step time of each rung (1.0 = unchanged); the planner minimises the product
_COST = {
    "attention": 0.9,  # flash / sdpa is faster than eager
    "packing": 0.9,  # flash-attn varlen computes no padding (offered for flash only: on the CPU, sdpa with a block
    # mask over one long row was slower than padded batches on the demo data, benchmarks/packing.py)
    "dropout": 0.98,
    "optimizer_8bit": 1.02,
    "gradient_checkpointing": 1.33,  # one extra forward
    "quantize": 1.4,  # dequantize per matmul
    "reduce_batch": 1.12,  # per halving: smaller matmuls, more python overhead
    "resolution": 1.5,  # faster, but the model sees less: after the changes that cost only time
    "precision": 1.5,  # faster, but the numerics the pipeline asked for (fp32) change: likewise
}
_EVAL_HALVING = 1.001  # a smaller eval batch: the eval is a small part of the run's time
_MAX_EXACT_CHECKS = 4  # plans the exact estimate may reject before the planner gives up on this device


@dataclass
class Plan:
    """The fastest allowed settings for one device, or the closest miss."""

    fits: bool
    settings: TrainSettings
    changes: list[str]
    estimate: Estimate
    needed_bytes: int  # the estimate's reserved figure at its error band's upper edge
    limit_bytes: int  # the device budget less the extra headroom

    def to_dict(self) -> dict:
        return {"fits": self.fits, "changes": self.changes, "settings": asdict(self.settings),
                "estimate": self.estimate.to_dict(), "needed_bytes": self.needed_bytes,
                "limit_bytes": self.limit_bytes}


@dataclass(frozen=True)
class Budget:
    """What a plan must stay within on ``device``: budget x (1 - headroom), against the band's upper edge.

    ``scout``: judge an analytic estimate as a predictor of the exact (traced) one that will verify the plan: a
    plan is worth tracing when the most favourable trace its analytic figure allows (the analytic-vs-traced band's
    low edge) fits at the traced band's upper edge. The exact check then decides; nothing is accepted on this."""

    device: Device
    headroom: float = DEFAULT_HEADROOM
    scout: bool = False

    @property
    def limit(self) -> int:
        return int(self.device.budget_bytes * (1 - self.headroom))

    def judge(self, e: Estimate) -> Estimate:
        """Mark ``e`` with its band, the headroom and whether it fits (for a scout: whether it is worth tracing)."""
        e.band = band_for(e.method, self.device.kind, _kbit(e), self.device.name)
        e.safety_margin = self.headroom
        e.fits = self.needed(e) <= self.limit
        return e

    def needed(self, e: Estimate) -> int:
        kind, kbit = self.device.kind, _kbit(e)
        if self.scout:
            lowest = int(e.reserved_peak_bytes * (1 + band_for("analytic-vs-traced", kind, kbit).low))
            return band_for("traced", kind, kbit, self.device.name).upper(lowest)
        return (e.band or band_for(e.method, kind, kbit, self.device.name)).upper(e.reserved_peak_bytes)


def _kbit(e: Estimate) -> bool:
    return e.settings.get("quant", "none") != "none"


def _gib(b: int) -> str:
    return f"{b / GiB:.1f} GiB"


def _rungs(s: TrainSettings, device: Device, allow: dict[str, bool]) -> list[tuple[str, Callable, str]]:
    """Each rung: (allow key, settings -> settings, explanation)."""
    out: list[tuple[str, Callable, str]] = []
    if allow["attention"] and s.attention == "eager":
        target = "flash" if device.kind == "cuda" and s.dtype != "fp32" else "sdpa"
        out.append(("attention", lambda x, t=target: replace(x, attention=t),
                    f"attention eager -> {target}: no seq x seq probability matrix kept"))
    if allow["packing"] and not s.packed_fill and s.batch > 1 and s.attention == "flash" and not s.images:
        out.append(("packing", lambda x: replace(x, packed_fill=1.0),
                    "packed batches: one padding-free row per micro-batch, no padding bias in flash attention"))
    if allow["dropout"] and s.method != "full" and s.dropout > 0:
        out.append(("dropout", lambda x: replace(x, dropout=0.0),
                    f"lora dropout {s.dropout:g} -> 0: no dropout mask and output kept for each adapted input"))
    if allow["optimizer_8bit"] and s.optimizer == "adamw" and device.supports_bnb:
        out.append(("optimizer_8bit", lambda x: replace(x, optimizer="adamw8bit"),
                    "optimizer adamw -> adamw8bit: 2 bytes of state per parameter instead of 8"))
    if allow["gradient_checkpointing"] and not s.grad_checkpointing:
        out.append(("gradient_checkpointing", lambda x: replace(x, grad_checkpointing=True),
                    "gradient checkpointing on: keep one tensor per layer, recompute the rest in backward "
                    "(~30 % slower)"))
    if allow["quantize"] and device.supports_bnb and s.method == "lora" and s.quant == "none":
        out.append(("quantize", lambda x: replace(x, method="qlora", quant="nf4", double_quant=True),
                    "QLoRA: base weights in 4-bit nf4 with double quant (~0.53 bytes per weight)"))
    if allow["precision"] and s.dtype == "fp32" and device.supports_bf16:
        out.append(("precision", lambda x: replace(x, dtype="bf16"),
                    "precision fp32 -> bf16 mixed: base weights and activations in 2 bytes (adapters and what "
                    "trains stay fp32)"))
    if allow["resolution"] and s.images and s.image_tokens >= 4:
        out.append(("resolution", _lower_resolution,
                    f"image resolution halved per side: {s.image_tokens} -> {s.image_tokens // 4} language tokens "
                    f"per image (data.image_max_pixels / 4), {s.images * (s.image_tokens - s.image_tokens // 4)} "
                    "fewer per sample"))
    return out


def _lower_resolution(s: TrainSettings) -> TrainSettings:
    """A quarter of the pixels per image: a quarter of the image tokens, and the sequence shorter by the rest."""
    cut = s.images * (s.image_tokens - s.image_tokens // 4)
    return replace(s, image_tokens=s.image_tokens // 4, seq_len=max(1, s.seq_len - cut))


def _halve_batch(base: TrainSettings, s: TrainSettings, k: int) -> TrainSettings:
    nb = max(1, base.batch // 2**k)
    return replace(s, batch=nb, grad_accum=base.grad_accum * (base.batch // nb))


def _fit_eval(est: EstimateFn, budget: Budget, s: TrainSettings) -> tuple[TrainSettings, Estimate, int]:
    """Lower the eval batch while the eval step is what does not fit: (settings, estimate, halvings)."""
    e = budget.judge(est(s, budget.device))
    k = 0
    while not e.fits and e.peak_phase == "eval" and s.eval_batch > 1:
        s = replace(s, eval_batch=s.eval_batch // 2)
        e = budget.judge(est(s, budget.device))
        k += 1
    return s, e, k


def _describe(base: TrainSettings, s: TrainSettings, rungs: list[str], e: Estimate) -> list[str]:
    why = list(rungs)
    if s.batch != base.batch:
        why.append(f"micro batch {base.batch} -> {s.batch}, grad_accum {base.grad_accum} -> {s.grad_accum} "
                   f"(same effective batch {base.effective_batch})")
    if s.eval_batch != base.eval_batch:
        why.append(f"eval batch {base.eval_batch} -> {s.eval_batch}: the eval step peaks at "
                   f"{_gib(e.phases.get('eval', 0))} allocated")
    return why


def plan_fit(
    shape: ModelShape,
    settings: TrainSettings,
    device: Device,
    safety_margin: float = DEFAULT_HEADROOM,
    allow: dict[str, bool] | None = None,
    *,
    exact: EstimateFn | None = None,
) -> Plan:
    """Fastest settings that fit ``device``: the band's upper edge within budget x (1 - ``safety_margin``).

    ``allow`` switches rungs off (keys of ``PreflightSpec.allow``; ``reduce_batch`` also covers the eval batch).
    ``exact`` verifies the chosen plan (e.g. the traced estimate); the analytic estimate does the search."""
    allow = {**{k: True for k in _COST}, **(allow or {})}
    budget = Budget(device, safety_margin)
    # with an exact check behind it, the search only picks plans worth tracing; the trace decides
    scout = Budget(device, safety_margin, scout=True) if exact is not None else budget

    def analytic(s: TrainSettings, d: Device) -> Estimate:
        return estimate(shape, s, d)

    def judged(s: TrainSettings) -> tuple[TrainSettings, Estimate, int]:
        if allow["reduce_batch"]:
            return _fit_eval(analytic, scout, s)
        return s, scout.judge(analytic(s, device)), 0

    def search() -> list[tuple[float, TrainSettings, list[str], Estimate]]:
        """Every rung combination and batch halving that fits (analytic), cheapest first."""
        out = []
        rungs = _rungs(settings, device, allow)
        halvings = settings.batch.bit_length() - 1 if allow["reduce_batch"] else 0
        for n in range(len(rungs) + 1):
            for combo in itertools.combinations(rungs, n):
                s, cost = settings, 1.0
                for key, fn, _ in combo:
                    s, cost = fn(s), cost * _COST[key]
                for k in range(halvings + 1):  # every halving that fits (further ones are for the exact check)
                    sk, e, ek = judged(_halve_batch(settings, s, k) if k else s)
                    if e.fits:
                        out.append((cost * _COST["reduce_batch"] ** k * _EVAL_HALVING**ek, sk,
                                    [text for _, _, text in combo], e))
        return sorted(out, key=lambda f: f[0])

    def taken(s: TrainSettings, rung_text: list[str], e: Estimate) -> Plan:
        e.plan = _describe(settings, s, rung_text, e)
        return Plan(True, s, e.plan, e, budget.needed(e), budget.limit)

    def checked(s: TrainSettings, e: Estimate) -> Estimate | None:
        """The exact estimate of ``s`` if it fits; else None, and the search learns how far off ``e`` was."""
        x = budget.judge(exact(s, device))
        if x.fits:
            return x
        rejected.append(s)
        ratio[0] = max(ratio[0], budget.needed(x) / scout.needed(e))
        return None

    def worth_tracing(e: Estimate) -> bool:
        """Whether the exact/analytic ratio learned from rejected plans still leaves room for ``e``'s plan."""
        return scout.needed(e) * ratio[0] <= scout.limit

    def verified(found: list) -> Plan | None:
        """The first of ``found`` that the exact estimate (when given) agrees fits. When the exact checks run out,
        one last check of the most frugal plan left: a slower plan verified beats a device given up on."""
        if exact is None:
            return taken(*found[0][1:]) if found else None
        for _, s, rung_text, e in found:
            if not worth_tracing(e):
                continue
            if len(rejected) >= _MAX_EXACT_CHECKS:
                break
            if (x := checked(s, e)) is not None:
                return taken(s, rung_text, x)
        else:
            return None
        left = [f for f in found if f[1] not in rejected and worth_tracing(f[3])]
        if not left:
            return None
        _, s, rung_text, e = min(left, key=lambda f: (scout.needed(f[3]), f[0]))
        n = len(rejected)
        if (x := checked(s, e)) is None:
            return None
        plan = taken(s, rung_text, x)
        plan.changes.append(f"the exact estimate rejected {n} cheaper plan(s); this is the most frugal one, checked "
                            "last: a cheaper plan between may fit too")
        return plan

    rejected: list[TrainSettings] = []
    ratio = [1.0]  # exact / analytic need seen on rejected plans: plans that would be rejected alike are skipped
    base_s, base, _ = judged(settings)
    plan = verified([(1.0, base_s, [], base)]) if base.fits else None
    if plan is None:
        plan = verified([f for f in search() if f[1] not in rejected])
    if plan is not None:
        return plan
    # nothing fits here: the closest miss (judged as the analytic estimate it is), and how long a sequence would fit
    base = budget.judge(base)
    longest = max_seq_len_that_fits(shape, settings, device, safety_margin)
    why = [f"nothing fits {device.name}: as configured it needs {_gib(budget.needed(base))} at the estimate's "
           f"upper edge (estimate {_gib(base.reserved_peak_bytes)}, band +{base.band.high:.0%}) of "
           f"{_gib(budget.limit)} (budget less {safety_margin:.0%} headroom)"]
    if rejected:
        why.append(f"the exact estimate rejected the {len(rejected)} cheapest plan(s) the analytic one accepted")
    why.append(f"longest sequence that fits {device.name} as configured: {longest} tokens"
               if longest else f"no sequence length fits {device.name} as configured")
    base.plan = list(why)
    return Plan(False, settings, why, base, budget.needed(base), budget.limit)


def max_seq_len_that_fits(shape: ModelShape, s: TrainSettings, device: Device,
                          margin: float = DEFAULT_HEADROOM) -> int:
    """Longest padded length (multiple of 64) that fits as configured; 0 if none."""
    budget = Budget(device, margin)
    lo, hi = 0, s.seq_len
    while hi - lo > 64:
        mid = (lo + hi) // 2 // 64 * 64 or 64
        if mid <= lo:
            break
        if budget.judge(estimate(shape, replace(s, seq_len=mid), device)).fits:
            lo = mid
        else:
            hi = mid
    return lo
