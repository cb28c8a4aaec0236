"""Python's cyclic garbage collector, run less often where it only costs time: while a fitburst process starts
(imports, data preparation, the preflight) and while the preflight traces a step on fake tensors.

Both create hundreds of thousands of Python objects that stay alive (modules, classes and functions; the trace's
events and fake tensors). With CPython's default thresholds (700, 10, 10) the collector runs every 700 new objects
and, each time the heap has grown by a quarter, walks all of it, finding almost nothing to free. A demo
``fitburst run`` spent 3.5-4.0 s of its 22-24 s of CPU in 2,800 collections, most of them while it imported
transformers, MLflow and peft (benchmarks/results/suite_time.txt, stop 51). So:

- :func:`collect_seldom_until_a_model_loads`, at a process's entry: a collection every :data:`START_THRESHOLD`
  new objects, until :func:`collect_as_before` (a real model loads: :func:`fitburst.models.load_pipeline_model`);
- :func:`seldom`, around a trace: fake tensors hold no memory, and the trace's cyclic garbage is still collected.

Training and evaluation keep the thresholds the process had: a real tensor caught in a reference cycle is freed
only by the collector, and a later collection would hold its memory longer than the preflight's estimate assumes.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager

START_THRESHOLD = 100_000  # new objects between two first-generation collections (Python's default: 700)
_before: tuple[int, int, int] | None = None  # the thresholds collect_seldom_until_a_model_loads replaced


def collect_seldom_until_a_model_loads() -> None:
    """At a process's entry: the first threshold raised to :data:`START_THRESHOLD` until :func:`collect_as_before`."""
    global _before
    if _before is None:
        _before = gc.get_threshold()
        gc.set_threshold(max(START_THRESHOLD, _before[0]), *_before[1:])


def collect_seldom_in_a_flow_run() -> None:
    """In the process Prefect starts for one flow run (``python -m prefect.engine``, which sets PREFECT__FLOW_RUN_ID):
    :func:`collect_seldom_until_a_model_loads`. Anywhere else (a test's process that imports the flow), nothing."""
    if os.environ.get("PREFECT__FLOW_RUN_ID"):
        collect_seldom_until_a_model_loads()


def collect_as_before() -> None:
    """The thresholds the process had before :func:`collect_seldom_until_a_model_loads` (nothing if not raised)."""
    global _before
    if _before is not None:
        gc.set_threshold(*_before)
        _before = None


@contextmanager
def seldom() -> Iterator[None]:
    """Inside the block the first threshold at least :data:`START_THRESHOLD`; afterwards as it was."""
    before = gc.get_threshold()
    gc.set_threshold(max(START_THRESHOLD, before[0]), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
