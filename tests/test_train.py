"""The training recipe on CPU (pinned with ``preflight.device: cpu``, so a GPU host runs the same tests): it learns,
checkpoints, resumes after an interruption or a crash, runs QLoRA through real bitsandbytes, and refuses what a
device cannot do before loading anything."""

from __future__ import annotations

import json

import pytest
import torch

from fitburst.device import DeviceError, check_quant_supported, select_device
from fitburst.train import latest_checkpoint, train


def small(spec, **training):
    """``spec`` with ``training`` changed, on the CPU whatever this host has."""
    return spec.model_copy(update={"training": spec.training.model_copy(update=training),
                                   "preflight": spec.preflight.model_copy(update={"device": "cpu"})})


def test_train_learns_and_writes_run_folder(tmp_path, demo_spec, demo_prepared):
    spec = small(demo_spec, max_steps=40, log_every=10, checkpoint_every=20)
    r = train(spec, demo_prepared, tmp_path, progress=False)
    assert (r.steps, r.total_steps, r.device, r.precision) == (40, 40, "cpu", "fp32")
    curve = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in curve] == [10, 20, 30, 40]
    assert curve[-1]["train_loss"] < curve[0]["train_loss"] - 0.5
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert 0 < r.trainable_params < r.total_params
    assert r.peak.kind == "cpu" and r.peak.allocated_bytes > 0
    assert json.loads((tmp_path / "train_result.json").read_text())["steps"] == 40


def test_interrupted_run_resumes_from_checkpoint(tmp_path, demo_spec, demo_prepared):
    spec = small(demo_spec, max_steps=30, checkpoint_every=10, log_every=5)
    first = train(spec, demo_prepared, tmp_path / "a", progress=False, stop_after=12)
    assert first.steps == 12
    assert latest_checkpoint(tmp_path / "a").name == "step-12"
    resumed = train(spec, demo_prepared, tmp_path / "a", progress=False)
    assert resumed.resumed_from == 12 and resumed.steps == 30
    # the resumed run ends where an uninterrupted one does (same data order, optimizer and scheduler state)
    train(spec, demo_prepared, tmp_path / "b", progress=False)
    a = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert a[-1]["step"] == b[-1]["step"] == 30
    assert a[-1]["train_loss"] == pytest.approx(b[-1]["train_loss"], rel=1e-3)


def test_crash_leaves_a_resumable_checkpoint(tmp_path, demo_spec, demo_prepared):
    spec = small(demo_spec, max_steps=20, checkpoint_every=100, log_every=5)

    def explode(row, step):
        if step == 15:
            raise RuntimeError("disk full (simulated)")

    with pytest.raises(RuntimeError, match="disk full"):
        train(spec, demo_prepared, tmp_path, progress=False, on_metrics=explode)
    assert latest_checkpoint(tmp_path).name == "step-15"
    assert train(spec, demo_prepared, tmp_path, progress=False).resumed_from == 15


@pytest.mark.parametrize("quant, layer", [("nf4", "Linear4bit"), ("int8", "Linear8bitLt")])
def test_quantized_base_trains_on_cpu_with_bitsandbytes(tmp_path, demo_spec, demo_prepared, quant, layer):
    import bitsandbytes as bnb

    from fitburst.train import build_model

    qlora = demo_spec.method.model_copy(update={"type": "qlora", "quant": quant})
    spec = small(demo_spec.model_copy(update={"method": qlora}))
    model, _ = build_model(spec, "cpu", "fp32")
    assert any(isinstance(m, getattr(bnb.nn, layer)) for m in model.modules())
    del model
    r = train(small(spec, max_steps=15, log_every=5), demo_prepared, tmp_path, progress=False)
    curve = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert r.steps == 15 and curve[-1]["train_loss"] < curve[0]["train_loss"]


def test_device_refusals():
    with pytest.raises(DeviceError, match="bitsandbytes .* MPS"):
        check_quant_supported("nf4", "mps")
    if torch.cuda.is_available():
        assert select_device("T4") == "cuda"  # a named GPU trains on this host's GPU
    else:
        with pytest.raises(DeviceError, match="no cuda device"):
            select_device("T4")
    best = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert select_device("auto") == best
    assert select_device("cpu") == "cpu"
