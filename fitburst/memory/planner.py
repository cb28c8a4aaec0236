"""The fit planner: the ladder of changes people try by hand, cheapest slowdown first."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from .devices import Device, GiB, resolve_device
from .estimator import Estimate, TrainSettings, estimate
from .shapes import ModelShape

# candidate cloud GPUs for a burst verdict (smallest first)
BURST_GPUS = ("T4", "L4", "A10G", "RTX4090", "A6000", "A100-40GB", "A100-80GB", "H100", "H200")

# relative step time of each rung (1.0 = unchanged); the planner minimises the product
_COST = {
    "attention": 0.9,  # flash / sdpa is faster than eager
    "dropout": 0.98,
    "optimizer_8bit": 1.02,
    "gradient_checkpointing": 1.33,  # one extra forward
    "quantize": 1.4,  # dequantize per matmul
    "reduce_batch": 1.12,  # per halving: smaller matmuls, more python overhead
}


@dataclass
class Plan:
    fits: bool
    settings: TrainSettings
    changes: list[str]
    estimate: Estimate
    verdict: str  # local | burst
    candidates: dict[str, Estimate] = field(default_factory=dict)  # burst: GPU name -> estimate there
    burst_gpu: str | None = None  # smallest candidate GPU on which the (re-planned) run fits

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return {
            "fits": self.fits,
            "verdict": self.verdict,
            "changes": self.changes,
            "settings": asdict(self.settings),
            "estimate": self.estimate.to_dict(),
            "burst_gpu": self.burst_gpu,
            "candidates": {
                k: {
                    "fits": v.fits,
                    "device_total_bytes": v.device_total_bytes,
                    "budget_bytes": v.budget_bytes,
                    "plan": v.plan,
                }
                for k, v in self.candidates.items()
            },
        }


def _gib(b: int) -> str:
    return f"{b / GiB:.1f} GiB"


def _rungs(s: TrainSettings, device: Device, allow: dict[str, bool]) -> list[tuple[str, list]]:
    """Each rung: (allow key, list of (variant settings function, explanation))."""
    out: list[tuple[str, list]] = []
    if allow.get("attention", True) and s.attention == "eager":
        target = "flash" if device.kind == "cuda" and s.dtype != "fp32" else "sdpa"
        out.append(
            (
                "attention",
                [
                    (
                        lambda x, t=target: replace(x, attention=t),
                        f"attention eager -> {target}: no seq x seq probability matrix kept",
                    )
                ],
            )
        )
    if allow.get("dropout", True) and s.method != "full" and s.dropout > 0:
        out.append(
            (
                "dropout",
                [
                    (
                        lambda x: replace(x, dropout=0.0),
                        f"lora dropout {s.dropout:g} -> 0: no fp32 dropout copy of each adapted input",
                    )
                ],
            )
        )
    if allow.get("optimizer_8bit", True) and s.optimizer == "adamw" and device.supports_bnb:
        out.append(
            (
                "optimizer_8bit",
                [
                    (
                        lambda x: replace(x, optimizer="adamw8bit"),
                        "optimizer adamw -> adamw8bit: 2 bytes of state per parameter instead of 8",
                    )
                ],
            )
        )
    if allow.get("gradient_checkpointing", True) and not s.grad_checkpointing:
        out.append(
            (
                "gradient_checkpointing",
                [
                    (
                        lambda x: replace(x, grad_checkpointing=True),
                        "gradient checkpointing on: keep one tensor per layer, "
                        "recompute the rest in backward (~30 % slower)",
                    )
                ],
            )
        )
    if allow.get("quantize", True) and device.supports_bnb and s.method == "lora" and s.quant == "none":
        out.append(
            (
                "quantize",
                [
                    (
                        lambda x: replace(x, method="qlora", quant="nf4", double_quant=True),
                        "QLoRA: base weights in 4-bit nf4 with double quant (~0.53 bytes per weight)",
                    )
                ],
            )
        )
    return out


def plan_fit(
    shape: ModelShape,
    settings: TrainSettings,
    device: Device,
    safety_margin: float = 0.1,
    allow: dict[str, bool] | None = None,
    burst_gpus: tuple[str, ...] | list[str] = BURST_GPUS,
    _burst: bool = True,
) -> Plan:
    """Fastest settings that fit ``device`` with ``safety_margin`` headroom, or a burst verdict."""
    allow = {**{k: True for k in _COST}, **(allow or {})}
    base = estimate(shape, settings, device, safety_margin)
    if base.fits:
        return Plan(True, settings, [], base, "local")
    rungs = _rungs(settings, device, allow)
    halvings = 0
    if allow.get("reduce_batch", True):
        b = settings.batch
        while b > 1:
            b //= 2
            halvings += 1
    best: tuple[float, TrainSettings, list[str], Estimate] | None = None
    for n in range(len(rungs) + 1):
        for combo in itertools.combinations(rungs, n):
            s = settings
            why: list[str] = []
            cost = 1.0
            for key, [(fn, text)] in combo:
                s = fn(s)
                why.append(text)
                cost *= _COST[key]
            for k in range(halvings + 1):
                sk = s
                if k:
                    f = 2**k
                    nb = max(1, settings.batch // f)
                    sk = replace(s, batch=nb, grad_accum=settings.grad_accum * (settings.batch // nb))
                if best is not None and cost * _COST["reduce_batch"] ** k >= best[0]:
                    break
                e = estimate(shape, sk, device, safety_margin)
                if e.fits:
                    w = list(why)
                    if k:
                        w.append(
                            f"micro batch {settings.batch} -> {sk.batch}, "
                            f"grad_accum {settings.grad_accum} -> "
                            f"{sk.grad_accum} (same effective batch {settings.effective_batch})"
                        )
                    best = (cost * _COST["reduce_batch"] ** k, sk, w, e)
                    break
    if best is not None:
        _, s, why, e = best
        e.plan = why
        return Plan(True, s, why, e, "local")
    # nothing fits here: burst, with the estimate (and plan) on each candidate GPU
    changes = [
        f"nothing fits {device.name} ({_gib(device.budget_bytes)} budget, {safety_margin:.0%} margin): "
        f"as configured the peak is {_gib(base.device_total_bytes)}"
    ]
    plan = Plan(False, settings, changes, base, "burst")
    if not _burst:
        return plan
    for g in burst_gpus:
        dev = resolve_device(g)
        if dev.total_bytes <= device.total_bytes and dev.kind == device.kind:
            continue
        p = plan_fit(shape, settings, dev, safety_margin, allow, burst_gpus, _burst=False)
        p.estimate.plan = p.changes if p.fits else []
        plan.candidates[g] = p.estimate
        if p.fits and plan.burst_gpu is None:
            plan.burst_gpu = g
            extra = f" with {'; '.join(p.changes)}" if p.changes else ""
            changes.append(
                f"burst to {g} ({_gib(dev.budget_bytes)}): peak {_gib(p.estimate.device_total_bytes)}{extra}"
            )
    if plan.burst_gpu is None:
        longest = max_seq_len_that_fits(shape, settings, resolve_device(burst_gpus[-1]), safety_margin)
        local = max_seq_len_that_fits(shape, settings, device, safety_margin)
        changes.append(
            f"no candidate GPU ({', '.join(burst_gpus)}) fits seq_len {settings.seq_len}: "
            f"cut max_seq_len to {local} to fit {device.name}, or {longest} on {burst_gpus[-1]}"
        )
    base.plan = list(changes)
    return plan


def max_seq_len_that_fits(shape: ModelShape, s: TrainSettings, device: Device, margin: float) -> int:
    """Longest padded length (multiple of 64) that fits as configured; 0 if none."""
    lo, hi = 0, s.seq_len
    while hi - lo > 64:
        mid = (lo + hi) // 2 // 64 * 64 or 64
        if mid <= lo:
            break
        if estimate(shape, replace(s, seq_len=mid), device, margin).fits:
            lo = mid
        else:
            hi = mid
    return lo
