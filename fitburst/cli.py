"""The ``fitburst`` command line.

validate   check pipelines.yaml before any compute (file, line, field, value, fix)
run        run a pipeline as the Prefect DAG: data prep -> preflight -> train (local or cloud) -> eval
prepare    tokenize and split a pipeline's data, print token-length statistics
preflight  estimate the run's peak memory on a device and plan a fit
estimate   "will it fit?" for a model without a pipeline file
train      one training step of the DAG with no Prefect (what the cloud node runs)
serve      register every pipeline as a Prefect deployment with its schedule
calibrate  fit the estimator's correction constants from MLflow history
costs      rented-GPU spend per pipeline and per day in a month, from MLflow
merge      fold a run's LoRA adapter into its base model (a plain model folder, base dtype)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

from fitburst.spec import DEFAULT_PIPELINES_FILE as DEFAULT_FILE


def _console():
    from rich.console import Console

    return Console(stderr=False, highlight=False)


def parse_overrides(items: list[str]) -> dict:
    """``--set training.max_steps=5`` pairs -> a dotted-key dict; values parse as YAML scalars."""
    import yaml

    from fitburst.errors import UserError

    out = {}
    for item in items or []:
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise UserError(f"--set expects KEY=VALUE (e.g. training.max_steps=20), got {item!r}")
        try:
            out[k.strip()] = yaml.safe_load(v)
        except yaml.YAMLError as e:
            raise UserError(f"--set {k.strip()}: the value {v!r} is not a YAML scalar, list or mapping "
                            f"({getattr(e, 'problem', e)}); quote it") from None
    return out


def _device_arg(value: str) -> str:
    """argparse type for --device: a name the memory model knows (checked before any compute)."""
    if value.lower() in ("auto", "cpu", "cuda", "mps"):
        return value
    from fitburst.hardware import resolve_device

    try:
        resolve_device(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _positive_int(value: str) -> int:
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value!r}")
    return int(value)


def _spec_file(value: str) -> str:
    if not Path(value).is_file():
        raise argparse.ArgumentTypeError(f"no file at {value!r} (the resolved pipeline YAML, PipelineSpec.to_yaml)")
    return value


def _prepared_dir(value: str) -> str:
    if not (Path(value) / "prepared.json").is_file():
        raise argparse.ArgumentTypeError(f"no prepared data at {value!r} (a folder holding prepared.json, as "
                                         "`fitburst prepare` writes)")
    return value


def cmd_validate(args) -> int:
    """Every pipeline's settings, then (unless --no-data) its data read and checked as data prep reads it."""
    from fitburst.errors import UserError
    from fitburst.spec import SpecError, load_all

    if not Path(args.file).is_file():  # the loader's advice names --file, which validate does not take
        raise SpecError(str(args.file), ["file not found (create it, or give its path: fitburst validate PATH)"])
    specs = load_all(args.file)
    if offload := _offload_problems(args.file, specs):
        raise SpecError(str(args.file), offload)
    con = _console()
    bad = 0
    for name, s in specs.items():
        sched = f", nightly {s.schedule.cron} {s.schedule.timezone}" if s.schedule.cron else ""
        what = f"{s.model.name}, {s.method.type} r{s.method.rank}, burst {s.burst.policy}{sched}"
        if not args.no_data:
            from fitburst.data import check_pipeline_data
            from fitburst.raw_records import DataUnreachable

            try:
                n, skipped = check_pipeline_data(s)
            except DataUnreachable as e:
                print(f"warning: pipeline {name!r}: data not checked here: {e}", file=sys.stderr)
                con.print(f"[green]ok[/] {name}: {what}; data: not checked", soft_wrap=True)
                continue
            except UserError as e:
                bad += 1
                print(f"error: pipeline {name!r}: {e}", file=sys.stderr)
                continue
            what += f"; data: {n} records" + (f" ({skipped} skipped)" if skipped else "")
        con.print(f"[green]ok[/] {name}: {what}", soft_wrap=True)
    if bad:
        print(f"{args.file}: {bad} of {len(specs)} pipeline(s) have bad data (--no-data checks the settings only)",
              file=sys.stderr)
        return 2
    checked = "settings" if args.no_data else "settings and data"
    con.print(f"{args.file}: {len(specs)} pipeline(s) valid ({checked})")
    return 0


def _offload_problems(path, specs: dict) -> list[str]:
    """Pipelines whose offloaded activations do not fit this machine's RAM (fitburst.memory.host), located as
    every other settings problem is: pipeline, line, field, value, fix."""
    from fitburst.hardware import host_ram_bytes
    from fitburst.memory.host import offload_problem
    from fitburst.spec import _locate, load_file

    _, lines = load_file(path)
    field = ("training", "activation_offloading")
    out = []
    for name, spec in specs.items():
        if why := offload_problem(spec, host_ram_bytes()):
            out.append(f"pipeline '{name}': line {_locate(lines, name, field)}: field '{'.'.join(field)}' (got True): "
                       f"{why}")
    return out


def cmd_prepare(args) -> int:
    from fitburst.data import prepare_pipeline
    from fitburst.spec import load_pipeline

    spec = load_pipeline(args.file, args.pipeline, parse_overrides(args.set))
    prepared = prepare_pipeline(spec)
    print(prepared.to_json())
    return 0


def cmd_preflight(args) -> int:
    from fitburst.data_facts import pipeline_facts
    from fitburst.preflight import preflight
    from fitburst.spec import load_pipeline

    spec = load_pipeline(args.file, args.pipeline, parse_overrides(args.set))
    facts = pipeline_facts(spec)
    report = preflight(spec, args.seq_len or facts.longest, args.device, n_train=facts.n_train,
                       mean_len=facts.mean)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        from rich.markdown import Markdown

        _console().print(Markdown(report.to_markdown()))
    return 0 if report.verdict.placement != "fail" else 3


def cmd_run(args) -> int:
    from fitburst.spec import load_pipeline

    overrides = parse_overrides(args.set)
    if args.force:  # train even when nothing changed since the last completed run
        overrides["schedule.when"] = "always"
    load_pipeline(args.file, args.pipeline, overrides)  # a mistake is one message here, not a Prefect traceback
    from flows.finetune import finetune

    summary = finetune(pipeline=args.pipeline, overrides=overrides, pipelines_file=args.file, dry_run=args.dry_run)
    assert isinstance(summary, dict)  # the spec loaded above; a flow that returns a Failed state raises here
    if summary.get("trained") is False:
        print(f"{args.pipeline}: {summary['message']}; nothing trained (--force trains anyway)")
    plan = summary.pop("burst_plan", None)
    summary.pop("candidates", None)
    if "tracking_uri" in summary:  # a server's URI may carry a password
        from fitburst.tracking import redact

        summary["tracking_uri"] = redact(str(summary["tracking_uri"]))
    print(json.dumps(summary, indent=2, default=str))
    if plan:
        print(plan)
    return 0


def cmd_train(args) -> int:
    """The node command: train (and evaluate) a resolved spec on prepared data, no Prefect needed. One process
    plans, trains, logs and evaluates itself through the supervisor (:mod:`fitburst.supervisor`). With
    ``--nproc-per-node`` x ``--nnodes`` above one it supervises its node's ranks (:class:`fitburst.ranks.Ranks`):
    node 0's plans per GPU, starts the ranks through torchrun (every rank stepped down together after an
    out-of-memory error), logs to MLflow and evaluates; another node's follows node 0. Inside a rank torchrun
    started, it runs the Recipe (:mod:`fitburst.recipe`) on the spec as given: nothing steps down in a rank."""
    from fitburst import distributed
    from fitburst.data import PreparedData
    from fitburst.errors import UserError
    from fitburst.ranks import Ranks
    from fitburst.spec import load_resolved

    if not 0 <= args.node_rank < args.nnodes:
        raise UserError(f"fitburst train: --node-rank {args.node_rank} is not a node of --nnodes {args.nnodes}: give "
                        f"each node its place, 0 .. {args.nnodes - 1} (SkyPilot's SKYPILOT_NODE_RANK)")
    spec = load_resolved(args.spec)
    prepared = PreparedData.from_dir(args.prepared)
    ranks = Ranks(args.nproc_per_node, args.nnodes, args.node_rank, args.master_addr, args.master_port)
    w = distributed.world()
    if w.sharded and (args.plan or ranks.size > 1):
        raise UserError(f"{spec.name}: torchrun started {w.size} ranks of `fitburst train` with --plan or "
                        "--nproc-per-node: start `fitburst train --nproc-per-node N [--nnodes M ...]` without "
                        "torchrun; it plans once and starts torchrun itself")
    if w.sharded:
        return _train_rank(spec, prepared, args)
    if ranks.node_rank > 0:
        return ranks.follow(prepared.dir, args.run_dir, device=args.device)
    try:
        result, ev = _supervise(spec, prepared, ranks, args)
    except BaseException as e:
        ranks.finish(error=str(e).splitlines()[0] if str(e) else type(e).__name__)
        raise
    ranks.finish()
    n = f" ({result.world_size} ranks)" if result.world_size > 1 else ""
    print(f"trained {result.steps} steps on {result.device}{n} in {result.seconds:.1f}s; adapter: "
          f"{result.adapter_dir}")
    if ev is not None:
        print(f"eval loss {ev.base_loss:.4f} -> {ev.tuned_loss:.4f}")
    return 0


def _train_rank(spec, prepared, args) -> int:
    """A rank torchrun started: the Recipe, on this rank's shard of the run (the supervisor that started torchrun
    holds the MLflow run, steps down and evaluates)."""
    from fitburst.settings import settings_from_spec
    from fitburst.unused_imports import leave_out, unused_packages

    # first: nothing in this process has asked yet whether they are installed (main imported transformers, which
    # asks only when its modeling and generation modules load: the Recipe's model builds them)
    leave_out(unused_packages(settings_from_spec(spec)))
    from fitburst import distributed
    from fitburst.recipe import Recipe

    w = distributed.world()
    try:
        result = Recipe(spec, prepared, args.run_dir, device=args.device, progress=not args.quiet and w.main).run()
    finally:
        distributed.stop()
    if w.main:
        print(f"trained {result.steps} steps on {result.device} ({result.world_size} ranks) in "
              f"{result.seconds:.1f}s; adapter: {result.adapter_dir}")
    return 0


def _supervise(spec, prepared, ranks, args):
    """Node 0 (or the one node): plan for this node's GPUs when ``--plan``, then the supervisor: train (over the
    ranks), step down on out-of-memory, evaluate when ``--eval``, record into the launcher's MLflow run."""
    from fitburst.supervisor import train_and_evaluate
    from fitburst.tracking import RUN_ID_ENV, Tracker

    estimate = None
    if args.plan:
        from fitburst.preflight import plan_for_ranks

        spec, changes, estimate = plan_for_ranks(spec, int(prepared.stats["max"]), ranks.per_node, ranks.nodes)
        for change in changes:
            print(f"plan for this device: {change}")
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
        Path(args.run_dir, "estimate.json").write_text(json.dumps(estimate.to_dict(), indent=2))
    tracker = None
    if os.environ.get(RUN_ID_ENV) and os.environ.get("MLFLOW_TRACKING_URI"):
        tracker = Tracker.attach(os.environ[RUN_ID_ENV])  # the node logs straight into the launcher's MLflow run
    return train_and_evaluate(spec, prepared, args.run_dir, tracker=tracker, path="cloud", estimate=estimate,
                              device=args.device, evaluate_after=args.eval, progress=not args.quiet,
                              ranks=ranks if ranks.size > 1 else None)


def cmd_costs(args) -> int:
    """Rented-GPU spend of a month from MLflow: each burst's recorded cost, or its estimate where none was."""
    from fitburst.errors import UserError
    from fitburst.history import costs_table, month_bounds, month_bursts
    from fitburst.tracking import redact, tracking_uri

    uri = args.tracking_uri or tracking_uri()
    start, _ = month_bounds(args.month)
    try:
        bursts = month_bursts(uri, args.experiment, args.month)
    except Exception as e:  # noqa: BLE001 - an unsupported URI, an unreachable server: one message, no traceback
        raise UserError(f"cannot read the MLflow store {redact(uri)} ({type(e).__name__}: {redact(str(e))[:300]}): "
                        "check --tracking-uri or MLFLOW_TRACKING_URI") from None
    print(f"rented-GPU spend in {start:%Y-%m} (UTC), {redact(uri)}")  # a server's URI may carry a password
    print(costs_table(bursts))
    return 0


def _month(value: str) -> str:
    """``--month``: YYYY-MM, both digits of the month (strptime alone takes 2026-1 too)."""
    import re

    if not re.fullmatch(r"[0-9]{4}-(0[1-9]|1[0-2])", value):
        raise argparse.ArgumentTypeError(f"a month is YYYY-MM (e.g. 2026-11), got {value!r}")
    return value


def cmd_merge(args) -> int:
    from fitburst.share import merge

    dest = merge(args.run, args.out)
    print(f"merged model written to {dest}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fitburst", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    def with_pipeline(sp):
        sp.add_argument("pipeline")
        sp.add_argument("--file", "-f", default=DEFAULT_FILE, help="pipelines file (default: %(default)s)")
        sp.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a field, e.g. training.max_steps=20")

    sp = sub.add_parser("validate", help="check pipelines.yaml")
    sp.add_argument("file", nargs="?", default=DEFAULT_FILE)
    sp.add_argument("--no-data", action="store_true", help="check the settings only, not the data files")
    sp.set_defaults(func=cmd_validate)

    sp = sub.add_parser("run", help="run a pipeline end to end (Prefect flow)")
    with_pipeline(sp)
    sp.add_argument("--dry-run", action="store_true", help="prep + preflight, print the decision, train nothing")
    sp.add_argument("--force", action="store_true", help="train even when nothing changed since the last completed "
                    "run (the same as --set schedule.when=always)")
    sp.set_defaults(func=cmd_run)

    sp = sub.add_parser("prepare", help="tokenize and split a pipeline's data")
    with_pipeline(sp)
    sp.set_defaults(func=cmd_prepare)

    sp = sub.add_parser("preflight", help="estimate peak memory and plan a fit")
    with_pipeline(sp)
    sp.add_argument("--device", type=_device_arg,
                    help="auto, cpu, cuda, mps, a named device (T4, RTX4090, A6000, M2-Max-32GB) "
                         "or cuda:24GiB / mps:36GiB / cpu:64GiB")
    sp.add_argument("--seq-len", type=_positive_int,
                    help="plan for this sequence length instead of the data's longest")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_preflight)

    from fitburst.memory.cli import add_estimate_arguments, run_estimate

    sp = sub.add_parser("estimate", help="will a model fit? (no pipeline file)")
    add_estimate_arguments(sp)
    sp.set_defaults(func=run_estimate)

    sp = sub.add_parser("train", help="train a resolved spec on prepared data (the cloud node's command)")
    sp.add_argument("--spec", required=True, type=_spec_file, help="resolved pipeline YAML (PipelineSpec.to_yaml)")
    sp.add_argument("--prepared", required=True, type=_prepared_dir, help="prepared data folder (fitburst prepare)")
    sp.add_argument("--run-dir", required=True)
    sp.add_argument("--device", default=None)
    sp.add_argument("--eval", action="store_true", help="evaluate base vs tuned afterwards")
    sp.add_argument("--plan", action="store_true", help="plan the memory settings for this device first")
    sp.add_argument("--quiet", action="store_true")
    ranks = sp.add_argument_group("several GPUs (this command then starts torchrun itself, one rank per GPU)")
    ranks.add_argument("--nproc-per-node", type=_positive_int, default=1, help="ranks on this node (default 1)")
    ranks.add_argument("--nnodes", type=_positive_int, default=1, help="nodes of the run (default 1)")
    ranks.add_argument("--node-rank", type=int, default=0, help="this node's place, 0 .. nnodes-1 (0 plans)")
    ranks.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (several nodes)")
    ranks.add_argument("--master-port", type=int, default=29400,
                       help="node 0's port for the nodes' supervisors; each attempt's torchrun takes the next ones")
    sp.set_defaults(func=cmd_train)

    # `fitburst serve ...` hands its arguments to flows.serve.cli (see main); listed here for --help
    sub.add_parser("serve", help="serve every pipeline as a Prefect deployment (flags: fitburst serve -h)")

    sp = sub.add_parser("calibrate", help="fit estimator corrections from MLflow history")
    from fitburst.calibrate import add_arguments as add_calibrate_arguments

    add_calibrate_arguments(sp)
    sp.set_defaults(func=lambda a: __import__("fitburst.calibrate", fromlist=["main"]).main(a))

    sp = sub.add_parser("costs", help="rented-GPU spend per pipeline and per day, from MLflow")
    sp.add_argument("--month", type=_month, help="YYYY-MM (default: this month, UTC)")
    sp.add_argument("--tracking-uri", help="MLflow store (default: MLFLOW_TRACKING_URI, else ./mlflow.db)")
    sp.add_argument("--experiment", help="one experiment (default: every experiment in the store)")
    sp.set_defaults(func=cmd_costs)

    sp = sub.add_parser("merge", help="merge a run's adapter into its base model (base dtype)")
    sp.add_argument("run", help="run folder (runs/<pipeline>/<id>), adapter folder, or MLflow run id")
    sp.add_argument("--out", "-o", help="output folder (default: <run folder>/merged)")
    sp.set_defaults(func=cmd_merge)
    return p


HEAVY_COMMANDS = {"run", "prepare", "preflight", "train", "merge"}  # these import transformers anyway


def main(argv: list[str] | None = None) -> int:
    from fitburst import logs
    from fitburst.errors import UserError

    argv = sys.argv[1:] if argv is None else argv
    verbose = argv[:1] in (["-v"], ["--verbose"])
    if argv[verbose:verbose + 1] == ["serve"]:  # `fitburst [-v] serve ...`: flows.serve parses the rest
        logs.setup("serve", verbose=verbose)
        from flows.serve import cli as serve_cli

        return serve_cli(argv[verbose + 1:])
    args = build_parser().parse_args(argv)
    pipelines = getattr(args, "file", None)
    logs.setup(args.command, verbose=args.verbose, base=Path(pipelines).parent if pipelines else None)
    if args.command != "estimate":  # estimate's analytic answer imports neither (about 0.5 s)
        logs.route_libraries(transformers=args.command in HEAVY_COMMANDS)
    try:
        return args.func(args) or 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def entry() -> NoReturn:
    """The process's entry (the ``fitburst`` command, ``python -m fitburst.cli``): :func:`main`, in a process that
    leaves out what no command calls (:mod:`fitburst.unused_imports`; marked before anything asks, so never in a
    test's process, which calls :func:`main`), collects its garbage seldom until a model loads
    (:mod:`fitburst.collector`) and ends without the interpreter's teardown (:mod:`fitburst.quick_exit`)."""
    from fitburst.collector import collect_seldom_until_a_model_loads
    from fitburst.quick_exit import exit_after_cleanup
    from fitburst.unused_imports import NEVER_CALLED, leave_out

    leave_out(NEVER_CALLED)
    collect_seldom_until_a_model_loads()
    exit_after_cleanup(main())


if __name__ == "__main__":
    entry()

