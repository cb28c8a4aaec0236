"""Which rented GPUs, from need and price: re-plan the run per GPU type and count, estimate hours, rank by cost.

For every GPU the burst policy allows, the memory planner is re-run for that GPU (a T4 has no bf16, so the run is
planned in fp16 there) over the GPU counts it may use (``burst.gpus`` counts, ``max_gpus_per_node``,
``max_nodes``, ``training.distributed``: :func:`fitburst.memory.planner.world_sizes`), the fewest that fit taken,
each count only where a provider sells an instance with that many GPUs; candidates that fit are ordered by
estimated total cost (hourly price of every node x estimated hours, provisioning included). Hours come from
:mod:`fitburst.hours`, the same model that times the local device, with its FSDP scaling on several GPUs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from fitburst.cloud.gpus import Offer, offers
from fitburst.hardware import CPU_CONTEXT, CPU_RESERVE, GiB
from fitburst.history import Spend, monthly_budget_problems
from fitburst.hours import estimate_hours, throughput, train_tokens
from fitburst.memory import Estimate, ModelShape, RunSettings, resolve_device
from fitburst.memory.planner import EstimateFn, Plan, plan_gpus, world_sizes
from fitburst.rules import ModelFacts, problems

log = logging.getLogger(__name__)


@dataclass
class Candidate:
    """One GPU on one provider, with the run re-planned for it."""

    gpu: str  # fitburst name (T4, A6000, ...)
    provider: str  # runpod | lambda | aws | gcp | azure
    accelerator: str  # SkyPilot catalog name on that provider (RTXA6000 on RunPod)
    memory_gib: float | None  # one GPU's
    fits: bool
    hourly_usd: float | None  # all nodes together
    est_hours: float | None = None
    est_total_usd: float | None = None
    changes: list[str] = field(default_factory=list)  # what the planner changed for this GPU
    estimate: Estimate | None = None  # the memory estimate on this GPU
    settings: RunSettings | None = None  # the settings planned for this GPU
    region: str | None = None
    price_source: str = ""
    hours_source: str = ""  # where the throughput behind est_hours comes from
    within_budget: bool = True
    reason: str = ""  # why it does not fit / is over budget
    gpus_per_node: int = 1
    nodes: int = 1

    @property
    def providers(self) -> list[str]:
        return [self.provider]

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def gpus_label(self) -> str:
        """``A6000``, ``2x A6000``, ``2 nodes x 8x H100``."""
        one = self.gpu if self.gpus_per_node == 1 else f"{self.gpus_per_node}x {self.gpu}"
        return one if self.nodes == 1 else f"{self.nodes} nodes x {one}"

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
            kw["settings"] = RunSettings.from_dict(kw["settings"])
        kw["estimate"] = Estimate.from_dict(kw["estimate"]) if kw.get("estimate") else None
        return cls(**kw)

    def label(self) -> str:
        return f"{self.gpus_label()} on {self.provider} ({self.accelerator})"


def _plan_on(gpu: str, shape: ModelShape | None, settings: RunSettings, spec, exact: EstimateFn | None,
             counts: list[int], per_node: int, host_gib: float | None) -> tuple[Plan | None, list[str], str]:
    """Re-run the planner for ``gpu`` over ``counts`` GPUs (``per_node`` on a node of ``host_gib`` RAM): (plan or
    None when it cannot run there, device changes, reason)."""
    device = resolve_device(gpu)
    changes: list[str] = []
    model = ModelFacts.of(shape)
    found = problems(dataclasses.replace(settings, world_size=counts[0]), device, model=model)  # the fewest GPUs
    if any(p.rule == "bf16_unsupported" for p in found):  # the one the cloud plan resolves: fp16 on that card
        settings = dataclasses.replace(settings, precision="fp16")
        changes.append(f"dtype bf16 -> fp16 ({gpu} has no bf16)")
        found = problems(dataclasses.replace(settings, world_size=counts[0]), device, model=model)
    if found:
        return None, changes, f"{gpu}: " + "; ".join(f"{p.path}: {p}" for p in found)
    host = int(host_gib * GiB) - CPU_RESERVE - per_node * CPU_CONTEXT if host_gib else None
    plan = plan_gpus(shape, settings, device, counts, spec.preflight.safety_margin,
                     spec.preflight.allow.model_dump(), exact=exact, gpus_per_node=per_node, host_limit=host)
    n = plan.settings.world_size
    reason = "" if plan.fits else (f"does not fit in {gpu if n == 1 else f'{n} x {gpu}'}: needs "
                                   f"{plan.needed_bytes / 2**30:.1f} GiB of {plan.limit_bytes / 2**30:.1f} GiB"
                                   + (" per GPU" if n > 1 else ""))
    return plan, changes + plan.changes, reason


def _gpu_offers(gpu: str, fixed: int | None, burst, offer_list: list[Offer] | None) -> dict[int, list[Offer]]:
    """Offers for ``gpu`` per GPUs-per-node count the policy allows (the fixed count of a ``NAME:N`` entry, else
    1, 2, 4, 8 up to ``max_gpus_per_node``), counts no provider sells left out."""
    wanted = [fixed] if fixed else sorted({n for n in (1, 2, 4, 8, 16) if n <= burst.max_gpus_per_node}
                                          | {burst.max_gpus_per_node})
    out: dict[int, list[Offer]] = {}
    for n in wanted:
        if offer_list is not None:
            found = [o for o in offer_list if o.gpu == gpu and o.count == n]
        else:
            found = offers([gpu], burst.providers, spot=burst.spot, count=n)
        if found:
            out[n] = found
    return out


def rank_candidates(
    spec,
    shape: ModelShape | None,
    settings: RunSettings,
    est_hours_fn: Callable[[str, RunSettings], float | None] | None = None,
    *,
    tokens: int | None = None,
    offer_list: list[Offer] | None = None,
    exact: EstimateFn | None = None,
    spent: Spend | None = None,
) -> list[Candidate]:
    """Every GPU of ``spec.burst`` on every provider that sells it, re-planned over the GPU counts it may use and
    priced; usable first, cheapest total first.

    Per GPU the fewest GPUs that fit are taken (one node of up to ``max_gpus_per_node``, then whole nodes up to
    ``max_nodes``; a ``NAME:N`` entry fixes N per node), counts only where an instance with that many is sold.
    ``est_hours_fn(gpu, settings) -> hours`` replaces the FLOPs-based estimate (e.g. from measured steps/s in
    MLflow history). ``tokens`` is what the run processes (see :func:`train_tokens`); without it hours and totals
    are estimated from ``max_steps`` when set, else left unknown and candidates rank by hourly price.
    ``offer_list`` skips the catalog lookup (tests, or a caller that already has offers; each offer's ``count``
    is its GPUs per instance). ``exact`` verifies each GPU's plan (see :func:`fitburst.memory.plan_fit`).
    ``spent``: this month's spend so far, for ``burst.max_monthly_usd`` (:func:`fitburst.history.month_spend`).
    """
    burst = spec.burst
    if tokens is None:
        tokens = train_tokens(spec)
    out: list[Candidate] = []
    for gpu, fixed in burst.gpu_choices():
        sold = _gpu_offers(gpu, fixed, burst, offer_list)
        if not sold:
            continue
        biggest = max(sold)
        counts = [n for n in world_sizes(spec.training.distributed, biggest, burst.max_nodes, fixed)
                  if (n if n <= biggest else biggest) in sold]
        if not counts:  # e.g. training.distributed fsdp and only 1-GPU instances: plan one to say why not
            counts = [min(sold)]
        host = min((o.host_memory_gib for o in sold[biggest] if o.host_memory_gib), default=None)
        plan, changes, reason = _plan_on(gpu, shape, settings, spec, exact, counts, biggest, host)
        planned = plan.settings if plan is not None else settings
        n = planned.world_size if plan is not None else counts[0]  # a miss: on the most GPUs tried
        per_node = n if n in sold else biggest
        nodes = -(-n // per_node)
        device = resolve_device(gpu)
        for offer in sold[per_node]:
            hours, source = None, ""
            # FLOPs are counted from the shape, or without one from the (traced) plan's parameter count
            size = shape if shape is not None else plan.estimate.params["total"] if plan is not None else None
            if est_hours_fn is not None:
                hours, source = est_hours_fn(gpu, planned), "caller's measured rate"
            elif size is not None:
                h = estimate_hours(size, planned, throughput(device), tokens, cloud=True, device=device, nodes=nodes)
                if h is not None:
                    hours, source = h.hours, h.source
            hourly = offer.hourly_usd * nodes if offer.hourly_usd else offer.hourly_usd
            total = round(hours * hourly, 2) if hours is not None and hourly else None
            c = Candidate(
                gpu=gpu,
                provider=offer.provider,
                accelerator=offer.accelerator,
                memory_gib=offer.memory_gib or round(device.total_bytes / 2**30, 1),
                fits=plan is not None and plan.fits,
                hourly_usd=round(hourly, 4) if hourly else hourly,
                est_hours=round(hours, 2) if hours is not None else None,
                est_total_usd=total,
                changes=list(changes),
                estimate=plan.estimate if plan is not None else None,
                settings=planned,
                region=offer.region,
                price_source=offer.source,
                hours_source=source,
                reason=reason,
                gpus_per_node=per_node,
                nodes=nodes,
            )
            over = budget_problems(burst, c, spent)
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


def budget_problems(burst, c: Candidate, spent: Spend | None = None) -> list[str]:
    """Why ``c`` breaks the policy's caps (empty when it does not); the monthly ones with ``spent`` so far."""
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
    return problems + monthly_budget_problems(burst, spent, c.est_total_usd)
