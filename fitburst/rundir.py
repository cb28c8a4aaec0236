"""Run folders: each run trains into its own folder; an interrupted run with the same config is resumed.

``<runs root>/<pipeline>/<timestamp>-<config hash>/`` holds ``run.json`` (who owns it), checkpoints, the adapter
and results. A folder is resumable when it has a checkpoint, no ``train_result.json`` with all steps done, and
no live process holding its lock, so two concurrent runs never share a folder.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

from fitburst.spec import PipelineSpec


def runs_root(spec: PipelineSpec) -> Path:
    return Path(os.environ.get("FITBURST_RUNS_DIR") or Path(spec.base_dir) / "runs")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _claim(run_dir: Path) -> bool:
    """Take the folder's lock (a file holding our pid); steal it only from a dead process."""
    lock = run_dir / ".lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            pid = int(lock.read_text() or 0)
        except (OSError, ValueError):
            pid = 0
        if pid and _alive(pid):
            return False
        lock.unlink(missing_ok=True)
        return _claim(run_dir)
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def release(run_dir: str | Path) -> None:
    lock = Path(run_dir) / ".lock"
    try:
        if lock.read_text() == str(os.getpid()):
            lock.unlink()
    except OSError:
        pass


def _finished(run_dir: Path) -> bool:
    res = run_dir / "train_result.json"
    if not res.exists():
        return False
    r = json.loads(res.read_text())
    return r.get("steps", 0) >= r.get("total_steps", 1)


def open_run_dir(spec: PipelineSpec, resume: bool = True) -> tuple[Path, bool]:
    """Claim a run folder for ``spec``: the newest resumable one with the same config, else a new one.
    Returns (folder, resumed)."""
    base = runs_root(spec) / spec.name
    base.mkdir(parents=True, exist_ok=True)
    h = spec.config_hash()
    if resume:
        for d in sorted(base.glob(f"*-{h}"), reverse=True):
            if (d / "checkpoints").is_dir() and any((d / "checkpoints").glob("step-*")) and not _finished(d):
                if _claim(d):
                    return d, True
    while True:
        d = base / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}-{h}"
        try:
            d.mkdir()
        except FileExistsError:
            continue
        _claim(d)
        (d / "run.json").write_text(json.dumps({"pipeline": spec.name, "config_hash": h, "pid": os.getpid()}))
        return d, False
