"""Where fitburst keeps what it builds: tokenized data, the locally built demo models and traced estimates
(``traces/``), under ``$FITBURST_CACHE`` (default ``~/.cache/fitburst``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("FITBURST_CACHE", Path.home() / ".cache" / "fitburst"))


def build_once(dest: Path, build: Callable[[Path], None]) -> Path:
    """``dest``, built by ``build`` into a temporary folder beside it on first use and renamed into place (atomic,
    so concurrent callers are safe: the first rename wins)."""
    if (dest / "config.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".build-"))
    try:
        build(tmp)
        try:
            tmp.rename(dest)
        except OSError:  # someone else finished first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
