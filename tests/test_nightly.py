"""Nightly fine-tunes the way a team runs them, through the real `fitburst` CLI, flow and MLflow store: train only
when something changed (schedule.when), start from the champion (method.init_from), a monthly budget for rented
GPUs (burst.max_monthly_usd) and `fitburst costs`. The cron schedule's own runs are in tests/test_serve.py."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

import pytest

from fitburst.cli import main

FAST = ["--set", "training.max_steps=3", "--set", "eval.max_batches=1", "--set", "eval.samples=0"]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A fresh MLflow store of this test's own."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return MlflowClient(uri)


def demo_runs(client) -> list:
    exp = client.get_experiment_by_name("fitburst")
    return client.search_runs([exp.experiment_id], "tags.pipeline = 'demo'", order_by=["attributes.start_time ASC"])


# --- schedule.when ---------------------------------------------------------------------------------------------

def test_nothing_changed_trains_nothing_until_forced(prefect_server, pipelines_file, store, capsys):
    run = ["run", "demo", "-f", str(pipelines_file), *FAST, "--set", "tracking.log_model=false",
           "--set", "tracking.register_as=null"]
    assert main([*run, "--set", "schedule.when=changed"]) == 0  # nothing before it: trains
    assert main([*run, "--set", "schedule.when=changed"]) == 0
    out = capsys.readouterr().out
    first, second = demo_runs(store)
    assert f"demo: nothing changed since run {first.info.run_id} (" in out and "nothing trained" in out
    assert second.info.status == "FINISHED" and second.data.tags["fitburst.trained"] == "false"
    assert second.data.tags["fitburst.unchanged_since"] == first.info.run_id
    assert second.data.tags["mlflow.note.content"].startswith("nothing changed since run")
    assert "memory.measured_peak_bytes" in first.data.metrics and "memory.measured_peak_bytes" not in (
        second.data.metrics)  # no preflight, no training: nothing was measured
    assert "memory.estimated_peak_bytes" not in second.data.metrics

    assert main([*run, "--set", "schedule.when=changed", "--force"]) == 0  # --force trains anyway
    assert main(run) == 0  # a run a person starts trains by default
    third, fourth = demo_runs(store)[2:]
    assert [r.data.tags["fitburst.trained"] for r in (third, fourth)] == ["true", "true"]
    assert third.data.tags["fitburst.fingerprint"] == first.data.tags["fitburst.fingerprint"]

    assert main([*run, "--set", "schedule.when=changed", "--set", "training.learning_rate=0.001"]) == 0
    assert demo_runs(store)[-1].data.tags["fitburst.trained"] == "true"  # a setting changed: trains


# --- method.init_from ------------------------------------------------------------------------------------------

def test_init_from_champion_starts_from_its_adapter_and_compares_on_the_same_split(prefect_server, pipelines_file,
                                                                                   store):
    run = ["run", "demo", "-f", str(pipelines_file), "--set", "eval.max_batches=2", "--set", "eval.samples=0"]
    assert main([*run, "--set", "training.max_steps=40"]) == 0  # version 1, the champion
    # a learning rate too small to move the weights: the run ends where it started
    assert main([*run, "--set", "training.max_steps=1", "--set", "training.learning_rate=1e-9",
                 "--set", "method.init_from=champion"]) == 0
    first, second = demo_runs(store)
    m = second.data.metrics
    assert second.data.tags["fitburst.init_from"] == "models:/fitburst-demo/1"
    assert second.data.tags["fitburst.init_from.run_id"] == first.info.run_id
    # started from the champion's weights, not a fresh LoRA (which starts at the base model's loss)
    assert m["eval.init_loss"] == pytest.approx(m["eval.tuned_loss"], abs=1e-4)
    assert m["eval.tuned_loss"] < m["eval.base_loss"] - 0.5
    # the champion measured on this run's split, and the alias moves only when the new version beats that
    assert float(second.data.tags["registry.champion_loss_same_split"]) == pytest.approx(m["eval.init_loss"])
    moved = m["eval.tuned_loss"] < m["eval.init_loss"]
    assert str(store.get_model_version_by_alias("fitburst-demo", "champion").version) == ("2" if moved else "1")
    # MLflow lineage: the champion's logged model (an output of the first run) is an input of the second
    champion_model = first.outputs.model_outputs[0].model_id
    inputs = store.get_run(second.info.run_id).inputs.model_inputs  # search_runs leaves model inputs out
    assert [i.model_id for i in inputs] == [champion_model]


def test_init_from_an_adapter_of_another_rank_is_refused_with_the_field_and_the_fix(prefect_server, pipelines_file,
                                                                                    store, capsys):
    exp = store.create_experiment("fitburst")
    src = store.create_run(exp, tags={"pipeline": "demo"})
    for k, v in {"model.name": "fitburst/tiny-demo", "model.revision": "None", "method.type": "lora",
                 "method.rank": "8"}.items():
        store.log_param(src.info.run_id, k, v)
    store.create_registered_model("fitburst-demo")
    store.create_model_version("fitburst-demo", f"runs:/{src.info.run_id}/adapter", run_id=src.info.run_id)
    store.set_registered_model_alias("fitburst-demo", "champion", "1")
    run = ["run", "demo", "-f", str(pipelines_file), *FAST, "--set", "method.init_from=champion"]
    assert main([*run, "--dry-run"]) == 2  # a dry run checks it too: it would fail the same way for real
    assert "has rank 8: set method.rank: 8" in capsys.readouterr().err
    rc = main(run)
    err = capsys.readouterr().err
    assert rc == 2
    assert ("method.rank is 16 but method.init_from 'champion' (models:/fitburst-demo/1) has rank 8: set "
            "method.rank: 8, or method.init_from: none") in err
    assert "Traceback" not in err
    refused = demo_runs(store)[-1]
    assert refused.info.status == "FAILED" and "data.content_hash" not in refused.data.params  # before data prep


def test_init_from_champion_needs_a_registered_model(tmp_path, pipelines_file):
    from fitburst.spec import SpecError, load_pipeline

    with pytest.raises(SpecError, match="init_from: champion needs tracking.register_as"):
        load_pipeline(pipelines_file, "demo", {"method.init_from": "champion", "tracking.register_as": None})
    with pytest.raises(SpecError, match=r"field 'method.init_from' \(got '\./nowhere'\): no adapter at"):
        load_pipeline(pipelines_file, "demo", {"method.init_from": "./nowhere"})


# --- burst.max_monthly_usd and fitburst costs ------------------------------------------------------------------

def _burst(client, exp: str, pipeline: str, when, **tags) -> None:
    run = client.create_run(exp, start_time=int(when.timestamp() * 1000),
                            tags={"pipeline": pipeline, "path": "cloud", "dry_run": "false", **tags})
    client.set_terminated(run.info.run_id, "FINISHED")


@pytest.fixture
def spent(store):
    """Earlier bursts this month: demo $9.00 (recorded) + $0.90 (its launcher died: the estimate counts), another
    pipeline $5.00; not counted: last month's $100 and a dry run's."""
    start = datetime.now(timezone.utc).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    exp = store.create_experiment("fitburst")
    _burst(store, exp, "demo", start + timedelta(hours=1), **{"cloud.cost_usd": "9.000", "cloud.estimated_usd": "7"})
    _burst(store, exp, "demo", start + timedelta(hours=2), **{"cloud.estimated_usd": "0.9000"})
    _burst(store, exp, "other", start + timedelta(days=1), **{"cloud.cost_usd": "5.000"})
    _burst(store, exp, "demo", start - timedelta(days=1), **{"cloud.cost_usd": "100.000"})
    _burst(store, exp, "demo", start + timedelta(hours=3), **{"cloud.cost_usd": "50.0", "dry_run": "true"})
    return start


def test_a_burst_over_the_monthly_budget_is_refused_before_launch(prefect_server, pipelines_file, spent, capsys):
    dry = ["run", "demo", "-f", str(pipelines_file), "--dry-run", "--set", "burst.policy=always"]
    assert main([*dry, "--set", "burst.max_monthly_usd=10"]) == 2
    err = capsys.readouterr().err
    m = re.search(r"this pipeline's rented-GPU spend this month so far \$9\.90 \+ this run's estimated \$([\d.]+) is "
                  r"over burst\.max_monthly_usd \$10\.00", err)
    assert m and 9.90 + float(m.group(1)) > 10, err
    assert "no allowed cloud GPU is usable" in err  # the verdict says so

    assert main([*dry, "--set", "burst.max_monthly_usd=20"]) == 0  # $9.90 + the same estimate fits $20
    assert '"verdict": "burst"' in capsys.readouterr().out

    # every pipeline's spend together: $14.90 so far
    assert main([*dry, "--set", "burst.max_monthly_usd=20", "--set", "burst.max_monthly_usd_all=15"]) == 2
    assert "every pipeline's rented-GPU spend this month so far $14.90" in capsys.readouterr().err


def test_costs_prints_spend_per_pipeline_and_per_day(spent, store, capsys):
    assert main(["costs"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^demo\s+2\s+\$9\.90\*$", out, re.M), out  # * : one counted at its estimate
    assert re.search(r"^other\s+1\s+\$5\.00$", out, re.M) and re.search(r"^all\s+3\s+\$14\.90\*$", out, re.M)
    assert re.search(rf"^{spent.date().isoformat()}\s+demo\s+\$9\.90\*$", out, re.M)
    assert re.search(rf"^{(spent + timedelta(days=1)).date().isoformat()}\s+other\s+\$5\.00$", out, re.M)
    last = (spent - timedelta(days=1)).strftime("%Y-%m")
    assert main(["costs", "--month", last]) == 0
    assert re.search(r"^demo\s+1\s+\$100\.00$", capsys.readouterr().out, re.M)
    for bad in ("2026-13", "2026-1", "26-11", "2026-11-01"):
        with pytest.raises(SystemExit):
            main(["costs", "--month", bad])
        assert f"a month is YYYY-MM (e.g. 2026-11), got '{bad}'" in capsys.readouterr().err


def test_costs_never_prints_the_tracking_servers_password(monkeypatch, capsys):
    monkeypatch.setattr("mlflow.tracking.MlflowClient", lambda tracking_uri: _NoRuns())
    assert main(["costs", "--tracking-uri", "https://alice:s3cret-pw@mlflow.example"]) == 0
    out = capsys.readouterr().out
    assert "s3cret-pw" not in out and "alice:***@mlflow.example" in out


class _NoRuns:
    """An MLflow client of a store with no experiments (the test reads no server)."""

    def search_experiments(self) -> list:
        return []


def test_a_malformed_models_uri_in_init_from_is_one_located_message_before_any_run(tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    (tmp_path / "pipelines.yaml").write_text(
        "pipelines:\n  p:\n    model: {name: fitburst/tiny-demo}\n    data: {path: d.jsonl}\n"
        "    training: {max_steps: 1}\n    method:\n      init_from: models:/my-model\n")
    assert main(["run", "p", "-f", str(tmp_path / "pipelines.yaml"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "line 7: field 'method.init_from'" in err and "is not models:/NAME/VERSION or models:/NAME@ALIAS" in err
    assert "Traceback" not in err


def test_the_fingerprint_changes_with_what_decides_the_adapter_and_nothing_else(demo_spec):
    from fitburst.history import fingerprint, fingerprint_parts

    def fp(overrides: dict, data_hash: str = "d1", init: str | None = None) -> str:
        return fingerprint(fingerprint_parts(demo_spec.with_overrides(overrides), data_hash, init))

    same = fp({})
    assert fp({}) == same  # a rerun with the same settings
    assert fp({"data.path": "/elsewhere/the-same-records.jsonl"}) == same  # where the file lies: its content counts
    assert fp({"training.distributed": "fsdp", "training.fsdp.cpu_offload": True}) == same  # the GPU split
    assert fp({}, data_hash="d2") != same  # one record changed
    assert fp({"training.learning_rate": 1e-3}) != same and fp({"method.rank": 8}) != same
    assert fp({"data.max_seq_len": 256}) != same and fp({"model.revision": "abc123"}) != same
    assert fp({}, init="models:/m/2") != same  # another starting adapter


def test_an_unknown_init_from_version_names_the_store_without_its_password(demo_spec, monkeypatch):
    from mlflow.exceptions import MlflowException

    from fitburst.init_adapter import InitMismatch, resolve_init

    class NoVersions:
        def __init__(self, tracking_uri: str) -> None:
            pass

        def get_model_version(self, name: str, version: str):
            raise MlflowException(f"registered model {name} has no version {version}")

    monkeypatch.setattr("mlflow.tracking.MlflowClient", NoVersions)
    spec = demo_spec.with_overrides({"method.init_from": "models:/m/7"})
    with pytest.raises(InitMismatch) as e:
        resolve_init(spec, "https://bob:pw-123@mlflow.example")
    assert "no such registered model version in https://bob:***@mlflow.example" in str(e.value)
    assert "pw-123" not in str(e.value)


def test_a_skipped_runs_summary_prints_the_tracking_uri_without_its_password(pipelines_file, monkeypatch, capsys):
    def skipped(**_) -> dict:
        return {"pipeline": "demo", "mlflow_run_id": "r2", "tracking_uri": "https://bob:pw-123@mlflow.example",
                "trained": False, "message": "nothing changed since run r1 (2026-11-01 02:00 UTC)"}

    monkeypatch.setattr("flows.finetune.finetune", skipped)
    assert main(["run", "demo", "-f", str(pipelines_file)]) == 0
    out = capsys.readouterr().out
    assert "demo: nothing changed since run r1" in out and "https://bob:***@mlflow.example" in out
    assert "pw-123" not in out


def test_a_monthly_budget_without_a_cost_estimate_says_the_fix(demo_spec):
    from fitburst.history import Spend, monthly_budget_problems

    burst = demo_spec.with_overrides({"burst.max_monthly_usd": 10}).burst
    (why,) = monthly_budget_problems(burst, Spend(1.0, 1.0), None)
    assert "cannot be estimated" in why and "set training.max_steps, or unset burst.max_monthly_usd" in why
    assert monthly_budget_problems(demo_spec.burst, Spend(1.0, 1.0), None) == []  # no monthly cap: no problem


def test_an_adapter_folder_rewritten_in_place_is_another_start(tmp_path):
    from fitburst.init_adapter import adapter_digest

    (tmp_path / "adapter_config.json").write_text('{"r": 16}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\0" * (3 << 20))
    (tmp_path / "README.md").write_text("not part of the adapter")
    first = adapter_digest(tmp_path)
    (tmp_path / "README.md").write_text("edited")
    assert adapter_digest(tmp_path) == first
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\0" * (3 << 20) + b"\1")
    assert adapter_digest(tmp_path) != first


def test_costs_from_a_store_it_cannot_read_is_one_message_without_the_password(capsys):
    assert main(["costs", "--tracking-uri", "foo://bob:pw-123@mlflow.example"]) == 2
    err = capsys.readouterr().err
    assert "error: cannot read the MLflow store foo://bob:***@mlflow.example" in err
    assert "check --tracking-uri or MLFLOW_TRACKING_URI" in err
    assert "pw-123" not in err and "Traceback" not in err
