"""A preflight of an unchanged pipeline loads no tokenizer: `fitburst preflight` keeps the data facts it plans with
by what decides them (records, data settings, the tokenizer's files on disk), and a tokenizer the hub could not
give is not asked for again within the hour. Through the real CLI, in a subprocess with its own caches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fitburst.models import resolve_model_ref
from tests.test_first_hour import not_fitburst_lines

REPO = Path(__file__).resolve().parents[1]
HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"  # config bundled (fitburst/configs), tokenizer from the hub cache
TOKENIZER_LOADED = "transformers.models.auto.tokenization_auto"


def preflight(tmp_path: Path, pipelines: Path, **env: str) -> tuple[dict, bool, str]:
    """(the report's JSON, whether the run imported AutoTokenizer, stderr) of ``fitburst preflight p``."""
    code = ("import sys\nfrom fitburst.cli import main\n"
            f"rc = main(['preflight', 'p', '--file', {str(pipelines)!r}, '--json'])\n"
            f"print('TOKENIZER', {TOKENIZER_LOADED!r} in sys.modules, file=sys.stderr)\nsys.exit(rc)\n")
    e = {**os.environ, "PYTHONPATH": str(REPO), "FITBURST_CACHE": str(tmp_path / "cache"),
         "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "FITBURST_HUB_MISS_TTL": "3600", **env}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=e, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = proc.stderr.splitlines()[-1]
    return json.loads(proc.stdout), loaded == "TOKENIZER True", proc.stderr


def pipelines_file(tmp_path: Path, data: Path) -> Path:
    p = tmp_path / "p.yaml"
    p.write_text(f"""pipelines:
  p:
    model: {{name: {HUB_ID}}}
    data: {{path: {data}, format: alpaca, max_seq_len: 512}}
    preflight: {{device: "cpu:16GiB", exact: false}}
    burst: {{policy: never}}
""")
    return p


@pytest.fixture
def data(tmp_path: Path) -> Path:
    d = tmp_path / "data.jsonl"
    d.write_text((REPO / "fitburst/demo/instructions.jsonl").read_text())
    return d


def cache_tokenizer(hf: Path) -> None:
    """The demo model's tokenizer files (and the config.json AutoTokenizer reads) as huggingface_hub would have
    cached ``HUB_ID``'s at a commit."""
    repo = hf / f"models--{HUB_ID.replace('/', '--')}"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    src = Path(resolve_model_ref("fitburst/tiny-demo"))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges", "config")):
            (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")


def test_an_unchanged_pipeline_is_planned_again_without_its_tokenizer(tmp_path, data):
    cache_tokenizer(tmp_path / "hf")
    pipelines = pipelines_file(tmp_path, data)
    first, loaded, _ = preflight(tmp_path, pipelines)
    assert loaded and first["seq_len"] < 512  # the data's own longest sample, from the tokenizer
    again, loaded, err = preflight(tmp_path, pipelines)
    assert not loaded, err
    assert again["seq_len"] == first["seq_len"] and again["tokens"] == first["tokens"]

    # a record fewer: the facts are the data's again, so the tokenizer loads
    data.write_text("".join(data.read_text().splitlines(keepends=True)[1:]))
    changed, loaded, _ = preflight(tmp_path, pipelines)
    assert loaded and changed["tokens"] < first["tokens"]


def test_a_tokenizer_the_hub_could_not_give_is_not_asked_for_again_within_the_hour(tmp_path, data):
    pipelines = pipelines_file(tmp_path, data)  # nothing in the hub cache, offline
    first, loaded, err = preflight(tmp_path, pipelines)
    assert loaded and first["seq_len"] == 512 and "could not tokenize the data" in err
    again, loaded, err = preflight(tmp_path, pipelines)
    assert not loaded and again["seq_len"] == 512
    assert "could not be loaded in the last 60 min" in err and not_fitburst_lines(err)[:-1] == []
    _, loaded, _ = preflight(tmp_path, pipelines, FITBURST_HUB_MISS_TTL="0")
    assert loaded


def test_a_dry_run_does_not_ask_the_hub_again_within_the_hour_of_a_miss(monkeypatch, tmp_path):
    """The DAG's data prep on a dry run: a tokenizer that could not be loaded is not tried again (each try waits on
    the hub client's retries), and the preflight plans for data.max_seq_len."""
    from prefect.logging import disable_run_logger

    from fitburst.spec import load_pipeline
    from tasks import data_prep as node

    monkeypatch.setenv("FITBURST_CACHE", str(tmp_path))
    monkeypatch.setenv("FITBURST_HUB_MISS_TTL", "3600")
    tried: list[str] = []

    def unreachable(model):
        tried.append(model.name)
        raise OSError("hub unreachable")

    monkeypatch.setattr(node, "tokenizer_for", unreachable)
    spec = load_pipeline(REPO / "pipelines.yaml", "qwen7b-lora")
    with disable_run_logger():
        assert node.data_prep.fn(spec, None, dry_run=True) is None
        assert node.data_prep.fn(spec, None, dry_run=True) is None
        assert tried == [spec.model.name]
        with pytest.raises(OSError):  # a real run needs its tokenizer: it is tried, and the error is the run's
            node.data_prep.fn(spec, None, dry_run=False)
