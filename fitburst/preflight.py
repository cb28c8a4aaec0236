"""Preflight: will this run fit on this device? Estimate, plan, verdict, before any weights are loaded.

It maps a pipeline to the memory model's :class:`TrainSettings` (sequence length from the prepared data's
longest sample, since batches pad to their longest), asks the planner for the fastest configuration that fits
the device with the configured safety margin, and writes the plan back into the spec the train step runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fitburst.errors import UserError
from fitburst.memory import TrainSettings, load_shape, plan_fit, resolve_device, settings_from_spec
from fitburst.spec import PipelineSpec

GIB = 1024**3


class PreflightFailed(UserError, RuntimeError):
    """The run does not fit anywhere it is allowed to run."""


def _duration(hours: float) -> str:
    return f"{hours:.1f} h" if hours >= 1 else f"{max(hours * 60, 0.1):.1f} min"


def model_ref(spec: PipelineSpec) -> str:
    """What the memory model reads the architecture from: the demo folder, a local path, or a hub id."""
    from fitburst.models import DEMO_MODEL, resolve_model_ref

    return resolve_model_ref(spec.model.name) if spec.model.name == DEMO_MODEL else spec.model.name


def apply_settings(spec: PipelineSpec, s: TrainSettings) -> PipelineSpec:
    """The spec with the planner's settings written back (what the train step then runs)."""
    method = spec.method.model_copy(update={
        "type": "qlora" if s.quant != "none" and spec.method.type == "lora" else spec.method.type,
        "quant": s.quant, "double_quant": s.double_quant, "dropout": s.dropout})
    training = spec.training.model_copy(update={
        "micro_batch_size": s.batch, "grad_accum": s.grad_accum, "gradient_checkpointing": s.grad_checkpointing,
        "optimizer": s.optimizer, "precision": s.dtype,
        "attention": spec.training.attention if spec.training.attention == "auto" and s.attention == "sdpa"
        else s.attention})
    return spec.model_copy(update={"method": method, "training": training})


@dataclass
class PreflightReport:
    pipeline: str
    verdict: str  # local | burst | fail
    reason: str
    device: dict
    estimate: dict
    changes: list[str]
    settings: dict
    seq_len: int
    spec_yaml: str  # the resolved spec with the plan applied
    tokens: int | None = None  # tokens the run will process (time and cost estimates)
    local_hours: float | None = None
    candidates: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> PreflightReport:
        return cls(**json.loads(Path(path).read_text()))

    def planned_spec(self) -> PipelineSpec:
        import yaml

        return PipelineSpec.model_validate(yaml.safe_load(self.spec_yaml))

    def to_markdown(self) -> str:
        e = self.estimate
        rows = "\n".join(f"| {k} | {v / GIB:.3f} |" for k, v in sorted(e["components"].items(), key=lambda kv: -kv[1]))
        plan = "\n".join(f"- {c}" for c in self.changes) or "- none needed"
        cands = ""
        if self.candidates:
            cands = ("\n\n### Cloud candidates\n| GPU | fits | est. peak GiB | $/h | hours | total $ |\n"
                     "|---|---|---|---|---|---|\n")
            cands += "\n".join(
                f"| {c.get('gpu')} | {c.get('fits')} | {c.get('estimate', {}).get('device_total_bytes', 0) / GIB:.1f} "
                f"| {c.get('hourly_usd') or '-'} | {c.get('est_hours') or '-'} | {c.get('est_total_usd') or '-'} |"
                for c in self.candidates)
        return (
            f"## Preflight: `{self.pipeline}` on {self.device['name']}\n\n"
            f"**Verdict: {self.verdict}** - {self.reason}\n\n"
            f"Estimated peak {e['device_total_bytes'] / GIB:.3f} GiB (allocated {e['allocated_peak_bytes'] / GIB:.3f}, "
            f"reserved {e['reserved_peak_bytes'] / GIB:.3f}) of a {e['budget_bytes'] / GIB:.3f} GiB budget; "
            f"peak phase: {e['peak_phase']}; sequence length {self.seq_len}.\n\n"
            f"| component | GiB |\n|---|---|\n{rows}\n\n### Plan\n{plan}{cands}\n")


def preflight(spec: PipelineSpec, seq_len: int, device_name: str | None = None, *, n_train: int | None = None,
              mean_len: float | None = None) -> PreflightReport:
    """Estimate ``spec`` at ``seq_len`` on the device, plan a fit, and decide local / burst / fail.

    ``n_train`` and ``mean_len`` (from the prepared data) give the token count behind the time estimate that
    ``burst.max_local_hours`` is checked against."""
    from fitburst.cloud.rank import estimate_hours, should_burst, train_tokens

    device = resolve_device(device_name or spec.preflight.device)
    shape = load_shape(model_ref(spec))
    settings = settings_from_spec(spec, device, seq_len)
    plan = plan_fit(shape, settings, device, safety_margin=spec.preflight.safety_margin,
                    allow=spec.preflight.allow.model_dump())
    est = plan.estimate.to_dict()
    tokens = train_tokens(spec, n_train, mean_len)
    local_hours = estimate_hours(shape, plan.settings, device.kind, tokens) if plan.fits else None
    burst, why = should_burst(spec, plan.fits, local_hours)
    budget = est["budget_bytes"] * (1 - spec.preflight.safety_margin)
    if burst:
        verdict, reason = "burst", f"{why}: bursting to a cloud GPU"
    elif plan.fits:
        verdict = "local"
        reason = (f"fits in {budget / GIB:.2f} GiB (budget less {spec.preflight.safety_margin:.0%} margin)"
                  + (f" after {len(plan.changes)} change(s)" if plan.changes else " as configured")
                  + (f"; ~{_duration(local_hours)} here" if local_hours is not None else ""))
    else:
        verdict = "fail"
        reason = (f"does not fit {device.name} even with every allowed change, and burst.policy is never: "
                  "allow more changes under preflight.allow, shorten data.max_seq_len, or set burst.policy: auto")
    planned = apply_settings(spec, plan.settings) if plan.fits else spec
    est["plan"] = list(plan.changes)
    return PreflightReport(
        pipeline=spec.name, verdict=verdict, reason=reason,
        device={"name": device.name, "kind": device.kind, "total_bytes": device.total_bytes,
                "budget_bytes": device.budget_bytes},
        estimate=est, changes=list(plan.changes), settings=asdict(plan.settings), seq_len=seq_len,
        spec_yaml=planned.to_yaml(), tokens=tokens, local_hours=local_hours)


def attach_candidates(report: PreflightReport, spec: PipelineSpec) -> None:
    """Fill ``report.candidates`` with the cloud GPUs the burst policy allows, re-estimated on each, cheapest
    first (the burst path launches from this list)."""
    from fitburst.cloud import rank_candidates

    settings = settings_from_spec(spec, None, report.seq_len)  # precision: auto resolves per GPU, not for here
    report.candidates = [c.to_dict() for c in rank_candidates(spec, load_shape(model_ref(spec)), settings,
                                                              tokens=report.tokens)]


def plan_here(spec: PipelineSpec, seq_len: int) -> tuple[PipelineSpec, list[str], dict]:
    """Plan ``spec`` for the device this process runs on, with no burst option (what the cloud node does before
    training: it may be any GPU of the ordered list). Returns the planned spec, the changes and the estimate;
    raises PreflightFailed when nothing allowed fits."""
    device = resolve_device(spec.preflight.device)
    plan = plan_fit(load_shape(model_ref(spec)), settings_from_spec(spec, device, seq_len), device,
                    safety_margin=spec.preflight.safety_margin, allow=spec.preflight.allow.model_dump())
    if not plan.fits:
        raise PreflightFailed(f"{spec.name} does not fit {device.name} "
                         f"({plan.estimate.device_total_bytes / GIB:.1f} GiB needed) with any allowed change")
    return apply_settings(spec, plan.settings), list(plan.changes), plan.estimate.to_dict()
