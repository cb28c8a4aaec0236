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


_HELD: dict[str, int] = {}  # run folder -> file descriptor holding its lock


def _claim(run_dir: Path) -> bool:
    """Take the folder's lock: an exclusive flock on ``.lock`` (released by the kernel when the process dies,
    so a crashed run's folder is free again at once; no stale-lock guessing)."""
    import fcntl

    fd = os.open(run_dir / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _HELD[str(run_dir)] = fd
    return True


def release(run_dir: str | Path) -> None:
    fd = _HELD.pop(str(Path(run_dir)), None)
    if fd is not None:
        os.close(fd)  # closing drops the flock


def _finished(run_dir: Path) -> bool:
    res = run_dir / "train_result.json"
    if not res.exists():
        return False
    r = json.loads(res.read_text())
    return r.get("steps", 0) >= r.get("total_steps", 1)


def _has_checkpoint(run_dir: Path) -> bool:
    return (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").glob("step-*"))


def _cloud_live(run_dir: Path) -> bool:
    """A burst whose cluster or job may still be running (fitburst.cloud's cloud.json): a rerun reattaches."""
    rec = run_dir / "cloud.json"
    return rec.exists() and json.loads(rec.read_text()).get("state") in ("launching", "running")


def open_run_dir(spec: PipelineSpec, resume: bool = True) -> tuple[Path, bool]:
    """Claim a run folder for ``spec``: the newest resumable one with the same config, else a new one.
    Returns (folder, resumed)."""
    base = runs_root(spec) / spec.name
    base.mkdir(parents=True, exist_ok=True)
    h = spec.config_hash()
    if resume:
        for d in sorted(base.glob(f"*-{h}"), reverse=True):
            if (_has_checkpoint(d) or _cloud_live(d)) and not _finished(d):
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
