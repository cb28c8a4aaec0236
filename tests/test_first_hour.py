"""A new user's first hour through the real CLI: a data mistake is one message from every command (no Prefect
traceback), `validate` reads the data, and `fitburst run demo` prints only fitburst's own lines.

*fitburst's line*, precisely: on stderr, a line the console formatter of ``fitburst.logs`` wrote (``fitburst: ``,
or a two-space continuation of such a record) or the CLI's own ``error: `` / ``warning: `` message; on stdout, the
run summary (one JSON document). Anything else (Prefect's engine and server, MLflow, alembic, transformers, the hub
client, progress bars, Python warnings) belongs in the log file under ``logs/``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fitburst.cli import main

REPO = Path(__file__).resolve().parents[1]
FITBURST_LINE = re.compile(r"^(fitburst: |  |error: |warning: )")


def fitburst(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess with its own run folders, Prefect home and MLflow store. Prefect and MLflow
    settings of the test session are dropped, so the CLI's own defaults (telemetry off) are what runs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env.update(PYTHONPATH=str(REPO), FITBURST_RUNS_DIR=str(cwd / "runs"), PREFECT_HOME=str(cwd / "prefect"),
               MLFLOW_TRACKING_URI=f"sqlite:///{cwd / 'mlflow.db'}")
    return subprocess.run([sys.executable, "-m", "fitburst.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def not_fitburst_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not FITBURST_LINE.match(line)]


@pytest.fixture
def broken_data(tmp_path: Path) -> tuple[Path, Path]:
    """A pipelines file whose data has a bad JSON line 42 (the demo instructions otherwise)."""
    lines = (REPO / "fitburst/demo/instructions.jsonl").read_text().splitlines()
    lines[41] = '{"instruction": "x", "output": '
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(lines) + "\n")
    pipelines = tmp_path / "my.yaml"
    pipelines.write_text(f"""pipelines:
  broken-data:
    model: {{name: fitburst/tiny-demo}}
    data: {{path: {data}, format: alpaca, max_seq_len: 128}}
    training: {{max_steps: 2}}
    burst: {{policy: never}}
""")
    return pipelines, data


def test_run_with_a_bad_data_line_prints_one_message(broken_data, tmp_path):
    pipelines, data = broken_data
    proc = fitburst(["run", "broken-data", "--file", str(pipelines)], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [f"error: {data}:42: not valid JSON: Expecting value (column 32) (fix it, or "
                                        "set data.skip_invalid: true to count and skip bad records)"]
    # the engine's records went to the log file, each one line without a traceback
    log = "".join(p.read_text() for p in (tmp_path / "logs").glob("*-run-*.log"))
    assert "Task run failed with exception: DataError" in log and "Traceback" not in log


def test_verbose_shows_the_rest_on_the_console(broken_data, tmp_path):
    pipelines, data = broken_data
    proc = fitburst(["-v", "run", "broken-data", "--file", str(pipelines)], tmp_path)
    assert proc.returncode == 2
    assert "prefect.task_runs: Task run failed with exception: DataError" in proc.stderr
    assert "Traceback" not in proc.stderr  # a user's mistake has no traceback even here


def test_validate_reads_the_data(broken_data, capsys):
    pipelines, data = broken_data
    assert main(["validate", str(pipelines)]) == 2
    err = capsys.readouterr().err
    assert f"error: pipeline 'broken-data': {data}:42: not valid JSON" in err
    assert main(["validate", str(pipelines), "--no-data"]) == 0
    assert "1 pipeline(s) valid (settings)" in capsys.readouterr().out


def test_validate_of_a_missing_file_advises_what_validate_takes(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "nosuchfile.yaml")]) == 2
    err = capsys.readouterr().err
    assert "nosuchfile.yaml: 1 problem" in err and "--file" not in err
    assert "file not found (create it, or give its path: fitburst validate PATH)" in err


def test_validate_names_an_unknown_chat_role(tmp_path, capsys):
    data = REPO / "tests/corpus/data/messages_unknown_role.jsonl"
    pipelines = tmp_path / "p.yaml"
    pipelines.write_text(f"pipelines:\n  chat:\n    model: {{name: fitburst/tiny-demo}}\n    data: {{path: {data}}}\n")
    assert main(["validate", str(pipelines)]) == 2
    assert f"{data}:1: messages[1]: unknown role 'assistnt' (did you mean 'assistant'?)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """`fitburst run demo` through the real CLI, a few steps, its own Prefect server and MLflow store."""
    cwd = tmp_path_factory.mktemp("demo-run")
    proc = fitburst(["run", "demo", "--file", str(REPO / "pipelines.yaml"), "--set", "training.max_steps=3",
                     "--set", "eval.samples=1"], cwd)
    return proc, cwd


def test_run_demo_prints_only_fitburst_lines(demo_run):
    proc, _ = demo_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not_fitburst_lines(proc.stderr) == [], proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["verdict"] == "local" and summary["steps"] == 3
    assert "fitburst: step 3/3" in proc.stderr  # the progress is fitburst's and shown


def test_run_demo_logged_model_is_in_the_runs_experiment(demo_run):
    import mlflow

    proc, cwd = demo_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    client = mlflow.MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}")
    run = client.get_run(summary["mlflow_run_id"])
    models = client.search_logged_models(experiment_ids=[run.info.experiment_id])
    assert [m.model_id for m in models] == [summary["model_uri"].removeprefix("models:/")]
    assert models[0].source_run_id == run.info.run_id


ESTIMATE_7B = ["estimate", "--model", "Qwen2.5-7B", "--method", "lora", "--rank", "128", "--targets", "all-linear",
               "--batch", "4", "--seq-len", "512", "--device", "RTX4090"]


def test_estimate_says_whether_each_answer_fits_and_by_how_much(capsys):
    main(ESTIMATE_7B)
    out = " ".join(capsys.readouterr().out.split())  # rich wraps lines at the terminal's width
    rows = dict(re.findall(r"│ ([a-z(][^│]*?) *│ +([0-9.,]+) │", out))
    reserved = float(rows["reserved (allocator)"])
    edge = next(float(v) for k, v in rows.items() if k.startswith("reserved at the upper edge"))
    assert edge >= reserved
    assert re.search(r"as configured, does not fit: [0-9.]+ GiB at the upper edge against [0-9.]+ GiB, "
                     r"[0-9.]+ GiB over", out)
    assert re.search(r"-> reserved peak [0-9.]+ GiB; fits: [0-9.]+ GiB at the upper edge within [0-9.]+ GiB, "
                     r"[0-9.]+ GiB to spare", out)


def test_auto_cpu_budget_is_machine_memory_less_a_reserve(monkeypatch, capsys):
    from fitburst import hardware as devices

    monkeypatch.setattr(devices, "_cgroup_limit", lambda: None)
    monkeypatch.setattr(devices, "_WARNED", set())
    budgets, errs = [], []
    for free in (5, 20):  # GiB free right now: the budget must not follow it
        monkeypatch.setattr(devices, "_meminfo", lambda free=free: (32 * devices.GiB, free * devices.GiB))
        args = ["estimate", "--model", "Qwen2.5-0.5B", "--method", "lora", "--device", "cpu", "--json"]
        main(args)
        out, err = capsys.readouterr()
        budgets.append(json.loads(out)["budget_bytes"])
        errs.append(err)
    assert budgets == [32 * devices.GiB - devices.CPU_RESERVE] * 2
    assert errs == ["fitburst: warning: this machine has 32.0 GiB; the CPU budget is 30.0 GiB (all of it less 2 GiB "
                    "for the system), but only 5.0 GiB is free now: close other programs if the run needs more "
                    "than that\n", ""]


def test_readme_is_short_and_links_every_docs_page():
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) <= 8000
    first, second = text.splitlines()[3:5]  # the two commands open the README, in its first code block
    assert first.startswith("bash scripts/demo.sh ") and second.startswith("bash scripts/test.sh ")
    assert "source .venv/bin/activate" in text
    for page in ("preflight", "training", "families-and-data", "bursting", "reliability", "deployments", "ui"):
        assert f"](docs/{page}.md)" in text and (REPO / "docs" / f"{page}.md").exists()
    bundled = sorted(p.stem for p in (REPO / "fitburst/configs").glob("*.json"))
    assert [name for name in bundled if name not in text] == []


def test_deployments_doc_names_the_installed_prefect():
    import prefect

    assert f"prefect {prefect.__version__}" in (REPO / "docs/deployments.md").read_text()


def test_a_deployment_run_with_a_bad_data_line_logs_no_traceback(prefect_server, broken_data):
    """What the Prefect UI shows for a served or deployed run: the flow run Failed, the located message in its
    logs, and no traceback anywhere in them (the task's failure included)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from flows.finetune import finetune

    pipelines, data = broken_data
    state = finetune(pipeline="broken-data", pipelines_file=str(pipelines), return_state=True)
    assert state.is_failed() and f"{data}:42: not valid JSON" in state.message

    async def logs() -> list[str]:
        async with get_client() as c:
            flt = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id]))
            return [m.message for m in await c.read_logs(flt, limit=200)]

    for _ in range(20):  # the API log handler sends in batches
        lines = asyncio.run(logs())
        if any("Task run failed" in m for m in lines):
            break
        time.sleep(0.5)
    assert [m for m in lines if f"{data}:42: not valid JSON" in m], lines
    assert not [m for m in lines if "Traceback" in m], lines


def test_skypilot_catalog_query_prints_nothing_offline(tmp_path):
    """The burst path's catalog query with no catalog and no network: SkyPilot's status payloads and its fetch
    error go to fitburst's log file, not the console (fitburst warns in its own words where it falls back)."""
    code = ("import sys; from fitburst import logs; logs.setup('test')\n"
            "from fitburst.cloud.gpus import _catalog_offers\n"
            "try:\n    _catalog_offers('A6000', 'runpod', False)\nexcept Exception as e:\n"
            "    sys.exit(0 if 'Connection' in type(e).__name__ else 1)\n")
    # no catalog anywhere: not the one another test module seeds for its own process (SKY_RUNTIME_DIR)
    env = {**{k: v for k, v in os.environ.items() if k != "SKY_RUNTIME_DIR"}, "PYTHONPATH": str(REPO),
           "HOME": str(tmp_path / "home"), "FITBURST_LOG_DIR": str(tmp_path / "logs")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""
    assert "Failed to fetch RunPod catalog" in "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))


def test_preflight_of_a_7b_pipeline_offline_prints_only_fitburst_lines(tmp_path):
    """The hub, the tokenizer fetch and SkyPilot's catalogs all unreachable (no HF_HUB_OFFLINE, no cached
    catalog): the report is the whole of stdout and every stderr line is fitburst's (its warnings say what it did
    instead). The analytic estimate keeps it to seconds; the trace adds minutes, not lines."""
    env_home = tmp_path / "home"
    proc = subprocess.run(
        [sys.executable, "-m", "fitburst.cli", "preflight", "qwen7b-lora", "--file", str(REPO / "pipelines.yaml"),
         "--set", "preflight.exact=false", "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**{k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}, "PYTHONPATH": str(REPO),
             "HOME": str(env_home), "FITBURST_RUNS_DIR": str(tmp_path / "runs")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["pipeline"] == "qwen7b-lora"
    assert not_fitburst_lines(proc.stderr) == [], proc.stderr
