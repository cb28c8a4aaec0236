"""The SkyPilot task for one burst run: train.yaml (package data), filled in with resources, envs, mounts, secrets
and a staged workdir holding only the fitburst package."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from importlib import metadata, resources
from pathlib import Path
from typing import Any

import yaml

import fitburst
from fitburst.cloud.rank import Candidate
from fitburst.errors import UserError
from fitburst.hardware import NODE_PACKAGES, SKY_CLOUD, SKY_NAMES
from fitburst.spec import ENV_REF, PipelineSpec

TASK_YAML = Path(str(resources.files("fitburst.cloud").joinpath("train.yaml")))  # package data: works from pip
JOB_DIR = "fitburst-job"  # relative to $HOME on the node; matches FITBURST_JOB_DIR in train.yaml
STOPPABLE = ("aws", "gcp", "azure")  # can stop a cluster (disk kept); RunPod and Lambda can only tear down
# what never goes to the node: local state, caches and anything that may hold a secret
# (the same list as the checkout's .skyignore)
WORKDIR_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".env", ".env.*", "*.pem", "*.egg-info", "build",
                                        ".pytest_cache", ".ruff_cache", "runs", "mlruns", "mlflow.db", ".venv*",
                                        ".fitburst", ".git")
# Secrets taken from the launcher's environment when set (never written to YAML, logs or MLflow): the model hub
# token only. The tracking server's credentials go only when the node logs to it; artifacts then travel through
# the server (`mlflow server` proxies its artifact store), so no raw cloud keys (AWS_*, GOOGLE_*, ...) ever leave.
SECRET_ENV = [
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
]
REMOTE_TRACKING_SECRET_ENV = [
    "MLFLOW_TRACKING_URI",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
]


class BurstError(UserError, RuntimeError):
    """A burst run that cannot start or did not finish; the message says what to do."""


class BudgetError(BurstError):
    """Every candidate breaks the policy's cost caps: refused before any cluster exists."""


def node_packages() -> str:
    """pip requirements for the node, pinned to the launcher's versions so both run the same stack."""
    reqs = []
    for name in NODE_PACKAGES:
        try:
            version = metadata.version(name).split("+")[0]  # 2.13.0+cpu -> 2.13.0 (CUDA build on the node)
            reqs.append(f"{name}=={version}")
        except metadata.PackageNotFoundError:
            reqs.append(name)
    return " ".join(reqs)


def remote_tracking_uri() -> str | None:
    """MLFLOW_TRACKING_URI when a cloud node could reach it (http(s) or databricks), else None."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    host = re.sub(r"^https?://([^@/]*@)?", "", uri).split("/")[0].split(":")[0]
    if uri.startswith(("http://", "https://")) and host not in ("localhost", "127.0.0.1", "0.0.0.0", "::1"):
        return uri
    if uri.startswith("databricks"):
        return uri
    return None


def collect_secrets(spec: PipelineSpec, remote_tracking: bool) -> dict[str, str]:
    """Secret values from the environment: the model's ${ENV} token reference, HF and MLflow credentials."""
    names = list(SECRET_ENV)
    ref = ENV_REF.match(spec.model.hf_token or "")
    if ref:
        names.insert(0, ref.group(1))
    if remote_tracking:
        names += REMOTE_TRACKING_SECRET_ENV
    return {n: os.environ[n] for n in dict.fromkeys(names) if os.environ.get(n)}


def usable(candidates: list[Candidate]) -> list[Candidate]:
    return [c for c in candidates if c.usable]


def check_budget(spec: PipelineSpec, candidates: list[Candidate]) -> list[Candidate]:
    """The candidates a launch may use; raise BudgetError / BurstError (before any cluster exists) if none."""
    candidates = [Candidate.from_dict(c) for c in candidates]
    if not candidates:
        raise BurstError(
            f"no GPU candidates: none of {spec.burst.gpus} is offered by {spec.burst.providers} "
            "(T4 is sold by aws/gcp/azure, not RunPod or Lambda); widen burst.gpus or burst.providers"
        )
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        tried = "; ".join(f"{c.label()}: {c.reason or 'does not fit'}" for c in candidates)
        raise BurstError(
            f"the run fits none of the burst GPUs ({tried}); add a larger GPU to burst.gpus "
            "(e.g. A100-80GB) or let the planner change more (preflight.allow)"
        )
    ok = usable(candidates)
    if not ok:
        why = "; ".join(f"{c.label()}: {c.reason}" for c in fitting)
        raise BudgetError(
            f"refused before launch: every fitting GPU breaks the burst budget ({why}); "
            "raise burst.max_hourly_usd / burst.max_total_usd / burst.max_monthly_usd or shorten the run"
        )
    return ok


def sky_resources(candidates: list[Candidate], spot: bool, autostop_minutes: int, bucket: str | None = None,
                  gpus_per_node: int = 1) -> list[dict]:
    """Resource configs (YAML form) for ``ordered``: one per usable candidate, cheapest total first, each with
    ``gpus_per_node`` of its GPU (``accelerators: <GPU>:N``).

    Autostop is the second guard after fitburst's own teardown. It stops (keeps the disk, so a rerun can still
    collect the outputs) where the provider can; it tears down where the outputs are safe in ``bucket`` or the
    provider cannot stop (RunPod, Lambda: there the outputs wait ``autostop_minutes`` for a rerun)."""
    out = []
    for c in candidates:
        r: dict[str, Any] = {
            "infra": SKY_CLOUD[c.provider].lower(),
            # the candidate's own count (the planner's per GPU type), else the task's
            "accelerators": {c.accelerator: c.gpus_per_node if c.gpus_per_node > 1 else gpus_per_node},
            "use_spot": spot,
            "disk_size": 100,
        }
        if not spot:
            r["autostop"] = {"idle_minutes": autostop_minutes,
                             "down": bucket is not None or c.provider not in STOPPABLE}
        out.append(r)
    return out


def build_task(
    spec: PipelineSpec,
    candidates: list[Candidate],
    *,
    prepared_dir: str | os.PathLike | None = None,
    spec_path: str | os.PathLike | None = None,
    mlflow_run_id: str | None = None,
    workdir: str | os.PathLike | None = None,
    task_yaml: str | os.PathLike = TASK_YAML,
    run_name: str | None = None,
    checkpoints: str | os.PathLike | None = None,
    gpus_per_node: int = 1,
    nodes: int = 1,
):
    """Load train.yaml with SkyPilot's Task.from_yaml and fill it in for ``spec`` on ``candidates``.

    ``gpus_per_node`` x ``nodes``: the GPUs the run is sharded over (the plan's choice; 1 x 1: one GPU, the task as
    it always was). More than one: each resource asks for ``<GPU>:gpus_per_node`` (a candidate planned over several
    GPUs, for its own count), the task for ``nodes`` nodes, and train.yaml's run block starts torchrun on every node
    from SkyPilot's node variables, with ``training.distributed: fsdp`` in the node's spec. A candidate planned
    over several GPUs on another number of nodes is left out: SkyPilot's task has one ``num_nodes`` for all its
    resources.

    ``spec_path``: the resolved spec to mount and ``workdir``: the staged package (written into a new temp folder
    when None; the caller deletes it: burst_train passes its own, removed after the launch).
    ``prepared_dir``: the prepared data to mount. ``mlflow_run_id``: with a reachable MLFLOW_TRACKING_URI the
    node logs into that run directly (URI and credentials go as secrets); otherwise outputs are pulled back.
    ``run_name``: the local run folder's name; with ``burst.bucket`` the node's RUN_DIR is
    :func:`bucket_url` of it, mounted MOUNT_CACHED. ``checkpoints``: a local checkpoints folder (of a run that
    failed or was pulled home) to mount into RUN_DIR, so the node resumes from it.
    """
    import sky  # sky: heavy, only the burst path loads it

    if gpus_per_node < 1 or nodes < 1:
        raise ValueError(f"gpus_per_node and nodes must be >= 1 (got {gpus_per_node} x {nodes})")
    ok = check_budget(spec, candidates)
    task = sky.Task.from_yaml(str(task_yaml))
    task.name = _task_name(spec)
    task.num_nodes = nodes
    if spec_path is None or workdir is None:
        tmp = tempfile.mkdtemp(prefix="fitburst-task-")
        spec_path = spec_path or write_node_spec(spec, tmp, sharded=gpus_per_node * nodes > 1)
        workdir = workdir or stage_workdir(Path(tmp) / "workdir")
    task.update_workdir(str(workdir), None, None)
    mounts = {f"~/{JOB_DIR}/spec.yaml": str(Path(spec_path).resolve())}
    if prepared_dir is not None:
        mounts[f"~/{JOB_DIR}/prepared"] = str(Path(prepared_dir).resolve())
    if checkpoints is not None:
        mounts[f"~/{JOB_DIR}/run/checkpoints"] = str(Path(checkpoints).resolve())
    task.set_file_mounts(mounts)
    remote = remote_tracking_uri() if mlflow_run_id else None
    envs = {
        "FITBURST_JOB_DIR": JOB_DIR,
        "FITBURST_NODE_PACKAGES": node_packages(),
        "FITBURST_PIPELINE": spec.name,
        "FITBURST_GPU": ok[0].gpu,
        "FITBURST_PROVIDER": ok[0].provider,
    }
    if remote and mlflow_run_id:
        envs["FITBURST_MLFLOW_RUN_ID"] = mlflow_run_id
    task.update_envs(envs)
    secrets = collect_secrets(spec, remote_tracking=bool(remote))
    if secrets:
        task.update_secrets(secrets)
    if spec.burst.bucket:
        url = bucket_url(spec, run_name or "run")
        task.set_storage_mounts({f"~/{JOB_DIR}/run": sky.Storage(source=url, mode=sky.StorageMode.MOUNT_CACHED)})
    # one task has one node count: a candidate planned over another number of nodes cannot stand in for the best
    same = [c for c in ok if c.nodes == nodes or c.world_size == 1]
    resources = sky_resources(same, spec.burst.spot, spec.burst.autostop_minutes, spec.burst.bucket, gpus_per_node)
    task.set_resources(sky.Resources.from_yaml_config({"ordered": resources}))
    return task


def bucket_url(spec: PipelineSpec, run_name: str) -> str:
    """Where one run's RUN_DIR lives in ``burst.bucket``: ``<bucket>/<pipeline>/<run folder name>``."""
    if spec.burst.bucket is None:
        raise ValueError(f"{spec.name}: burst.bucket is not set")
    return f"{spec.burst.bucket.rstrip('/')}/{spec.name}/{run_name}"


def stage_workdir(dest: str | os.PathLike, package: str | os.PathLike | None = None) -> Path:
    """A workdir holding a copy of the ``fitburst`` package (``package``: the installed one) and nothing else
    (the node runs it with PYTHONPATH=workdir), so a `pip install` bursts like a checkout and no .env, cache or
    run folder is uploaded."""
    dest = Path(dest)
    shutil.copytree(package or Path(fitburst.__file__).parent, dest / "fitburst", ignore=WORKDIR_IGNORE)
    return dest


def node_spec(spec: PipelineSpec, sharded: bool = False) -> PipelineSpec:
    """The spec the node trains from: its own device (``preflight.device: auto``, not the launcher's cpu/MPS/...)
    and no tracking URI (the node gets MLFLOW_TRACKING_URI as a SkyPilot secret; a URI may hold user:pass@);
    ``sharded`` (several GPUs): ``training.distributed: fsdp``. A spec, not :class:`fitburst.settings.RunSettings`:
    the node plans for its own card (``fitburst train --plan``), so ``training.precision: auto`` must reach it
    unresolved (RunSettings holds a resolved precision: bf16 with no device, which a T4 cannot run), and neither
    field it changes besides ``distributed`` is a run setting."""
    training = spec.training.model_copy(update={"distributed": "fsdp"}) if sharded else spec.training
    return spec.model_copy(
        update={
            "preflight": spec.preflight.model_copy(update={"device": "auto"}),
            "tracking": spec.tracking.model_copy(update={"uri": None}),
            "training": training,
        }
    )


def write_node_spec(spec: PipelineSpec, directory: str | os.PathLike, sharded: bool = False) -> Path:
    """``node_spec(spec, sharded)`` as YAML in ``directory`` (the file mounted at ~/fitburst-job/spec.yaml)."""
    path = Path(directory) / "spec.yaml"
    path.write_text(node_spec(spec, sharded).to_yaml())
    return path


def _task_name(spec: PipelineSpec) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", f"fitburst-{spec.name}".lower()).strip("-")
    return name[:40].rstrip("-")


def task_yaml(task) -> str:
    """The task as SkyPilot YAML with secret values redacted (what dry-run prints and MLflow may store)."""
    from sky.task import redact_task_yaml_dict  # sky: heavy, only the burst path loads it

    config = task.to_yaml_config()
    config.pop("_user_specified_yaml", None)  # the raw sky/train.yaml, already shown as setup/run
    redact_task_yaml_dict(config)
    return yaml.dump(config, Dumper=_BlockDumper, sort_keys=False)


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (setup, run) as literal blocks, so the printed task reads like sky/train.yaml."""


def _str(dumper: yaml.SafeDumper, s: str):
    if "\n" in s:
        s = "\n".join(line.rstrip() for line in s.split("\n"))
        return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", s)


_BlockDumper.add_representer(str, _str)


def dry_run_report(
    spec: PipelineSpec,
    candidates: list[Candidate],
    task=None,
    *,
    local: dict | None = None,
    optimizer_pick: str | None = None,
) -> str:
    """What a burst would do, without launching: local vs cloud side by side, the pick, cost, task YAML.

    ``local``: ``{"device": ..., "fits": ..., "hours": ...}`` for the comparison row.
    """
    candidates = [Candidate.from_dict(c) for c in candidates]
    lines = [
        f"burst plan for pipeline '{spec.name}' (policy {spec.burst.policy}, "
        f"{'spot' if spec.burst.spot else 'on-demand'})"
    ]
    head = f"  {'where':<34} {'fits':<5} {'$/h':>7} {'hours':>7} {'total $':>8}  notes"
    lines.append(head)
    if local:
        hours = local.get("hours")
        lines.append(
            f"  {'local ' + str(local.get('device', '')):<34} {_yn(local.get('fits')):<5} {'-':>7} "
            f"{_num(hours):>7} {'-':>8}  {local.get('note', '')}"
        )
    for c in candidates:
        notes = c.reason if not c.usable else ", ".join(c.changes)
        if c.price_source and c.price_source != "skypilot-catalog":
            notes = (notes + "; " if notes else "") + f"price from {c.price_source}"
        lines.append(
            f"  {c.label():<34} {_yn(c.fits):<5} {_num(c.hourly_usd):>7} {_num(c.est_hours):>7} "
            f"{_num(c.est_total_usd):>8}  {notes}"
        )
    offered = {c.gpu for c in candidates}
    for gpu in spec.burst.gpu_names():
        if gpu not in offered and gpu in SKY_NAMES:
            lines.append(
                f"  {gpu}: not offered by {', '.join(spec.burst.providers)} "
                f"(sold by {', '.join(SKY_NAMES[gpu])})"
            )
    ok = usable(candidates)
    if ok:
        best = ok[0]
        total = (
            f"~${best.est_total_usd:.2f}" if best.est_total_usd is not None else "unknown (no token count)"
        )
        lines.append(
            f"chosen: {best.gpus_label()} on {best.provider} as {best.accelerator}, ${best.hourly_usd:.2f}/h, "
            f"~{_num(best.est_hours)} h, total {total}; then in order: "
            + (", ".join(c.label() for c in ok[1:]) or "none")
        )
        if optimizer_pick:
            lines.append(f"SkyPilot optimizer pick: {optimizer_pick}")
        caps = [
            f"max_hourly_usd ${spec.burst.max_hourly_usd:g}" if spec.burst.max_hourly_usd else "",
            f"max_total_usd ${spec.burst.max_total_usd:g}" if spec.burst.max_total_usd else "",
        ]
        lines.append(
            "budget: "
            + (", ".join(filter(None, caps)) or "no caps set")
            + f"; autostop (down) after {spec.burst.autostop_minutes} idle minutes"
        )
    else:
        lines.append("no usable candidate: " + "; ".join(f"{c.label()}: {c.reason}" for c in candidates))
    if task is not None:
        lines += ["", "SkyPilot task (secrets redacted):", task_yaml(task)]
    return "\n".join(lines)


def _yn(v: Any) -> str:
    return "?" if v is None else ("yes" if v else "no")


def _num(v: Any) -> str:
    return "?" if v is None else f"{v:.2f}"
