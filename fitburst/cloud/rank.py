"""Which rented GPU, from need and price: re-plan the run per GPU, estimate hours, rank by total cost.

For every (GPU, provider) the burst policy allows, the memory planner is re-run for that GPU (a T4 has no
bf16, so the run is planned in fp16 there); candidates that fit are ordered by estimated total cost (hourly
price x estimated hours, provisioning included). Hours come from :mod:`fitburst.hours`, the same model that
times the local device.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from fitburst.cloud.gpus import Offer, offers
from fitburst.hours import estimate_hours, throughput, train_tokens
from fitburst.memory import Estimate, ModelShape, TrainSettings, plan_fit, resolve_device
from fitburst.memory.planner import EstimateFn, Plan

log = logging.getLogger(__name__)


@dataclass
class Candidate:
    """One GPU on one provider, with the run re-planned for it."""

    gpu: str  # fitburst name (T4, A6000, ...)
    provider: str  # runpod | lambda | aws | gcp | azure
    accelerator: str  # SkyPilot catalog name on that provider (RTXA6000 on RunPod)
    memory_gib: float | None
    fits: bool
    hourly_usd: float | None
    est_hours: float | None = None
    est_total_usd: float | None = None
    changes: list[str] = field(default_factory=list)  # what the planner changed for this GPU
    estimate: Estimate | None = None  # the memory estimate on this GPU
    settings: TrainSettings | None = None  # the settings planned for this GPU
    region: str | None = None
    price_source: str = ""
    hours_source: str = ""  # where the throughput behind est_hours comes from
    within_budget: bool = True
    reason: str = ""  # why it does not fit / is over budget

    @property
    def providers(self) -> list[str]:
        return [self.provider]

    @property
    def usable(self) -> bool:
        return self.fits and self.within_budget

    def to_dict(self) -> dict:
        d = asdict(self)
        d["estimate"] = self.estimate.to_dict() if self.estimate is not None else {}
        d["usable"] = self.usable
        return d

    @classmethod
    def from_dict(cls, d: dict | Candidate) -> Candidate:
        """Back from :meth:`to_dict` (a candidate list that crossed a process boundary as JSON)."""
        if isinstance(d, Candidate):
            return d
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if kw.get("settings"):
            kw["settings"] = TrainSettings(**kw["settings"])
        kw["estimate"] = Estimate.from_dict(kw["estimate"]) if kw.get("estimate") else None
        return cls(**kw)

    def label(self) -> str:
        return f"{self.gpu} on {self.provider} ({self.accelerator})"


def _plan_on(gpu: str, shape: ModelShape | None, settings: TrainSettings, spec, exact: EstimateFn | None
             ) -> tuple[Plan | None, list[str], str]:
    """Re-run the planner for ``gpu``: (plan or None when it cannot run there, device changes, reason)."""
    device = resolve_device(gpu)
    changes: list[str] = []
    if not device.supports_bf16 and settings.dtype == "bf16":
        settings = dataclasses.replace(settings, dtype="fp16")
        changes.append(f"dtype bf16 -> fp16 ({gpu} has no bf16)")
    if not device.supports_bnb and settings.kbit:
        return None, changes, f"{gpu} cannot run bitsandbytes quantization"
    plan = plan_fit(shape, settings, device, spec.preflight.safety_margin, spec.preflight.allow.model_dump(),
                    exact=exact)
    reason = "" if plan.fits else (f"does not fit in {gpu}: needs {plan.needed_bytes / 2**30:.1f} GiB "
                                   f"of {plan.limit_bytes / 2**30:.1f} GiB")
    return plan, changes + plan.changes, reason


def rank_candidates(
    spec,
    shape: ModelShape | None,
    settings: TrainSettings,
    est_hours_fn: Callable[[str, TrainSettings], float | None] | None = None,
    *,
    tokens: int | None = None,
    offer_list: list[Offer] | None = None,
    exact: EstimateFn | None = None,
) -> list[Candidate]:
    """Every (GPU, provider) of ``spec.burst``, re-planned and priced; usable first, cheapest total first.

    ``est_hours_fn(gpu, settings) -> hours`` replaces the FLOPs-based estimate (e.g. from measured steps/s in
    MLflow history). ``tokens`` is what the run processes (see :func:`train_tokens`); without it hours and
    totals are estimated from ``max_steps`` when set, else left unknown and candidates rank by hourly price.
    ``offer_list`` skips the catalog lookup (tests, or a caller that already has offers). ``exact`` verifies
    each GPU's plan (see :func:`fitburst.memory.plan_fit`).
    """
    burst = spec.burst
    if tokens is None:
        tokens = train_tokens(spec)
    offer_list = (
        offer_list if offer_list is not None else offers(burst.gpus, burst.providers, spot=burst.spot)
    )
    plans: dict[str, tuple[Plan | None, list[str], str]] = {}
    out: list[Candidate] = []
    for offer in offer_list:
        if offer.gpu not in plans:
            plans[offer.gpu] = _plan_on(offer.gpu, shape, settings, spec, exact)
        plan, changes, reason = plans[offer.gpu]
        planned = plan.settings if plan is not None else settings
        hours, source = None, ""
        # FLOPs are counted from the shape, or without one from the (traced) plan's parameter count
        size = shape if shape is not None else plan.estimate.params["total"] if plan is not None else None
        if est_hours_fn is not None:
            hours, source = est_hours_fn(offer.gpu, planned), "caller's measured rate"
        elif size is not None:
            h = estimate_hours(size, planned, throughput(resolve_device(offer.gpu)), tokens, cloud=True)
            if h is not None:
                hours, source = h.hours, h.source
        total = round(hours * offer.hourly_usd, 2) if hours is not None and offer.hourly_usd else None
        c = Candidate(
            gpu=offer.gpu,
            provider=offer.provider,
            accelerator=offer.accelerator,
            memory_gib=offer.memory_gib or round(resolve_device(offer.gpu).total_bytes / 2**30, 1),
            fits=plan is not None and plan.fits,
            hourly_usd=offer.hourly_usd,
            est_hours=round(hours, 2) if hours is not None else None,
            est_total_usd=total,
            changes=list(changes),
            estimate=plan.estimate if plan is not None else None,
            settings=planned,
            region=offer.region,
            price_source=offer.source,
            hours_source=source,
            reason=reason,
        )
        over = budget_problems(burst, c)
        if over:
            c.within_budget = False
            c.reason = "; ".join(filter(None, [c.reason, *over]))
        out.append(c)
    out.sort(
        key=lambda c: (
            not c.usable,
            not c.fits,
            c.est_total_usd if c.est_total_usd is not None else float("inf"),
            c.hourly_usd if c.hourly_usd is not None else float("inf"),
        )
    )
    return out


def budget_problems(burst, c: Candidate) -> list[str]:
    """Why ``c`` breaks the policy's caps (empty when it does not)."""
    problems = []
    if burst.max_hourly_usd is not None and c.hourly_usd is not None and c.hourly_usd > burst.max_hourly_usd:
        problems.append(f"${c.hourly_usd:.2f}/h is over max_hourly_usd ${burst.max_hourly_usd:.2f}")
    if burst.max_total_usd is not None:
        if c.est_total_usd is None:
            problems.append("max_total_usd is set but the total cost cannot be estimated (no token count)")
        elif c.est_total_usd > burst.max_total_usd:
            problems.append(
                f"estimated ${c.est_total_usd:.2f} is over max_total_usd ${burst.max_total_usd:.2f}"
            )
    return problems
