"""``method.init_from``: the adapter a run starts from instead of a fresh LoRA (the registered model's champion, a
``models:/`` version, or an adapter folder), found, checked against the pipeline and fetched before training.

A registered version's adapter is its source run's ``adapter`` artifact (what :meth:`Tracker.log_train` logged), and
the run's params say what it was trained as (base model, revision, method, rank); a folder says it in its
``adapter_config.json``. MLflow is read lazily; nothing here imports Prefect or torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from fitburst.errors import UserError
from fitburst.models import resolve_model_ref
from fitburst.spec import MODEL_VERSION_URI, PipelineSpec
from fitburst.tracking import CHAMPION, redact


class InitMismatch(UserError, ValueError):
    """The adapter ``method.init_from`` names cannot start this pipeline's run."""


@dataclass(frozen=True)
class InitSource:
    """Where a run starts from: ``uri`` models:/NAME/VERSION (``run_id``: its source run) or a folder's path."""

    uri: str
    run_id: str | None = None
    version: str | None = None
    model: str | None = None
    params: dict | None = None  # the source run's params (a registered version)
    digest: str | None = None  # a folder's adapter files' hash (a folder rewritten in place is another start)
    config: dict | None = None  # a folder's adapter_config.json

    @property
    def fingerprint(self) -> str:
        return f"{self.uri}#{self.digest}" if self.digest else self.uri


def resolve_init(spec: PipelineSpec, uri: str) -> InitSource | None:
    """``spec.method.init_from`` resolved to one version or folder and checked against the pipeline (InitMismatch
    names every difference and its fix), before anything is downloaded; None for ``none``, and for ``champion``
    while the registered model has no champion yet (its first run trains a fresh LoRA)."""
    src = _find(spec, uri)
    problems = mismatches(spec, src) if src is not None else []
    if problems:
        raise InitMismatch(f"{spec.name}: cannot start from {src.uri if src else '?'}:\n"
                           + "\n".join(f"  - {p}" for p in problems))
    return src


def _find(spec: PipelineSpec, uri: str) -> InitSource | None:
    init = spec.method.init_from
    if init == "none":
        return None
    folder = spec.init_folder()
    if folder is not None:
        return InitSource(str(folder.resolve()), digest=adapter_digest(folder),
                          config=json.loads((folder / "adapter_config.json").read_text()))
    from mlflow.exceptions import MlflowException  # mlflow: heavy, loaded only to read the registry
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    m = MODEL_VERSION_URI.match(f"models:/{spec.tracking.register_as}@{CHAMPION}" if init == "champion" else init)
    if m is None:
        raise InitMismatch(f"{spec.name}: method.init_from {init!r} is not models:/NAME/VERSION or "
                           "models:/NAME@ALIAS: write it so, or give an adapter folder")
    name, version, alias = str(m["name"]), m["version"], m["alias"]
    try:
        mv = client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, version)
    except MlflowException:
        if init == "champion":
            return None
        raise InitMismatch(f"{spec.name}: method.init_from {init!r}: no such registered model version in "
                           f"{redact(uri)}: check the name and version (or alias), or set init_from: none") from None
    params = dict(client.get_run(mv.run_id).data.params) if mv.run_id else {}
    return InitSource(f"models:/{name}/{mv.version}", run_id=mv.run_id, version=str(mv.version), model=name,
                      params=params)


def adapter_digest(folder: Path) -> str:
    """A hash of an adapter folder's ``adapter*`` files, names and bytes, read in chunks (a large adapter is not
    held in memory): a folder rewritten in place is another starting point."""
    h = hashlib.sha256()
    for f in sorted(f for f in folder.iterdir() if f.is_file() and f.name.startswith("adapter")):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:12]


def mismatches(spec: PipelineSpec, src: InitSource) -> list[str]:
    """What differs between the pipeline and the adapter it would start from, each with the field and the fix: a
    registered version's source run's params, a folder's adapter_config.json."""
    m, out = spec.method, []
    where = f"method.init_from {spec.method.init_from!r} ({src.uri})"
    p, cfg = src.params or {}, src.config or {}
    base = p.get("model.name") or cfg.get("base_model_name_or_path")
    if base not in (spec.model.name, resolve_model_ref(spec.model.name)):
        out.append(f"model.name is {spec.model.name!r} but {where} was trained on {base!r}: set model.name to it, "
                   "or method.init_from: none")
    if src.params is not None and p.get("model.revision", "None") != str(spec.model.revision):
        out.append(f"model.revision is {spec.model.revision!r} but {where} was trained on revision "
                   f"{p.get('model.revision')!r}: set model.revision to it, or method.init_from: none")
    if "method.type" in p and p["method.type"] != m.type:
        out.append(f"method.type is {m.type!r} but {where} was trained with {p['method.type']!r}: set method.type: "
                   f"{p['method.type']}, or method.init_from: none")
    rank = p.get("method.rank", cfg.get("r"))
    if rank is not None and int(rank) != m.rank:
        out.append(f"method.rank is {m.rank} but {where} has rank {rank}: set method.rank: {rank}, or "
                   "method.init_from: none")
    return out


def fetch_init(spec: PipelineSpec, src: InitSource, uri: str) -> PipelineSpec:
    """``spec`` starting from ``src``'s adapter folder on this machine (a registered version's source run's
    ``adapter`` artifact, downloaded into the cache once per run)."""
    if src.run_id is None:
        folder = Path(src.uri)
    else:
        import mlflow  # mlflow: heavy, loaded only to download

        from fitburst.cache import cache_root

        folder = cache_root() / "init" / src.run_id / "adapter"  # a run id names one adapter in any store
        if not (folder / "adapter_config.json").is_file():
            folder = Path(mlflow.artifacts.download_artifacts(run_id=src.run_id, artifact_path="adapter",
                                                              dst_path=str(folder.parent), tracking_uri=uri))
    if not (folder / "adapter_config.json").is_file():
        raise InitMismatch(f"{spec.name}: method.init_from {spec.method.init_from!r} ({src.uri}) holds no LoRA "
                           f"adapter (no adapter_config.json in {folder}): it was a full fine-tune, or set "
                           "init_from: none")
    return spec.with_overrides({"method.init_from": str(folder.resolve())})
