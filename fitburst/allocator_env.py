"""Allocator settings the seeds advised by hand, applied when fitburst is imported (before torch touches a device).

- CUDA: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (less fragmentation, so the reserved memory stays close
  to the allocated peak) unless the user configured the allocator (``PYTORCH_CUDA_ALLOC_CONF`` or torch's newer
  ``PYTORCH_ALLOC_CONF``). :func:`allocator_mode` says which mode is in force, for the estimate.
- MPS: ``PYTORCH_MPS_HIGH_WATERMARK_RATIO`` (torch's default 1.7 lets a run grow past the recommended working set
  and swap the machine to a halt) set to ``FITBURST_MPS_HIGH_WATERMARK_RATIO`` (default 1.0: fail fast with an
  out-of-memory error the step-down handles) unless the user set it.
"""

from __future__ import annotations

import os

CUDA_CONF = "PYTORCH_CUDA_ALLOC_CONF"
TORCH_CONF = "PYTORCH_ALLOC_CONF"
MPS_RATIO = "PYTORCH_MPS_HIGH_WATERMARK_RATIO"
MPS_RATIO_SETTING = "FITBURST_MPS_HIGH_WATERMARK_RATIO"
DEFAULT_MPS_RATIO = "1.0"


def configure(environ: dict | None = None) -> None:
    """Set the defaults above in ``environ`` (``os.environ``) where the user has not."""
    env = os.environ if environ is None else environ
    if CUDA_CONF not in env and TORCH_CONF not in env:
        env[CUDA_CONF] = "expandable_segments:True"
    if MPS_RATIO not in env:
        env[MPS_RATIO] = env.get(MPS_RATIO_SETTING, DEFAULT_MPS_RATIO)


def allocator_mode(environ: dict | None = None) -> str:
    """The CUDA caching allocator's mode in force: ``"expandable_segments"`` or ``"default"`` (fixed segments).
    The torch setting names (``PYTORCH_ALLOC_CONF`` wins over ``PYTORCH_CUDA_ALLOC_CONF``, as in torch)."""
    env = os.environ if environ is None else environ
    conf = env.get(TORCH_CONF) or env.get(CUDA_CONF) or ""
    options = dict(part.split(":", 1) for part in conf.replace(" ", "").split(",") if ":" in part)
    return "expandable_segments" if options.get("expandable_segments", "").lower() == "true" else "default"


def mps_high_watermark_ratio(environ: dict | None = None) -> float:
    """The MPS hard cap as a multiple of ``torch.mps.recommended_max_memory()`` (torch's default 1.7)."""
    env = os.environ if environ is None else environ
    return float(env.get(MPS_RATIO, "1.7"))
