"""Launch one burst run, stream its logs, bring the outputs home, and always tear the cluster down.

Two lifecycles (both through SkyPilot's client SDK):
- on-demand: a cluster. ``sky.launch`` (autostop-with-down as a second guard) -> ``sky.tail_logs`` (follow;
  0 success, 100 failure) -> ``sky.job_status`` -> rsync ``~/fitburst-job/run`` back -> ``sky.down`` in
  ``finally`` (success, failure, exceptions, Ctrl-C and Prefect cancellation alike).
- spot: a managed job (``sky.jobs.launch``), which recovers from preemption from the last checkpoint and tears
  its own cluster down; fitburst cancels it on any error or interrupt. Its outputs reach home through MLflow
  (the node logs directly) or ``burst.bucket``.
"""

from __future__ import annotations

import io
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
    BurstError,
    build_task,
    check_budget,
    dry_run_report,
    remote_tracking_uri,
    write_node_spec,
)
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


def cluster_name(spec: Any) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", spec.name.lower()).strip("-")[:20].rstrip("-") or "run"
    return f"fitburst-{base}-{uuid.uuid4().hex[:6]}"


def explain_launch_error(e: BaseException, candidates: list[Candidate]) -> str:
    """A message a user can act on, from a SkyPilot launch exception."""
    from sky import exceptions as sx

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


def burst_train(
    spec: Any,
    prepared_dir: str | os.PathLike,
    run_dir: str | os.PathLike,
    candidates: list[Candidate],
    *,
    dry_run: bool = False,
    log: Callable[[str], Any] = print,
    mlflow_run_id: str | None = None,
    local: dict | None = None,
    pull: Callable[[str, Path, Callable], None] | None = None,
) -> BurstResult:
    """Train ``spec`` on the best usable candidate; return the result with outputs in ``run_dir``.

    Budget caps and fit are checked before anything is created (BudgetError / BurstError). With ``dry_run``
    nothing is launched: the report (GPU, provider, $/h, total, task YAML) is returned. On a failed job,
    failed setup, launch error or interrupt the cluster is torn down and BurstFailed (or the interrupt) is
    raised, so the flow can mark its MLflow run FAILED.
    """
    candidates = [Candidate.from_dict(c) for c in candidates]
    ok = check_budget(spec, candidates)
    # the node's spec file lives only until the launch has uploaded it (dry runs included)
    with tempfile.TemporaryDirectory(prefix="fitburst-spec-") as tmp:
        spec_path = write_node_spec(spec, tmp)
        return _burst_train(spec, prepared_dir, run_dir, candidates, ok, spec_path, dry_run=dry_run, log=log,
                            mlflow_run_id=mlflow_run_id, local=local, pull=pull)


def _burst_train(spec, prepared_dir, run_dir, candidates, ok, spec_path, *, dry_run, log, mlflow_run_id, local,
                 pull) -> BurstResult:
    task = build_task(spec, candidates, prepared_dir=prepared_dir, spec_path=spec_path, mlflow_run_id=mlflow_run_id)
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
    if spec.burst.spot:
        return _managed_job(spec, task, ok, Path(run_dir), log, remote, base)
    return _cluster_run(spec, task, ok, Path(run_dir), log, remote, base, pull or _pull_outputs)


def _cluster_run(spec, task, ok, run_dir: Path, log, remote: bool, base: dict, pull) -> BurstResult:
    import sky

    name = cluster_name(spec)
    result = BurstResult(
        ok=False, job_status="LAUNCHING", cluster=name, run_dir=str(run_dir), logged_remotely=remote, **base
    )
    stream = LogStream(log)
    started = time.monotonic()
    launched = False
    request_id = None
    try:
        log(f"launching {name}: {', '.join(c.label() for c in ok)} (in this order)")
        request_id = sky.launch(
            task, cluster_name=name, idle_minutes_to_autostop=spec.burst.autostop_minutes, down=True
        )
        launched = True  # from here on a cluster may exist
        try:
            job_id, handle = sky.stream_and_get(request_id, output_stream=stream)
        except Exception as e:
            from sky import exceptions as sx

            setup_failed = isinstance(e, sx.ClusterSetUpError) or "setup" in str(e).lower()
            result.job_status = "FAILED_SETUP" if setup_failed else "LAUNCH_FAILED"
            result.message = explain_launch_error(e, ok)
            raise BurstFailed(result.message, result) from None  # raw SDK text may hold secrets
        _describe(result, handle)
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
            except Exception as e:  # noqa: BLE001
                result.message = f"training succeeded but pulling outputs from {name} failed: {e}"
                raise BurstFailed(result.message, result) from None  # raw SDK text may hold secrets
        result.ok = True
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
        if launched:
            result.torn_down = _teardown(name, log)


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
    import sky

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


def _managed_job(spec, task, ok, run_dir: Path, log, remote: bool, base: dict) -> BurstResult:
    import sky

    bucket = getattr(spec.burst, "bucket", None)
    if not remote and not bucket:
        raise BurstError(
            "spot runs use SkyPilot managed jobs, which delete their cluster when done, so outputs "
            "must leave the node: set MLFLOW_TRACKING_URI to a server the cloud can reach, or "
            "burst.bucket (s3://... or gs://...)"
        )
    if bucket:
        task.set_storage_mounts({f"~/{JOB_DIR}/run": sky.Storage(source=bucket, mode=sky.StorageMode.MOUNT)})
    task.set_resources(
        type(task.resources)(
            r.copy(job_recovery={"strategy": "FAILOVER", "max_restarts_on_errors": 1}) for r in task.resources
        )
    )
    name = cluster_name(spec)
    result = BurstResult(
        ok=False, job_status="LAUNCHING", cluster=name, run_dir=str(run_dir), logged_remotely=remote, **base
    )
    stream = LogStream(log)
    started = time.monotonic()
    job_id = request_id = None
    try:
        request_id = sky.jobs.launch(task, name=name)
        job_ids, _ = sky.stream_and_get(request_id, output_stream=stream)
        job_id = job_ids[0] if job_ids else None
        code = sky.jobs.tail_logs(job_id=job_id, follow=True, output_stream=stream)
        result.job_status = "SUCCEEDED" if code == 0 else ("CANCELLED" if code == 103 else "FAILED")
        if code != 0:
            result.message = f"managed job {job_id} ended {result.job_status} (exit code {code})"
            raise BurstFailed(result.message, result)
        if bucket and not remote:
            _sync_bucket(bucket, run_dir, log)
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
        if interrupted or isinstance(e, BurstFailed):
            raise  # unchanged: the flow and Prefect must see the interrupt itself
        raise BurstFailed(result.message, result) from None  # raw SDK text may hold secrets
    finally:
        stream.flush()
        result.seconds = round(time.monotonic() - started, 1)
        if result.hourly_usd is not None:
            result.cost_usd = round(result.hourly_usd * result.seconds / 3600, 4)


def _cancel_managed(name: str, job_id: int | None, request_id: Any, log) -> bool:
    """Cancel the managed job (by id, or by name while the launch request has not returned one); never raises.

    True when SkyPilot accepted the cancel, so no cluster is left behind."""
    import sky

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


def _sync_bucket(bucket: str, run_dir: Path, log) -> None:
    tool = ["aws", "s3", "sync"] if bucket.startswith("s3://") else ["gsutil", "-m", "rsync", "-r"]
    if shutil.which(tool[0]) is None:
        raise BurstError(f"outputs are in {bucket}; install {tool[0]} to pull them back")
    run_dir.mkdir(parents=True, exist_ok=True)
    log(f"pulling outputs from {bucket}")
    subprocess.run([*tool, bucket, str(run_dir)], check=True, timeout=1800)
