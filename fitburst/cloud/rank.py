"""Which rented GPU, from need and price: re-plan the run per GPU, estimate hours, rank by total cost.

For every (GPU, provider) the burst policy allows, the memory planner is re-run against that GPU's memory and
capabilities (a T4 has no bf16, so the run is planned in fp16 there); candidates that fit with the pipeline's
safety margin are ordered by estimated total cost (hourly price x estimated hours, provisioning included).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from fitburst.cloud.gpus import DEFAULT_MFU, MFU, PEAK_TFLOPS, Offer, offers

log = logging.getLogger(__name__)

# Provisioning, setup (pip install) and the base-model download on a fresh node, charged to every cloud run.
OVERHEAD_HOURS = 0.25
# Sustained dense throughput (TFLOP/s) for local devices that are not in PEAK_TFLOPS (time estimates only).
LOCAL_TFLOPS = {"cpu": 0.3, "mps": 4.0}


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
    estimate: dict = field(default_factory=dict)  # the memory estimate on this GPU
    settings: dict = field(default_factory=dict)  # the TrainSettings planned for this GPU
    region: str | None = None
    price_source: str = ""
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
        d["usable"] = self.usable
        return d

    @classmethod
    def from_dict(cls, d: dict | Candidate) -> Candidate:
        """Back from :meth:`to_dict` (the preflight report stores candidates as dicts)."""
        if isinstance(d, Candidate):
            return d
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def label(self) -> str:
        return f"{self.gpu} on {self.provider} ({self.accelerator})"


# --- time -------------------------------------------------------------------------------------------------


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    value = getattr(obj, name, default)
    return value() if callable(value) else value


def param_count(shape: Any) -> int:
    """Parameters of the base model (ModelShape.param_count, or a dense decoder count from its sizes)."""
    n = _get(shape, "param_count")
    if n:
        return int(n)
    h, layers, inter, vocab = (_get(shape, k, 0) for k in ("hidden", "layers", "intermediate", "vocab"))
    return int(layers * (4 * h * h + 3 * h * inter) + 2 * vocab * h)


def train_tokens(spec: Any, n_train: int | None = None, mean_len: float | None = None) -> int | None:
    """Tokens the run processes: steps x effective batch x length, or epochs x examples x length."""
    t = spec.training
    length = mean_len or spec.data.max_seq_len
    if t.max_steps:
        return int(t.max_steps * t.micro_batch_size * t.grad_accum * length)
    if n_train:
        return int((t.epochs or 1.0) * n_train * length)
    return None


def flops_per_token(shape: Any, settings: Any) -> float:
    """Training FLOPs per token: 2N forward, 2N activation grads, +2N weight grads for full fine-tuning,
    +2N recompute with gradient checkpointing; dequantizing a 4/8-bit base costs about 25 % more."""
    n = param_count(shape)
    method = _get(settings, "method", "lora")
    mult = 6.0 if method == "full" else 4.0
    if _get(settings, "grad_checkpointing", False):
        mult += 2.0
    quant = _get(settings, "quant", "none")
    factor = 1.25 if quant not in (None, "none") else 1.0
    return mult * n * factor


def estimate_hours(
    shape: Any, settings: Any, device: str, tokens: int | None, overhead_hours: float = OVERHEAD_HOURS
) -> float | None:
    """Wall-clock hours for ``tokens`` on ``device`` (a fitburst GPU name, or ``cpu``/``mps`` for local)."""
    if not tokens:
        return None
    if device in PEAK_TFLOPS:
        tflops = PEAK_TFLOPS[device] * MFU.get(device, DEFAULT_MFU)
    else:
        tflops = LOCAL_TFLOPS.get(device, LOCAL_TFLOPS["cpu"])
        overhead_hours = 0.0
    seconds = tokens * flops_per_token(shape, settings) / (tflops * 1e12)
    return seconds / 3600 + overhead_hours


# --- fit per GPU ------------------------------------------------------------------------------------------


def _memory():
    """The estimator's functions (package exports when present, else its submodules)."""
    import importlib

    m = importlib.import_module("fitburst.memory")
    api = {}
    for name, sub in (("resolve_device", "devices"), ("estimate", "estimator"), ("plan_fit", "planner")):
        fn = getattr(m, name, None)
        if fn is None:
            try:
                fn = getattr(importlib.import_module(f"fitburst.memory.{sub}"), name, None)
            except ImportError:
                fn = None
        api[name] = fn
    return api


def _device_gib(gpu: str) -> float | None:
    try:
        return round(_memory()["resolve_device"](gpu).total_bytes / 2**30, 1)
    except Exception:  # noqa: BLE001
        return None


def _plan_on(gpu: str, shape: Any, settings: Any, spec: Any) -> tuple[bool, Any, list[str], dict, str]:
    """Re-run the planner for ``gpu``: (fits, settings, changes, estimate dict, reason)."""
    mem = _memory()
    device = mem["resolve_device"](gpu)
    changes: list[str] = []
    if not getattr(device, "supports_bf16", True) and _get(settings, "dtype") == "bf16":
        settings = dataclasses.replace(settings, dtype="fp16")
        changes.append(f"dtype bf16 -> fp16 ({gpu} has no bf16)")
    if not getattr(device, "supports_bnb", True) and _get(settings, "quant", "none") not in (None, "none"):
        return False, settings, changes, {}, f"{gpu} cannot run bitsandbytes quantization"
    margin = spec.preflight.safety_margin
    if mem["plan_fit"] is not None:
        allow = spec.preflight.allow
        allow = allow.model_dump() if hasattr(allow, "model_dump") else dict(allow or {})
        try:  # _burst=False: plan for this GPU only, no search over other GPUs
            plan = mem["plan_fit"](shape, settings, device, margin, allow, _burst=False)
        except TypeError:
            plan = mem["plan_fit"](shape, settings, device, margin, allow)
        fits, planned, est_obj = bool(plan.fits), plan.settings, plan.estimate
        changes += [str(c) for c in (plan.changes or [])]
        verdict = str(getattr(plan, "verdict", "") or "")
    else:  # estimator without a planner: fit as configured
        est_obj = mem["estimate"](shape, settings, device, margin)
        fits, planned, verdict = bool(est_obj.fits), settings, ""
    est = est_obj.to_dict() if hasattr(est_obj, "to_dict") else dict(est_obj or {})
    if fits:
        return True, planned, changes, est, ""
    need = est.get("device_total_bytes")
    budget = est.get("budget_bytes")
    detail = f"needs {need / 2**30:.1f} GiB of {budget / 2**30:.1f} GiB" if need and budget else verdict
    return False, planned, changes, est, f"does not fit in {gpu}" + (f": {detail}" if detail else "")


def rank_candidates(
    spec: Any,
    shape: Any,
    settings: Any,
    est_hours_fn: Callable[..., float | None] | None = None,
    *,
    tokens: int | None = None,
    offer_list: list[Offer] | None = None,
) -> list[Candidate]:
    """Every (GPU, provider) of ``spec.burst``, re-planned and priced; usable first, cheapest total first.

    ``est_hours_fn(gpu, settings) -> hours`` replaces the FLOPs-based estimate (e.g. from measured steps/s in
    MLflow history). ``tokens`` is what the run processes (see :func:`train_tokens`); without it hours and
    totals are estimated from ``max_steps`` when set, else left unknown and candidates rank by hourly price.
    ``offer_list`` skips the catalog lookup (tests, or a caller that already has offers).
    """
    burst = spec.burst
    if tokens is None:
        tokens = train_tokens(spec)
    offer_list = (
        offer_list if offer_list is not None else offers(burst.gpus, burst.providers, spot=burst.spot)
    )
    plans: dict[str, tuple] = {}
    out: list[Candidate] = []
    for offer in offer_list:
        if offer.gpu not in plans:
            try:
                plans[offer.gpu] = _plan_on(offer.gpu, shape, settings, spec)
            except (KeyError, ValueError) as e:
                plans[offer.gpu] = (False, settings, [], {}, f"cannot plan for {offer.gpu}: {e}")
        fits, planned, changes, est, reason = plans[offer.gpu]
        if est_hours_fn is not None:
            hours = est_hours_fn(offer.gpu, planned)
        else:
            hours = estimate_hours(shape, planned, offer.gpu, tokens)
        total = round(hours * offer.hourly_usd, 2) if hours is not None and offer.hourly_usd else None
        c = Candidate(
            gpu=offer.gpu,
            provider=offer.provider,
            accelerator=offer.accelerator,
            memory_gib=offer.memory_gib or _device_gib(offer.gpu),
            fits=fits,
            hourly_usd=offer.hourly_usd,
            est_hours=round(hours, 2) if hours is not None else None,
            est_total_usd=total,
            changes=list(changes),
            estimate=est,
            settings=asdict(planned) if dataclasses.is_dataclass(planned) else dict(planned or {}),
            region=offer.region,
            price_source=offer.source,
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


def budget_problems(burst: Any, c: Candidate) -> list[str]:
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


def should_burst(spec: Any, local_fits: bool, local_hours: float | None) -> tuple[bool, str]:
    """The placement rule of ``spec.burst.policy``: (burst?, why). ``never`` never bursts (a no-fit fails)."""
    policy = spec.burst.policy
    if policy == "always":
        return True, "burst policy is 'always'"
    if policy == "never":
        return False, "burst policy is 'never'" + ("" if local_fits else ": the run does not fit locally")
    if not local_fits:
        return True, "does not fit on the local device"
    cap = spec.burst.max_local_hours
    if cap is not None and local_hours is not None and local_hours > cap:
        return True, f"fits locally but needs ~{local_hours:.1f} h there, over max_local_hours {cap:g}"
    return False, "fits on the local device" + (f" (~{local_hours:.1f} h)" if local_hours is not None else "")
