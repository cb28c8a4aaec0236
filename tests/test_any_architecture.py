"""Architectures the analytic estimate does not model (GPT-NeoX, OLMo 2, StarCoder2, Granite): transformers builds
them, so `fitburst estimate --exact` and `fitburst preflight` trace them, and plan by tracing (issue 28)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitburst.cli import main

# small configs with the proportions of their families (as benchmarks/_measure.py ARCHS)
_SMALL = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, vocab_size=6000, max_position_embeddings=4096)
ARCHS = {
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=192, intermediate_size=768, num_hidden_layers=2,
                     num_attention_heads=6, vocab_size=6000, max_position_embeddings=4096, tie_word_embeddings=False),
    "olmo2": dict(model_type="olmo2", tie_word_embeddings=False, **_SMALL),
    "starcoder2": dict(model_type="starcoder2", tie_word_embeddings=True, **_SMALL),
    "granite": dict(model_type="granite", tie_word_embeddings=True, **_SMALL),
}
TARGETS = {"gpt_neox": "query_key_value", "olmo2": "q_proj,v_proj", "starcoder2": "q_proj,v_proj",
           "granite": "q_proj,v_proj"}


def _config(tmp_path, arch: str) -> str:
    d = tmp_path / arch
    d.mkdir()
    (d / "config.json").write_text(json.dumps(ARCHS[arch]))
    return str(d)


def _tokenizer(folder: str) -> None:
    """A minimal word-level tokenizer (data prep tokenizes the records before the preflight)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, "<eos>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(folder)


def _meta_params(arch: str) -> int:
    """The parameter count of the model transformers builds from the config (tied weights once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(ARCHS[arch])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw))
    return sum(p.numel() for p in model.parameters())


def _estimate(capsys, *argv: str) -> tuple[int, dict]:
    rc = main(["estimate", *argv, "--json"])
    out = capsys.readouterr()
    assert out.out.strip(), out.err
    return rc, json.loads(out.out)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_exact_estimate_traces_an_architecture_the_analytic_path_does_not_model(arch, tmp_path, capsys):
    """The command the analytic refusal used to point at answers: traced, judged, the real model's parameters."""
    rc, d = _estimate(capsys, "--model", _config(tmp_path, arch), "--method", "lora", "--targets", TARGETS[arch],
                      "--dtype", "fp32", "--device", "cpu", "--seq-len", "128", "--exact")
    assert rc == 0 and d["verdict"] == "local" and d["fits"]
    assert d["method"] == "traced"
    assert d["params"]["base"] == _meta_params(arch)  # the LoRA adapters come on top
    assert d["params"]["trainable"] > 0
    assert any("not one the analytic estimate models" in n for n in d["notes"])


def test_an_unmodelled_architecture_is_planned_by_tracing_with_a_bounded_count(tmp_path, capsys):
    """As configured it misses a small budget; the exact search finds a plan that fits, in at most 6 traces, and
    the plan's settings trace within that budget."""
    ref = _config(tmp_path, "gpt_neox")
    args = ["--model", ref, "--method", "lora", "--targets", "query_key_value", "--dtype", "fp32", "--seq-len", "256",
            "--batch", "8"]
    rc, d = _estimate(capsys, *args, "--device", "cpu:0.3GiB", "--exact")
    assert rc == 0 and not d["fits"] and d["verdict"] == "local"
    planned = d["planned_settings"]
    assert planned is not None and d["plan"]
    assert any("planned by the exact estimate alone" in n and "at most 6" in n for n in d["notes"])
    # the chosen plan, traced on its own, fits the same budget
    flags = ["--batch", str(planned["micro_batch_size"]), "--grad-accum", str(planned["grad_accum"]),
             "--dtype", planned["precision"], "--optimizer", planned["optimizer"],
             "--method", planned["method"], "--quant", planned["quant"], "--dropout", str(planned["dropout"]),
             "--loss", planned["loss"]]
    flags += ["--grad-checkpointing"] if planned["gradient_checkpointing"] else []
    flags += ["--double-quant"] if planned["double_quant"] else []
    rc, again = _estimate(capsys, "--model", ref, "--targets", "query_key_value", "--seq-len", "256", *flags,
                          "--device", "cpu:0.3GiB", "--exact")
    assert rc == 0 and again["fits"], again["needed_bytes"]


def test_a_trace_that_cannot_run_says_what_failed(tmp_path, capsys):
    """int8 is not traced: the refusal names the architecture, the trace's reason and what to do."""
    rc = main(["estimate", "--model", _config(tmp_path, "olmo2"), "--method", "lora", "--quant", "int8",
               "--device", "cpu", "--exact"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "model_type 'olmo2' is not one the analytic estimate models" in err
    assert "the traced estimate cannot run" in err and "int8" in err and "nf4" in err


def test_plain_estimate_answers_for_an_unmodelled_architecture_by_tracing(tmp_path, capsys):
    rc, d = _estimate(capsys, "--model", _config(tmp_path, "granite"), "--device", "cpu", "--seq-len", "64")
    assert rc == 0 and d["method"] == "traced"
    assert any("traced instead" in n and "not instant" in n for n in d["notes"])


def test_preflight_plans_an_unmodelled_architecture_by_tracing(tmp_path, capsys):
    """`fitburst preflight` on a pipeline whose model is a StarCoder2 folder: the traced estimate decides."""
    model = _config(tmp_path, "starcoder2")
    _tokenizer(model)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"say {i}", "output": str(i)}) + "\n" for i in range(20)))
    pipelines = tmp_path / "pipelines.yaml"
    pipelines.write_text(json.dumps({"pipelines": {"sc2": {
        "model": {"name": model}, "data": {"path": str(data), "format": "alpaca", "max_seq_len": 128},
        "method": {"type": "lora", "rank": 8, "target_modules": ["q_proj", "v_proj"]},
        "training": {"micro_batch_size": 2, "max_steps": 10, "precision": "fp32"},
        "burst": {"policy": "never"}}}}))
    rc = main(["preflight", "sc2", "--file", str(pipelines), "--device", "cpu", "--seq-len", "128", "--json"])
    out = capsys.readouterr()
    assert out.out.strip(), out.err
    d = json.loads(out.out)
    assert rc == 0 and d["verdict"] == "local", d["reason"]
    assert d["estimate_method"] == "traced" and d["analytic_estimate"] is None
    assert "no analytic estimate" in d["trace"]
    assert d["estimate"]["params"]["base"] == _meta_params("starcoder2")
    assert d["local_hours"] is not None and d["local_hours"] > 0


# --- the default LoRA targets: all-linear fits every architecture ------------------------------------------

def _model_folder(tmp_path, arch: str, cfg: dict) -> str:
    """A random model of ``cfg`` saved with a minimal tokenizer: what a pipeline's model.name points at."""
    import torch
    from transformers import AutoConfig

    from fitburst.models import auto_model_class

    kw = dict(cfg)
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    path = tmp_path / arch
    auto_model_class(config).from_config(config).save_pretrained(path)
    _tokenizer(str(path))
    return str(path)


PHI3 = dict(model_type="phi3", tie_word_embeddings=False, pad_token_id=0, **{**_SMALL, "num_key_value_heads": 6})
LINEARS = {  # every linear layer of each family but the output head: what peft's all-linear wraps
    "t5": {"q", "k", "v", "o", "wi_0", "wi_1", "wo"},  # the tiny T5 is gated (T5 v1.1)
    "gpt_neox": {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"},
    "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
}


def _family_case(arch: str, tmp_path, root) -> tuple[str, dict]:
    """(model name, data section) of a tiny model of ``arch`` and data its family reads."""
    if arch == "t5":
        return "fitburst/tiny-t5", {"path": str(root / "fitburst/demo/seq2seq.jsonl"), "format": "input_target",
                                    "max_seq_len": 64, "max_target_len": 32}
    model = _model_folder(tmp_path, arch, ARCHS["gpt_neox"] if arch == "gpt_neox" else PHI3)
    return model, {"path": str(root / "fitburst/demo/instructions.jsonl"), "format": "alpaca", "max_seq_len": 64}


@pytest.mark.parametrize("arch", ["t5", "gpt_neox", "phi3"])
def test_a_pipeline_without_target_modules_trains_every_family(arch, tmp_path, root):
    """No method.target_modules: LoRA on every linear layer but the head (q_proj, v_proj fit none of these), and
    the loop trains it."""
    import json as _json

    from fitburst.data import prepare_pipeline
    from fitburst.recipe import train
    from fitburst.spec import PipelineSpec

    model, data = _family_case(arch, tmp_path, root)
    spec = PipelineSpec.model_validate({
        "name": f"{arch}-default-targets", "model": {"name": model}, "data": data,
        "method": {"type": "lora", "rank": 4}, "eval": {"enabled": False},
        "training": {"max_steps": 2, "micro_batch_size": 2, "grad_accum": 1, "checkpoint_every": 100,
                     "log_every": 1, "precision": "fp32"}})
    assert spec.method.target_modules == "all-linear"
    result = train(spec, prepare_pipeline(spec), tmp_path / "run", device="cpu", progress=False)
    assert result.steps == 2 and result.trainable_params > 0
    config = _json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    wrapped = {name.rsplit(".", 1)[-1] for name in config["target_modules"]}
    assert wrapped == LINEARS[arch]


def test_an_explicit_target_list_is_checked_against_the_real_layers_with_a_hint(tmp_path, capsys):
    """A typo in an explicit list is refused by the trace (the loop's own preparation) with the closest name."""
    rc = main(["estimate", "--model", _config(tmp_path, "gpt_neox"), "--targets", "query_key_valu,dense",
               "--device", "cpu", "--dtype", "fp32", "--exact"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "'query_key_valu' (did you mean 'query_key_value'?)" in err and "dense_4h_to_h" in err


# --- the quick (sliced) estimate of an unmodelled architecture -----------------------------------------------

def _deep(tmp_path, arch: str, layers: int = 6) -> str:
    d = tmp_path / f"{arch}-{layers}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**ARCHS[arch], "num_hidden_layers": layers}))
    return str(d)


@pytest.mark.parametrize("arch", ["granite", "gpt_neox"])
def test_plain_estimate_of_an_unmodelled_architecture_is_sliced_and_agrees_with_the_full_trace(arch, tmp_path,
                                                                                              capsys):
    """Two- and three-block models traced and scaled to six blocks: on the CPU the same figure as the whole model's
    trace (every block adds the same bytes there)."""
    args = ["--model", _deep(tmp_path, arch), "--method", "lora", "--targets", TARGETS[arch], "--dtype", "fp32",
            "--device", "cpu", "--seq-len", "128", "--batch", "2"]
    rc, quick = _estimate(capsys, *args)
    assert rc == 0 and quick["method"] == "sliced"
    assert any("traced at two and three blocks" in n for n in quick["notes"])
    rc, full = _estimate(capsys, *args, "--exact")
    assert rc == 0 and full["method"] == "traced"
    assert abs(quick["reserved_peak_bytes"] / full["reserved_peak_bytes"] - 1) < 0.005
    assert quick["params"]["total"] == full["params"]["total"]
    assert quick["error_band"]["source"].startswith("sliced vs full trace")  # its band: the slicing's on the trace's


def test_the_sliced_estimate_chooses_what_the_exact_search_traces(tmp_path, capsys, monkeypatch):
    """As configured the run misses a small budget: the quick estimate rules plans out before any full trace, so
    the search traces fewer times than without it, and its plan still fits when traced on its own."""
    from fitburst.memory import sliced

    ref = _deep(tmp_path, "gpt_neox")
    args = ["--model", ref, "--method", "lora", "--targets", "query_key_value", "--dtype", "fp32", "--seq-len", "256",
            "--batch", "8", "--device", "cpu:0.45GiB", "--exact"]
    rc, d = _estimate(capsys, *args)
    assert rc == 0 and not d["fits"] and d["planned_settings"] is not None
    note = next(n for n in d["notes"] if "planned by the exact estimate alone" in n)
    assert "quick (sliced) estimate(s)" in note
    with_quick = int(note.split(": ")[1].split(" trace")[0])
    monkeypatch.setattr(sliced, "quick_estimate", lambda spec, seq_len: None)
    rc, without = _estimate(capsys, *args)
    note = next(n for n in without["notes"] if "planned by the exact estimate alone" in n)
    assert "quick" not in note and int(note.split(": ")[1].split(" trace")[0]) > with_quick
    assert without["planned_settings"] == d["planned_settings"]  # the same plan, found with fewer traces


def test_a_config_that_cannot_be_sliced_says_why():
    from fitburst.memory.sliced import NotSliceable, depth, sliced_config

    cfg = {"model_type": "gemma3_text", "num_hidden_layers": 6, "layer_types": ["sliding"] * 5 + ["full"]}
    assert depth(cfg) == 6 and sliced_config(cfg, 2)["layer_types"] == ["sliding", "sliding"]
    for bad, why in [({"model_type": "t5", "num_layers": 6, "num_decoder_layers": 6, "is_encoder_decoder": True},
                      "two stacks"), ({"model_type": "x", "num_hidden_layers": 6, "auto_map": {"a": "b"}}, "auto_map"),
                     ({"model_type": "x", "num_hidden_layers": 3}, "deeper than 3")]:
        with pytest.raises(NotSliceable, match=why):
            depth(bad)


@pytest.mark.parametrize("arch", ["t5", "gpt_neox", "phi3"])
def test_a_pipeline_without_target_modules_runs_the_dag(arch, tmp_path, root, prefect_server):
    """data prep -> preflight (for GPT-NeoX the trace plans an architecture the analytic path does not model) ->
    train (LoRA on every linear layer but the head, the default) -> eval -> MLflow, through the Prefect flow."""
    from mlflow.tracking import MlflowClient

    from flows.finetune import finetune

    model, data = _family_case(arch, tmp_path, root)
    pipelines = tmp_path / "pipelines.yaml"
    pipelines.write_text(json.dumps({"pipelines": {arch: {
        "model": {"name": model}, "data": data, "method": {"type": "lora", "rank": 4},
        "training": {"max_steps": 3, "micro_batch_size": 2, "precision": "fp32", "log_every": 1},
        "preflight": {"device": "cpu:8GiB"}, "burst": {"policy": "never"}, "tracking": {"log_model": False}}}}))
    out = finetune(pipeline=arch, pipelines_file=str(pipelines))
    run = MlflowClient().get_run(out["mlflow_run_id"])
    assert run.info.status == "FINISHED", out
    assert run.data.metrics["memory.estimated_peak_bytes"] > 0 and out["eval_tuned_loss"] > 0
    adapter = json.loads((Path(out["adapter_dir"]) / "adapter_config.json").read_text())
    assert {n.rsplit(".", 1)[-1] for n in adapter["target_modules"]} == LINEARS[arch]
