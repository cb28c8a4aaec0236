"""torchrun for fitburst's ranks: torch's own launcher (its arguments, rendezvous and agent, unchanged) whose ranks
are forked from this process after it has imported what a rank imports.

torchrun starts every rank as a new Python that imports torch, transformers, peft and datasets again, each with a
private copy of those modules in host RAM. Here they are imported once, and each forked rank shares them
(copy-on-write) and starts at once: a two-rank run of the demo took 20.3 s of CPU through torchrun, 11.1 s here
(``benchmarks/results/suite_time.txt``).
:class:`fitburst.ranks.Ranks` starts it as ``python -m fitburst.torchrun <torchrun's arguments> -m fitburst.cli
train ...``; ``torchrun -m fitburst.cli train ...`` still works, each rank then importing on its own.

A fork is safe here because this process only imports before it forks: it runs no tensor op (no CPU thread pool
exists yet), and the agent's store and rendezvous threads are not copied into a forked rank (it opens its own
store client). Each forked rank then becomes what a new Python would be: torch's thread count from OMP_NUM_THREADS
(torchrun sets it after this process imported torch), the default signal handlers (the agent's are installed before
it forks), its output written as it prints.

CUDA does not survive a fork once this process has asked the CUDA driver anything: torch then marks a forked child
"in bad fork" and refuses CUDA there. So while it imports and reads torchrun's arguments, this process asks through
NVML (PYTORCH_NVML_BASED_CUDA_CHECK, which asks the driver nothing; torchrun's LaunchConfig asks whether CUDA is
available), and a run that uses bitsandbytes preloads nothing on a CUDA build (bitsandbytes reads each GPU's
capability as it is imported). Before it forks, a child forked to ask tells whether CUDA would be refused; if so, the
ranks are spawned fresh, as torchrun spawns them.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

MODULE = "fitburst.cli"  # the one module this launcher's ranks run


def rank(argv: list[str]) -> None:
    """One rank, forked or spawned: ``fitburst train`` with ``argv`` (its exit status, when not 0, ends the rank),
    in a process set as a new Python would be."""
    import torch

    from fitburst.cli import main

    if threads := os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(threads))
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for stream in (sys.stdout, sys.stderr):  # into ranks.log as printed, as torchrun's `python -u` ranks write
        stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    code = main(argv)
    if code:
        sys.exit(code)


@contextmanager
def cuda_asked_through_nvml() -> Iterator[None]:
    """torch's CUDA availability answered through NVML while inside (the driver, asked, would refuse CUDA to forked
    ranks); the environment as it was after."""
    before = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = before


def _import_what_a_rank_imports(argv: list[str]) -> None:
    """What a rank of ``fitburst train argv`` imports before it loads its model; the packages its run never calls
    stay out (:mod:`fitburst.unused_imports`), as in a rank torchrun started."""
    import torch

    from fitburst import logs
    from fitburst.cli import build_parser
    from fitburst.settings import settings_from_spec
    from fitburst.spec import load_resolved
    from fitburst.unused_imports import leave_out, unused_packages

    settings = settings_from_spec(load_resolved(build_parser().parse_args(argv).spec))
    logs.quiet_libraries()
    leave_out(unused_packages(settings))
    if settings.uses_bitsandbytes and torch.cuda._is_compiled():
        return  # peft would import bitsandbytes, which sets CUDA up: each rank imports for itself
    import peft  # noqa: F401  (the Recipe imports it as it builds the model)

    import fitburst.recipe  # noqa: F401


def start_method() -> str:
    """``fork``, unless a forked rank could not use CUDA: then ``spawn``."""
    return "spawn" if _cuda_refused_after_fork() else "fork"


def _cuda_refused_after_fork() -> bool:
    """Whether torch would refuse CUDA in a child forked now (this process asked the CUDA driver something): a
    child forked to ask answers in its exit status."""
    import torch

    if not torch.cuda._is_compiled():  # a CPU build: nothing to refuse
        return False
    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) != 0


def main(argv: list[str] | None = None) -> int:
    """torchrun's command line (``argv``) for ``-m fitburst.cli train ...`` ranks; the exit status: 2 when refused
    before any rank starts, 1 when a rank failed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    from fitburst.errors import UserError

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not (args.module and args.training_script == MODULE):
        print(f"error: fitburst.torchrun starts `-m {MODULE}` ranks only; for another program use torchrun",
              file=sys.stderr)
        return 2
    _rendezvous_as_torchrun_sets_it(args)
    train_args = list(args.training_script_args)
    with cuda_asked_through_nvml():
        try:
            _import_what_a_rank_imports(train_args)
        except UserError as e:  # the spec the ranks would train: refused here, as each rank would refuse it
            print(f"error: {e}", file=sys.stderr)
            return 2
        config, _, _ = config_from_args(args)
    config.start_method = start_method()
    sys.stdout.flush()  # nothing buffered here is written again by each forked rank
    sys.stderr.flush()
    try:
        elastic_launch(config, entrypoint=rank)(train_args)
    except ChildFailedError as e:  # which ranks failed, how, and where each wrote its error (torchrun's summary)
        print(e.format_msg(), file=sys.stderr)
        return 1
    return 0


def _rendezvous_as_torchrun_sets_it(args) -> None:
    """torchrun's own run(): one node's rendezvous on a free port (--standalone, or no address given)."""
    from torch.distributed.run import parse_min_max_nnodes

    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
                           and parse_min_max_nnodes(args.nnodes)[1] == 1):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


if __name__ == "__main__":  # this module's own functions, not __main__'s copies: the ranks' entrypoint by its name
    from fitburst import collector, torchrun
    from fitburst.quick_exit import exit_after_cleanup

    collector.collect_seldom_until_a_model_loads()  # forked ranks inherit it, until each loads its model
    exit_after_cleanup(torchrun.main())
