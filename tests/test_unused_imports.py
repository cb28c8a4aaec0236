"""A fitburst process leaves out the optional packages it never calls (fitburst.unused_imports): every process
scikit-learn, a rank bitsandbytes too unless its settings use it; the libraries that would import them take their
own not-installed branch."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fitburst.settings import RunSettings
from fitburst.unused_imports import leave_out, leave_out_in_a_flow_run, unused_packages


@pytest.mark.parametrize(("settings", "unused"), [
    (RunSettings(method="lora"), ["sklearn", "bitsandbytes"]),
    (RunSettings(method="full"), ["sklearn", "bitsandbytes"]),
    (RunSettings(method="qlora"), ["sklearn"]),  # quant resolved to nf4
    (RunSettings(method="qlora", quant="nf4"), ["sklearn"]),
    (RunSettings(method="lora", quant="int8"), ["sklearn"]),
    (RunSettings(method="lora", optimizer="adamw8bit"), ["sklearn"]),
    (RunSettings(method="lora", optimizer="paged_adamw8bit"), ["sklearn"]),
])
def test_bitsandbytes_is_left_out_unless_the_run_quantizes_or_uses_its_optimizer(settings, unused):
    assert unused_packages(settings) == unused


def test_a_package_left_out_is_not_installed_for_peft_and_transformers(monkeypatch):
    for name in ("bitsandbytes", "sklearn"):
        monkeypatch.setitem(sys.modules, name, None)  # restored (or removed) after the test, as it was before
        del sys.modules[name]
    assert leave_out(["bitsandbytes", "sklearn", "json"]) == ["bitsandbytes", "sklearn"]  # json: imported already
    assert sys.modules["json"] is not None
    assert importlib.util.find_spec("bitsandbytes") is importlib.util.find_spec("sklearn") is None  # what both ask
    with pytest.raises(ImportError):
        import sklearn  # noqa: F401


def test_a_rank_leaves_out_what_none_of_its_runs_uses():
    assert unused_packages(RunSettings(method="lora"), RunSettings(method="full")) == ["sklearn", "bitsandbytes"]
    assert unused_packages(RunSettings(method="lora"), RunSettings(method="qlora")) == ["sklearn"]


def test_the_fitburst_command_leaves_out_scikit_learn_before_transformers_asks():
    """The process entry marks it first; transformers' generation module (which every model's class imports) then
    loads without it and answers that it is not installed."""
    code = ("import sys\n"
            "from fitburst import cli\n"
            "def main():\n"
            "    import transformers.generation.candidate_generator\n"
            "    from transformers.utils import is_sklearn_available\n"
            "    print(is_sklearn_available(), sys.modules['sklearn'])\n"
            "    return 0\n"
            "cli.main = main\n"
            "sys.exit(cli.entry())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "None"]


@pytest.mark.parametrize("flow_run", [True, False])
def test_a_flow_runs_process_leaves_out_scikit_learn_before_transformers_asks(flow_run):
    """Prefect's flow-run process imports flows/finetune.py first (PREFECT__FLOW_RUN_ID set): scikit-learn is left
    out there, and transformers answers that it is not installed; any other process that imports the flow keeps
    it."""
    code = ("import sys\n"
            "import flows.finetune\n"
            "import transformers.generation.candidate_generator\n"
            "from transformers.utils import is_sklearn_available\n"
            "print(is_sklearn_available(), sys.modules.get('sklearn', 'unimported') is None)\n")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT__FLOW_RUN_ID"}
    if flow_run:
        env["PREFECT__FLOW_RUN_ID"] = "00000000-0000-0000-0000-000000000000"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == (["False", "True"] if flow_run else ["True", "False"])


def test_a_process_where_transformers_already_asked_leaves_nothing_out(monkeypatch):
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", "00000000-0000-0000-0000-000000000000")
    import transformers  # noqa: F401  (this test process: imported, and asked)

    assert leave_out_in_a_flow_run() == []
