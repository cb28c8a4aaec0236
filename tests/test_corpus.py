"""The bad-input corpus (tests/corpus/): every broken pipeline file, data file, model folder, CLI argument and
deployment parameter goes through the real CLI in a subprocess and must give one located message with the fix,
exit code 2, no traceback, and spend no compute (no model or tokenizer built, no run folder, no MLflow run).

Each case keeps its expected message beside it: a ``# expect: ...`` first line in a pipeline file (and an optional
``# command: run NAME`` second line; default ``validate FILE``), ``expect.yaml`` in data/ and models/, and
``cli.yaml`` for arguments and deployment parameters.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CORPUS = Path(__file__).resolve().parent / "corpus"
GOOD_DATA = CORPUS / "good.jsonl"
DATA_EXPECT = yaml.safe_load((CORPUS / "data" / "expect.yaml").read_text())
MODEL_EXPECT = yaml.safe_load((CORPUS / "models" / "expect.yaml").read_text())
CLI_CASES = yaml.safe_load((CORPUS / "cli.yaml").read_text())
PIPELINE_FILES = sorted((CORPUS / "pipelines").glob("*.yaml"))


def fitburst(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The real CLI with scratch caches, run folders and MLflow store, so spent compute would show."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env.update(PYTHONPATH=str(REPO), FITBURST_CACHE=str(cwd / "cache"), FITBURST_RUNS_DIR=str(cwd / "runs"),
               MLFLOW_TRACKING_URI=f"sqlite:///{cwd / 'mlflow.db'}", PREFECT_HOME=str(cwd / "prefect"),
               HOME=str(cwd / "home"))
    return subprocess.run([sys.executable, "-m", "fitburst.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def assert_refused(proc: subprocess.CompletedProcess, expect: str, cwd: Path) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert expect in proc.stderr, f"expected {expect!r} in:\n{proc.stderr}"
    assert "Traceback" not in out and "prefect" not in out.lower(), out[-3000:]
    assert proc.stderr.count("error:") == 1, proc.stderr  # one message
    spent = [p.name for p in (cwd / "cache", cwd / "runs", cwd / "mlflow.db", cwd / "prefect") if p.exists()]
    assert not spent, f"compute was spent before refusing: {spent}"


def write_pipelines(tmp_path: Path, model: str, data: Path, fmt: str = "auto") -> Path:
    p = tmp_path / "pipelines.yaml"
    p.write_text(yaml.safe_dump({"pipelines": {"case": {
        "model": {"name": model}, "data": {"path": str(data), "format": fmt}, "training": {"max_steps": 2}}}}))
    return p


@pytest.mark.parametrize("path", PIPELINE_FILES, ids=lambda p: p.stem)
def test_broken_pipeline_file(path, tmp_path):
    head = path.read_text().splitlines()
    assert head[0].startswith("# expect: "), f"{path.name}: first line must be '# expect: <message fragment>'"
    expect = head[0].removeprefix("# expect: ")
    command = head[1].removeprefix("# command: ").split() if head[1:2] and head[1].startswith("# command:") else []
    args = [command[0], command[1], "--file", str(path)] if command else ["validate", str(path)]
    proc = fitburst(args, tmp_path)
    assert_refused(proc, expect, tmp_path)
    assert f"{path}: 1 problem" in proc.stderr  # names the file; a defaults mistake is not repeated per pipeline


@pytest.mark.parametrize("name", sorted(DATA_EXPECT), ids=str)
def test_broken_data_file(name, tmp_path):
    case = DATA_EXPECT[name]
    data = CORPUS / "data" / name
    assert data.exists(), f"expect.yaml names {name}, which is not in tests/corpus/data"
    proc = fitburst(["prepare", "case", "--file", str(write_pipelines(tmp_path, "fitburst/tiny-demo", data,
                                                                            case.get("format", "auto")))], tmp_path)
    assert_refused(proc, case["expect"], tmp_path)
    assert str(data) in proc.stderr
    if "line" in case:
        assert f"{data}:{case['line']}: " in proc.stderr


def test_data_corpus_lists_every_file():
    assert sorted(p.name for p in (CORPUS / "data").iterdir() if p.name != "expect.yaml") == sorted(DATA_EXPECT)


def test_a_50_mb_line_is_refused_before_tokenizing(tmp_path):
    data = tmp_path / "huge.jsonl"
    with data.open("w") as f:
        f.write('{"prompt": "a", "completion": "b"}\n')
        f.write('{"prompt": "' + "x" * (50 << 20) + '", "completion": "b"}\n')
    proc = fitburst(["prepare", "case", "--file", str(write_pipelines(tmp_path, "fitburst/tiny-demo", data))],
                    tmp_path)
    assert_refused(proc, f"{data}:2: the line is 50 MiB (limit 16 MiB)", tmp_path)


@pytest.mark.parametrize("name", sorted(MODEL_EXPECT), ids=str)
def test_broken_model_folder(name, tmp_path):
    folder = CORPUS / "models" / name
    pipelines = write_pipelines(tmp_path, str(folder), GOOD_DATA)
    proc = fitburst(["validate", str(pipelines)], tmp_path)
    assert_refused(proc, MODEL_EXPECT[name]["expect"], tmp_path)
    assert f"{pipelines}: 1 problem" in proc.stderr and "field 'model.name'" in proc.stderr


@pytest.mark.parametrize("case", CLI_CASES, ids=lambda c: " ".join(c["args"])[:60])
def test_bad_cli_argument_or_deployment_parameter(case, tmp_path):
    pipelines = write_pipelines(tmp_path, "org/model", GOOD_DATA).rename(tmp_path / "p.yaml")
    text = pipelines.read_text().replace("case:", "demo:")
    pipelines.write_text(text)
    args = [a.replace("{file}", str(pipelines)) for a in case["args"]]
    assert_refused(fitburst(args, tmp_path), case["expect"], tmp_path)
