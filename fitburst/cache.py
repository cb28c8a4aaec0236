"""Where fitburst keeps what it builds: tokenized data, the locally built demo models and traced estimates
(``traces/``), under ``$FITBURST_CACHE`` (default ``~/.cache/fitburst``)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
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


def read_kept(path: Path, ttl: float | None = None) -> dict | None:
    """What :func:`keep` wrote at ``path``, or None: none kept, a file cut short, or (with ``ttl``) older than
    ``ttl`` seconds (``ttl`` 0: never kept)."""
    try:
        if ttl is not None and not (ttl > 0 and time.time() - path.stat().st_mtime < ttl):
            return None
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return kept if isinstance(kept, dict) else None


def keep(path: Path, kept: dict) -> None:
    """Write ``kept`` to ``path`` as JSON, atomically (concurrent writers leave one whole file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(kept))
    tmp.replace(path)
