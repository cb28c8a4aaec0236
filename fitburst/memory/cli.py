"""`fitburst estimate`: will this training run fit? (no pipeline file, no torch for named devices)"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from pydantic import ValidationError

from fitburst.hardware import Device, GiB, host_ram_bytes, resolve_device
from fitburst.rules import problems
from fitburst.settings import (
    ATTENTIONS,
    DTYPES,
    LOSSES,
    METHODS,
    OPTIMIZERS,
    QUANTS,
    VISION,
    RunSettings,
    settings_from_spec,
)
from fitburst.spec import SAFETY_MARGIN, PipelineSpec

from .budget import Budget
from .estimator import Estimate, estimate
from .host import host_limit, offload_words, parse_host_ram
from .planner import LONGEST_SEARCHED, EstimateFn, Plan, longest_planned, max_seq_len_that_fits, plan_fit
from .shapes import ModelShape, UnmodelledArchitecture, load_shape


def add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument(
        "--model", required=True, help="hub id, local model dir, config.json path, or a bundled name"
    )
    p.add_argument("--method", choices=METHODS, default="lora")
    p.add_argument(
        "--quant",
        choices=QUANTS,
        default=None,
        help="weight quantization (default: nf4 for qlora, none otherwise)",
    )
    p.add_argument("--double-quant", action="store_true", help="bitsandbytes double quantization")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--dropout", type=float, default=0.05, help="lora dropout")
    p.add_argument("--targets", default="all-linear",
                   help="comma-separated module names, or all-linear (default: every linear layer but the output "
                        "head; a vision-language model's language model only, unless --vision says otherwise)")
    p.add_argument("--batch", type=int, default=1, help="micro batch size")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512, help="padded length (longest sample in a batch)")
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="default: bf16, or fp16 on devices without bf16",
    )
    p.add_argument("--attention", choices=ATTENTIONS, default="sdpa")
    p.add_argument(
        "--device",
        default="auto",
        help="auto (this machine's), a named device (T4, RTX4090, A100-80GB, M2-Max-64GB...), or cuda:24GiB / "
        "mps:36GiB / cpu:64GiB: a named or sized CUDA card is planned as a burst node runs it, with the libraries "
        "that node installs (fitburst preflight plans its preflight.device with this machine's)",
    )
    p.add_argument(
        "--safety-margin", type=float, default=SAFETY_MARGIN,
        help="headroom kept on top of the estimate's error band (fraction of budget)"
    )
    p.add_argument("--pure-bf16", action="store_true", help="full fine-tuning steps bf16 weights (no fp32 masters)")
    p.add_argument("--images", type=int, default=0, help="vision-language models: images per sample")
    p.add_argument("--image-max-pixels", type=int, default=1003520,
                   help="vision-language models: pixels per image (data.image_max_pixels; sets tokens per image)")
    p.add_argument("--vision", choices=VISION, default="frozen",
                   help="vision-language models: what of the vision side trains (method.vision)")
    p.add_argument("--loss", choices=LOSSES, default="auto",
                   help="training.loss: the standard loss, a fused linear cross-entropy, or auto (standard unless "
                        "the plan needs the memory)")
    p.add_argument("--activation-offloading", action="store_true",
                   help="training.activation_offloading (CUDA): saved activations in pinned host memory")
    p.add_argument("--host-ram", default=None, metavar="SIZE",
                   help="the RAM of the machine the run trains on (e.g. 64GiB; default: this machine's): offloaded "
                        "activations must fit it, less the system's reserve and each process")
    p.add_argument("--gpus", type=int, default=1, help="GPUs per node the run is sharded over with FSDP (figures "
                   "are per GPU; totals across all GPUs are shown beside them)")
    p.add_argument("--nodes", type=int, default=1, help="nodes of --gpus GPUs each (multi-node FSDP)")
    p.add_argument("--offload", action="store_true", help="FSDP: sharded weights, gradients and optimizer state in "
                   "host memory (training.fsdp.cpu_offload)")
    p.add_argument("--keep-gathered", action="store_true", help="FSDP: keep each block's gathered weights from "
                   "forward to backward (training.fsdp.reshard_after_forward: false)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON (today's keys per GPU; totals, "
                   "host_bytes and world_size beside them)")
    p.add_argument(
        "--exact",
        action="store_true",
        help="trace the real training step at full size with no memory (torch; seconds) instead of the "
        "instant analytic estimate",
    )


def spec_from_args(args: argparse.Namespace, device: Device) -> PipelineSpec:
    """The run the arguments describe, as a pipeline (no data read): what both estimates take, through
    :func:`fitburst.settings.settings_from_spec` like every other caller. The precision defaults to bf16, or fp16
    on a device without bf16; no eval step."""
    targets = ("all-linear" if args.targets.strip() == "all-linear"
               else [t.strip() for t in args.targets.split(",") if t.strip()])
    data: dict = {"path": "unused.jsonl", "max_seq_len": args.seq_len}
    if args.images:
        data["image_max_pixels"] = args.image_max_pixels
    return PipelineSpec.model_validate({
        "name": "estimate", "model": {"name": args.model}, "data": data,
        "method": {"type": args.method, "quant": args.quant, "double_quant": args.double_quant, "rank": args.rank,
                   "alpha": args.alpha, "dropout": args.dropout, "target_modules": targets, "vision": args.vision},
        "training": {"micro_batch_size": args.batch, "grad_accum": args.grad_accum,
                     "gradient_checkpointing": args.grad_checkpointing, "optimizer": args.optimizer,
                     "precision": args.dtype or ("bf16" if device.supports_bf16 else "fp16"),
                     "attention": args.attention, "pure_bf16": args.pure_bf16, "loss": args.loss,
                     "activation_offloading": args.activation_offloading,
                     "distributed": "fsdp" if args.gpus * args.nodes > 1 else "none",
                     "fsdp": {"cpu_offload": args.offload, "reshard_after_forward": not args.keep_gathered}},
        "eval": {"enabled": False}})


def run_estimate(args: argparse.Namespace) -> int:
    """Estimate and plan the run the arguments describe. An architecture the analytic estimate does not model is
    traced (and planned by tracing, a bounded number of times) even without ``--exact``; only a trace that cannot
    run refuses, saying what failed."""
    shape: ModelShape | None = None
    why = ""  # why the analytic estimate cannot answer (an architecture it does not model)
    try:
        try:
            shape = load_shape(args.model)
        except UnmodelledArchitecture as e:  # the trace builds it with transformers: it estimates and plans
            shape, why = None, f"model_type {e.model_type!r} is not one the analytic estimate models"
        device = resolve_device(args.device)
        offload = [p for p in problems(RunSettings(activation_offloading=args.activation_offloading), device)
                   if p.rule == "activation_offloading_off_cuda"]  # the rule table's row, before the spec is built
        if offload:
            raise ValueError(f"--activation-offloading: {offload[0]}")
        if args.gpus < 1 or args.nodes < 1:
            raise ValueError("--gpus and --nodes: 1 or more")
        ram = parse_host_ram(args.host_ram) if args.host_ram is not None else host_ram_bytes()
        host = host_limit(ram, args.gpus)
        if (args.offload or args.keep_gathered) and args.gpus * args.nodes == 1:
            raise ValueError("--offload and --keep-gathered are FSDP's: shard over --gpus 2 or more")
        try:
            spec = spec_from_args(args, device)
        except ValidationError as e:
            err = e.errors()[0]
            raise ValueError(f"--{'-'.join(str(p) for p in err['loc'][1:])}: {err['msg']}") from None
        settings = replace(settings_from_spec(spec, device, args.seq_len, images=args.images),
                           world_size=args.gpus * args.nodes)
        if args.images and shape is not None and shape.vision is None:
            raise ValueError(f"--images: {args.model} has no vision tower (a vision-language model takes images)")
        quick = None
        if shape is None:  # the sliced estimate answers in seconds; --exact traces the whole model to verify it
            from .sliced import quick_estimate

            quick = quick_estimate(spec, args.seq_len)
        exact = _traced(spec, args.seq_len) if args.exact or (shape is None and quick is None) else quick
        # with --exact the trace verifies the plan too, as in the preflight: one figure decides both lines
        plan, est = _planned(shape, settings, device, args, exact, quick, host)
    except ValueError as e:  # ModelConfigError, TraceUnsupported and bad arguments: a message, no traceback
        what = f"{args.model}: {why}, and the traced estimate cannot run: " if why else ""
        print(f"error: {what}{e}", file=sys.stderr)
        return 2
    if why and est.method == "sliced":
        est.notes.append(f"{why}: estimated from its real model traced at two and three blocks and scaled to its "
                         "depth (seconds, not instant; --exact traces the whole model)")
    elif why:
        est.notes.append(f"{why}: traced instead (the real model built by transformers on the meta device and "
                         "stepped on fake tensors; seconds, not instant)")
        est.notes += [n for n in plan.estimate.notes if n.startswith("planned by")]
    budget = Budget(device, args.safety_margin, gpus_per_node=args.gpus, host_limit=host)
    est = budget.judge(est)
    est.plan = [] if est.fits else list(plan.changes)
    longest = _longest(shape, settings, device, args, host, plan)
    if args.json:
        d = est.to_dict()
        d["error_band"] = d.pop("band")  # the band the fit was judged by (fitburst.memory.calibration)
        d["verdict"] = "local" if plan.fits else "burst"
        d["needed_bytes"] = budget.needed(est)
        d["planned_settings"] = plan.to_dict()["settings"] if plan.changes else None
        # the planned settings' own breakdown beside the as-configured one above
        d["planned_components"] = plan.estimate.components if plan.changes else None
        d["planned_device_total_bytes"] = plan.estimate.device_total_bytes if plan.changes else None
        d["host_ram"] = _host_ram(ram, host, est, plan)
        d["longest_seq_len"] = longest
        print(json.dumps(d, indent=2))
        return 0 if est.fits or plan.fits else 1
    _print_human(shape.name if shape is not None else args.model, settings, device, est, plan)
    _print_host_and_longest(est, plan, host, longest)
    return 0 if est.fits or plan.fits else 1


def _longest(shape: ModelShape | None, settings, device: Device, args: argparse.Namespace,
             host: int, chosen: Plan) -> dict | None:
    """The longest sequence that fits by the analytic estimate (searched up to LONGEST_SEARCHED tokens): as
    configured; with the settings of the plan ``chosen`` at the configured length (``chosen_plan``; None when that
    plan changes nothing or fits nothing); and with the plan the planner chooses at that longest length itself
    (``planned``, whose settings may differ from ``chosen``'s). None for an architecture it does not model, or a
    sharded run (planned per GPU count)."""
    if shape is None or settings.world_size > 1:
        return None
    as_configured = max_seq_len_that_fits(shape, settings, device, args.safety_margin, longest=LONGEST_SEARCHED,
                                          host_limit=host)
    with_chosen = (max_seq_len_that_fits(shape, chosen.settings, device, args.safety_margin,
                                         longest=LONGEST_SEARCHED, host_limit=host)
                   if chosen.fits and chosen.changes else None)
    n, plan = longest_planned(shape, settings, device, args.safety_margin, host_limit=host)
    return {"as_configured": as_configured, "chosen_plan": with_chosen, "chosen_plan_by": chosen.estimate.method,
            "planned": n, "searched_up_to": LONGEST_SEARCHED,
            "planned_changes": plan.changes if plan is not None else [],
            "planned_settings": plan.settings.describe() if plan is not None else None,
            "planned_device_total_bytes": plan.estimate.device_total_bytes if plan is not None else None,
            "planned_host_bytes": plan.estimate.host_bytes if plan is not None else None,
            "by": "analytic"}


def _host_ram(ram: int, limit: int, est: Estimate, plan: Plan) -> dict:
    """The host side of the run as configured and as planned: what offloading pins there against the limit."""
    return {"ram_bytes": ram, "limit_bytes": limit, "host_bytes": est.host_bytes,
            "offloaded_bytes": est.offloaded_host_bytes, "fits": est.host_bytes <= limit,
            "planned_host_bytes": plan.estimate.host_bytes if plan.changes else None,
            "planned_offloaded_bytes": plan.estimate.offloaded_host_bytes if plan.changes else None}


def _print_host_and_longest(est: Estimate, plan: Plan, host: int, longest: dict | None) -> None:
    """The host side of the run (offloaded activations against the host's limit) and the longest sequence that
    fits, as configured and with the plan the planner would choose."""
    from rich.console import Console

    con = Console()
    for e, what in ((est, "as configured"), (plan.estimate, "as planned")):
        if e.host_side_bytes and (e is est or plan.changes):
            con.print(f"{what}: {offload_words(e.host_bytes, host)}")
    if longest is None:
        return
    cap = longest["searched_up_to"]
    words = lambda n: "none" if not n else (f"{n:,} tokens or more" if n >= cap else f"{n:,} tokens")  # noqa: E731
    chosen = ""
    if longest["chosen_plan"] is not None:
        by = longest["chosen_plan_by"]
        chosen = (f"; with the plan above, its settings kept (chosen at {est.settings['seq_len']:,} tokens"
                  + (f" by the {by} estimate" if by != "analytic" else "") + ") " + words(longest["chosen_plan"]))
    con.print(f"longest sequence that fits by the analytic estimate (batch {est.settings['micro_batch_size']}): as "
              f"configured {words(longest['as_configured'])}{chosen}; with the plan it would choose at that length "
              f"{words(longest['planned'])}"
              + (f" ({longest['planned_settings']})" if longest["planned"] else ""))


def _planned(shape: ModelShape | None, settings: RunSettings, device: Device, args: argparse.Namespace,
             exact: EstimateFn | None, quick: EstimateFn | None, host: int) -> tuple[Plan, Estimate]:
    """The plan and the estimate as configured, by ``exact`` (the trace) where given. Where the trace cannot run
    here (TraceUnsupported: a plan for a card whose libraries this machine lacks, int8 weights) and the analytic
    estimate models the model, both by the analytic estimate with its wider band, and a note says why."""
    from .trace_guards import TraceUnsupported

    def planned_by(by: EstimateFn | None) -> tuple[Plan, Estimate]:
        plan = plan_fit(shape, settings, device, safety_margin=args.safety_margin, exact=by,
                        quick=quick if args.exact and by is not None else None, gpus_per_node=args.gpus,
                        host_limit=host)
        if by is not None:
            return plan, by(settings, device)
        assert shape is not None  # an unmodelled architecture is always traced
        return plan, estimate(shape, settings, device)

    try:
        return planned_by(exact)
    except TraceUnsupported as e:
        if exact is None or shape is None:
            raise
        plan, est = planned_by(None)
        est.notes.append(f"planned by the analytic estimate and its band: {e}")
        return plan, est


def _traced(spec: PipelineSpec, seq_len: int) -> EstimateFn:
    """The traced estimate of ``spec``'s run (torch: imported only here), one trace per distinct settings."""
    from .trace import traced_estimate

    cache: dict = {}
    return lambda s, d: traced_estimate(spec, s, d, seq_len=min(seq_len, s.seq_len), cache=cache)


def _fit_words(needed: int, limit: int) -> str:
    """Whether ``needed`` (the upper edge of an estimate's error band) fits ``limit``, and by how much."""
    g = needed / GiB, limit / GiB
    if needed <= limit:
        return f"fits: {g[0]:,.2f} GiB at the upper edge within {g[1]:,.2f} GiB, {g[1] - g[0]:,.2f} GiB to spare"
    return f"does not fit: {g[0]:,.2f} GiB at the upper edge against {g[1]:,.2f} GiB, {g[0] - g[1]:,.2f} GiB over"


def _print_human(name: str, settings, device, est, plan) -> None:
    """The breakdown, then the verdict in the terms it is decided in: the reserved peak at the upper edge of the
    estimate's error band (never below the reserved peak it bounds) against the budget less headroom; the device
    total (reserved + runtime context, which the budget already leaves out) is shown for reference below."""
    from rich.console import Console
    from rich.table import Table

    g = lambda b: f"{b / GiB:,.2f}"  # noqa: E731
    budget = Budget(device, est.safety_margin)
    needed = max(budget.needed(est), est.reserved_peak_bytes)
    con = Console()
    where = device.name if est.world_size == 1 else (
        f"{est.world_size}x {device.name}" + (f" on {est.nodes} nodes" if est.nodes > 1 else "") + ", per GPU")
    t = Table(title=f"{name}: {settings.describe()} on {where} (peak phase: {est.peak_phase})")
    t.add_column("component")
    t.add_column("GiB", justify="right")
    for k, v in sorted(est.components.items(), key=lambda kv: -kv[1]):
        t.add_row(k, g(v))
    t.add_section()
    t.add_row("allocated peak", g(est.allocated_peak_bytes))
    t.add_row("reserved (allocator)", g(est.reserved_peak_bytes))
    t.add_row(f"reserved at the upper edge of the error band ({est.band.high:+.0%})", g(needed))
    t.add_row(f"budget (less {est.safety_margin:.0%} headroom; context left out)", g(budget.limit))
    t.add_section()
    t.add_row("device total (reserved + context), for reference", g(est.device_total_bytes))
    if est.world_size > 1:  # every figure above is one GPU's
        n = est.world_size
        t.add_section()
        t.add_row(f"all {n} GPUs: reserved", g(est.reserved_peak_bytes * n))
        t.add_row(f"all {n} GPUs: device total", g(est.device_total_bytes * n))
        t.add_row("host RAM per node (loading" + (", offloaded state)" if settings.cpu_offload else ")"),
                  g(est.host_bytes))
    con.print(t)
    con.print(f"error band: {est.band.describe()}")
    p = est.params
    con.print(f"params: {p['total'] / 1e9:.3f} B total, {p['trainable'] / 1e6:.2f} M trainable")
    if est.fits:
        con.print(f"[green]as configured, {_fit_words(needed, budget.limit)}[/green]")
        for n in est.notes:
            con.print(f"[dim]{n}[/dim]")
        return
    con.print(f"[yellow]as configured, {_fit_words(needed, budget.limit)}[/yellow]")
    if plan.changes:
        con.print("plan:")
        for c in plan.changes:
            con.print(f"  - {c}")
        planned = max(budget.needed(plan.estimate), plan.estimate.reserved_peak_bytes)
        con.print(f"  -> reserved peak {g(plan.estimate.reserved_peak_bytes)} GiB; "
                  f"{_fit_words(planned, budget.limit)}")
    if not plan.fits:
        con.print("[red]nothing tried fits here[/red]: verdict burst")
    for n in est.notes:
        con.print(f"[dim]{n}[/dim]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fitburst estimate")
    add_estimate_arguments(parser)
    return run_estimate(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
