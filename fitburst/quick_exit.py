"""How a fitburst process ends: Python's own exit, less the interpreter's teardown.

Python's exit joins the non-daemon threads (and runs what libraries registered for then: Prefect drains its log
and event services there), runs the ``atexit`` handlers (logging's flush and close, MLflow's end of an active run,
Prefect's ephemeral server's stop, temporary folders), flushes stdout and stderr, and then tears the interpreter
down: every module's globals cleared and several full garbage collections over everything torch, transformers,
peft, MLflow and Prefect made. That teardown frees memory the operating system takes back anyway, and costs a
process that imported them 2.2-2.7 s of CPU on a 2-core box (benchmarks/results/suite_time.txt, stop 51): a
``fitburst`` command ends once its output is written, without it.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_after_cleanup(code: int) -> NoReturn:
    """End the process with status ``code`` after the threads, ``atexit`` handlers and flushes a normal exit runs."""
    threading._shutdown()  # type: ignore[attr-defined]  # what Python's exit runs first: join threads, their hooks
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)
