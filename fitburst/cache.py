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
    """``dest``, built by ``build`` on first use. One build per cache: a caller in another process (a second user's
    run, another test worker) waits on a lock beside ``dest`` while the first builds (minutes of pretraining on a
    busy CPU) and then takes its folder. The build goes into a temporary folder renamed into place, so a build that
    dies leaves no half-built ``dest``."""
    if (dest / "config.json").exists():
        return dest
    from filelock import FileLock

    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(dest.parent / f".{dest.name}.lock"):
        if (dest / "config.json").exists():  # built while this caller waited
            return dest
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".build-"))
        try:
            build(tmp)
            try:
                tmp.rename(dest)
            except OSError:  # a folder a build without the lock (an older fitburst) put there first
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
