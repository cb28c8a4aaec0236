"""The DAG end to end on the local path, against a real Prefect server and a real MLflow store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SENTINEL = "hf_fitburstSENTINEL0123456789"


@pytest.fixture(scope="module")
def demo_run(prefect_server, pipelines_file, tmp_path_factory, monkeypatch_module):
    """The demo pipeline as the README runs it, with an HF token in the environment that must never leak."""
    from flows.finetune import finetune

    monkeypatch_module.setenv("HF_TOKEN", SENTINEL)
    # the token is referenced, so it is resolved and handed to from_pretrained: it must still never be recorded
    return finetune(pipeline="demo", pipelines_file=str(pipelines_file), overrides={"model.hf_token": "${HF_TOKEN}"})


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def host_device() -> str:
    """Where the demo trains on this host with ``preflight.device: auto``: the README's own run."""
    import torch

    return "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"


def client():
    from mlflow.tracking import MlflowClient

    return MlflowClient()


def test_demo_run_is_recorded_in_mlflow(demo_run):
    run = client().get_run(demo_run["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    p, m, t = run.data.params, run.data.metrics, run.data.tags
    assert p["model.name"] == "fitburst/tiny-demo" and p["method.type"] == "lora"
    assert p["training.max_steps"] == "150" and "data.content_hash" in p
    assert t["pipeline"] == "demo" and t["path"] == "local" and t["device"] == host_device()
    assert t["verdict"] == "local" and t["fitburst.version"]
    for key in ("memory.estimated_peak_bytes", "memory.measured_peak_bytes", "eval.base_loss", "eval.tuned_loss"):
        assert m[key] > 0, key
    # the headline: fine-tuning clearly lowered the validation loss
    assert m["eval.tuned_loss"] < m["eval.base_loss"] - 1.0
    history = client().get_metric_history(run.info.run_id, "train_loss")
    assert len(history) == 15 and history[-1].value < history[0].value
    names = {a.path for a in client().list_artifacts(run.info.run_id)}
    assert {"adapter", "config", "preflight", "train", "eval"} <= names
    files = {a.path for d in ("preflight", "train", "config", "eval")
             for a in client().list_artifacts(run.info.run_id, d)}
    assert {"preflight/report.md", "preflight/memory_breakdown.png", "train/loss.png", "train/memory.png",
            "config/pipeline.yaml", "eval/samples.json"} <= files


def test_adapter_from_mlflow_reproduces_the_logged_eval_loss(demo_run, demo_spec, demo_prepared, tmp_path):
    import mlflow

    from fitburst.evaluate import evaluate

    run_id = demo_run["mlflow_run_id"]
    adapter = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="adapter", dst_path=str(tmp_path))
    run = client().get_run(run_id)
    # evaluated again where and how the run evaluated (a GPU host trains and evaluates there, in its precision)
    ev = evaluate(demo_spec, demo_prepared, adapter, device=run.data.tags["device"],
                  precision=run.data.tags["precision"])
    logged = run.data.metrics
    assert ev.tuned_loss == pytest.approx(logged["eval.tuned_loss"], rel=1e-4)
    assert ev.base_loss == pytest.approx(logged["eval.base_loss"], rel=1e-4)


def test_no_secret_reaches_mlflow(demo_run, tmp_path):
    import mlflow

    run = client().get_run(demo_run["mlflow_run_id"])
    assert SENTINEL not in json.dumps([run.data.params, run.data.tags])
    root = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, dst_path=str(tmp_path)))
    for f in root.rglob("*"):
        if f.is_file():
            assert SENTINEL.encode() not in f.read_bytes(), f


def test_prefect_records_the_dag_and_artifacts(demo_run):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def fetch():
        async with get_client() as c:
            runs = await c.read_task_runs()
            keys = ArtifactFilterKey(any_=["preflight-demo", "summary-demo"])
            arts = await c.read_artifacts(artifact_filter=ArtifactFilter(key=keys))
            return runs, arts

    runs, arts = asyncio.run(fetch())
    names = {r.name.rsplit("-", 1)[0] for r in runs if r.state and r.state.is_completed()}
    assert {"data-prep", "preflight", "train-local", "evaluate"} <= names
    assert {a.key for a in arts} == {"preflight-demo", "summary-demo"}
    assert any("Verdict: local" in (a.data or "") for a in arts)


def test_failed_run_ends_failed_in_mlflow(prefect_server, tmp_path):
    from fitburst.data import DataError
    from fitburst.demo_models import DEMO_DATA
    from flows.finetune import finetune

    bad = tmp_path / "data.jsonl"
    bad.write_text(DEMO_DATA.read_text().splitlines()[0] + "\n{broken\n")
    pf = tmp_path / "pipelines.yaml"
    pf.write_text(f"pipelines:\n  broken:\n    model: {{name: fitburst/tiny-demo}}\n    data: {{path: {bad}}}\n")
    with pytest.raises(DataError, match=r"data.jsonl:2"):
        finetune(pipeline="broken", pipelines_file=str(pf))
    runs = client().search_runs([client().get_experiment_by_name("fitburst").experiment_id],
                                "tags.pipeline = 'broken'")
    assert [r.info.status for r in runs] == ["FAILED"]


def test_pipeline_with_probe_measures_real_steps_before_training(prefect_server, pipelines_file, tmp_path):
    """``preflight.probe: true`` in a pipeline: the preflight node runs real optimizer steps of the planned run on
    the longest batch, records the measured peak beside the estimate in the run, and times the run from them."""
    import mlflow

    from flows.finetune import finetune

    out = finetune(pipeline="demo", pipelines_file=str(pipelines_file),
                   overrides={"preflight.probe": True, "preflight.device": "cpu", "training.max_steps": 4,
                              "training.log_every": 2, "eval.samples": 1, "eval.max_new_tokens": 4,
                              "eval.max_batches": 1})
    run = client().get_run(out["mlflow_run_id"])
    assert run.info.status == "FINISHED" and out["verdict"] == "local"
    m, t = run.data.metrics, run.data.tags
    assert t["probe.device"] == "cpu" and m["memory.probe_replanned"] == 0.0
    assert m["memory.probe_peak_bytes"] > 0 and m["memory.probe_tokens_per_s"] > 0
    # measured by the probe's tensor tracker on real steps vs the estimate: a real measurement, not a copy
    assert 0.9 < m["memory.probe_peak_bytes"] / m["memory.probe_estimated_bytes"] < 1.1, m
    probe = json.loads(Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, dst_path=str(tmp_path),
                                                                artifact_path="preflight/probe.json")).read_text())
    assert probe["steps"] == 2 and probe["seq_len"] == m["memory.probe_seq_len"]
    report = json.loads(Path(mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id, dst_path=str(tmp_path), artifact_path="preflight/report.json")).read_text())
    assert report["local_hours_source"].startswith("probe: "), report["local_hours_source"]  # timed by the probe


def test_bad_spec_fails_before_any_run_exists(prefect_server, pipelines_file):
    from fitburst.spec import SpecError
    from flows.finetune import finetune

    with pytest.raises(SpecError, match="max_steps"):
        finetune(pipeline="demo", overrides={"training.max_steps": 0}, pipelines_file=str(pipelines_file))


def test_flow_and_node_command_record_the_same(demo_run, demo_prepared, tmp_path, monkeypatch):
    """One recipe, two callers: `fitburst train --eval --plan` (the cloud node's command) on the spec the flow
    trained records what the flow's train and evaluate tasks recorded; only the path tag says where it ran."""
    import mlflow

    from fitburst import cli
    from fitburst.spec import load_resolved
    from fitburst.tracking import RUN_ID_ENV, Tracker

    flow_id = demo_run["mlflow_run_id"]
    spec_file = mlflow.artifacts.download_artifacts(run_id=flow_id, artifact_path="config/planned.yaml",
                                                    dst_path=str(tmp_path))
    node = Tracker.start(load_resolved(spec_file))
    monkeypatch.setenv(RUN_ID_ENV, node.run_id)
    assert cli.main(["train", "--spec", spec_file, "--prepared", demo_prepared.dir, "--run-dir",
                     str(tmp_path / "run"), "--eval", "--plan", "--quiet"]) == 0
    node.end()

    def records(run_id: str) -> tuple[dict, set, dict]:
        run = client().get_run(run_id)
        ours = ("train.", "eval.", "params.", "memory.measured")
        metrics = {k: v for k, v in run.data.metrics.items() if k.startswith(ours)}
        files = {a.path for d in ("adapter", "train", "eval") for a in client().list_artifacts(run_id, d)}
        tags = {k: run.data.tags.get(k) for k in ("device", "precision", "path")}
        return metrics, files, tags

    (fm, ff, ft), (nm, nf, nt) = records(flow_id), records(node.run_id)
    assert set(fm) == set(nm) and ff == nf and {"eval/samples.json", "train/loss.png"} <= ff
    assert {**ft, "path": None} == {**nt, "path": None} and (ft["path"], nt["path"]) == ("local", "cloud")
    for key in ("train.steps", "train.tokens", "train.final_loss", "params.trainable", "eval.base_loss",
                "eval.tuned_loss", "eval.n_tokens"):
        assert nm[key] == pytest.approx(fm[key], rel=1e-4), key
    curves = [[m.value for m in client().get_metric_history(r, "train_loss")] for r in (flow_id, node.run_id)]
    assert curves[1] == pytest.approx(curves[0], rel=1e-4)


def test_flow_run_is_named_pipeline_date_short_id(demo_run):
    import asyncio
    import re

    from prefect.client.orchestration import get_client

    async def fetch():
        async with get_client() as c:
            return await c.read_flow_runs()

    run = next(r for r in asyncio.run(fetch()) if str(r.id) == client().get_run(
        demo_run["mlflow_run_id"]).data.tags["prefect.flow_run_id"])
    assert re.fullmatch(r"demo-\d{4}-\d{2}-\d{2}-[0-9a-f]{8}", run.name), run.name
    assert run.name.endswith(run.id.hex[:8])

    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def logs():
        async with get_client() as c:
            return await c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])), limit=200)

    # not a terminal: one clean line per logged step, no carriage-return progress bar
    lines = [m.message for m in asyncio.run(logs())]
    steps = [m for m in lines if m.startswith("step ")]
    assert len(steps) == 15 and steps[-1].startswith("step 150/150 · loss ") and "ETA 0s" in steps[-1]
    assert not [m for m in lines if "\r" in m]


def test_progress_artifact_reaches_100_and_preflight_table_exists(demo_run):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    flow_run_id = client().get_run(demo_run["mlflow_run_id"]).data.tags["prefect.flow_run_id"]

    async def fetch():  # this flow run's artifacts (other tests' demo runs share the server)
        async with get_client() as c:
            keys = ArtifactFilterKey(any_=["training-demo", "training-demo-log", "preflight-table-demo"])
            return await c.read_artifacts(artifact_filter=ArtifactFilter(
                key=keys, flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))

    arts = {a.key: a for a in asyncio.run(fetch())}
    progress = arts["training-demo"]
    assert progress.type == "progress" and float(progress.data) == 100.0
    assert progress.description.startswith("step 150/150 · loss ") and "tokens/s · ETA" in progress.description
    log = json.loads(arts["training-demo-log"].data)
    assert [r["step"] for r in log] == list(range(10, 151, 10))
    table = json.loads(arts["preflight-table-demo"].data)
    assert {"weights", "lora_weights", "device total (+ context)"} <= {r["item"] for r in table}


def test_run_is_model_training_with_lineage_and_system_metrics(demo_run, demo_prepared):
    run = client().get_run(demo_run["mlflow_run_id"])
    exp = client().get_experiment(run.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    by_context = {next(t.value for t in d.tags if t.key == "mlflow.data.context"): d.dataset
                  for d in run.inputs.dataset_inputs}
    assert set(by_context) == {"training", "validation"}
    for context, n in (("training", demo_prepared.n_train), ("validation", demo_prepared.n_val)):
        ds = by_context[context]
        assert ds.digest == run.data.params["data.content_hash"] == demo_prepared.content_hash
        assert json.loads(ds.profile)["num_rows"] == n
        assert json.loads(ds.source)["uri"].endswith("fitburst/demo/instructions.jsonl")
    # token statistics are params (and a table), not one-point metrics
    assert run.data.params["data.tokens.p95"] == str(demo_prepared.stats["p95"])
    assert not [k for k in run.data.metrics if k.startswith("data.")]
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(run.data.metrics)
    # validation loss beside the train loss curve: the base model at step 0, the tuned one at the last step
    val = sorted((m.step, m.value) for m in client().get_metric_history(run.info.run_id, "val_loss"))
    assert val == [(0, run.data.metrics["eval.base_loss"]), (150, run.data.metrics["eval.tuned_loss"])]


def test_registered_model_generates_like_the_adapter_loaded_directly(demo_run, demo_spec):
    import mlflow
    import torch
    from peft import PeftModel

    from fitburst.models import load_model, load_tokenizer

    run = client().get_run(demo_run["mlflow_run_id"])
    assert [o.model_id for o in run.outputs.model_outputs] and demo_run["version"] == 1
    version = client().get_model_version_by_alias("fitburst-demo", "champion")
    assert str(version.version) == "1" and version.run_id == run.info.run_id
    assert {k: version.tags[k] for k in ("pipeline", "verdict", "path")} == {"pipeline": "demo", "verdict": "local",
                                                                             "path": "local"}
    assert float(version.tags["eval.delta_loss"]) == pytest.approx(run.data.metrics["eval.delta_loss"], abs=1e-5)

    messages = [{"role": "user", "content": "Give me a synonym for happy."}]
    pyfunc = mlflow.pyfunc.load_model("models:/fitburst-demo@champion")
    logged = pyfunc.predict({"messages": messages, "max_tokens": 12})[0]["choices"][0]["message"]["content"]

    tok = load_tokenizer(demo_run["adapter_dir"])
    direct = PeftModel.from_pretrained(load_model(demo_spec.model.name, dtype=torch.float32, device="cpu"),
                                       demo_run["adapter_dir"])
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = direct.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    expected = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert logged.strip() == expected and expected
    # and through the transformers flavor: the same PEFT model
    components = mlflow.transformers.load_model("models:/fitburst-demo/1", return_type="components")
    assert type(components["model"]).__name__ == "PeftModelForCausalLM"


def test_bad_deployment_parameter_fails_with_one_message_and_no_traceback(prefect_server, pipelines_file):
    """A deployment parameter that passes the server's schema but not the spec's rules (here max_steps 0) ends the
    flow run Failed with the located message in its state and log, and no traceback in the run's logs."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from flows.finetune import finetune

    state = finetune(pipeline="demo", overrides={"training.max_steps": 0}, pipelines_file=str(pipelines_file),
                     return_state=True)
    assert state.is_failed() and "max_steps" in state.message

    async def logs():
        async with get_client() as c:
            flt = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id]))
            return [m.message for m in await c.read_logs(flt, limit=200)]

    lines = asyncio.run(logs())
    assert [m for m in lines if "max_steps" in m] and not [m for m in lines if "Traceback" in m], lines
