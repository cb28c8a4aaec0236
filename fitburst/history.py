"""What earlier runs left in MLflow, read back for the next one: the fingerprint of what a run trains on (to skip a
scheduled run when nothing changed since the pipeline's last completed training) and the month's rented-GPU spend
(``burst.max_monthly_usd``, ``fitburst costs``).

MLflow is read lazily (only these functions import it); nothing here imports Prefect.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import date, datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from fitburst import __version__
from fitburst.spec import BurstSpec, ModelSpec, PipelineSpec

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

FINGERPRINT_TAG = "fitburst.fingerprint"  # the whole fingerprint; fitburst.fingerprint.<part> each part
TRAINED_TAG = "fitburst.trained"  # "true": the run trained (not a dry run, not a skipped one)
UNCHANGED_TAG = "fitburst.unchanged_since"  # a skipped run: the run whose fingerprint it matched
COST_TAG = "cloud.cost_usd"  # what a burst cost (its hours at the launched price), set when the launcher saw it end
ESTIMATE_TAG = "cloud.estimated_usd"  # the estimate a burst was launched with, set at launch
# The modules whose code decides the trained adapter: their source is the "training code version"
TRAINING_CODE = ("train.py", "recipe.py", "builders.py", "checkpoints.py", "data.py", "models.py", "settings.py",
                 "distributed.py", "families")


# --- the fingerprint -------------------------------------------------------------------------------------------

def training_code_version() -> str:
    """fitburst's version and a hash of the training modules' source (:data:`TRAINING_CODE`)."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for name in TRAINING_CODE:
        p = root / name
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            h.update(str(f.relative_to(root)).encode() + f.read_bytes())
    return f"{__version__}+{h.hexdigest()[:12]}"


def model_revision(model: ModelSpec) -> str:
    """The base model's revision as it will load: the one given; for a hub id without one, the commit the local
    hub cache resolves it to (no network); for a local folder (the demo models too), a hash of its config and
    weight files' names and sizes. "unknown" when none can be read (a hub model never downloaded)."""
    from fitburst.models import resolve_model_ref

    if model.revision:
        return model.revision
    folder = Path(resolve_model_ref(model.name)).expanduser()
    if folder.is_dir():
        h = hashlib.sha256((folder / "config.json").read_bytes() if (folder / "config.json").exists() else b"")
        for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
        return f"local:{h.hexdigest()[:12]}"
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model.name, "config.json")
    except Exception:  # noqa: BLE001 - a malformed id, an unreadable cache: nothing pinned
        hit = None
    return Path(hit).parent.name if isinstance(hit, str) else "unknown"


def fingerprint_parts(spec: PipelineSpec, data_hash: str, init_source: str | None = None) -> dict[str, str]:
    """What decides the adapter a run trains, part by part: the prepared data's content hash (the data cache's key:
    records, data settings, tokenizer), the settings, the base model and its revision, the training code, and the
    adapter it starts from. The settings are :meth:`PipelineSpec.config_hash` without the data's location and the
    starting adapter (their contents are parts of their own), so a moved data file or another GPU split is no
    change."""
    return {"data": data_hash, "settings": spec.config_hash(sources=False), "model": spec.model.name,
            "revision": model_revision(spec.model), "code": training_code_version(), "init": init_source or "none"}


def fingerprint(parts: dict[str, str]) -> str:
    """The whole fingerprint: one short hash of every part."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint_tags(parts: dict[str, str]) -> dict[str, str]:
    return {FINGERPRINT_TAG: fingerprint(parts), **{f"{FINGERPRINT_TAG}.{k}": v for k, v in parts.items()}}


@dataclass(frozen=True)
class PastRun:
    """A pipeline's last completed training in MLflow."""

    run_id: str
    started: datetime
    fingerprint: str | None
    parts: dict[str, str]

    def changed(self, parts: dict[str, str]) -> list[str]:
        """The fingerprint parts that differ from this run's (every part when it recorded none)."""
        return [k for k, v in parts.items() if self.parts.get(k) != v]


def _experiment_ids(client: MlflowClient, experiment: str | None) -> list[str]:
    if experiment is None:
        return [e.experiment_id for e in client.search_experiments()]
    exp = client.get_experiment_by_name(experiment)
    return [exp.experiment_id] if exp else []


def last_trained(uri: str, experiment: str, pipeline: str) -> PastRun | None:
    """The pipeline's most recent run that trained and finished (FINISHED, ``fitburst.trained`` true), or None."""
    from mlflow.tracking import MlflowClient  # mlflow: heavy, loaded only to read the store

    client = MlflowClient(tracking_uri=uri)
    ids = _experiment_ids(client, experiment)
    if not ids:
        return None
    found = client.search_runs(ids, f"tags.pipeline = '{pipeline}' and attributes.status = 'FINISHED' and "
                                    f"tags.`{TRAINED_TAG}` = 'true'", order_by=["attributes.start_time DESC"],
                               max_results=1)
    if not found:
        return None
    run = found[0]
    prefix = f"{FINGERPRINT_TAG}."
    parts = {k.removeprefix(prefix): v for k, v in run.data.tags.items() if k.startswith(prefix)}
    return PastRun(run.info.run_id, datetime.fromtimestamp(run.info.start_time / 1000, timezone.utc),
                   run.data.tags.get(FINGERPRINT_TAG), parts)


def unchanged_message(past: PastRun) -> str:
    return f"nothing changed since run {past.run_id} ({past.started:%Y-%m-%d %H:%M} UTC)"


# --- rented-GPU spend ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Burst:
    """One burst's cost as MLflow holds it: the actual cost when the launcher recorded it, else the estimate it was
    launched with (the node or the launcher died before the end was seen), until someone sets the actual one."""

    run_id: str
    pipeline: str
    day: date
    usd: float
    actual: bool


def month_bounds(month: str | None = None) -> tuple[datetime, datetime]:
    """[start, end) of a calendar month in UTC: ``YYYY-MM``, or this month."""
    if month is None:
        now = datetime.now(timezone.utc)
        start = datetime(now.year, now.month, 1, tzinfo=timezone.utc)
    else:
        start = datetime.strptime(month, "%Y-%m").replace(tzinfo=timezone.utc)
    end = datetime(start.year + start.month // 12, start.month % 12 + 1, 1, tzinfo=timezone.utc)
    return start, end


def month_bursts(uri: str, experiment: str | None = None, month: str | None = None) -> list[Burst]:
    """Every burst started in ``month`` (default this one) in ``experiment`` (or every experiment), dry runs left
    out, oldest first."""
    from mlflow.tracking import MlflowClient  # mlflow: heavy, loaded only to read the store

    client = MlflowClient(tracking_uri=uri)
    ids = _experiment_ids(client, experiment)
    if not ids:
        return []
    start, end = month_bounds(month)
    runs = client.search_runs(ids, f"tags.path = 'cloud' and attributes.start_time >= {int(start.timestamp() * 1000)}"
                                   f" and attributes.start_time < {int(end.timestamp() * 1000)}",
                              order_by=["attributes.start_time ASC"], max_results=50000)
    out = []
    for r in runs:
        tags = r.data.tags
        if tags.get("dry_run") == "true" or not (COST_TAG in tags or ESTIMATE_TAG in tags):
            continue
        actual = COST_TAG in tags
        out.append(Burst(r.info.run_id, tags.get("pipeline", "?"),
                         datetime.fromtimestamp(r.info.start_time / 1000, timezone.utc).date(),
                         float(tags[COST_TAG if actual else ESTIMATE_TAG]), actual))
    return out


@dataclass(frozen=True)
class Spend:
    """This month's rented-GPU spend so far: the pipeline's and every pipeline's of its experiment."""

    pipeline: float
    all: float


def month_spend(spec: PipelineSpec) -> Spend:
    from fitburst.tracking import tracking_uri

    bursts = month_bursts(tracking_uri(spec), spec.tracking.experiment)
    return Spend(round(sum(b.usd for b in bursts if b.pipeline == spec.name), 4), round(sum(b.usd for b in bursts), 4))


def monthly_budget_problems(burst: BurstSpec, spent: Spend | None, est_total_usd: float | None) -> list[str]:
    """Why a burst estimated at ``est_total_usd`` breaks ``burst.max_monthly_usd`` / ``max_monthly_usd_all``
    given what was ``spent`` this month (empty when it does not, or no monthly cap is set)."""
    caps = [(cap, so_far, field, whose) for cap, so_far, field, whose in (
        (burst.max_monthly_usd, spent.pipeline if spent else 0.0, "max_monthly_usd", "this pipeline's"),
        (burst.max_monthly_usd_all, spent.all if spent else 0.0, "max_monthly_usd_all", "every pipeline's"))
        if cap is not None]
    if caps and est_total_usd is None:
        return ["a monthly budget is set but this run's cost cannot be estimated (the data's size is unknown "
                "here, as in a dry run without the tokenizer): set training.max_steps, or unset "
                "burst.max_monthly_usd / max_monthly_usd_all"]
    return [f"{whose} rented-GPU spend this month so far ${so_far:.2f} + this run's estimated ${est_total_usd:.2f} "
            f"is over burst.{field} ${cap:.2f}" for cap, so_far, field, whose in caps
            if est_total_usd is not None and so_far + est_total_usd > cap]


def costs_table(bursts: list[Burst]) -> str:
    """``fitburst costs``: spend per pipeline, then per day and pipeline (an estimate-only burst marked ``*``)."""
    if not bursts:
        return "no bursts recorded in MLflow for this month"
    by_pipe: dict[str, list[Burst]] = {}
    by_day: dict[tuple[date, str], list[Burst]] = {}
    for b in bursts:
        by_pipe.setdefault(b.pipeline, []).append(b)
        by_day.setdefault((b.day, b.pipeline), []).append(b)

    def usd(bs: list[Burst]) -> str:
        star = "*" if any(not b.actual for b in bs) else ""
        return f"${sum(b.usd for b in bs):.2f}{star}"

    lines = [f"{'pipeline':<24} {'bursts':>6} {'spend':>10}"]
    lines += [f"{p:<24} {len(bs):>6} {usd(bs):>10}" for p, bs in sorted(by_pipe.items())]
    lines += [f"{'all':<24} {len(bursts):>6} {usd(bursts):>10}", "", f"{'day':<12} {'pipeline':<24} {'spend':>10}"]
    lines += [f"{d.isoformat():<12} {p:<24} {usd(bs):>10}" for (d, p), bs in sorted(by_day.items())]
    if any(not b.actual for b in bursts):
        lines += ["", "* includes a burst whose actual cost was never recorded (counted at its estimate; set its "
                      f"MLflow tag {COST_TAG} to correct it)"]
    return "\n".join(lines)
