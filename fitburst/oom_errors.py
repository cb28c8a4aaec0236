"""Which exceptions are out-of-memory errors, of which device, how much they asked for, and how to let go of what
a failed attempt held: what the OOM step-down (:mod:`fitburst.oom`), the probe and a rank's failure record share."""

from __future__ import annotations

import gc
import re
import traceback

from fitburst.ranks import RanksFailed

_CPU = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory",
        "std::bad_alloc")
_REQUESTED = re.compile(r"(?:Tried to allocate|tried to allocate) ([\d.]+) ?(bytes|[KMG]i?B)")


def oom_kind(exc: BaseException | None) -> str | None:
    """"cuda", "mps" or "cpu" when ``exc`` (or an exception it was raised from) is an out-of-memory error."""
    import torch

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RanksFailed) and exc.oom_kind:  # a rank of a sharded run ran out
            return exc.oom_kind
        if isinstance(exc, torch.OutOfMemoryError):
            return "cuda"
        if isinstance(exc, MemoryError):
            return "cpu"
        if isinstance(exc, RuntimeError):
            text = str(exc)
            if "MPS backend out of memory" in text:
                return "mps"
            if any(s in text for s in _CPU):
                return "cpu"
            if "CUDA out of memory" in text:
                return "cuda"
        exc = exc.__cause__ or exc.__context__
    return None


def requested_bytes(exc: BaseException) -> int | None:
    """The allocation that failed, when the message says ("Tried to allocate 2.00 GiB", "... 123 bytes")."""
    m = _REQUESTED.search(str(exc)) or (_REQUESTED.search(str(exc.__cause__)) if exc.__cause__ else None)
    if not m:
        return None
    unit = {"bytes": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)]
    return int(float(m.group(1)) * unit)


def free_memory(exc: BaseException) -> None:
    """Drop the failed attempt's frames (the traceback holds the model and activations) and empty the caches."""
    import torch

    seen = set()
    e: BaseException | None = exc  # then its causes and contexts down the chain
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()
