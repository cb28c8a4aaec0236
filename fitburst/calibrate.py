"""`fitburst calibrate`: fit the estimator's correction constants from MLflow run history (read by
:func:`fitburst.tracking.memory_runs`).

Every run records the estimate (``memory.estimated_*``, from the preflight) and the measured peak
(``memory.measured_peak_bytes``, from the meter), with tags ``path`` (local | cloud) and ``device``. Per device
family (cuda / mps / cpu), and per GPU name once it has ``--min-runs`` runs, the correction is the median of
measured / estimated, where "estimated" is the figure the meter's measurement compares with on that kind
(``memory.estimated_comparable_bytes``; else allocated on CUDA, reserved on CPU and MPS), with the calibration
factor the estimate already carried divided out; on CUDA reserved memory gets its own factor. Out-of-memory
step-downs (``oom_history.jsonl``) set a floor: a group's factor is never below measured peak / estimate of a
configuration that ran out of memory, so a calibrated preflight does not pass it again. The result goes to
``$FITBURST_CACHE/calibration.json``, which :func:`fitburst.memory.estimate` applies.

A factor is written only where it makes the fit's own reported errors no worse: the median ratio, else the factor
that minimises the worst error, else 1.0 (kept). Runs whose comparable figure on CPU or MPS is mostly the runtime
heap rather than tensors (estimated tensor bytes under half of it, e.g. the tiny demo: 11 of 43 MiB) are left out:
their measured RSS growth is the process's runtime heap, which depends on what ran before in that process (the
demo measures ~31 MiB in the flow, after the preflight's trace warmed torch, and ~75 MiB in a fresh `fitburst
train`), so a multiplicative factor fitted on them says nothing about the model and would scale every estimate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from fitburst.hardware import resolve_device
from fitburst.memory.calibration import OOM_HISTORY_FILE, calibration_path, gpu_key
from fitburst.memory.estimator import MEASURED_COUNTERPART

if TYPE_CHECKING:
    from fitburst.tracking import RunRecord

KINDS = ("cuda", "mps", "cpu")
TENSOR_SHARE = 0.5  # on CPU / MPS, a run calibrates only when tensors are at least this share of its figure
_FALLBACK = {k: "memory.estimated_" + v.split("_")[0] + "_bytes" for k, v in MEASURED_COUNTERPART.items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experiment", default=None, help="MLflow experiment (default: all experiments)")
    p.add_argument("--tracking-uri", default=None, help="MLflow store (default: MLFLOW_TRACKING_URI or ./mlflow.db)")
    p.add_argument("--min-runs", type=int, default=3, help="runs needed for a per-GPU constant (default 3)")
    p.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    p.add_argument("--json", action="store_true", help="print the fit as JSON")


def _kind(device: str) -> str | None:
    d = (device or "").strip().lower()
    for k in KINDS:
        if d.startswith(k):
            return k
    try:
        return resolve_device(device).kind if device else None
    except ValueError:
        return None


def collect(runs: Iterable[RunRecord]) -> list[dict]:
    """One record per run (:func:`fitburst.tracking.memory_runs`) with an estimate and a measurement: kind, gpu,
    path, ratio (measured / the uncalibrated estimate: the factor the run's estimate already carried,
    ``memory.calibration_factor``, is divided out, so fitting again on runs made with a fitted file gives the same
    factor), and on CUDA the same for the reserved figure (``reserved_ratio``) when the run measured it."""
    out: list[dict] = []
    for run in runs:
        m, t = run["metrics"], run["tags"]
        kind = _kind(t.get("device", ""))
        if kind is None:
            continue
        est = m.get("memory.estimated_comparable_bytes") or m.get(_FALLBACK[kind])
        measured = m["memory.measured_peak_bytes"]
        if not est:
            continue
        applied = m.get("memory.calibration_factor") or 1.0
        raw = est / applied
        gpu = t.get("cloud.gpu") or t.get("gpu") or (t.get("device") if "(" in t.get("device", "") else "")
        tensors = m.get("memory.estimated_allocated_bytes")
        rec = dict(run_id=run["run_id"], kind=kind, gpu=gpu_key(gpu) if gpu and kind == "cuda" else "",
                   path=t.get("path", "local"), estimated=raw, measured=measured, ratio=measured / raw,
                   reserved_ratio=None,
                   heap_dominated=kind != "cuda" and tensors is not None and 0 < tensors < TENSOR_SHARE * est)
        est_r, meas_r = m.get("memory.estimated_reserved_bytes"), m.get("memory.measured_reserved_bytes")
        if kind == "cuda" and est_r and meas_r:
            rec["reserved_ratio"] = meas_r / (est_r / (m.get("memory.calibration_reserved_factor") or applied))
        out.append(rec)
    return out


def collect_ooms(path: Path | None = None) -> list[dict]:
    """One record per out-of-memory step-down in ``oom_history.jsonl`` (written by fitburst.supervisor beside the
    calibration file) that carries an uncalibrated estimate: kind, gpu and ``floor``, the measured peak over the
    estimate. The run needed at least its measured peak, so a fitted factor is never below a floor."""
    path = path or calibration_path().with_name(OOM_HISTORY_FILE)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash mid-write
            continue
        est, measured = r.get("estimated_bytes"), r.get("measured_peak_bytes")
        kind = _kind(r.get("device", ""))
        if not est or not measured or kind is None:
            continue
        name = r.get("device_name", "")
        out.append(dict(kind=kind, gpu=gpu_key(name) if kind == "cuda" and name else "", floor=measured / est,
                        pipeline=r.get("pipeline", "")))
    return out


def _errors(ratios: list[float], factor: float) -> dict:
    errs = [abs(factor / r - 1) for r in ratios]  # |estimate x factor / measured - 1|
    return {"median": statistics.median(errs), "worst": max(errs)}


def _no_worse(ratios: list[float]) -> tuple[float, str]:
    """The factor to write and how it was chosen: the median ratio, else the one that minimises the worst error
    (equal errors at the two extreme ratios), whichever first leaves both the median and the worst error no worse
    than no factor; else 1.0."""
    before = _errors(ratios, 1.0)
    minimax = 2 / (1 / min(ratios) + 1 / max(ratios))
    for f, how in ((statistics.median(ratios), "median"), (minimax, "least worst error")):
        after = _errors(ratios, f)
        if after["median"] <= before["median"] + 1e-12 and after["worst"] <= before["worst"] + 1e-12:
            return f, how
    return 1.0, "kept 1.0: no factor lowers the errors"


def fit(records: list[dict], min_runs: int = 3, ooms: list[dict] | None = None) -> dict:
    """{"families": {kind: {...}}, "gpus": {name: {...}}}, each with factor, how it was chosen, n, before and
    after errors (errors against the uncalibrated estimate), and reserved_factor where reserved memory was
    measured. Out-of-memory records (:func:`collect_ooms`) of a group raise its factor to their highest floor
    (``oom_floor``): a configuration that ran out of memory must not pass again. Heap-dominated runs are left out
    (``skipped`` says how many)."""
    floors: dict[str, list[float]] = defaultdict(list)
    for o in ooms or []:
        floors[o["kind"]].append(o["floor"])
        if o["gpu"]:
            floors["gpu:" + o["gpu"]].append(o["floor"])
    skipped = sum(1 for r in records if r.get("heap_dominated"))
    records = [r for r in records if not r.get("heap_dominated")]

    def one(rs: list[dict], key: str) -> dict:
        ratios = [r["ratio"] for r in rs]
        f, how = _no_worse(ratios)
        paths = sorted({r["path"] for r in rs})
        if floors[key] and max(floors[key]) > f:
            f, how = max(floors[key]), "out-of-memory floor"
        g = {"factor": round(f, 4), "chosen": how, "n": len(rs), "paths": paths, "before": _errors(ratios, 1.0),
             "after": _errors(ratios, f)}
        if floors[key]:
            g["oom_n"], g["oom_floor"] = len(floors[key]), round(max(floors[key]), 4)
        reserved = [r["reserved_ratio"] for r in rs if r.get("reserved_ratio")]
        if reserved:
            g["reserved_factor"] = round(_no_worse(reserved)[0], 4)
            g["reserved_n"] = len(reserved)
        return g

    fam, gpus = defaultdict(list), defaultdict(list)
    for r in records:
        fam[r["kind"]].append(r)
        if r["gpu"]:
            gpus[r["gpu"]].append(r)
    return {"version": 2, "fitted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "skipped": skipped,
            "families": {k: one(v, k) for k, v in sorted(fam.items())},
            "gpus": {k: one(v, "gpu:" + k) for k, v in sorted(gpus.items()) if len(v) >= min_runs}}


def main(args) -> int:
    # tracking (and the data and model modules it imports) stays off CLI startup: cli.py imports this module
    # to build its parser
    from fitburst.tracking import memory_runs, tracking_uri

    uri = getattr(args, "tracking_uri", None) or tracking_uri()
    records = collect(memory_runs(uri, getattr(args, "experiment", None)))
    ooms = collect_ooms()
    result = fit(records, getattr(args, "min_runs", 3), ooms)
    path = calibration_path()
    if getattr(args, "json", False):
        print(json.dumps(result, indent=2))
    else:
        print(f"{len(records)} runs with estimated and measured peaks in {uri}; "
              f"{len(ooms)} out-of-memory records in {calibration_path().with_name(OOM_HISTORY_FILE)}")
        if result["skipped"]:
            print(f"{result['skipped']} CPU/MPS runs left out: their peak is mostly the runtime heap (estimated "
                  f"tensors under {TENSOR_SHARE:.0%} of it), which a factor on the model cannot correct")
        print(f"{'group':24s} {'runs':>5s} {'factor':>7s}  {'before median/worst':>20s}  {'after median/worst':>19s}"
              "  chosen by")
        for scope, groups in (("", result["families"]), ("gpu ", result["gpus"])):
            for k, g in groups.items():
                b, a = g["before"], g["after"]
                print(f"{scope + k:24s} {g['n']:5d} {g['factor']:7.3f}  {b['median']:9.1%} / {b['worst']:7.1%}"
                      f"  {a['median']:8.1%} / {a['worst']:7.1%}  {g['chosen']}")
    if not result["families"]:
        print("nothing to fit: no run has both memory.measured_peak_bytes and an estimate that tensors dominate")
        return 1
    if getattr(args, "dry_run", False):
        print(f"dry run: {path} not written")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(path)
    print(f"wrote {path}")
    return 0
