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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace

from fitburst.hardware import Device, GiB
from fitburst.rules import ModelFacts, new_problems
from fitburst.settings import RunSettings
from fitburst.spec import SAFETY_MARGIN

from .budget import Budget
from .estimator import Estimate, estimate
from .ladder import EVAL_HALVING_COST, LADDER, RUNGS, smaller_batch
from .shapes import ModelShape

# An estimate of one run on one device: (settings, device) -> Estimate. The analytic one is
# ``lambda s, d: estimate(shape, s, d)``; the preflight passes the traced one as ``exact``.
EstimateFn = Callable[[RunSettings, Device], Estimate]

_MAX_EXACT_CHECKS = 4  # plans the exact estimate may reject before the planner gives up on this device
# an architecture with no analytic estimate is planned by the exact one alone: the run as configured, the most
# frugal allowed plan, then at most this many plans in between (cheapest first)
_MAX_EXACT_SEARCH = 4


@dataclass
class Plan:
    """The fastest allowed settings for one device, or the closest miss."""

    fits: bool
    settings: RunSettings
    changes: list[str]
    estimate: Estimate
    needed_bytes: int  # the estimate's reserved figure at its error band's upper edge
    limit_bytes: int  # the device budget less the extra headroom

    def to_dict(self) -> dict:
        return {"fits": self.fits, "changes": self.changes, "settings": asdict(self.settings),
                "estimate": self.estimate.to_dict(), "needed_bytes": self.needed_bytes,
                "limit_bytes": self.limit_bytes}


def _gib(b: int) -> str:
    return f"{b / GiB:.1f} GiB"


def _batch_steps(s: RunSettings, k: int) -> RunSettings:
    """``s`` after ``k`` steps of the micro-batch rung."""
    for _ in range(k):
        s = smaller_batch(s)
    return s


def _fit_eval(est: EstimateFn, budget: Budget, s: RunSettings) -> tuple[RunSettings, Estimate, list[str], int]:
    """Lower the eval batch while the eval step is what does not fit: (settings, estimate, what changed, steps)."""
    e = budget.judge(est(s, budget.device))
    first, k = s.eval_batch, 0
    eval_peak = e.phases.get("eval", 0)
    while not e.fits and e.peak_phase == "eval" and s.eval_batch > 1:
        s = replace(s, eval_batch=s.eval_batch // 2)
        e = budget.judge(est(s, budget.device))
        k += 1
    why = [f"eval batch {first} -> {s.eval_batch}: at {first} the eval step was the peak "
           f"({_gib(eval_peak)} allocated)"] if k else []
    return s, e, why, k


def _batch_change(base: RunSettings, s: RunSettings) -> list[str]:
    if s.micro_batch_size == base.micro_batch_size:
        return []
    return [f"micro batch {base.micro_batch_size} -> {s.micro_batch_size}, "
            f"grad_accum {base.grad_accum} -> {s.grad_accum} "
            f"(same effective batch {base.effective_batch})"]


@dataclass(frozen=True)
class _Combination:
    """One candidate plan: rungs taken (by key, with what they change in words), micro-batch steps, its cost."""

    settings: RunSettings
    keys: frozenset[str]
    texts: list[str]
    steps: int
    cost: float


def _combinations(settings: RunSettings, device: Device, allowed: Mapping[str, bool],
                  shape: ModelShape | None = None) -> Iterator[_Combination]:
    """Every combination of the rungs that apply to ``settings`` (and to the model ``shape``) and every number of
    micro-batch steps, the run as configured first; a combination whose rungs together break a row of the rule
    table that none breaks alone (fp32 -> bf16 with the fused loss: CCE's kernel, not Liger's) is left out."""
    rungs = [r for r in LADDER if r.key != "reduce_batch" and r.allowed(settings, device, allowed, shape)]
    facts = ModelFacts.of(shape) if shape is not None else None
    steps = 0
    while allowed["reduce_batch"] and _batch_steps(settings, steps).micro_batch_size > 1:
        steps += 1
    for n in range(len(rungs) + 1):
        for combo in itertools.combinations(rungs, n):
            s, cost = settings, 1.0
            for r in combo:
                s, cost = r.take(s, device), cost * r.cost
            if n > 1 and new_problems(settings, s, device, model=facts):
                continue
            texts = [r.explain(settings, device) for r in combo]
            for k in range(steps + 1):
                yield _Combination(_batch_steps(s, k), frozenset(r.key for r in combo), texts, k,
                                   cost * RUNGS["reduce_batch"].cost ** k)


def plan_fit(
    shape: ModelShape | None,
    settings: RunSettings,
    device: Device,
    safety_margin: float = SAFETY_MARGIN,
    allow: Mapping[str, bool] | None = None,
    *,
    exact: EstimateFn | None = None,
    quick: EstimateFn | None = None,
    gpus_per_node: int = 1,
    host_limit: int | None = None,
) -> Plan:
    """Fastest settings that fit ``device``: the band's upper edge within budget x (1 - ``safety_margin``).

    The search walks combinations of the ladder's rungs (:mod:`fitburst.memory.ladder`) and smaller micro-batches.
    ``allow`` switches rungs off (keys of ``PreflightSpec.allow``; ``reduce_batch`` also covers the eval batch).
    ``exact`` verifies the chosen plan (e.g. the traced estimate); the analytic estimate does the search. With no
    ``shape`` (an architecture the analytic estimate does not model) ``exact`` does both, with ``quick`` (the sliced
    estimate) choosing what is worth tracing (:func:`_plan_exact_only`).
    """
    allowed = {r.key: True for r in LADDER} | dict(allow or {})
    budget = Budget(device, safety_margin, gpus_per_node=gpus_per_node, host_limit=host_limit)
    if shape is None:
        if exact is None:
            raise ValueError("an architecture with no analytic estimate is planned by an exact estimate only")
        return _plan_exact_only(settings, budget, allowed, exact, quick)
    # with an exact check behind it, the search only picks plans worth tracing; the trace decides
    scout = replace(budget, scout=True) if exact is not None else budget

    def analytic(s: RunSettings, d: Device) -> Estimate:
        return estimate(shape, s, d)

    def judged(s: RunSettings) -> tuple[RunSettings, Estimate, list[str], int]:
        if allowed["reduce_batch"]:
            return _fit_eval(analytic, scout, s)
        return s, scout.judge(analytic(s, device)), [], 0

    def search() -> list[tuple[float, RunSettings, list[str], Estimate]]:
        """Every rung combination and micro-batch step that fits (analytic), cheapest first."""
        out = []
        for c in _combinations(settings, device, allowed, shape):  # every one that fits (more for the exact check)
            sk, e, ev, ek = judged(c.settings)
            if e.fits:
                out.append((c.cost * EVAL_HALVING_COST**ek, sk, c.texts + ev, e))
        return sorted(out, key=lambda f: f[0])

    def taken(s: RunSettings, rung_text: list[str], e: Estimate) -> Plan:
        e.plan = rung_text + _batch_change(settings, s)
        return Plan(True, s, e.plan, e, budget.needed(e), budget.limit)

    def checked(exact: EstimateFn, s: RunSettings, e: Estimate) -> Estimate | None:
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
            if (x := checked(exact, s, e)) is not None:
                return taken(s, rung_text, x)
        else:
            return None
        left = [f for f in found if f[1] not in rejected and worth_tracing(f[3])]
        if not left:
            return None
        _, s, rung_text, e = min(left, key=lambda f: (scout.needed(f[3]), f[0]))
        n = len(rejected)
        if (x := checked(exact, s, e)) is None:
            return None
        plan = taken(s, rung_text, x)
        plan.changes.append(f"the exact estimate rejected {n} cheaper plan(s); this is the most frugal one, checked "
                            "last: a cheaper plan between may fit too")
        return plan

    rejected: list[RunSettings] = []
    ratio = [1.0]  # exact / analytic need seen on rejected plans: plans that would be rejected alike are skipped
    base_s, base, base_ev, _ = judged(settings)
    plan = verified([(1.0, base_s, base_ev, base)]) if base.fits else None
    if plan is None:
        plan = verified([f for f in search() if f[1] not in rejected])
    if plan is not None:
        return plan
    return _closest_miss(shape, settings, device, budget, base, len(rejected), safety_margin)


def _closest_miss(shape: ModelShape, settings: RunSettings, device: Device, budget: Budget, base: Estimate,
                  rejected: int, safety_margin: float) -> Plan:
    """Nothing fits here: the plan that does not fit, with the closest miss (``base``, judged as the analytic
    estimate it is), why (the device, or the host RAM), how many plans the exact estimate ``rejected``, and how long
    a sequence would fit."""
    base = budget.judge(base)
    assert base.band is not None  # judge sets it
    if not budget.host_fits(base):
        gpu_fits = budget.needed(base) <= budget.limit
        assert budget.host_limit is not None  # host_fits is False only against a limit
        what = "offloaded state and loading" if settings.cpu_offload else "loading"
        if settings.activation_offloading:  # each process's offloaded activations, pinned (fitburst.memory.host)
            what = ("offloaded activations" if settings.world_size == 1 else f"{what}, offloaded activations")
        why = [f"nothing fits {device.name}: the host RAM does not: {_gib(base.host_bytes)} per node ({what}) of "
               f"{_gib(budget.host_limit)}" + (f", while each GPU would hold its part ({_gib(budget.needed(base))} of "
                                               f"{_gib(budget.limit)} at the upper edge)" if gpu_fits else
                                               f", and each GPU needs {_gib(budget.needed(base))} of "
                                               f"{_gib(budget.limit)}")
               + ": a node with more RAM, more GPUs"
               + (", or training.fsdp.cpu_offload off" if settings.cpu_offload else "")
               + (", a shorter sequence, or training.activation_offloading off" if settings.activation_offloading
                  else "")]
        # offloaded activations shrink with the sequence; what FSDP keeps on the host does not
        longest = max_seq_len_that_fits(shape, settings, device, safety_margin, host_limit=budget.host_limit) \
            if settings.activation_offloading else 0
    else:
        longest = max_seq_len_that_fits(shape, settings, device, safety_margin)
        why = [f"nothing fits {device.name}: as configured it needs {_gib(budget.needed(base))} at the estimate's "
               f"upper edge (estimate {_gib(base.reserved_peak_bytes)}, band +{base.band.high:.0%}) of "
               f"{_gib(budget.limit)} (budget less {safety_margin:.0%} headroom)"]
    if rejected:
        why.append(f"the exact estimate rejected the {rejected} cheapest plan(s) the analytic one accepted")
    if not budget.host_fits(base) and not settings.activation_offloading:
        why.append("a shorter sequence does not help: the host RAM decides")
    else:
        why.append(f"longest sequence that fits {device.name} as configured: {longest} tokens"
                   if longest else f"no sequence length fits {device.name} as configured")
    base.plan = list(why)
    return Plan(False, settings, why, base, budget.needed(base), budget.limit)


def world_sizes(distributed: str, per_node: int, max_nodes: int = 1, fixed: int | None = None) -> list[int]:
    """The GPU counts a plan may use, fewest first: ``training.distributed`` none: 1; auto: 1, then as many as
    needed; fsdp: 2 or more. Up to ``per_node`` GPUs on one node (all of them when ``fixed`` per node), then whole
    nodes of ``per_node`` (or ``fixed``) GPUs up to ``max_nodes``; counts past 2 on one node are powers of two (how
    machines come), ``per_node`` itself included."""
    if distributed == "none":
        return [1]
    if fixed is not None:
        one = [fixed]
    else:
        one = sorted({n for n in (1, 2, 4, 8, 16) if n <= per_node} | {per_node})
    node = fixed or per_node
    out = one + [node * k for k in range(2, max_nodes + 1)]
    return [n for n in out if n >= (2 if distributed == "fsdp" else 1)]


def plan_gpus(shape: ModelShape | None, settings: RunSettings, device: Device, counts: list[int],
              safety_margin: float = SAFETY_MARGIN, allow: Mapping[str, bool] | None = None, *,
              exact: EstimateFn | None = None, quick: EstimateFn | None = None, gpus_per_node: int | None = None,
              host_limit: int | None = None) -> Plan:
    """The fastest plan on the fewest of ``counts`` GPUs of ``device`` (:func:`world_sizes`), each count planned by
    :func:`plan_fit` (more than one: sharded with FSDP, every figure per GPU); when none fits, the closest miss on
    the most GPUs. ``gpus_per_node``: GPUs one node has (default: all of them on one); ``host_limit``: host RAM a
    node has for what a sharded run keeps there."""
    if not counts:
        raise ValueError("no GPU count to plan for")
    plan: Plan | None = None
    for n in counts:
        spread = replace(settings, world_size=n)
        if n > 1 and (refused := new_problems(settings, spread, device)):  # what FSDP refuses (fitburst.rules)
            if plan is None and n == counts[-1]:
                raise ValueError(f"{n} GPUs: {refused[0]}")
            continue
        plan = plan_fit(shape, spread, device, safety_margin, allow, exact=exact,
                        quick=quick, gpus_per_node=gpus_per_node or n, host_limit=host_limit)
        if plan.fits:
            break
    assert plan is not None
    n = plan.settings.world_size
    if n > 1:
        e = plan.estimate
        where = f"{n} GPUs" + (f" on {e.nodes} nodes" if e.nodes > 1 else "")
        why = ("the run fits no fewer" if plan.fits else "the most allowed, and it does not fit there either")
        plan.changes.insert(0, f"FSDP over {where} ({why}): per GPU {_gib(plan.needed_bytes)} at the estimate's "
                               f"upper edge, {_gib(e.reserved_peak_bytes * n)} reserved across all"
                               + (f"; host RAM {_gib(e.host_bytes)} per node" if e.host_bytes else ""))
        e.plan = list(plan.changes)
    return plan


def max_seq_len_that_fits(shape: ModelShape, s: RunSettings, device: Device,
                          margin: float = SAFETY_MARGIN, *, longest: int | None = None,
                          host_limit: int | None = None) -> int:
    """Longest padded length (multiple of 64) up to ``longest`` (default: ``s.seq_len``) that fits as configured,
    the host side against ``host_limit`` included; 0 if none."""
    budget = Budget(device, margin, host_limit=host_limit)
    return _longest(lambda n: bool(budget.judge(estimate(shape, replace(s, seq_len=n), device)).fits),
                    longest or s.seq_len)


def _longest(fits: Callable[[int], bool], hi: int) -> int:
    """The longest multiple of 64 up to ``hi`` (``hi`` itself when it fits) for which ``fits`` holds, by bisection
    (``fits`` must hold for every length below one that fits); 0 if none."""
    if fits(hi):
        return hi
    lo = 0
    while hi - lo > 64:
        mid = (lo + hi) // 2 // 64 * 64 or 64
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


# how far `fitburst estimate` looks for the longest sequence a plan fits (tokens); a run that fits this long says so
LONGEST_SEARCHED = 1 << 20


def most_frugal(settings: RunSettings, device: Device, allow: Mapping[str, bool] | None = None,
                shape: ModelShape | None = None) -> RunSettings:
    """``settings`` with every allowed rung that applies taken, in the ladder's order (a rung that applies only
    after another, such as the 8-bit optimizer after quantizing, is taken too), and the micro-batch at its
    smallest: what the planner would need at most of each rung."""
    allowed = {r.key: True for r in LADDER} | dict(allow or {})
    s = settings
    for r in LADDER:
        if r.key != "reduce_batch" and r.allowed(s, device, allowed, shape):
            s = r.take(s, device)
    while allowed["reduce_batch"] and s.micro_batch_size > 1:
        s = smaller_batch(s)
    return s


def frugal_plans(settings: RunSettings, device: Device, allow: Mapping[str, bool] | None = None,
                 shape: ModelShape | None = None) -> list[RunSettings]:
    """The most frugal allowed plan (:func:`most_frugal`), then it without each of its rungs in turn: a rung that
    saves memory at one length may cost some at another (the tiled MLP's shards at a short sequence), and
    offloading spends host RAM the host may not have."""
    allowed = {r.key: True for r in LADDER} | dict(allow or {})
    out = [most_frugal(settings, device, allowed, shape)]
    for r in LADDER:
        if r.key != "reduce_batch" and allowed[r.key]:
            without = most_frugal(settings, device, allowed | {r.key: False}, shape)
            if without not in out:
                out.append(without)
    return out


def longest_planned(shape: ModelShape, settings: RunSettings, device: Device, margin: float = SAFETY_MARGIN,
                    allow: Mapping[str, bool] | None = None, *, host_limit: int | None = None,
                    longest: int = LONGEST_SEARCHED) -> tuple[int, Plan | None]:
    """The longest padded length (multiple of 64, up to ``longest``) at which the planner finds a plan that fits
    ``device`` (the analytic estimate at its band's upper edge, the host side against ``host_limit``), and that plan
    (None when no length fits). Bisected on the most frugal allowed plans (:func:`frugal_plans`: when the host
    cannot hold the offloaded activations the run may still fit the GPU without them); the plan itself is
    :func:`plan_fit`'s at that length (the fastest that fits there)."""
    budget = Budget(device, margin, host_limit=host_limit)

    def fits(n: int) -> bool:
        tries = frugal_plans(replace(settings, seq_len=n), device, allow, shape)
        return any(bool(budget.judge(estimate(shape, t, device)).fits) for t in tries)

    n = _longest(fits, longest)
    if not n:
        return 0, None
    return n, plan_fit(shape, replace(settings, seq_len=n), device, margin, allow, host_limit=host_limit)


def _plan_exact_only(settings: RunSettings, budget: Budget, allowed: Mapping[str, bool],
                     exact: EstimateFn, quick: EstimateFn | None = None) -> Plan:
    """The fastest plan the exact estimate alone finds, for an architecture the analytic estimate does not model.

    Each check is a trace (seconds), so the search is bounded: the run as configured; if that misses, the most
    frugal allowed plan (every rung, the smallest micro-batch), and if even that misses, nothing fits; otherwise
    at most ``_MAX_EXACT_SEARCH`` plans in between, cheapest first, skipping any that takes a subset of the
    changes of a plan already rejected (fewer changes never need less), and the most frugal one when none of
    those fit. At most ``2 + _MAX_EXACT_SEARCH`` traces; the plan says how many ran. With ``quick`` (the sliced
    estimate, :mod:`fitburst.memory.sliced`) a plan is traced only where the quick figure leaves room for it (the
    low edge of its band against the trace fits, as :class:`Budget` scouts), and what it rules out prunes the
    search as a rejected trace does."""
    device = budget.device
    scout = replace(budget, scout=True)
    traced: list[str] = []
    screened: list[str] = []

    def judged(s: RunSettings) -> Estimate:
        traced.append(s.describe())
        return budget.judge(exact(s, device))

    def ruled_out(s: RunSettings) -> Estimate | None:
        """The quick estimate of ``s`` judged against the budget when it leaves no room for a trace to fit."""
        if quick is None:
            return None
        screened.append(s.describe())
        q = quick(s, device)
        return budget.judge(q) if not scout.judge(replace(q)).fits else None

    def note(plan: Plan) -> Plan:
        how = f", {len(screened)} quick (sliced) estimate(s) choosing what to trace" if screened else ""
        plan.estimate.notes.append(f"planned by the exact estimate alone (no analytic estimate for this "
                                   f"architecture): {len(traced)} trace(s), at most {2 + _MAX_EXACT_SEARCH}{how}")
        plan.estimate.plan = list(plan.changes)
        return plan

    base = ruled_out(settings) or judged(settings)
    if base.fits:
        return note(Plan(True, settings, [], base, budget.needed(base), budget.limit))
    options = [(c.cost, c.keys, c.steps, c.settings, c.texts + _batch_change(settings, c.settings))
               for c in _combinations(settings, device, allowed) if c.keys or c.steps]
    if not options:
        return _missed(settings, base, budget, "no allowed change applies", traced, note)
    options.sort(key=lambda o: o[0])
    frugal = max(options, key=lambda o: (len(o[1]), o[2]))
    low = ruled_out(frugal[3]) or judged(frugal[3])
    if not low.fits:
        return _missed(settings, base, budget, f"even the most frugal allowed plan ({frugal[3].describe()}) needs "
                       f"{_gib(budget.needed(low))}", traced, note)
    rejected: list[tuple[frozenset[str], int]] = []
    cut = False  # the trace count ran out before the most frugal plan was reached
    for _, keys, k, s, texts in options:
        if s == frugal[3]:
            break
        if len(traced) >= 2 + _MAX_EXACT_SEARCH:
            cut = True
            break
        if any(keys <= rk and k <= rkk for rk, rkk in rejected):
            continue
        if ruled_out(s) is not None:
            rejected.append((keys, k))
            continue
        e = judged(s)
        if e.fits:
            e.plan = texts
            return note(Plan(True, s, list(texts), e, budget.needed(e), budget.limit))
        rejected.append((keys, k))
    low.plan = list(frugal[4])
    plan = Plan(True, frugal[3], list(frugal[4]), low, budget.needed(low), budget.limit)
    if cut:
        plan.changes.append("the most frugal allowed plan: a cheaper plan may fit too (the trace count is bounded)")
    return note(plan)


def _missed(settings: RunSettings, base: Estimate, budget: Budget, why: str, traced: list[str],
            note: Callable[[Plan], Plan]) -> Plan:
    """The run as configured, marked as the closest miss with why nothing allowed fits."""
    assert base.band is not None  # judge sets it
    changes = [f"nothing fits {budget.device.name}: as configured it needs {_gib(budget.needed(base))} at the "
               f"estimate's upper edge (estimate {_gib(base.reserved_peak_bytes)}, band +{base.band.high:.0%}) of "
               f"{_gib(budget.limit)} (budget less {budget.headroom:.0%} headroom); {why}"]
    return note(Plan(False, settings, changes, base, budget.needed(base), budget.limit))
