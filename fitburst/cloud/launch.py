"""Launch one burst run, stream its logs, bring the outputs home, and always tear the cluster down.

Two lifecycles (both through SkyPilot's client SDK):
- on-demand: a cluster. ``sky.launch`` (autostop as a second guard) -> ``sky.tail_logs`` (follow; 0 success,
  100 failure) -> ``sky.job_status`` -> rsync ``~/fitburst-job/run`` back -> ``sky.down``. The pull runs before
  the teardown on every exit path (success, failed job, exception, Ctrl-C, Prefect cancellation), so the
  checkpoints of a failed run come home and a rerun resumes them (they travel back to the next node).
- spot: a managed job (``sky.jobs.launch``) whose RUN_DIR is ``burst.bucket`` (MOUNT_CACHED), so a restart after
  preemption resumes from the newest checkpoint; it tears its own cluster down; fitburst cancels it on any
  error or interrupt and syncs the bucket home.

The cluster and job ids are written to ``<run folder>/cloud.json`` (and MLflow tags, through ``on_ids``) as soon
as they exist: a rerun on the same run folder after the launcher died reattaches to the running job, or collects
a finished one, instead of launching again.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fitburst.cloud.rank import Candidate
from fitburst.cloud.task import (
    JOB_DIR,
    STOPPABLE,
    BurstError,
    bucket_url,
    build_task,
    check_budget,
    dry_run_report,
    remote_tracking_uri,
    stage_workdir,
    write_node_spec,
)
from fitburst.spec import PipelineSpec
from fitburst.tracking import redact

CREDENTIAL_HINTS = {
    "runpod": "RunPod: put an API key in ~/.runpod/config.toml (or RUNPOD_API_KEY), then `sky check runpod`",
    "lambda": "Lambda: put an API key in ~/.lambda_cloud/lambda_keys, then `sky check lambda`",
    "aws": "AWS: `aws configure`, then `sky check aws`",
    "gcp": "GCP: `gcloud auth application-default login`, then `sky check gcp`",
    "azure": "Azure: `az login`, then `sky check azure`",
}


@dataclass
class BurstResult:
    ok: bool
    job_status: str  # SUCCEEDED | FAILED | FAILED_SETUP | CANCELLED | DRY_RUN | LAUNCH_FAILED | ...
    cluster: str | None = None
    job_id: int | None = None
    reattached: bool = False  # picked up a job a previous launcher started (cloud.json)
    provider: str | None = None
    gpu: str | None = None
    accelerator: str | None = None
    region: str | None = None
    hourly_usd: float | None = None
    cost_usd: float | None = None
    seconds: float | None = None
    run_dir: str | None = None  # pulled-back outputs (adapter/, train_result.json, eval.json, metrics.jsonl)
    logged_remotely: bool = False  # the node logged into the MLflow run itself
    torn_down: bool = False
    message: str = ""
    report: str = ""  # the dry-run report (also filled for real launches)
    candidates: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def tags(self) -> dict[str, str]:
        """MLflow tags for the run (``path=cloud`` and where it ran)."""
        t = {
            "path": "cloud",
            "cloud.provider": self.provider,
            "cloud.gpu": self.gpu,
            "cloud.accelerator": self.accelerator,
            "cloud.region": self.region,
            "cloud.cluster": self.cluster,
            "cloud.job_id": self.job_id,
            "cloud.hourly_usd": f"{self.hourly_usd:.3f}" if self.hourly_usd is not None else None,
            "cloud.cost_usd": f"{self.cost_usd:.3f}" if self.cost_usd is not None else None,
            "cloud.job_status": self.job_status,
        }
        return {k: str(v) for k, v in t.items() if v is not None}


class BurstFailed(BurstError):
    """The cloud run failed; ``result`` holds what is known (the cluster is already down).

    The message (often SkyPilot's exception text) is redacted here: it becomes Prefect's state message,
    notifications and an MLflow artifact."""

    def __init__(self, message: str, result: BurstResult):
        message = redact(message)
        super().__init__(message)
        result.message = redact(result.message) if result.message else message
        self.result = result


class LogStream(io.TextIOBase):
    """A text stream that hands complete lines to ``log`` (SkyPilot's output_stream -> Prefect's logger)."""

    def __init__(self, log: Callable[[str], Any]):
        self._log, self._buf = log, ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self._buf += s
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self._log(line.rstrip("\r"))
        return len(s)

    def flush(self) -> None:
        if self._buf:
            self._log(self._buf)
            self._buf = ""


def cluster_name(spec: PipelineSpec) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", spec.name.lower()).strip("-")[:20].rstrip("-") or "run"
    return f"fitburst-{base}-{uuid.uuid4().hex[:6]}"


def explain_launch_error(e: BaseException, candidates: list[Candidate]) -> str:
    """A message a user can act on, from a SkyPilot launch exception."""
    from sky import exceptions as sx  # sky: heavy, only the burst path loads it

    tried = ", ".join(c.label() for c in candidates)
    providers = list(dict.fromkeys(c.provider for c in candidates))
    text = str(e)
    if isinstance(
        e, (sx.NoCloudAccessError, sx.InvalidCloudCredentials, sx.CloudUserIdentityError)
    ) or re.search(r"credential|not enabled|authenticat|api key|unauthori", text, re.I):
        steps = "; ".join(CREDENTIAL_HINTS[p] for p in providers if p in CREDENTIAL_HINTS)
        who = ", ".join(providers)
        return f"no usable cloud credentials for {who}: {steps}. ({type(e).__name__}: {text[:300]})"
    if re.search(r"quota|limit exceeded|vcpulimit", text, re.I):
        return (
            f"quota: the provider refused the GPU ({text[:300]}); request a quota increase or add a provider"
        )
    if isinstance(e, sx.ResourcesUnavailableError):
        return (
            f"no GPU available in any region for: {tried}. SkyPilot tried each in order and every region "
            f"({text[:300]}); retry later, allow spot, or add GPUs/providers to the burst policy"
        )
    if isinstance(e, sx.ClusterSetUpError) or "setup" in text.lower():
        return f"the node's setup step failed ({text[:300]}); see the setup log above"
    return f"launch failed: {type(e).__name__}: {text[:500]}"


def _status_name(status: Any) -> str:
    return getattr(status, "value", None) or (str(status) if status is not None else "UNKNOWN")


def _pull_outputs(cluster: str, run_dir: Path, log: Callable[[str], Any]) -> None:
    """rsync the node's RUN_DIR home (SkyPilot writes an ssh alias named after the cluster)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        "rsync",
        "-az",
        "-e",
        "ssh -o StrictHostKeyChecking=no",
        f"{cluster}:~/{JOB_DIR}/run/",
        f"{run_dir}/",
    ]
    log(f"pulling outputs: {' '.join(cmd)}")
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)


def node_hosts(cluster: str, nodes: int) -> list[str]:
    """The ssh names of a cluster's nodes as SkyPilot writes them: the head, then ``<cluster>-worker<i>``."""
    return [cluster] + [f"{cluster}-worker{i}" for i in range(1, nodes)]


def every_node(pull: Callable[[str, Path, Callable], None], nodes: int) -> Callable[[str, Path, Callable], None]:
    """``pull`` from every node of a cluster into the one run folder: a sharded checkpoint's files are spread over
    the nodes' disks (each node's ranks wrote theirs), and copied together they make the whole checkpoint."""
    if nodes == 1:
        return pull

    def pull_all(cluster: str, run_dir: Path, log: Callable[[str], Any]) -> None:
        for host in node_hosts(cluster, nodes):
            pull(host, run_dir, log)

    return pull_all


RECORD = "cloud.json"
LIVE = ("launching", "running")  # record states a rerun reattaches to


def read_record(run_dir: str | os.PathLike) -> dict | None:
    """The run folder's cloud record (cluster, job_id, managed, state), or None."""
    path = Path(run_dir) / RECORD
    return json.loads(path.read_text()) if path.exists() else None


def _record(run_dir: Path, on_ids: Callable[[dict], Any] | None, **fields: Any) -> None:
    """Update ``cloud.json`` atomically (and hand new ids to ``on_ids``: the MLflow tags)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rec = {**(read_record(run_dir) or {}), **fields}
    tmp = run_dir / f".{RECORD}.tmp"
    tmp.write_text(json.dumps(rec, indent=2))
    tmp.replace(run_dir / RECORD)
    if on_ids is not None:
        on_ids({k: v for k, v in rec.items() if k in ("cluster", "job_id", "managed") and v is not None})


def burst_train(
    spec: PipelineSpec,
    prepared_dir: str | os.PathLike | None,
    run_dir: str | os.PathLike,
    candidates: list[Candidate],
    *,
    dry_run: bool = False,
    log: Callable[[str], Any] = print,
    mlflow_run_id: str | None = None,
    local: dict | None = None,
    pull: Callable[[str, Path, Callable], None] | None = None,
    on_ids: Callable[[dict], Any] | None = None,
    gpus_per_node: int = 1,
    nodes: int = 1,
) -> BurstResult:
    """Train ``spec`` on the best usable candidate; return the result with outputs in ``run_dir``.
    ``gpus_per_node`` x ``nodes`` GPUs (the plan's): more than one shards the run (:func:`build_task`), and the
    outputs come home from every node.

    Budget caps and fit are checked before anything is created (BudgetError / BurstError). With ``dry_run``
    nothing is launched: the report (GPU, provider, $/h, total, task YAML) is returned. On a failed job,
    failed setup, launch error or interrupt the outputs so far are pulled home, the cluster is torn down and
    BurstFailed (or the interrupt) is raised, so the flow can mark its MLflow run FAILED. A ``run_dir`` whose
    cloud.json names a live cluster or job is reattached to instead of launching. ``on_ids`` receives the
    cluster name and job id as soon as they exist (to tag the MLflow run).
    """
    candidates = [Candidate.from_dict(c) for c in candidates]
    ok = check_budget(spec, candidates)
    if gpus_per_node * nodes == 1 and ok:  # the plan's GPUs: the best usable candidate's count (the ranking's)
        gpus_per_node, nodes = ok[0].gpus_per_node, ok[0].nodes
    # the node's spec file and staged workdir live only until the launch has uploaded them (dry runs included)
    with tempfile.TemporaryDirectory(prefix="fitburst-task-") as tmp:
        spec_path = write_node_spec(spec, tmp, sharded=gpus_per_node * nodes > 1)
        workdir = stage_workdir(Path(tmp) / "workdir")
        return _burst_train(spec, prepared_dir, Path(run_dir), candidates, ok, spec_path, workdir, dry_run=dry_run,
                            log=log, mlflow_run_id=mlflow_run_id, local=local, pull=pull, on_ids=on_ids,
                            gpus_per_node=gpus_per_node, nodes=nodes)


def _burst_train(spec, prepared_dir, run_dir: Path, candidates, ok, spec_path, workdir, *, dry_run, log,
                 mlflow_run_id, local, pull, on_ids, gpus_per_node: int, nodes: int) -> BurstResult:
    ckpts = run_dir / "checkpoints"
    resume = ckpts if not spec.burst.bucket and any(ckpts.glob("step-*")) else None  # travels to the new node
    task = build_task(spec, candidates, prepared_dir=prepared_dir, spec_path=spec_path, mlflow_run_id=mlflow_run_id,
                      workdir=workdir, run_name=run_dir.name, checkpoints=resume, gpus_per_node=gpus_per_node,
                      nodes=nodes)
    report = dry_run_report(spec, candidates, task, local=local)
    first = ok[0]
    base = dict(
        provider=first.provider,
        gpu=first.gpu,
        accelerator=first.accelerator,
        region=first.region,
        hourly_usd=first.hourly_usd,
        report=report,
        candidates=[c.to_dict() for c in candidates],
    )
    if dry_run:
        log(report)
        return BurstResult(ok=True, job_status="DRY_RUN", message="dry run: nothing launched", **base)
    remote = bool(mlflow_run_id and remote_tracking_uri())
    record = read_record(run_dir)
    if record is not None and record.get("state") not in LIVE:
        record = None  # collected or torn down: this is a new launch (resuming the checkpoints above)
    if spec.burst.bucket and record is None and any(ckpts.glob("step-*")):
        _seed_bucket(ckpts, bucket_url(spec, run_dir.name), log)  # the bucket is RUN_DIR: resume from them there
    if spec.burst.spot:
        return _managed_job(spec, task, ok, run_dir, log, remote, base, record, on_ids)
    attach = _live_cluster(record, log) if record is not None else None
    return _cluster_run(spec, task, ok, run_dir, log, remote, base, every_node(pull or _pull_outputs, nodes), attach,
                        on_ids)


def _live_cluster(record: dict, log) -> dict | None:
    """What of a recorded cluster is still there: ``{"cluster", "job_id"}`` (job_id None: not submitted yet),
    or None when it is gone. A stopped cluster (autostop on a provider that can stop) is started again."""
    import sky  # sky: heavy, only the burst path loads it

    name = record["cluster"]
    try:
        found = sky.stream_and_get(sky.status(cluster_names=[name]))
        if not found:
            log(f"recorded cluster {name} no longer exists; launching again" + (
                "" if record.get("job_id") is None else " (its outputs went with it unless burst.bucket held them)"))
            return None
        if _status_name(found[0]["status"]) == "STOPPED":
            log(f"recorded cluster {name} is stopped; starting it to collect its outputs")
            sky.stream_and_get(sky.start(name))
        job_id = record.get("job_id")
        if job_id is None:  # the launcher died while launching: find the job it may have submitted
            jobs = sky.stream_and_get(sky.queue(name)) or []
            job_id = max((j["job_id"] for j in jobs), default=None)
    except Exception as e:  # noqa: BLE001 - cannot reach it: launch anew (a new name; the old one autostops)
        log(f"WARNING: could not reach recorded cluster {name} ({type(e).__name__}: {redact(str(e))}); launching "
            f"a new one (check `sky status {name}`)")
        return None
    return {"cluster": name, "job_id": job_id}


def _cluster_run(spec, task, ok, run_dir: Path, log, remote: bool, base: dict, pull, attach: dict | None,
                 on_ids) -> BurstResult:
    import sky  # sky: heavy, only the burst path loads it

    name = attach["cluster"] if attach else cluster_name(spec)
    result = BurstResult(
        ok=False, job_status="LAUNCHING", cluster=name, run_dir=str(run_dir), logged_remotely=remote, **base
    )
    stream = LogStream(log)
    started = time.monotonic()
    launched = collected = False
    request_id = job_id = None
    try:
        if attach and attach["job_id"] is not None:
            launched, job_id, result.reattached = True, attach["job_id"], True
            log(f"reattaching to job {job_id} on {name} (recorded in {run_dir / RECORD}); not launching again")
        else:
            _record(run_dir, on_ids, cluster=name, job_id=None, managed=False, state="launching")
            log(f"launching {name}: {', '.join(c.label() for c in ok)} (in this order)")
            request_id = sky.launch(task, cluster_name=name, idle_minutes_to_autostop=spec.burst.autostop_minutes,
                                    down=bool(spec.burst.bucket) or ok[0].provider not in STOPPABLE)
            launched = True  # from here on a cluster may exist
            try:
                job_id, handle = sky.stream_and_get(request_id, output_stream=stream)
            except Exception as e:
                from sky import exceptions as sx  # sky: heavy, only the burst path loads it

                setup_failed = isinstance(e, sx.ClusterSetUpError) or "setup" in str(e).lower()
                result.job_status = "FAILED_SETUP" if setup_failed else "LAUNCH_FAILED"
                result.message = explain_launch_error(e, ok)
                raise BurstFailed(result.message, result) from None  # raw SDK text may hold secrets
            if job_id is None:  # SkyPilot submits no job for a task without a run command
                result.job_status = "LAUNCH_FAILED"
                result.message = f"{name} came up but SkyPilot submitted no job (does the task have a run command?)"
                raise BurstFailed(result.message, result)
            _describe(result, handle)
            _record(run_dir, on_ids, job_id=job_id, state="running")
        result.job_id = job_id
        log(
            f"job {job_id} on {name} ({result.accelerator} @ {result.provider} {result.region or ''}); "
            "streaming logs"
        )
        code = sky.tail_logs(name, job_id, follow=True, output_stream=stream)
        stream.flush()
        statuses = sky.stream_and_get(sky.job_status(name, [job_id]))
        status = _status_name((statuses or {}).get(job_id))
        result.job_status = status if status != "UNKNOWN" else ("SUCCEEDED" if code == 0 else "FAILED")
        if code != 0 or result.job_status != "SUCCEEDED":
            kind = "setup" if result.job_status == "FAILED_SETUP" else "training job"
            result.message = (
                f"the {kind} on {name} ended {result.job_status} (log exit code {code}); "
                "the log is above, the cluster is being torn down"
            )
            raise BurstFailed(result.message, result)
        if not remote:
            try:
                pull(name, run_dir, log)
                collected = True
            except Exception as e:  # noqa: BLE001
                result.message = f"training succeeded but pulling outputs from {name} failed: {e}"
                raise BurstFailed(result.message, result) from None  # raw SDK text may hold secrets
        result.ok = collected = True
        result.message = f"trained on {result.accelerator} ({result.provider})"
        return result
    except BaseException as e:
        if not isinstance(e, BurstFailed):
            # KeyboardInterrupt, SystemExit, Prefect's TerminationSignal: any BaseException that is not an Exception
            result.job_status = "ERROR" if isinstance(e, Exception) else "CANCELLED"
            result.message = result.message or f"{type(e).__name__}: {e}"
            if request_id is not None:
                _quiet(lambda: sky.api_cancel(request_id), log)
        raise
    finally:
        stream.flush()
        result.seconds = round(time.monotonic() - started, 1)
        if result.hourly_usd is not None:
            result.cost_usd = round(result.hourly_usd * result.seconds / 3600, 4)
        if launched and job_id is not None and not collected:
            # a failed, cancelled or broken run: its checkpoints and logs come home before the cluster goes
            collected = _pull_quietly(pull, name, run_dir, log)
        if launched:
            result.torn_down = _teardown(name, log)
        if launched or (run_dir / RECORD).exists():
            # torn down but not collected: nothing left to reattach to; not torn down: a rerun collects it
            _record(run_dir, None, state="collected" if collected else ("torn_down" if result.torn_down
                                                                        else "running"))


def _pull_quietly(pull, name: str, run_dir: Path, log) -> bool:
    """Pull what the node has (best effort, never raises: the error that got us here matters more)."""
    try:
        pull(name, run_dir, log)
        log(f"pulled the outputs of {name} home to {run_dir} (a rerun resumes from its checkpoints)")
        return True
    except BaseException as e:  # noqa: BLE001 - including a second Ctrl-C
        log(f"WARNING: pulling outputs from {name} failed ({type(e).__name__}: {redact(str(e))})")
        return False


def _describe(result: BurstResult, handle: Any) -> None:
    res = getattr(handle, "launched_resources", None)
    if res is None:
        return
    result.provider = str(getattr(res, "cloud", "") or result.provider).lower() or result.provider
    accs = getattr(res, "accelerators", None) or {}
    if accs:
        result.accelerator = next(iter(accs))
    result.region = getattr(res, "region", None) or result.region
    try:
        result.hourly_usd = float(res.get_cost(3600))
    except Exception:  # noqa: BLE001 - keep the ranked price
        pass


def _teardown(name: str, log) -> bool:
    """sky.down, retried once; never raises (the error that got us here matters more)."""
    import sky  # sky: heavy, only the burst path loads it

    for attempt in (1, 2):
        try:
            log(f"tearing down {name}")
            sky.stream_and_get(sky.down(name))
            return True
        except KeyboardInterrupt:
            log(f"interrupted during teardown of {name}; retrying once (autostop is the second guard)")
        except Exception as e:  # noqa: BLE001
            if "does not exist" in str(e).lower():
                return True
            log(f"teardown of {name} failed (attempt {attempt}): {e}")
    log(f"WARNING: {name} may still be running: run `sky down {name}` (autostop will take it down when idle)")
    return False


def _quiet(fn, log) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        log(f"(ignored) {type(e).__name__}: {e}")


def _managed_job(spec: PipelineSpec, task, ok, run_dir: Path, log, remote: bool, base: dict, record: dict | None,
                 on_ids) -> BurstResult:
    """A spot run as a SkyPilot managed job with RUN_DIR mounted from ``burst.bucket`` (BurstSpec refuses spot
    without a bucket, before any compute)."""
    import sky  # sky: heavy, only the burst path loads it

    task.set_resources(
        type(task.resources)(
            r.copy(job_recovery={"strategy": "FAILOVER", "max_restarts_on_errors": 1}) for r in task.resources
        )
    )
    name = record["cluster"] if record else cluster_name(spec)
    result = BurstResult(
        ok=False, job_status="LAUNCHING", cluster=name, run_dir=str(run_dir), logged_remotely=remote, **base
    )
    stream = LogStream(log)
    started = time.monotonic()
    job_id = request_id = None
    url = bucket_url(spec, run_dir.name)
    try:
        if record is not None and record.get("job_id") is not None:
            job_id, result.reattached = record["job_id"], True
            log(f"reattaching to managed job {job_id} ({name}, recorded in {run_dir / RECORD}); not launching again")
        else:
            _record(run_dir, on_ids, cluster=name, job_id=None, managed=True, state="launching", bucket=url)
            request_id = sky.jobs.launch(task, name=name)
            job_ids, _ = sky.stream_and_get(request_id, output_stream=stream)
            job_id = job_ids[0] if job_ids else None
            _record(run_dir, on_ids, job_id=job_id, state="running")
        result.job_id = job_id
        code = sky.jobs.tail_logs(job_id=job_id, follow=True, output_stream=stream)
        result.job_status = "SUCCEEDED" if code == 0 else ("CANCELLED" if code == 103 else "FAILED")
        if code != 0:
            result.message = f"managed job {job_id} ended {result.job_status} (exit code {code})"
            raise BurstFailed(result.message, result)
        _sync_bucket(url, run_dir, log)
        result.ok, result.message = True, f"managed job {job_id} succeeded"
        return result
    except BaseException as e:
        interrupted = not isinstance(e, Exception)  # Ctrl-C, SystemExit, Prefect's TerminationSignal
        if not isinstance(e, BurstFailed):
            result.job_status = "CANCELLED" if interrupted else "ERROR"
            result.message = result.message or (
                f"interrupted ({type(e).__name__})" if interrupted else explain_launch_error(e, ok)
            )
        if isinstance(e, BurstFailed):
            result.torn_down = True  # the job ended on its own; managed jobs delete their own cluster
        else:
            result.torn_down = _cancel_managed(name, job_id, request_id, log)
        if job_id is not None and not result.ok:  # the checkpoints so far are in the bucket; bring them home too
            _quiet(lambda: _sync_bucket(url, run_dir, log), log)
        if interrupted or isinstance(e, BurstFailed):
            raise  # unchanged: the flow and Prefect must see the interrupt itself
        raise BurstFailed(result.message, result) from None  # raw SDK text may hold secrets
    finally:
        stream.flush()
        result.seconds = round(time.monotonic() - started, 1)
        if result.hourly_usd is not None:
            result.cost_usd = round(result.hourly_usd * result.seconds / 3600, 4)
        if (run_dir / RECORD).exists():  # the bucket keeps everything: a managed run is never lost once done
            _record(run_dir, None, state="collected" if result.ok else ("torn_down" if result.torn_down
                                                                        else "running"))


def _cancel_managed(name: str, job_id: int | None, request_id: Any, log) -> bool:
    """Cancel the managed job (by id, or by name while the launch request has not returned one); never raises.

    True when SkyPilot accepted the cancel, so no cluster is left behind."""
    import sky  # sky: heavy, only the burst path loads it

    if job_id is None and request_id is not None:
        _quiet(lambda: sky.api_cancel(request_id, silent=True), log)  # stop the launch request itself
    try:
        log(f"cancelling managed job {job_id if job_id is not None else name}")
        if job_id is not None:
            sky.stream_and_get(sky.jobs.cancel(job_ids=[job_id]))
        else:
            sky.stream_and_get(sky.jobs.cancel(name=name))
        return True
    except BaseException as e:  # noqa: BLE001 - including a second Ctrl-C: the error that got us here matters more
        log(f"WARNING: cancelling managed job {name} failed ({type(e).__name__}: {redact(str(e))}); "
            f"run `sky jobs cancel -n {name}`")
        return False


def _bucket_sync_tool(url: str) -> list[str]:
    tool = ["aws", "s3", "sync"] if url.startswith("s3://") else ["gsutil", "-m", "rsync", "-r"]
    if shutil.which(tool[0]) is None:
        raise BurstError(f"{url} needs {tool[0]} on this machine (install it, with credentials for the bucket)")
    return tool


def _seed_bucket(checkpoints: Path, url: str, log) -> None:
    """Copy local checkpoints (a local run that ran out of memory, or a cloud run pulled home) into the run's
    folder in the bucket before launching, so the node resumes them instead of starting over. A sync only adds:
    newer checkpoints the bucket already holds stay, and the node resumes the newest."""
    dest = f"{url}/checkpoints"
    log(f"copying the checkpoints in {checkpoints} to {dest} for the node to resume")
    subprocess.run([*_bucket_sync_tool(url), str(checkpoints), dest], check=True, timeout=1800)


def _sync_bucket(url: str, run_dir: Path, log) -> None:
    """Copy one run's folder from the bucket home (the launcher's own credentials; the node never gets them)."""
    tool = _bucket_sync_tool(url)
    run_dir.mkdir(parents=True, exist_ok=True)
    log(f"pulling outputs from {url}")
    subprocess.run([*tool, url, str(run_dir)], check=True, timeout=1800)
