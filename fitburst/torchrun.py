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
store client). CUDA does not survive a fork once this process has asked the driver anything
(``torch.cuda.is_available`` asks; bitsandbytes asks as it is imported): torch then marks a forked child "in bad
fork" and refuses CUDA there. A child forked to ask tells; where it says so, the ranks are spawned fresh, as torchrun
spawns them. Ranks on CPU (gloo) are always forked; on a GPU node, as the imports of the run leave the driver.
"""

from __future__ import annotations

import os
import sys
import uuid

MODULE = "fitburst.cli"  # the one module this launcher's ranks run


def rank(argv: list[str]) -> None:
    """One forked rank: ``fitburst train`` with ``argv`` (its exit status, when not 0, ends the rank)."""
    from fitburst.cli import main

    code = main(argv)
    if code:
        sys.exit(code)


def _import_what_a_rank_imports(argv: list[str]) -> None:
    """What a rank of ``fitburst train argv`` imports before it loads its model; the packages its run never calls
    stay out (:mod:`fitburst.unused_imports`), as in a rank torchrun started."""
    from fitburst import logs
    from fitburst.cli import build_parser
    from fitburst.settings import settings_from_spec
    from fitburst.spec import load_resolved
    from fitburst.unused_imports import leave_out, unused_packages

    spec = load_resolved(build_parser().parse_args(argv).spec)
    logs.quiet_libraries()
    leave_out(unused_packages(settings_from_spec(spec)))
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
    if args.standalone:  # as torchrun's own run() sets it
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    train_args = list(args.training_script_args)
    try:
        _import_what_a_rank_imports(train_args)
    except UserError as e:  # the spec the ranks would train: refused here, as each rank would refuse it
        print(f"error: {e}", file=sys.stderr)
        return 2
    config, _, _ = config_from_args(args)
    config.start_method = start_method()
    for stream in (sys.stdout, sys.stderr):  # the ranks write through this process's streams, as written
        stream.flush()
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    try:
        elastic_launch(config, entrypoint=rank)(train_args)
    except ChildFailedError as e:  # which ranks failed, how, and where each wrote its error (torchrun's summary)
        print(e.format_msg(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # this module's own functions, not __main__'s copies: the ranks' entrypoint by its name
    from fitburst import torchrun

    sys.exit(torchrun.main())
