"""What a rank of a sharded run leaves unimported: the optional packages its run never calls.

Two libraries import an optional package whenever it is installed, whatever the run does with it:

- peft imports bitsandbytes (``peft.helpers``), and bitsandbytes sets up torch.compile for its CPU kernels as it
  is imported;
- transformers imports scikit-learn's metrics for assisted generation (``generation.candidate_generator``);
  scikit-learn is installed because MLflow requires it.

Together they are about a quarter of a rank's start-up CPU (a two-rank run of the demo: 20 s of CPU with them,
15 s without; ``benchmarks/results/suite_time.txt``), paid by every rank of every attempt. A rank process trains
exactly one run (a step-down starts new ranks with the new settings), so what its settings never use can be left
out: ``None`` in ``sys.modules`` is Python's own "not there", for which ``importlib.util.find_spec`` answers None
and ``import`` raises ImportError, so both libraries take their own not-installed branch. That holds when it is
marked before anything in the process asks whether they are installed: transformers and peft cache the answer
(``is_sklearn_available``, ``is_bnb_available``), and a cached "yes" would meet an import that fails.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from fitburst.settings import RunSettings


def unused_packages(*runs: RunSettings) -> list[str]:
    """The optional packages a rank training each of ``runs`` never calls: scikit-learn always (a rank does not
    generate), bitsandbytes unless a run has quantized weights or an 8-bit optimizer."""
    return ["sklearn", *([] if any(s.uses_bitsandbytes for s in runs) else ["bitsandbytes"])]


def leave_out(names: Iterable[str]) -> list[str]:
    """Mark each of ``names`` not yet imported in this process as absent; the names marked."""
    marked = [name for name in names if name not in sys.modules]
    for name in marked:
        sys.modules[name] = None  # type: ignore[assignment]
    return marked
