"""Correction constants fitted from measured runs (``fitburst calibrate``), read by the estimator.

A small JSON file at ``$FITBURST_CACHE/calibration.json`` (default ``~/.cache/fitburst``): a multiplicative
factor per device family (cuda / mps / cpu) and per GPU name where enough runs were seen, for the figure a run's
measured peak compares with (``factor``) and, on CUDA, for the allocator's reserved figure (``reserved_factor``).
No file, no change.
Pure Python (json, os): importing it stays light.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FILE_NAME = "calibration.json"
_cache: dict[str, tuple[float, dict]] = {}


def calibration_path() -> Path:
    root = os.environ.get("FITBURST_CACHE") or str(Path.home() / ".cache" / "fitburst")
    return Path(root) / FILE_NAME


def load() -> dict:
    """The calibration file's content ({} when there is none or it cannot be read)."""
    p = calibration_path()
    try:
        mtime = p.stat().st_mtime
    except OSError:
        return {}
    hit = _cache.get(str(p))
    if hit and hit[0] == mtime:
        return hit[1]
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        data = {}
    _cache[str(p)] = (mtime, data)
    return data


def gpu_key(name: str) -> str:
    """A GPU name as runs record it ("cuda (NVIDIA A100-SXM4-80GB)", "A100-80GB") reduced to a stable key."""
    n = name.strip()
    if "(" in n and n.endswith(")"):
        n = n[n.index("(") + 1 : -1]
    return n.upper().replace("NVIDIA ", "").replace(" ", "-")


def factor_for(name: str, kind: str) -> tuple[float, str]:
    """(factor, what it was fitted on) for a device; (1.0, "") when uncalibrated."""
    data = load()
    g = data.get("gpus", {}).get(gpu_key(name))
    if g and g.get("factor"):
        return float(g["factor"]), f"{gpu_key(name)}, {g.get('n', '?')} runs"
    f = data.get("families", {}).get(kind)
    if f and f.get("factor"):
        return float(f["factor"]), f"{kind}, {f.get('n', '?')} runs"
    return 1.0, ""


def reserved_factor_for(name: str, kind: str) -> float:
    """The factor for the reserved figure: fitted on measured reserved memory (CUDA) where there is one, else the
    same as :func:`factor_for` (on CPU and MPS the measured figure is the reserved one)."""
    data = load()
    for group in (data.get("gpus", {}).get(gpu_key(name)), data.get("families", {}).get(kind)):
        if group and group.get("factor"):
            return float(group.get("reserved_factor") or group["factor"])
    return 1.0
