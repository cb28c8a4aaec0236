"""Preflight: will this run fit on this device, and where should it run? Decided before any weights load.

A pipeline becomes the memory model's :class:`RunSettings` (sequence length from the prepared data's longest
sample, since batches pad to their longest); the planner finds the fastest configuration that fits the local
device (:func:`fitburst.memory.plan_fit`), the local device is timed (:mod:`fitburst.hours`), and
:func:`decide` places the run: local, burst (cloud candidates from :func:`fitburst.cloud.rank_candidates`) or
fail. The report keeps these typed objects; :meth:`PreflightReport.to_dict` is its form outside the process.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from fitburst.cloud.rank import Candidate, rank_candidates
from fitburst.data import PreparedData, images_per_record
from fitburst.errors import UserError
from fitburst.hardware import CPU_CONTEXT, CPU_RESERVE, Gpus, resolve_gpus
from fitburst.history import month_spend
from fitburst.hours import Hours, estimate_hours, throughput, train_tokens
from fitburst.memory import Budget, Device, Estimate, EstimateFn, ModelShape, Plan, estimate
from fitburst.memory.loss_kernels import describe_lean, loss_kernel_of
from fitburst.memory.planner import plan_gpus, world_sizes
from fitburst.models import ResolvedModel, resolve_model, spec_with_model_ref
from fitburst.probe import probe
from fitburst.settings import RunSettings, settings_from_spec, spec_with_settings
from fitburst.spec import PipelineSpec

if TYPE_CHECKING:
    from fitburst.tracking import Tracker

GIB = 1024**3
log = logging.getLogger(__name__)
Placement = Literal["local", "burst", "fail"]


class PreflightFailed(UserError, RuntimeError):
    """The run does not fit anywhere it is allowed to run."""


@dataclass(frozen=True)
class Verdict:
    """Where the run goes and why: the one placement decision (see :func:`decide`)."""

    placement: Placement
    reason: str


@dataclass
class PreflightReport:
    pipeline: str
    verdict: Verdict
    device: Device  # the local device planned for (one GPU of ``gpus``)
    plan: Plan  # the plan for the local device (fits or the closest miss); plan.settings.world_size GPUs
    seq_len: int
    planned: PipelineSpec  # the spec with the plan applied (what the train step runs)
    tokens: int | None = None  # tokens the run will process (time and cost estimates)
    local_time: Hours | None = None  # on the local device, with the source of the throughput
    candidates: list[Candidate] = field(default_factory=list)  # cloud GPUs, best first (burst only)
    analytic: Estimate | None = None  # the analytic estimate of the planned settings, when the traced one decided
    unchecked: str | None = None  # why the traced estimate did not verify the plan (the analytic band decided)
    gpus: Gpus | None = None  # the local GPUs the plan could use (None: the one device)

    @property
    def world_size(self) -> int:
        """GPUs the local plan trains on (FSDP over more than one)."""
        return self.plan.settings.world_size

    @property
    def estimate(self):
        return self.plan.estimate

    @property
    def changes(self) -> list[str]:
        return self.plan.changes

    @property
    def reason(self) -> str:
        return self.verdict.reason

    @property
    def local_hours(self) -> float | None:
        return self.local_time.hours if self.local_time else None

    def planned_spec(self) -> PipelineSpec:
        return self.planned

    def to_dict(self) -> dict:
        """The JSON form (``fitburst preflight --json``, MLflow's preflight/report.json)."""
        return {
            "pipeline": self.pipeline, "verdict": self.verdict.placement, "reason": self.verdict.reason,
            "device": {"name": self.device.name, "kind": self.device.kind, "total_bytes": self.device.total_bytes,
                       "budget_bytes": self.device.budget_bytes, "count": self.gpus.count if self.gpus else 1,
                       "host_bytes": self.gpus.host_bytes if self.gpus else None},
            "world_size": self.world_size,
            "estimate": self.estimate.to_dict(), "changes": list(self.changes),
            "settings": asdict(self.plan.settings), "needed_bytes": self.plan.needed_bytes,
            "limit_bytes": self.plan.limit_bytes, "seq_len": self.seq_len, "spec_yaml": self.planned.to_yaml(),
            "tokens": self.tokens, "local_hours": self.local_hours,
            "local_hours_source": self.local_time.source if self.local_time else None,
            "candidates": [c.to_dict() for c in self.candidates],
            "estimate_method": self.estimate.method, "trace": self.trace_line(),
            "loss": loss_kernel_of(self.plan.settings, self.device),
            "activation_offloading": self.plan.settings.activation_offloading,
            "lean": describe_lean(self.plan.settings, self.device),
            "analytic_estimate": self.analytic.to_dict() if self.analytic else None,
            "analytic_needed_bytes": self.analytic.band.upper(self.analytic.reserved_peak_bytes)
            if self.analytic and self.analytic.band else None}

    def trace_line(self) -> str:
        """Both figures when the traced estimate decided; otherwise why the analytic one decided alone."""
        e, a = self.estimate, self.analytic
        if e.method == "traced" and a is not None and a.band and e.band:
            return (f"traced estimate {e.reserved_peak_bytes / GIB:.3f} GiB reserved (band {e.band.high:+.1%}) "
                    f"decided; analytic {a.reserved_peak_bytes / GIB:.3f} GiB (band {a.band.high:+.0%})")
        if e.method == "traced" and a is None and e.band:
            return (f"traced estimate {e.reserved_peak_bytes / GIB:.3f} GiB reserved (band {e.band.high:+.1%}) "
                    "decided; no analytic estimate (an architecture it does not model)")
        if self.unchecked:
            return f"not traced ({self.unchecked}): the analytic estimate decided with its wider band"
        return "not traced: no plan passed the analytic search, so the analytic estimate decided"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    def to_markdown(self) -> str:
        e = self.estimate
        rows = "\n".join(f"| {k} | {v / GIB:.3f} |" for k, v in sorted(e.components.items(), key=lambda kv: -kv[1]))
        plan = "\n".join(f"- {c}" for c in self.changes) or "- none needed"
        band = f" (error band {e.band.low:+.0%} / {e.band.high:+.0%}: {e.band.source})" if e.band else ""
        t = self.local_time
        time = f"\n\nTime here: ~{_duration(t.hours)} ({t.source})." if t else ""
        cands = ""
        if self.candidates:
            cands = ("\n\n### Cloud candidates\n| GPUs | provider | fits | est. peak GiB per GPU | all GPUs GiB | "
                     "$/h | hours | total $ |\n|---|---|---|---|---|---|---|---|\n")
            cands += "\n".join(
                f"| {c.gpus_label()} | {c.provider} | {c.fits} | "
                f"{(c.estimate.device_total_bytes if c.estimate else 0) / GIB:.1f} | "
                f"{(c.estimate.device_total_bytes * c.world_size if c.estimate else 0) / GIB:.1f} "
                f"| {c.hourly_usd or '-'} | {c.est_hours or '-'} | {c.est_total_usd or '-'} |" for c in self.candidates)
        n = self.world_size
        sharded = (f"\n\nSharded with FSDP over {n} GPUs: every figure above is one GPU's; all {n} together reserve "
                   f"{e.reserved_peak_bytes * n / GIB:.3f} GiB (device totals {e.device_total_bytes * n / GIB:.3f} "
                   f"GiB)" + (f"; host RAM {e.host_bytes / GIB:.3f} GiB per node" if e.host_bytes else "") + "."
                   if n > 1 else "")
        where = self.device.name if n == 1 else f"{n}x {self.device.name}"
        return (
            f"## Preflight: `{self.pipeline}` on {where}\n\n"
            f"**Verdict: {self.verdict.placement}** - {self.verdict.reason}\n\n"
            f"Reserved peak {e.reserved_peak_bytes / GIB:.3f} GiB, {self.plan.needed_bytes / GIB:.3f} GiB at the upper "
            f"edge of its error band{band}, against {self.plan.limit_bytes / GIB:.3f} GiB usable (budget less "
            f"{e.safety_margin:.0%} headroom): {_fit_words(self.plan)}. For reference: allocated "
            f"{e.allocated_peak_bytes / GIB:.3f} GiB, device total with the runtime's context "
            f"{e.device_total_bytes / GIB:.3f} GiB; peak phase: {e.peak_phase}; sequence length "
            f"{self.seq_len}.{sharded}{time}\n\n"
            f"Estimate: {self.trace_line()}.\n\n"
            f"Training: {describe_lean(self.plan.settings, self.device)}.\n\n"
            f"| component | GiB |\n|---|---|\n{rows}\n\n### Plan\n{plan}{cands}\n")


def _fit_words(plan: Plan) -> str:
    spare = plan.limit_bytes - plan.needed_bytes
    return (f"fits, {spare / GIB:.3f} GiB to spare" if spare >= 0
            else f"does not fit, {-spare / GIB:.3f} GiB short")


def _duration(hours: float) -> str:
    return f"{hours:.1f} h" if hours >= 1 else f"{max(hours * 60, 0.1):.1f} min"


def exact_estimate(spec: PipelineSpec, seq_len: int) -> EstimateFn | None:
    """The estimate that verifies the chosen plan (the planner searches with the analytic one): the traced step
    (:func:`fitburst.memory.trace.traced_estimate`, method "traced", its band in ``fitburst.memory.calibration``),
    one trace per distinct settings; None when ``preflight.exact`` is off. It raises TraceUnsupported where the
    trace cannot run (see :func:`plan_checked`)."""
    if not spec.preflight.exact:
        return None
    from fitburst.memory.trace import traced_estimate

    cache: dict = {}
    local = spec_with_model_ref(spec)
    # a plan with fewer image tokens (memory.planner's resolution rung) has a shorter sequence than the data's
    return lambda s, d: traced_estimate(local, s, d, seq_len=min(seq_len, s.seq_len), cache=cache)


@dataclass
class Checked:
    """A plan and how it was checked: ``exact``, the traced estimate the cloud plans are verified by (None where it
    cannot run); ``unchecked``, why it did not verify ``plan`` (None when it did)."""

    plan: Plan
    exact: EstimateFn | None
    unchecked: str | None = None  # why the trace did not verify the plan (the analytic band decided)


def host_limit(gpus: Gpus) -> int | None:
    """Host RAM a node's sharded run may use for offloaded state and loading: its RAM less the system's reserve and
    each rank's process (torch and transformers imported); None when the node's RAM is not known."""
    if gpus.host_bytes is None:
        return None
    return gpus.host_bytes - CPU_RESERVE - gpus.count * CPU_CONTEXT


def local_counts(spec: PipelineSpec, gpus: Gpus) -> list[int]:
    """The GPU counts the local plan may use (:func:`fitburst.memory.planner.world_sizes` on this machine's
    ``gpus``); PreflightFailed where ``training.distributed: fsdp`` has fewer than two."""
    counts = world_sizes(spec.training.distributed, gpus.count, gpus.nodes)
    if not counts:
        raise PreflightFailed(f"{spec.name}: training.distributed is fsdp (2 or more GPUs) but preflight.device "
                              f"{spec.preflight.device!r} is {gpus.label()}: name several GPUs (e.g. RTX4090 x2, "
                              "cuda:0,1) or set training.distributed: auto")
    return counts


def plan_checked(spec: PipelineSpec, shape: ModelShape | None, settings: RunSettings, device: Device,
                 seq_len: int, gpus: Gpus | None = None, *, trace: bool = True) -> Checked:
    """:func:`fitburst.memory.planner.plan_gpus` over the GPU counts ``gpus`` allows (:func:`local_counts`; one
    ``device`` when not given) with the traced estimate behind it; where the trace cannot run (TraceUnsupported:
    torch missing, int8, an architecture transformers cannot build) the analytic plan with its wider band, and why.
    With no ``shape`` (an architecture the analytic estimate does not model) the trace plans alone, and a trace
    that cannot run fails the preflight with what failed. ``trace`` False: the analytic plan alone, untraced."""
    from fitburst.memory.trace import TraceUnsupported

    gpus = gpus or Gpus(device)
    counts = local_counts(spec, gpus)

    def plan(exact: EstimateFn | None = None, quick: EstimateFn | None = None) -> Plan:
        return plan_gpus(shape, settings, device, counts, spec.preflight.safety_margin,
                         spec.preflight.allow.model_dump(), exact=exact, quick=quick, gpus_per_node=gpus.count,
                         host_limit=host_limit(gpus))

    if not trace and shape is not None:  # the analytic plan alone (the caller says why)
        return Checked(plan(), None)
    exact = exact_estimate(spec, seq_len)
    if shape is None:
        what = (f"{spec.name}: {spec.model.name} is an architecture the analytic estimate does not model, so only "
                "the traced estimate can plan it")
        if exact is None:
            raise PreflightFailed(f"{what}, and preflight.exact is false: set preflight.exact: true")
        from fitburst.memory.sliced import quick_estimate

        try:
            return Checked(plan(exact, quick_estimate(spec_with_model_ref(spec), seq_len)), exact)
        except TraceUnsupported as e:
            raise PreflightFailed(f"{what}, and it cannot run: {e}") from None
    if exact is None:
        return Checked(plan(), None, "preflight.exact is false")
    try:
        return Checked(plan(exact), exact)
    except TraceUnsupported as e:
        return Checked(plan(), None, f"the traced estimate cannot run: {e}")


def decide(spec: PipelineSpec, plan: Plan, local_time: Hours | None,
           rank: Callable[[], list[Candidate]]) -> tuple[Verdict, list[Candidate]]:
    """The placement rule, by fit and by time, under ``spec.burst.policy``: (verdict, cloud candidates ranked
    when the cloud was considered). ``rank`` is asked only when bursting is on the table."""
    policy, cap = spec.burst.policy, spec.burst.max_local_hours
    hours = local_time.hours if local_time else None
    slow = plan.fits and cap is not None and hours is not None and hours > cap
    here = f"; ~{_duration(hours)} here ({local_time.source})" if local_time and hours is not None else ""
    n = plan.settings.world_size
    fits = (f"fits in {plan.limit_bytes / GIB:.2f} GiB{' per GPU on ' + str(n) + ' GPUs (FSDP)' if n > 1 else ''} "
            f"(budget less {plan.estimate.safety_margin:.0%} headroom; "
            f"{plan.needed_bytes / GIB:.2f} GiB at the estimate's upper edge)"
            + (f" after {len(plan.changes)} change(s)" if plan.changes else " as configured") + here)
    if policy == "never" or (policy == "auto" and plan.fits and not slow):
        if plan.fits:
            return Verdict("local", fits + (f", over max_local_hours {cap:g} but burst.policy is never"
                                            if slow else "")), []
        return Verdict("fail", "does not fit the local device even with every allowed change, and burst.policy "
                               "is never: allow more changes under preflight.allow, shorten data.max_seq_len, or "
                               "set burst.policy: auto"), []
    if policy == "always":
        why = "burst policy is 'always'"
    elif not plan.fits:
        why = "does not fit on the local device"
    else:  # fits but slow: the hours were estimated and are over the cap
        assert local_time is not None and hours is not None
        why = f"fits locally but needs ~{hours:.1f} h there ({local_time.source}), over max_local_hours {cap:g}"
    candidates = rank()
    usable = [c for c in candidates if c.usable]
    if usable:
        best = usable[0]
        cost = f", ~{best.est_hours} h, ~${best.est_total_usd}" if best.est_total_usd is not None else ""
        return Verdict("burst", f"{why}: bursting to {best.label()}{cost}"), candidates
    refused = "; ".join(f"{c.gpus_label()} on {c.provider}: {c.reason}" for c in candidates) or "no offer found"
    if plan.fits and policy == "auto":
        return Verdict("local", f"{fits}; {why}, but no allowed cloud GPU is usable ({refused})"), candidates
    return Verdict("fail", f"{why}, and no allowed cloud GPU is usable: {refused}"), candidates


def _size(shape: ModelShape | None, plan: Plan) -> ModelShape | int:
    """What the time estimate counts FLOPs by: the shape, or the traced model's parameter count without one."""
    return shape if shape is not None else plan.estimate.params["total"]


def conclude(spec: PipelineSpec, model: ResolvedModel, device: Device, checked: Checked, seq_len: int,
             tokens: int | None, *, measured_tokens_per_s: float | None = None,
             gpus: Gpus | None = None) -> PreflightReport:
    """Time the local plan, place the run (:func:`decide`) and write the report. ``model``: the pipeline's
    (:func:`fitburst.models.resolve_model`), resolved once by the caller."""
    plan, exact, shape = checked.plan, checked.exact, model.shape
    local_time = (estimate_hours(_size(shape, plan), plan.settings, throughput(device, measured_tokens_per_s),
                                 tokens, device=device) if plan.fits else None)

    verdict, candidates = decide(spec, plan, local_time, lambda: rank_cloud(spec, model, seq_len, tokens, exact))
    planned = spec_with_settings(spec, plan.settings) if plan.fits else spec
    analytic = None
    if plan.estimate.method == "traced" and shape is not None:
        analytic = Budget(device, spec.preflight.safety_margin, gpus_per_node=gpus.count if gpus else 1).judge(
            estimate(shape, plan.settings, device))
    return PreflightReport(pipeline=spec.name, verdict=verdict, device=device, plan=plan, seq_len=seq_len,
                           planned=planned, tokens=tokens, local_time=local_time, candidates=candidates,
                           analytic=analytic, unchecked=checked.unchecked, gpus=gpus)


def rank_cloud(spec: PipelineSpec, model: ResolvedModel, seq_len: int, tokens: int | None,
               exact: EstimateFn | None) -> list[Candidate]:
    """The cloud GPUs of ``spec.burst``, re-planned for ``seq_len`` and ranked (:func:`rank_candidates`); with a
    monthly budget, against this month's spend so far as MLflow holds it."""
    from fitburst.memory.trace import TraceUnsupported

    # precision: auto resolves per GPU, not for here
    cloud = settings_from_spec(spec, None, seq_len, images=images_per_record(spec), family=model.family)
    shape = model.shape
    b = spec.burst
    spent = None
    if b.max_monthly_usd is not None or b.max_monthly_usd_all is not None:
        try:
            spent = month_spend(spec)
        except Exception as e:  # noqa: BLE001 - an unreachable store: the budget cannot be checked, so no burst
            from fitburst.tracking import redact  # the store's URI may carry a password

            raise PreflightFailed(f"{spec.name}: a monthly burst budget is set but this month's spend cannot be read "
                                  f"from MLflow ({type(e).__name__}: {redact(str(e))[:200]}): bring the tracking "
                                  "server back, or unset burst.max_monthly_usd / max_monthly_usd_all") from None
    try:
        return rank_candidates(spec, shape, cloud, tokens=tokens, exact=exact, spent=spent)
    except TraceUnsupported:  # a cloud plan the trace cannot run: the analytic band places all of them
        if shape is None:  # no analytic estimate to fall back on: no cloud GPU can be planned
            return []
        return rank_candidates(spec, shape, cloud, tokens=tokens, spent=spent)


def cloud_candidates(spec: PipelineSpec, report: PreflightReport) -> list[Candidate]:
    """``report``'s cloud candidates, ranked now when the preflight placed the run locally without them (a local
    run that ran out of memory with every step-down taken bursts to them)."""
    return report.candidates or rank_cloud(spec, resolve_model(spec), report.seq_len, report.tokens,
                                           exact_estimate(spec, report.seq_len))


def preflight(spec: PipelineSpec, seq_len: int, device_name: str | None = None, *, n_train: int | None = None,
              mean_len: float | None = None) -> PreflightReport:
    """Plan ``spec`` at ``seq_len`` for the device, time it, and decide local / burst / fail.

    ``n_train`` and ``mean_len`` (from the prepared data) give the token count behind the time estimates that
    ``burst.max_local_hours`` is checked against and cloud GPUs are priced by."""
    gpus = resolve_gpus(device_name or spec.preflight.device)
    device = gpus.device
    model = resolve_model(spec)
    shape = model.shape
    settings = settings_from_spec(spec, device, seq_len, images=images_per_record(spec), family=model.family)
    tokens = train_tokens(spec, n_train, mean_len)
    if shape is not None and (why := reason_to_burst_anyway(spec, shape, settings, device, tokens)) is not None:
        unchecked = replace(plan_checked(spec, shape, settings, device, seq_len, gpus, trace=False), unchecked=why,
                            exact=exact_estimate(spec, seq_len))
        report = conclude(spec, model, device, unchecked, seq_len, tokens, gpus=gpus)
        if report.verdict.placement == "burst":
            return report
    checked = plan_checked(spec, shape, settings, device, seq_len, gpus)
    return conclude(spec, model, device, checked, seq_len, tokens, gpus=gpus)


def reason_to_burst_anyway(spec: PipelineSpec, shape: ModelShape, settings: RunSettings, device: Device,
                  tokens: int | None) -> str | None:
    """Why the run bursts whatever the local plan's trace would say (None when the local plan can decide): the
    burst policy is ``always``, or even the run as configured, the fastest any local plan gets (every rung of the
    ladder costs time), is over ``burst.max_local_hours``. The trace then verifies the cloud plan, the one that
    runs, and not the local one."""
    policy, cap = spec.burst.policy, spec.burst.max_local_hours
    if policy == "always":
        return "the run bursts whatever it says: the burst policy is 'always'; the cloud plan is traced"
    if policy != "auto" or cap is None:
        return None
    fastest = estimate_hours(shape, settings, throughput(device), tokens)
    if fastest is None or fastest.hours <= cap:
        return None
    return (f"the run bursts whatever it says: even as configured it needs ~{_duration(fastest.hours)} here, over "
            f"max_local_hours {cap:g}; the cloud plan is traced")


def replan_for_budget(spec: PipelineSpec, report: PreflightReport, budget_bytes: int, why: str, *,
                      measured_tokens_per_s: float | None = None) -> PreflightReport:
    """The report re-planned for a smaller budget on the same device (after a probe measured more than the
    estimate), from the already planned settings, and placed again."""
    device = replace(report.device, budget_bytes=budget_bytes)
    gpus = replace(report.gpus, device=device) if report.gpus else None
    model = resolve_model(spec)
    planned = settings_from_spec(report.planned, device, report.seq_len, images=images_per_record(spec),
                                 family=model.family)
    checked = plan_checked(spec, model.shape, planned, device, report.seq_len, gpus)
    checked.plan.changes[:0] = [*report.changes, why]
    return conclude(report.planned, model, device, checked, report.seq_len, report.tokens,
                    measured_tokens_per_s=measured_tokens_per_s, gpus=gpus)


def retime(spec: PipelineSpec, report: PreflightReport, tokens_per_s: float) -> PreflightReport:
    """The report with the local device timed by a measured throughput (the probe's), and placed again."""
    checked = Checked(report.plan, exact_estimate(spec, report.seq_len) if report.unchecked is None else None,
                      report.unchecked)
    return conclude(report.planned, resolve_model(spec), report.device, checked, report.seq_len, report.tokens,
                    measured_tokens_per_s=tokens_per_s, gpus=report.gpus)


def plan_here(spec: PipelineSpec, seq_len: int, gpus: Gpus | None = None) -> tuple[PipelineSpec, list[str], Estimate]:
    """Plan ``spec`` for the GPUs this process runs on (``gpus``, default this machine's: ``preflight.device``),
    with no burst option (what the cloud node does before training: it may be any GPU of the ordered list).
    Returns the planned spec, the changes and the estimate; raises PreflightFailed when nothing allowed fits."""
    gpus = gpus or resolve_gpus(spec.preflight.device)
    device = gpus.device
    model = resolve_model(spec)
    settings = settings_from_spec(spec, device, seq_len, images=images_per_record(spec), family=model.family)
    plan = plan_checked(spec, model.shape, settings, device, seq_len, gpus).plan
    if not plan.fits:
        raise PreflightFailed(f"{spec.name} does not fit {device.name} ({plan.needed_bytes / GIB:.1f} GiB needed "
                              f"at the estimate's upper edge, {plan.limit_bytes / GIB:.1f} GiB usable) with any "
                              "allowed change")
    return spec_with_settings(spec, plan.settings), list(plan.changes), plan.estimate


def plan_for_ranks(spec: PipelineSpec, seq_len: int, per_node: int, nodes: int) -> tuple[PipelineSpec, list[str],
                                                                                         Estimate]:
    """:func:`plan_here` for a node's GPUs as ranks of a run over ``per_node`` x ``nodes`` of them."""
    if per_node * nodes == 1:
        return plan_here(spec, seq_len)
    here = resolve_gpus(spec.preflight.device)
    return plan_here(spec, seq_len, Gpus(here.device, per_node, nodes, here.host_bytes))


def replan_after_probe(spec: PipelineSpec, report: PreflightReport, result: dict) -> PreflightReport:
    """The preflight report after a probe: re-timed with the measured throughput when there is one; unchanged
    in memory when the measured peak fits the budget less the headroom; otherwise re-planned for the budget
    scaled by estimated / measured (so that the estimate, wrong by the probe's ratio, still lands inside the
    real budget) and placed again."""
    rate = result.get("tokens_per_s")
    limit = report.plan.limit_bytes
    measured = result.get("measured_peak_bytes") or 0
    if measured <= limit or not result.get("estimated_peak_bytes"):
        return retime(spec, report, rate) if rate else report
    scale = result["estimated_peak_bytes"] / measured
    budget = int(report.device.budget_bytes * scale)
    gib = 1024**3
    why = (f"probe measured {measured / gib:.3f} GiB > {limit / gib:.3f} GiB budget less headroom "
           f"(estimate x{measured / result['estimated_peak_bytes']:.2f}): re-planned for a "
           f"{budget / gib:.3f} GiB budget")
    new = replan_for_budget(spec, report, budget, why, measured_tokens_per_s=rate)
    if not new.plan.fits:
        return replace(new, verdict=replace(new.verdict, reason=f"{why}, and nothing allowed fits it; "
                                                                f"{new.verdict.reason}"))
    return new


def probe_and_replan(spec: PipelineSpec, prepared: PreparedData | None, report: PreflightReport,
                     tracker: Tracker | None = None, *, steps: int = 2) -> tuple[PreflightReport, dict | None]:
    """What the preflight task runs when ``preflight.probe`` is set: probe the planned run on the local device,
    log the figures (MLflow metrics memory.probe_*), and re-plan when the probe is over budget."""
    if report.verdict.placement != "local" or prepared is None:
        return report, None
    from fitburst.oom_errors import free_memory, oom_kind  # torch: the probe trains on the device

    try:
        result = probe(report.planned, prepared, report.estimate, steps=steps)
    except (RuntimeError, MemoryError) as e:  # CUDA's OutOfMemoryError is a RuntimeError too
        kind = oom_kind(e)
        if kind is None:
            raise
        free_memory(e)  # the probe itself did not fit: at least the whole device was needed
        del e
        est = report.estimate.comparable_bytes(report.device.kind)
        total = report.device.total_bytes
        result = {"device": report.device.name, "oom": kind, "measured_peak_bytes": total,
                  "estimated_peak_bytes": est, "ratio": total / est if est else None,
                  "measured_rss_peak_bytes": None, "seq_len": report.seq_len, "seconds": None}
    new = replan_after_probe(spec, report, result)
    if tracker is not None:
        tracker.log_metrics({"memory.probe_peak_bytes": result["measured_peak_bytes"],
                             "memory.probe_estimated_bytes": result["estimated_peak_bytes"],
                             "memory.probe_ratio": result["ratio"],
                             "memory.probe_rss_peak_bytes": result["measured_rss_peak_bytes"],
                             "memory.probe_seq_len": result["seq_len"],
                             "memory.probe_seconds": result["seconds"],
                             "memory.probe_tokens_per_s": result.get("tokens_per_s"),
                             "memory.probe_replanned": float(new.plan is not report.plan)})
        tracker.set_tags({"probe.device": result["device"]})
        tracker.log_dict({k: v for k, v in result.items()}, "preflight/probe.json")
    log.info("probe on %s: measured %s bytes vs estimated %s (x%.2f)%s", result["device"],
             result["measured_peak_bytes"], result["estimated_peak_bytes"], result["ratio"] or 0,
             "; re-planned" if new.plan is not report.plan else "")
    return new, result
