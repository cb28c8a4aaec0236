"""What a fitburst process leaves unimported: the optional packages it never calls.

Two libraries import an optional package whenever it is installed, whatever the run does with it:

- transformers imports scikit-learn's metrics for assisted generation (``generation.candidate_generator``), which
  fitburst never runs; scikit-learn is installed because MLflow requires it. Every ``fitburst`` process leaves it
  out (:func:`fitburst.cli.entry`), and so does the process Prefect starts for a deployment's flow run
  (:func:`leave_out_in_a_flow_run`, from ``flows/finetune.py``): 1.1-1.7 s of each command or flow run that loads a
  model or traces one;
- peft imports bitsandbytes (``peft.helpers``), and bitsandbytes sets up torch.compile for its CPU kernels as it
  is imported. Only a rank leaves it out, when its run uses neither 4-bit weights nor an 8-bit optimizer: a rank
  process trains exactly one run (a step-down starts new ranks with the new settings), where the supervisor and
  ``fitburst run`` may step down to QLoRA in the same process.

Together they are about a quarter of a rank's start-up CPU (a two-rank run of the demo: 20 s of CPU with them,
15 s without; ``benchmarks/results/suite_time.txt``). ``None`` in ``sys.modules`` is Python's own "not there", for
which ``importlib.util.find_spec`` answers None and ``import`` raises ImportError, so both libraries take their own
not-installed branch. That holds when it is marked before anything in the process asks whether they are installed:
transformers and peft cache the answer (``is_sklearn_available``, ``is_bnb_available``), and a cached "yes" would
meet an import that fails. So the marks are made first thing in a process's entry, never in a function a test
calls in-process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from fitburst.settings import RunSettings

NEVER_CALLED = ("sklearn",)  # by any fitburst process


def unused_packages(*runs: RunSettings) -> list[str]:
    """The optional packages a rank training each of ``runs`` never calls: :data:`NEVER_CALLED` always,
    bitsandbytes unless a run has quantized weights or an 8-bit optimizer."""
    return [*NEVER_CALLED, *([] if any(s.uses_bitsandbytes for s in runs) else ["bitsandbytes"])]


def leave_out(names: Iterable[str]) -> list[str]:
    """Mark each of ``names`` not yet imported in this process as absent; the names marked."""
    marked = [name for name in names if name not in sys.modules]
    for name in marked:
        sys.modules[name] = None  # type: ignore[assignment]
    return marked


def leave_out_in_a_flow_run() -> list[str]:
    """In the process Prefect starts for one flow run (``python -m prefect.engine``, which sets PREFECT__FLOW_RUN_ID
    and imports the flow's file before anything imports transformers), :func:`leave_out` :data:`NEVER_CALLED`; the
    names marked. Anywhere else (a test's process, one where transformers already asked), nothing."""
    if not os.environ.get("PREFECT__FLOW_RUN_ID") or "transformers" in sys.modules:
        return []
    return leave_out(NEVER_CALLED)
