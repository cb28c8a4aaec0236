"""Traced estimates kept on disk, keyed by everything that decides them: the model's config, the run's settings,
the sequence length, the device, the library versions and the source of the code that traces.

`fitburst estimate --exact`, the preflight and the planner share it, so a nightly preflight of an unchanged
pipeline traces nothing. A change of fitburst's tracing code, of torch, transformers, peft or bitsandbytes, or of
the model's config.json makes a new key: a stale figure is never served. ``FITBURST_TRACE_CACHE=0`` traces every
time (the test suite sets it: its tests patch kernel rules that no key can see).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

from fitburst.cache import cache_root
from fitburst.hardware import Device
from fitburst.settings import RunSettings

from .estimator import Estimate

log = logging.getLogger(__name__)

# the code a traced figure depends on: the trace and its kernel rules, the model loading and the training step
_CODE = ("memory/trace.py", "memory/recorder.py", "memory/trace_events.py", "memory/sharded.py",
         "memory/allocator.py", "memory/cuda_kernels.py", "memory/mps_kernels.py", "memory/autocast_policy.py",
         "memory/estimator.py", "memory/params.py", "memory/loss_kernels.py", "memory/model_kernels.py",
         "hardware.py", "models.py", "builders.py", "train.py", "pace.py", "distributed.py", "device.py", "settings.py",
         "families/*.py")
_LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "liger-kernel")


@functools.cache
def _fingerprint() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for pattern in _CODE:
        for path in sorted(root.glob(pattern)):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    for lib in _LIBRARIES:
        try:
            h.update(f"{lib}=={metadata.version(lib)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{lib} missing".encode())
    return h.hexdigest()


def key(config: dict, settings: RunSettings, seq_len: int, device: Device, **step: object) -> str:
    """The cache key of one traced estimate; ``step``: the spec's other fields the traced step reads."""
    # a card traces alike planned from here or trained on here (Device.local): one entry for both
    dev = {k: v for k, v in asdict(device).items() if k != "local"}
    doc = {"config": config, "settings": asdict(settings), "seq_len": seq_len, "device": dev, "step": step,
           "code": _fingerprint()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _path(k: str) -> Path:
    return cache_root() / "traces" / f"{k}.json"


def enabled() -> bool:
    return os.environ.get("FITBURST_TRACE_CACHE", "1") != "0"


def load(k: str) -> Estimate | None:
    if not enabled():
        return None
    p = _path(k)
    try:
        return Estimate.from_dict(json.loads(p.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:  # a file cut short by a crash: trace again
        log.debug("ignoring unreadable trace cache %s (%s)", p, e)
        return None


def store(k: str, est: Estimate) -> None:
    if not enabled():
        return
    p = _path(k)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(est.to_dict()))
    tmp.replace(p)  # atomic: a reader sees the old file or the whole new one
