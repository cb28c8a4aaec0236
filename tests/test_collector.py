"""fitburst.collector: a fitburst process collects its garbage seldom from its entry until a real model loads, and
a trace always; training and evaluation run under the thresholds the process had."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fitburst import collector
from fitburst.settings import RunSettings
from fitburst.spec import PipelineSpec

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def thresholds():
    """The test process's thresholds, put back after the test."""
    before = gc.get_threshold()
    yield before
    collector.collect_as_before()
    gc.set_threshold(*before)


def test_a_process_collects_seldom_until_a_model_loads_then_as_before(thresholds):
    from fitburst.models import load_pipeline_model

    collector.collect_seldom_until_a_model_loads()
    collector.collect_seldom_until_a_model_loads()  # a second call keeps what the first replaced
    assert gc.get_threshold() == (collector.START_THRESHOLD, *thresholds[1:])
    spec = PipelineSpec.model_validate(dict(name="t", model=dict(name="fitburst/tiny-demo"), data=dict(path="x")))
    load_pipeline_model(spec, "cpu", "fp32")
    assert gc.get_threshold() == thresholds


def test_seldom_raises_the_first_threshold_only_and_restores_it_on_an_error(thresholds):
    gc.set_threshold(700, 10, 10)
    with pytest.raises(RuntimeError), collector.seldom():
        assert gc.get_threshold() == (collector.START_THRESHOLD, 10, 10)
        raise RuntimeError
    assert gc.get_threshold() == (700, 10, 10)
    gc.set_threshold(10 * collector.START_THRESHOLD, 5, 5)  # a process that collects even less keeps its own
    with collector.seldom():
        assert gc.get_threshold() == (10 * collector.START_THRESHOLD, 5, 5)


def test_a_trace_runs_collecting_seldom(thresholds, monkeypatch, tmp_path):
    from fitburst.memory import trace

    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256)))
    spec = PipelineSpec.model_validate(dict(name="t", model=dict(name=str(tmp_path)), data=dict(path="x")))
    monkeypatch.setattr(trace, "_traced_step", lambda *a, **k: gc.get_threshold())
    gc.set_threshold(700, 10, 10)
    assert trace.trace_step(spec, RunSettings(method="lora"), seq_len=8) == (collector.START_THRESHOLD, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize(("entry", "env"), [
    ("from fitburst import cli\ncli.main = report\ncli.entry()", {}),
    ("import runpy\nfrom fitburst import torchrun\ntorchrun.main = report\n"
     "runpy.run_module('fitburst.torchrun', run_name='__main__')", {}),
    ("import flows.finetune", {"PREFECT__FLOW_RUN_ID": "00000000-0000-0000-0000-000000000000"}),
    ("import flows.finetune", {}),  # a process that imports the flow and is not Prefect's flow run: as it was
])
def test_each_entry_of_a_fitburst_process_collects_seldom(entry, env):
    """The ``fitburst`` command, the ranks' launcher (forked ranks inherit it) and Prefect's flow-run process."""
    code = f"import gc\ndef report():\n    print(gc.get_threshold()[0])\n    return 0\n{entry}\nreport()\n"
    base = {k: v for k, v in os.environ.items() if k != "PREFECT__FLOW_RUN_ID"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**base, **env}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    python_default = 700
    seen = {int(x) for x in proc.stdout.split()}
    assert seen == ({python_default} if entry == "import flows.finetune" and not env else {collector.START_THRESHOLD})
