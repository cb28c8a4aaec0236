"""Where the shared measurement files live: ``--shared DIR`` / ``$FITBURST_SHARED``, else ``../shared`` beside the
repository (the checkout's or worktree's parent). A missing file stops the benchmark with a message, never a skip."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    """The folder holding ``memory/t4_dev.csv`` and ``memory/calibration.csv``."""
    return Path(os.environ.get("FITBURST_SHARED") or REPO.parent / "shared")


def shared_file(rel: str) -> Path:
    """``rel`` under :func:`shared_dir`; exits with what to set when it is not there."""
    p = shared_dir() / rel
    if not p.is_file():
        raise SystemExit(f"{p} not found: pass --shared DIR (or set FITBURST_SHARED) to the folder holding {rel}")
    return p
