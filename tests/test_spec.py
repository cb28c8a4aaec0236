"""pipelines.yaml: the shipped file is valid; mistakes are reported with file, line, field, value and a fix."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from fitburst.spec import SpecError, expand_dotted, load_all, load_pipeline, load_resolved, resolve_env

GOOD = """\
defaults:
  training:
    micro_batch_size: 4
    learning_rate: 1.0e-4
pipelines:
  a:
    model: {name: org/model}
    data: {path: data.jsonl}
    training:
      max_steps: 10
"""


def write(tmp_path, text):
    (tmp_path / "data.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    p = tmp_path / "pipelines.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def problems(tmp_path, text, name=None):
    p = write(tmp_path, text)
    with pytest.raises(SpecError) as exc:
        load_pipeline(p, name) if name else load_all(p)
    return str(exc.value), exc.value.problems


def test_shipped_pipelines_file_is_valid(pipelines_file):
    specs = load_all(pipelines_file)
    assert "demo" in specs and specs["demo"].model.name == "fitburst/tiny-demo"
    assert specs["demo"].data_path().exists()


def test_defaults_merge_and_qlora_quant_default(tmp_path):
    spec = load_pipeline(write(tmp_path, GOOD), "a")
    assert spec.training.micro_batch_size == 4 and spec.training.max_steps == 10
    assert spec.training.learning_rate == 1e-4
    assert spec.method.quant == "none"
    q = load_pipeline(write(tmp_path, GOOD), "a", {"method.type": "qlora"})
    assert q.method.quant == "nf4"


@pytest.mark.parametrize(
    "bad, line, needles",
    [
        # a typo in a field name: line of the key, and a suggestion
        (GOOD.replace("max_steps: 10", "max_step: 10"), 10, ["training.max_step", "did you mean 'max_steps'"]),
        # wrong type: the value is echoed
        (GOOD.replace("max_steps: 10", "max_steps: ten"), 10, ["training.max_steps", "'ten'", "integer"]),
        # not one of the choices: the choices are listed
        (GOOD.replace("training:\n      max", "method: {type: lorra}\n    training:\n      max"), 9,
         ["method.type", "'lorra'", "'lora'", "'qlora'"]),
        # a literal secret where a reference belongs
        (GOOD.replace("name: org/model}", "name: org/model, hf_token: hf_abcdef123}"), 7,
         ["model.hf_token", "${HF_TOKEN}"]),
        # an error that comes from the defaults section is located there
        (GOOD.replace("micro_batch_size: 4", "micro_batch_size: 0"), 3,
         ["training.micro_batch_size", "greater than or equal to 1"]),
        # cross-field rule
        (GOOD.replace("training:\n      max", "method: {type: qlora, quant: none}\n    training:\n      max"), 9,
         ["qlora needs a quantized base"]),
        # cron shape and timezone
        (GOOD + "    schedule: {cron: '0 2 * *', timezone: Mars/Olympus}\n", 11, ["five fields", "unknown timezone"]),
        # missing required section
        (GOOD.replace("    data: {path: data.jsonl}\n", ""), 6, ["field 'data' is required"]),
        # a data file that is not there, named with where it was looked for
        (GOOD.replace("data.jsonl", "dta.jsonl"), 8, ["data.path", "'dta.jsonl'", "file not found"]),
        # evaluation without a validation split
        (GOOD.replace("data: {path: data.jsonl}", "data: {path: data.jsonl, val_split: 0}"), 6,
         ["eval.enabled needs a validation split"]),
        # a device the preflight cannot budget
        (GOOD + "    preflight: {device: RTX4009}\n", 11, ["preflight.device", "'RTX4009'", "RTX4090"]),
        # nothing to adapt
        (GOOD.replace("training:\n      max", "method: {target_modules: []}\n    training:\n      max"), 9,
         ["method.target_modules", "at least 1"]),
        # several GPUs: a bad count, more per node than the limit, MPS x2 (FSDP's own refusals: below)
        (GOOD + "    burst: {gpus: ['A6000:two']}\n", 11, ["burst.gpus", "GPUs per node, e.g. A6000:2"]),
        (GOOD + "    burst: {gpus: ['H100:8'], max_gpus_per_node: 4}\n", 11,
         ["H100:8", "max_gpus_per_node (4)", "raise burst.max_gpus_per_node"]),
        (GOOD + "    preflight: {device: mps x2}\n", 11, ["preflight.device", "MPS is one device", "drop the count"]),
    ],
)
def test_mistakes_are_located(tmp_path, bad, line, needles):
    msg, probs = problems(tmp_path, bad)
    assert str(tmp_path / "pipelines.yaml") in msg
    assert f"line {line}:" in msg, msg
    for n in needles:
        assert n in msg, (n, msg)


def test_yaml_syntax_error_names_line(tmp_path):
    msg, _ = problems(tmp_path, "pipelines:\n  a:\n    model: {name: x\n    data: 1\n")
    assert "not valid YAML" in msg and "line " in msg


def test_unknown_pipeline_and_top_level_key(tmp_path):
    msg, _ = problems(tmp_path, GOOD, name="b")
    assert "no pipeline named 'b'" in msg
    msg, _ = problems(tmp_path, GOOD + "pipeline: {}\n")
    assert "unknown top-level key 'pipeline'" in msg and "line 11" in msg


def test_all_problems_reported_at_once(tmp_path):
    bad = GOOD.replace("max_steps: 10", "max_steps: 0\n      optimizer: adam")
    _, probs = problems(tmp_path, bad)
    assert len(probs) == 2


def test_overrides_dotted_and_located(tmp_path):
    p = write(tmp_path, GOOD)
    assert load_pipeline(p, "a", {"training.max_steps": 3}).training.max_steps == 3
    with pytest.raises(SpecError, match=r"training.max_steps.*from overrides"):
        load_pipeline(p, "a", {"training.max_steps": -3})
    assert expand_dotted({"a.b": 1, "a": {"c": 2}}) == {"a": {"b": 1, "c": 2}}


def test_secrets_stay_references(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_SENTINELsecret")
    text = GOOD.replace("name: org/model}", "name: org/model, hf_token: '${HF_TOKEN}'}")
    spec = load_pipeline(write(tmp_path, text), "a")
    assert "hf_SENTINELsecret" not in spec.to_yaml()
    assert resolve_env(spec.model.hf_token) == "hf_SENTINELsecret"
    out = tmp_path / "resolved.yaml"
    out.write_text(spec.to_yaml())
    assert load_resolved(out) == spec


def test_cli_validate_exit_codes(tmp_path, pipelines_file):
    ok = subprocess.run([sys.executable, "-m", "fitburst.cli", "validate", str(pipelines_file)],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "demo" in ok.stdout
    bad = write(tmp_path, GOOD.replace("max_steps: 10", "max_step: 10"))
    r = subprocess.run([sys.executable, "-m", "fitburst.cli", "validate", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "line 10" in r.stderr and "max_step" in r.stderr


@pytest.mark.parametrize("extra, line, needles", [
    # an Apple GPU is one device
    ("    preflight: {device: mps}\n    training: {max_steps: 10, distributed: fsdp}\n", 10,
     ["training.distributed", "'fsdp'", "MPS", "training.distributed: none"]),
    # bitsandbytes' int8 weights do not shard
    ("    method: {type: qlora, quant: int8}\n    training: {max_steps: 10, distributed: fsdp}\n", 9,
     ["method.quant", "'int8'", "cannot be sharded", "nf4"]),
    # bitsandbytes' optimizers do not step DTensors
    ("    training: {max_steps: 10, distributed: fsdp, optimizer: paged_adamw8bit}\n", 9,
     ["training.optimizer", "8-bit optimizers", "optimizer: adamw"]),
    # the fused loss reads the head's weight outside forward, where FSDP holds a shard
    ("    training: {max_steps: 10, distributed: fsdp, loss: fused}\n", 9,
     ["training.loss", "'fused'", "training.loss: standard"]),
    # offload is FSDP's
    ("    training: {max_steps: 10, distributed: none, fsdp: {cpu_offload: true}}\n", 9,
     ["training.fsdp.cpu_offload", "training.distributed: fsdp"]),
])
def test_distributed_combinations_that_cannot_run_are_refused_with_the_field_and_the_fix(tmp_path, extra, line,
                                                                                       needles):
    text = GOOD.replace("    training:\n      max_steps: 10\n", "") + extra
    msg, probs = problems(tmp_path, text)
    assert len(probs) == 1 and f"line {line}:" in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    fine = load_pipeline(write(tmp_path, GOOD), "a", {"training.distributed": "fsdp",
                                                      "training.fsdp.cpu_offload": True})
    assert fine.training.fsdp.cpu_offload and fine.training.fsdp.reshard_after_forward  # the defaults that work


def test_gpu_counts_are_canonical_and_multi_gpu_devices_accepted(tmp_path):
    spec = load_pipeline(write(tmp_path, GOOD), "a", {"burst.gpus": ["RTXA6000:2", "a100-80gb", "H100:8"],
                                                     "preflight.device": "RTX4090 x2"})
    assert spec.burst.gpus == ["A6000:2", "A100-80GB", "H100:8"]
    assert spec.burst.gpu_choices() == [("A6000", 2), ("A100-80GB", None), ("H100", 8)]
    assert spec.burst.gpu_names() == ["A6000", "A100-80GB", "H100"]
    assert load_pipeline(write(tmp_path, GOOD), "a", {"preflight.device": "cuda:0,1"}).preflight.device == "cuda:0,1"
