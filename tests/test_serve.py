"""Deployments: `fitburst serve` against a real Prefect server, driven with the real `prefect deployment run` CLI.

A module-scoped Prefect server (`prefect server start` on a free loopback port, temporary PREFECT_HOME), a loopback
webhook receiver, and `fitburst serve` in a subprocess; teardown stops serve first, then the server.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
FAST = {"training.max_steps": 3, "eval.max_batches": 1, "eval.samples": 0}
TIMINGS: dict[str, float] = {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, timeout: float = 30, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def write_pipelines(path: Path, *, drop: tuple[str, ...] = (), demo_cron: str | None = None,
                    demo_tz: str | None = None) -> Path:
    """The repository's pipelines.yaml with absolute data paths and a webhook notification on demo."""
    doc = yaml.safe_load((ROOT / "pipelines.yaml").read_text())
    for name in drop:
        doc["pipelines"].pop(name)
    for p in doc["pipelines"].values():
        if "path" in p["data"]:  # a local file (hub datasets have `dataset` instead)
            p["data"]["path"] = str(ROOT / p["data"]["path"])
    demo = doc["pipelines"]["demo"]
    data = path.parent / "instructions.jsonl"  # demo's own copy of its data: a test changes one record of it
    if not data.exists():
        shutil.copy(ROOT / demo["data"]["path"], data)
    demo["data"]["path"] = str(data)
    demo["training"]["max_steps"] = 5  # the schedule's own runs (no overrides) train briefly
    demo["eval"].update(max_batches=1, samples=0)
    demo["tracking"] = {"experiment": "fitburst", "log_model": False}  # no model logged or registered: faster runs
    demo["notify"] = {"events": ["failed", "completed"], "webhook_url": "${FITBURST_TEST_WEBHOOK}"}
    if demo_cron:
        demo["schedule"] = {"cron": demo_cron, "timezone": demo_tz or "UTC"}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class Hook:
    """A loopback webhook receiver: every JSON POST body lands in ``received``."""

    def __init__(self):
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                received.append(json.loads(body or b"{}"))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/fitburst-hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, subject: str, timeout: float = 60, containing: str = "") -> dict:
        """The first notification with ``subject`` whose text holds ``containing``."""
        end = time.time() + timeout
        while time.time() < end:
            for m in self.received:
                if m.get("subject") == subject and containing in m.get("text", ""):
                    return m
            time.sleep(0.3)
        raise AssertionError(f"no {subject!r} notification within {timeout}s; got {self.received}")


class Stack:
    """The Prefect server, the serve process and their environment."""

    def __init__(self, tmp: Path, hook: Hook):
        self.tmp, self.hook = tmp, hook
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(tmp / "prefect"),
            "PREFECT_API_URL": self.api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_SERVICES_SCHEDULER_RECENT_DEPLOYMENTS_LOOP_SECONDS": "2",
            "PREFECT_RUNNER_POLL_FREQUENCY": "1",
            "PREFECT_CLI_COLORS": "false",
            "COLUMNS": "400",
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
            "FITBURST_RUNS_DIR": str(tmp / "runs"),
            "FITBURST_TEST_WEBHOOK": hook.url,
        }
        self.pipelines = write_pipelines(tmp / "pipelines.yaml")
        self.server = self.serve = self.worker = None
        self.serve_logs: list[Path] = []

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.api, timeout=30)

    def start_server(self) -> None:
        t0 = time.time()
        self.server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                        "--port", str(self.port)], env=self.env, cwd=self.tmp,
                                       stdout=open(self.tmp / "server.log", "w"), stderr=subprocess.STDOUT)
        while time.time() - t0 < 120:
            assert self.server.poll() is None, (self.tmp / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{self.api}/health", timeout=2).status_code == 200:
                    TIMINGS["server healthy"] = time.time() - t0
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError("Prefect server not healthy in 120 s")

    def start_serve(self, names: set[str]) -> None:
        t0 = time.time()
        log = self.tmp / f"serve-{len(self.serve_logs)}.log"
        self.serve_logs.append(log)
        self.serve = subprocess.Popen([str(BIN / "fitburst"), "serve", "--file", str(self.pipelines)], env=self.env,
                                      cwd=self.tmp, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        while time.time() - t0 < 120:
            assert self.serve.poll() is None, log.read_text()[-3000:]
            if "ready:" in log.read_text():  # logged after registration, stale cleanup and notifications
                assert names <= {d["name"] for d in self.deployments()}
                TIMINGS.setdefault("serve: deployments visible", time.time() - t0)
                return
            time.sleep(0.5)
        raise AssertionError("serve not ready in 120 s:\n" + log.read_text()[-3000:])

    def serve_output(self) -> str:
        return "".join(p.read_text() for p in self.serve_logs)

    def stop_serve(self) -> None:
        if self.serve is not None:
            stop(self.serve)

    def deployments(self) -> list[dict]:
        with self.http() as c:
            return c.post("/deployments/filter", json={"flows": {"name": {"any_": ["finetune"]}}}).json()

    def deployment(self, name: str) -> dict:
        return next(d for d in self.deployments() if d["name"] == name)

    def flow_runs(self, **flt) -> list[dict]:
        with self.http() as c:
            return c.post("/flow_runs/filter", json={"flow_runs": flt, "limit": 200}).json()

    def trigger(self, overrides: dict, watch: bool = True, name: str = "demo") -> subprocess.Popen:
        cmd = [str(BIN / "prefect"), "deployment", "run", f"finetune/{name}", "--param",
               f"overrides={json.dumps(overrides)}"] + (["--watch"] if watch else [])
        return subprocess.Popen(cmd, env=self.env, cwd=self.tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    hook = Hook()
    s = Stack(tmp_path_factory.mktemp("serve"), hook)
    try:
        s.start_server()
        s.start_serve({"demo", "qwen7b-lora", "qwen1.5b-qlora"})
        yield s
    finally:
        t0 = time.time()
        s.stop_serve()  # serve and worker first, or they retry a dead server for a minute
        TIMINGS["stop serve"] = time.time() - t0
        if s.worker is not None:
            stop(s.worker, sig=signal.SIGINT)
        TIMINGS["stop worker"] = time.time() - t0
        if s.server is not None:
            stop(s.server)
        TIMINGS["stop server"] = time.time() - t0
        hook.server.shutdown()
        print("\ntimings:", json.dumps({k: round(v, 1) for k, v in TIMINGS.items()}))


def run_cli(stack: Stack, overrides: dict, timeout: float = 240) -> tuple[int, str, float]:
    t0 = time.time()
    p = stack.trigger(overrides)
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out, time.time() - t0


def flow_run_id(out: str) -> str:
    m = re.search(r"UUID:\s*([0-9a-f-]{36})", out)
    assert m, out
    return m.group(1)


# --- no server needed -------------------------------------------------------------------------------------

def test_prefect_yaml_is_in_sync_with_pipelines_yaml():
    from fitburst.spec import load_all
    from flows.serve import prefect_yaml

    committed = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    specs = load_all(ROOT / "pipelines.yaml")
    expected = prefect_yaml(ROOT / "pipelines.yaml", specs, ROOT)
    got = {d["name"]: d for d in committed["deployments"]}
    assert list(got) == list(specs), "regenerate: python -m flows.serve --write-prefect-yaml"
    for d in expected["deployments"]:
        c = got[d["name"]]
        assert c["schedules"] == d["schedules"], f"{d['name']}: cron/timezone differ from pipelines.yaml"
        assert (c["parameters"], c["tags"], c["entrypoint"]) == (d["parameters"], d["tags"], d["entrypoint"])
        assert c["work_pool"]["name"] == "fitburst" and c["enforce_parameter_schema"] is True
    demo = got["demo"]["schedules"][0]
    assert (demo["cron"], demo["timezone"]) == (specs["demo"].schedule.cron, specs["demo"].schedule.timezone)


def test_serve_refuses_a_broken_file(tmp_path):
    bad = tmp_path / "pipelines.yaml"
    bad.write_text("pipelines:\n  demo:\n    model: {name: fitburst/tiny-demo}\n    data: {path: d.jsonl}\n"
                   "    schedule: {cron: '0 2 * *'}\n    notify: {webhook_url: 'https://hooks.example/SECRET'}\n")
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # never reached
    p = subprocess.run([str(BIN / "fitburst"), "serve", "--file", str(bad)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2
    assert "line 5: field 'schedule.cron'" in p.stderr and "five fields" in p.stderr
    assert "notify.webhook_url must be an environment reference" in p.stderr
    assert "SECRET" not in p.stderr + p.stdout


def test_overrides_schema_is_derived_from_the_spec():
    from flows.finetune import finetune

    schema = finetune.parameters.model_dump()["properties"]["overrides"]
    props = schema["properties"]
    assert schema["additionalProperties"] is False
    assert props["training.max_steps"]["anyOf"][0] == {"type": "integer", "minimum": 1}
    assert set(props["method.type"]["enum"]) == {"lora", "qlora", "full"}
    assert props["training"]["properties"]["max_steps"] == props["training.max_steps"]
    assert not {"notify", "name", "base_dir", "schedule.cron", "schedule.timezone"} & set(props)
    assert set(props["schedule"]["properties"]) == {"when"}  # a run may say whether to train: nothing else of it
    assert props["schedule.when"]["anyOf"][0]["enum"] == ["changed", "always"]


# --- against the served stack -----------------------------------------------------------------------------

def test_every_pipeline_is_a_deployment_with_its_schedule(stack):
    deps = {d["name"]: d for d in stack.deployments()}
    declared = set(yaml.safe_load(stack.pipelines.read_text())["pipelines"])
    assert set(deps) == declared and {"demo", "qwen7b-lora", "qwen1.5b-qlora"} <= declared
    demo = deps["demo"]
    assert [(s["schedule"]["cron"], s["schedule"]["timezone"], s["active"]) for s in demo["schedules"]] == [
        ("0 2 * * *", "UTC", True)]
    assert deps["qwen7b-lora"]["schedules"][0]["schedule"]["timezone"] == "Europe/Berlin"
    assert deps["qwen1.5b-qlora"]["schedules"] == []
    assert demo["parameters"] == {"pipeline": "demo", "pipelines_file": str(stack.pipelines)}
    assert demo["enforce_parameter_schema"] and "pipeline:demo" in demo["tags"]
    assert demo["parameter_openapi_schema"]["properties"]["pipeline"]["enum"] == ["demo"]


@pytest.fixture(scope="module")
def two_runs(stack) -> list[tuple[int, str]]:
    """(exit code, output) of two ``prefect deployment run --watch`` of demo (3 steps) started at once, made on
    first use. Shared by the test of what one run records and the test that the two serialize on the local
    training slot: each flow run is a process that imports torch and transformers before it trains."""
    t0 = time.time()
    procs = [stack.trigger(FAST), stack.trigger(FAST)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    TIMINGS["two deployment runs --watch at once (demo, 3 steps)"] = time.time() - t0
    return [(p.returncode, out) for p, out in zip(procs, outs, strict=True)]


def test_deployment_run_watch_completes_and_records_mlflow(stack, two_runs):
    rc, out = two_runs[0]
    assert rc == 0, out
    assert "Completed" in out
    fr = flow_run_id(out)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(stack.env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("fitburst").experiment_id],
                              f"tags.`prefect.flow_run_id` = '{fr}'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["training.max_steps"] == "3" and runs[0].data.tags["pipeline"] == "demo"
    run_id = runs[0].info.run_id

    with stack.http() as c:
        arts = c.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [fr]}}}).json()
    summary = next(a for a in arts if a["key"] == "summary-demo")["data"]
    assert run_id in summary and stack.env["MLFLOW_TRACKING_URI"] in summary
    assert any(a["key"] == "preflight-demo" for a in arts)

    done = stack.hook.wait_for("fitburst: demo completed", containing=run_id)  # this run's, not the other's
    assert "eval loss" in done["text"] and run_id in done["text"]


def test_invalid_override_is_rejected_before_a_run_exists(stack):
    # runs the CLI would have made (the cron deployment's scheduler adds SCHEDULED runs meanwhile)
    made = {"state": {"type": {"not_any_": ["SCHEDULED"]}}}
    before = len(stack.flow_runs(**made))
    rc, out, _ = run_cli(stack, {"training.max_steps": 0})
    assert rc == 1
    assert "overrides['training.max_steps']" in out and "less than the minimum of 1" in out
    rc, out, _ = run_cli(stack, {"training.max_step": 5})
    assert rc == 1 and "'training.max_step' was unexpected" in out
    rc, out, _ = run_cli(stack, {"method.type": "dora"})
    assert rc == 1 and "method.type" in out
    assert len(stack.flow_runs(**made)) == before  # nothing was created, so nothing ran


def test_cron_schedule_produces_scheduled_runs(stack):
    demo = stack.deployment("demo")
    end, runs = time.time() + 60, []
    while time.time() < end and not runs:
        runs = stack.flow_runs(deployment_id={"any_": [demo["id"]]}, state={"type": {"any_": ["SCHEDULED"]}})
        time.sleep(1)
    assert runs, "the scheduler created no runs for finetune/demo"
    starts = sorted(datetime.fromisoformat(r["expected_start_time"].replace("Z", "+00:00")) for r in runs)
    assert all((s.hour, s.minute) == (2, 0) and s.utcoffset().total_seconds() == 0 for s in starts)
    assert all(r["parameters"]["pipeline"] == "demo" for r in runs)


def _next_scheduled_run(stack: Stack, deployment_id: str) -> dict:
    """The earliest run the scheduler created for the deployment (its cron's next 02:00)."""
    end = time.time() + 60
    while time.time() < end:
        runs = stack.flow_runs(deployment_id={"any_": [deployment_id]}, state={"type": {"any_": ["SCHEDULED"]}})
        if runs:
            return min(runs, key=lambda r: r["expected_start_time"])
        time.sleep(1)
    raise AssertionError("the scheduler created no runs")


def _start_now(stack: Stack, run: dict, timeout: float = 240) -> dict:
    """Move a scheduled run's start to now (it stays the schedule's run: auto_scheduled) and wait for its end."""
    now = datetime.now().astimezone().isoformat()
    with stack.http() as c:
        r = c.post(f"/flow_runs/{run['id']}/set_state", json={"state": {
            "type": "SCHEDULED", "name": "Scheduled", "state_details": {"scheduled_time": now}}, "force": True})
        assert r.status_code in (200, 201), r.text
        end = time.time() + timeout
        while time.time() < end:
            fr = c.get(f"/flow_runs/{run['id']}").json()
            if fr["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                return fr
            time.sleep(1)
    raise AssertionError(f"scheduled run {run['id']} did not finish in {timeout}s:\n" + stack.serve_output()[-3000:])


def _trained(stack: Stack, flow_run: dict) -> tuple[bool, dict]:
    """Whether the flow run trained (a train-local task ran), and the tags of its MLflow run."""
    from mlflow.tracking import MlflowClient

    with stack.http() as c:
        trs = c.post("/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run["id"]]}}}).json()
    client = MlflowClient(stack.env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("fitburst").experiment_id],
                              f"tags.`prefect.flow_run_id` = '{flow_run['id']}'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    return any(r["name"].startswith("train-local") for r in trs), {"run_id": runs[0].info.run_id, **runs[0].data.tags}


def test_scheduled_runs_train_only_when_something_changed(stack):
    """The cron schedule's own runs: the first trains, the second (nothing changed) ends Completed having trained
    nothing, the third (one record of the data changed) trains again."""
    deployment = stack.deployment("demo")["id"]
    first = _start_now(stack, _next_scheduled_run(stack, deployment))
    assert first["state_type"] == "COMPLETED" and first["auto_scheduled"], first["state"]
    trained, first_tags = _trained(stack, first)
    assert trained and first_tags["fitburst.trained"] == "true"

    second = _start_now(stack, _next_scheduled_run(stack, deployment))
    assert second["state_type"] == "COMPLETED", second["state"]
    assert second["state"]["message"].startswith(f"nothing changed since run {first_tags['run_id']} (")
    trained, tags = _trained(stack, second)
    assert not trained and tags["fitburst.trained"] == "false"
    assert tags["fitburst.unchanged_since"] == first_tags["run_id"]
    assert tags["fitburst.fingerprint"] == first_tags["fitburst.fingerprint"]
    with stack.http() as c:
        arts = c.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [second["id"]]}}}).json()
    assert first_tags["run_id"] in next(a for a in arts if a["key"] == "unchanged-demo")["data"]

    data = Path(yaml.safe_load(stack.pipelines.read_text())["pipelines"]["demo"]["data"]["path"])
    lines = data.read_text().splitlines()
    record = json.loads(lines[0])
    record["output"] += " (revised)"
    data.write_text("\n".join([json.dumps(record), *lines[1:]]) + "\n")
    third = _start_now(stack, _next_scheduled_run(stack, deployment))
    assert third["state_type"] == "COMPLETED", third["state"]
    trained, tags = _trained(stack, third)
    assert trained and tags["fitburst.trained"] == "true"
    assert tags["fitburst.fingerprint.data"] != first_tags["fitburst.fingerprint.data"]
    assert tags["fitburst.fingerprint.settings"] == first_tags["fitburst.fingerprint.settings"]


def test_concurrent_local_trainings_serialize(stack, two_runs):
    outs = [out for _, out in two_runs]
    assert [rc for rc, _ in two_runs] == [0, 0], outs
    ids = [flow_run_id(o) for o in outs]
    with stack.http() as c:
        trs = c.post("/task_runs/filter", json={"flow_runs": {"id": {"any_": ids}}}).json()
        limits = c.post("/v2/concurrency_limits/filter", json={}).json()
    assert {(lim["name"], lim["limit"]) for lim in limits} >= {("tag:fitburst-local-train", 1)}
    train = sorted((r for r in trs if r["name"].startswith("train-local")), key=lambda r: r["start_time"])
    assert len(train) == 2 and all(r["state_type"] == "COMPLETED" for r in train)
    first_end = datetime.fromisoformat(train[0]["end_time"])
    # the slot is held from the preflight on: the second run's preflight waits for the first run's training
    second = train[1]["flow_run_id"]
    pre = next(r for r in trs if r["name"].startswith("preflight") and r["flow_run_id"] == second)
    # Prefect stamps end_time when the task's Completed state is proposed, which under load can trail the return
    # (and the flow's slot release) by some ms; without the slot the preflight overlaps the whole ~10 s training
    assert (datetime.fromisoformat(pre["start_time"]) - first_end).total_seconds() >= -2.0, \
        f"preflight overlapped training: {pre}"


def test_failed_run_notifies_the_webhook(stack):
    rc, out, _ = run_cli(stack, {"training.max_steps": None, "training.epochs": None})
    assert rc == 1 and "Failed" in out  # passes the schema; fitburst.spec refuses it inside the flow
    msg = stack.hook.wait_for("fitburst: demo failed")
    assert "training needs epochs or max_steps" in msg["text"] and msg["pipeline"] == "demo"
    assert stack.hook.url not in stack.serve_output()  # the resolved webhook URL is never logged


def test_restart_picks_up_a_changed_file(stack):
    """Last: restarts serve with a file that drops a pipeline and moves demo's schedule."""
    stack.stop_serve()
    write_pipelines(stack.pipelines, drop=("qwen1.5b-qlora",), demo_cron="30 3 * * 1-5", demo_tz="Europe/Berlin")
    stack.start_serve({"demo", "qwen7b-lora"})
    deps = {d["name"]: d for d in stack.deployments()}
    kept = set(yaml.safe_load(stack.pipelines.read_text())["pipelines"])
    assert set(deps) == kept and "qwen1.5b-qlora" not in kept and {"demo", "qwen7b-lora"} <= kept
    sched = deps["demo"]["schedules"][0]["schedule"]
    assert (sched["cron"], sched["timezone"]) == ("30 3 * * 1-5", "Europe/Berlin") and not deps["demo"]["paused"]


def test_production_path_prefect_deploy_and_worker(stack):
    """prefect.yaml as the docs use it: `prefect deploy --all` from the repository root, then a process worker."""
    stack.stop_serve()
    prefect = str(BIN / "prefect")
    p = subprocess.run([prefect, "work-pool", "create", "fitburst", "--type", "process"], env=stack.env,
                       cwd=stack.tmp, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    t0 = time.time()
    p = subprocess.run([prefect, "--no-prompt", "deploy", "--all"], env=stack.env, cwd=ROOT, capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    TIMINGS["prefect deploy --all"] = time.time() - t0
    from fitburst.spec import load_all

    specs = load_all(ROOT / "pipelines.yaml")
    deps = {d["name"]: d for d in stack.deployments()}
    assert set(specs) <= set(deps)
    for name, spec in specs.items():
        assert deps[name]["work_pool_name"] == "fitburst" and deps[name]["enforce_parameter_schema"]
        crons = [(s["schedule"]["cron"], s["schedule"]["timezone"]) for s in deps[name]["schedules"]]
        assert crons == ([(spec.schedule.cron, spec.schedule.timezone)] if spec.schedule.cron else [])
    p = subprocess.run([sys.executable, "-m", "flows.serve", "--setup-only", "--file", str(ROOT / "pipelines.yaml")],
                       env=stack.env, cwd=stack.tmp, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "concurrency limit" in p.stderr, p.stdout + p.stderr
    stack.worker = subprocess.Popen([prefect, "worker", "start", "--pool", "fitburst"],
                                    env={**stack.env, "PREFECT_WORKER_QUERY_SECONDS": "1"}, cwd=stack.tmp,
                                    stdout=open(stack.tmp / "worker.log", "w"), stderr=subprocess.STDOUT)
    rc, out, took = run_cli(stack, {**FAST, "eval.enabled": False})
    TIMINGS["worker: deployment run --watch (demo, 3 steps)"] = took
    assert rc == 0, out + (stack.tmp / "worker.log").read_text()[-3000:]
