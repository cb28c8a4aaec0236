"""The tuned model in MLflow's registry (versions, champion alias), `fitburst merge`, the Hub push and its model
card, and the like-with-like memory plot; against a real MLflow sqlite store and real short training runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

SENTINEL = "hf_trackingSENTINEL0123456789"


@pytest.fixture(scope="module")
def short_runs(pipelines_file, demo_prepared, tmp_path_factory):
    """Two real trainings of the demo pipeline: 3 steps (barely tuned) and 40 steps (clearly better)."""
    from fitburst.evaluate import evaluate
    from fitburst.recipe import train
    from fitburst.spec import load_pipeline

    out = {}
    for steps in (3, 40):
        spec = load_pipeline(pipelines_file, "demo", {"training.max_steps": steps, "training.log_every": 1,
                                                      "eval.samples": 0, "tracking.register_as": "tracking-test"})
        result = train(spec, demo_prepared, tmp_path_factory.mktemp(f"run{steps}"), progress=False)
        ev = evaluate(spec, demo_prepared, result.adapter_dir, device=result.device, precision=result.precision)
        out[steps] = (spec, result, ev)
    assert out[40][2].tuned_loss < out[3][2].tuned_loss
    return out


def _log_and_register(spec, result, ev):
    from mlflow.tracking._tracking_service import utils

    from fitburst.tracking import Tracker

    tracker = Tracker.start(spec)
    # MLflow's process-wide state: unset here (MLFLOW_TRACKING_URI decides, and must go on deciding)
    before = (utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI"))
    info = tracker.log_model(spec, result.adapter_dir, precision=result.precision)
    assert (utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")) == before  # left exactly as it was
    tags = {"pipeline": spec.name, "verdict": "local", "path": "local", "eval.tuned_loss": ev.tuned_loss,
            "eval.delta_loss": ev.delta_loss}
    reg = tracker.register_model("tracking-test", info.model_id, tags, ev.tuned_loss)
    tracker.end()
    return tracker, reg


def test_versions_per_run_and_champion_follows_the_better_eval(short_runs):
    from mlflow.tracking import MlflowClient

    c = MlflowClient()
    _, first = _log_and_register(*short_runs[3])
    assert first == {"version": 1, "champion": 1, "moved": True}  # no holder yet
    t2, second = _log_and_register(*short_runs[40])
    assert second == {"version": 2, "champion": 2, "moved": True}  # lower eval loss takes the alias
    _, third = _log_and_register(*short_runs[3])
    assert third == {"version": 3, "champion": 2, "moved": False}  # worse: registered, alias stays
    champ = c.get_model_version_by_alias("tracking-test", "champion")
    assert str(champ.version) == "2" and champ.run_id == t2.run_id
    assert float(champ.tags["eval.tuned_loss"]) == pytest.approx(short_runs[40][2].tuned_loss)
    assert c.get_run(t2.run_id).data.tags["registry.champion"] == "2"


def test_merge_folds_the_adapter_into_the_base_dtype(short_runs, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fitburst.cli import main
    from fitburst.models import load_model

    spec, result, _ = short_runs[40]
    assert main(["merge", result.run_dir, "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    base = load_model(spec.model.name, dtype=torch.float32, device="cpu")
    assert merged.dtype == base.dtype and not (tmp_path / "merged" / "adapter_config.json").exists()
    direct = PeftModel.from_pretrained(base, result.adapter_dir).eval()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, direct(ids).logits, atol=1e-4, rtol=1e-4)
        with direct.disable_adapter():  # the adapter changed something, so the match above means something
            assert (direct(ids).logits - merged(ids).logits).abs().max() > 1e-3
    assert (tmp_path / "merged" / "tokenizer.json").exists()


def test_merge_of_a_folder_without_adapter_is_a_located_error(tmp_path, capsys):
    from fitburst.cli import main

    assert main(["merge", str(tmp_path)]) == 2
    assert "no adapter_config.json" in capsys.readouterr().err


def test_push_to_hub_sends_adapter_and_card_through_the_hub_api(short_runs, monkeypatch):
    """No hub server here: the HfApi calls are captured at huggingface_hub's boundary (create_repo, upload_folder)."""
    from huggingface_hub import HfApi

    from fitburst.share import model_card, push_adapter

    calls = {}

    def create_repo(self, repo_id, **kw):
        calls["create"] = (repo_id, kw, self.token)

    def upload_folder(self, *, repo_id, folder_path, **kw):
        calls["upload"] = (repo_id, {p.name: p.read_bytes() for p in Path(folder_path).iterdir()})
        return "https://huggingface.co/me/demo-lora/commit/abc"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setenv("HF_TOKEN", SENTINEL)
    spec, result, ev = short_runs[40]
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"hf_token": "${HF_TOKEN}"}),
                                   "description": f"token {SENTINEL}"})
    metrics = {"eval.base_loss": ev.base_loss, "eval.tuned_loss": ev.tuned_loss, "eval.base_ppl": ev.base_ppl,
               "eval.tuned_ppl": ev.tuned_ppl}
    card = model_card(spec, base=spec.model.name, run_id="r123", metrics=metrics,
                      tags={"path": "local", "device": "cpu", "precision": "fp32"})
    assert card.startswith("---\n") and "base_model: fitburst/tiny-demo" in card and "library_name: peft" in card
    assert f"| tuned | {ev.tuned_loss:.4f} |" in card and f"| base | {ev.base_loss:.4f} |" in card
    assert "rank 16" in card and "MLflow run: `r123`" in card
    url = push_adapter("me/demo-lora", result.adapter_dir, card, token=SENTINEL)
    assert url.endswith("/commit/abc")
    repo, kw, token = calls["create"]
    assert repo == "me/demo-lora" and kw["private"] and token == SENTINEL  # the token goes to the API only
    repo, files = calls["upload"]
    assert repo == "me/demo-lora"
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "tokenizer.json"} <= set(files)
    assert files["README.md"].decode() == card
    for name, data in files.items():
        assert SENTINEL.encode() not in data, name


def _estimate(allocated: int, reserved: int, total: int, components: dict[str, int]):
    from fitburst.memory import Estimate

    return Estimate(allocated_peak_bytes=allocated, reserved_peak_bytes=reserved, device_total_bytes=total,
                    components=components, peak_phase="backward", device="test", budget_bytes=8 << 30, params={})


def test_memory_plot_pairs_only_like_with_like():
    from fitburst.meter import MemoryPeak
    from fitburst.plots import comparable_pairs

    est = _estimate(100, 130, 600, {"weights": 60, "activations": 40})
    cpu = comparable_pairs(est, MemoryPeak("cpu", allocated_bytes=120, rss_peak_bytes=640))
    assert cpu == [("run's added memory", 130, 120), ("process total (VmHWM)", 600, 640)]
    cuda = comparable_pairs(est, MemoryPeak("cuda", allocated_bytes=98, reserved_bytes=128, rss_peak_bytes=9))
    assert cuda == [("tensor peak (allocated)", 100, 98), ("allocator reserved", 130, 128)]  # host RSS: not GPU


def test_memory_comparison_and_loss_plots_render(tmp_path):
    from fitburst.meter import MemoryPeak
    from fitburst.plots import loss_curve, memory_comparison

    est = _estimate(2 << 30, 3 << 30, 4 << 30, {"weights": 1 << 30, "activations": 1 << 30})
    png = memory_comparison(est, MemoryPeak("cuda", allocated_bytes=2 << 30, reserved_bytes=3 << 30),
                            tmp_path / "m.png")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({"step": s, "train_loss": 3 - s / 10}) for s in range(1, 11)))
    loss = loss_curve(metrics, tmp_path / "l.png", eval_points={"base": 3.2, "tuned": 2.1})
    for p in (png, loss):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_two_runs_starting_together_on_a_fresh_sqlite_store_both_start(tmp_path):
    """Two flow runs triggered at once on a store that does not exist yet: each finds or creates the experiment
    under the store's lock, so neither fails while the other creates MLflow's tables."""
    import subprocess
    import sys
    import textwrap

    uri = f"sqlite:///{tmp_path / 'fresh.db'}"
    go = tmp_path / "go"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from fitburst.spec import PipelineSpec
        from fitburst.tracking import Tracker
        spec = PipelineSpec.model_validate(dict(name="p", model=dict(name="fitburst/tiny-demo"),
                                                data=dict(path="x.jsonl"), tracking=dict(uri={uri!r})))
        import os
        Path({str(tmp_path)!r}, f"ready-{{os.getpid()}}").touch()
        while not Path({str(go)!r}).exists():
            time.sleep(0.01)
        print(Tracker.start(spec).run_id)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "MLFLOW_TRACKING_URI": uri}) for _ in range(2)]
    while len(list(tmp_path.glob("ready-*"))) < 2 and all(p.poll() is None for p in procs):
        subprocess.run(["sleep", "0.05"])  # both imported, each waiting for the other
    go.touch()
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 2
