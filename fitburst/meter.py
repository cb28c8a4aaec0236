"""Measured memory peaks of a run, for the device it ran on (what the estimate is compared with).

- CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` after ``reset_peak_memory_stats``.
- MPS: no peak counter; ``torch.mps.driver_allocated_memory()`` is sampled every step.
- CPU: the process high-water mark (VmHWM, reset through /proc/self/clear_refs) minus the resident size at the start,
  taken after the training stack (transformers, peft; bitsandbytes where the process may use it) is imported, so the
  figure is what the run adds: weights, training tensors, glibc slack and the first step's runtime heap. That is what
  the estimate's ``reserved_peak_bytes`` models on CPU (``fitburst.memory.Estimate.comparable_bytes``). fitburst does
  not pin glibc (MALLOC_MMAP_THRESHOLD_=131072 brings VmHWM within a few % of tensor bytes but made the demo's steps
  ~35 % slower); the method string says which allocator mode a figure was taken under.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


def _warm_imports() -> None:
    import importlib

    for mod in ("transformers", "peft", "bitsandbytes"):
        try:
            importlib.import_module(mod)
        except Exception:  # optional parts of the stack (bitsandbytes) may be missing or fail to load
            pass


@dataclass
class MemoryPeak:
    kind: str
    allocated_bytes: int | None = None  # CUDA allocator peak; MPS driver peak; CPU: RSS high-water minus start
    reserved_bytes: int | None = None   # CUDA reserved peak
    rss_peak_bytes: int | None = None   # process high-water mark (CPU and MPS unified memory)
    method: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc malloc_trim), so memory the process freed earlier cannot
    be reused silently by the run and hide its growth from the high-water mark."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class MemoryMeter:
    """Reset at the start of a run, ``sample()`` per step, ``peak()`` at the end."""

    def __init__(self, device: str):
        self.kind = device.split(":")[0]
        self._mps_peak = 0
        self._rss_start = 0

    def reset(self) -> None:
        import torch

        if self.kind == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:  # RSS-based figures: import the stack first so its code and data are not counted as the run's
            _warm_imports()
            _trim_heap()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self._rss_start = _status_kib("VmRSS") or 0
        self._mps_peak = 0

    def sample(self) -> None:
        if self.kind == "mps":
            import torch

            self._mps_peak = max(self._mps_peak, torch.mps.driver_allocated_memory())

    def peak(self) -> MemoryPeak:
        import torch

        hwm = _status_kib("VmHWM")
        if self.kind == "cuda":
            return MemoryPeak("cuda", torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), hwm,
                              "torch.cuda.max_memory_allocated/reserved")
        if self.kind == "mps":
            self.sample()
            return MemoryPeak("mps", self._mps_peak, None, hwm, "sampled torch.mps.driver_allocated_memory")
        pinned = os.environ.get("MALLOC_MMAP_THRESHOLD_") == "131072"
        return MemoryPeak("cpu", max(0, (hwm or 0) - self._rss_start), None, hwm,
                          "VmHWM - start RSS" + (" (glibc mmap threshold pinned)" if pinned else " (unpinned malloc)"))
