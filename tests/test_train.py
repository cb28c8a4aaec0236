"""The training recipe on CPU (pinned with ``preflight.device: cpu``, so a GPU host runs the same tests): it learns,
checkpoints, resumes after an interruption or a crash, runs QLoRA through real bitsandbytes, and refuses what a
device cannot do before loading anything."""

from __future__ import annotations

import json

import pytest
import torch

from fitburst.checkpoints import latest_checkpoint
from fitburst.device import DeviceError, select_device
from fitburst.recipe import train


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

    from fitburst.builders import build_model

    qlora = demo_spec.method.model_copy(update={"type": "qlora", "quant": quant})
    spec = small(demo_spec.model_copy(update={"method": qlora}))
    model, _ = build_model(spec, "cpu", "fp32")
    assert any(isinstance(m, getattr(bnb.nn, layer)) for m in model.modules())
    del model
    r = train(small(spec, max_steps=15, log_every=5), demo_prepared, tmp_path, progress=False)
    curve = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert r.steps == 15 and curve[-1]["train_loss"] < curve[0]["train_loss"]


def test_device_refusals():
    if torch.cuda.is_available():
        assert select_device("T4") == "cuda"  # a named GPU trains on this host's GPU
    else:
        with pytest.raises(DeviceError, match="no cuda device"):
            select_device("T4")
    best = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert select_device("auto") == best
    assert select_device("cpu") == "cpu"


def test_the_loss_is_read_on_the_host_at_log_intervals_only(tmp_path, demo_spec, demo_prepared, monkeypatch):
    """Each step's loss stays on the device, summed there; the host reads it (waiting for the device) once per
    logged row, not once per step."""
    import fitburst.recipe as loop

    reads: list[int] = []

    class Watched(torch.Tensor):
        def item(self):
            reads.append(1)
            return super().item()

    step = loop.optimizer_step
    monkeypatch.setattr(loop, "optimizer_step", lambda *a, **k: step(*a, **k).as_subclass(Watched))
    r = train(small(demo_spec, max_steps=6, log_every=3), demo_prepared, tmp_path, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert r.steps == 6 and [row["step"] for row in rows] == [3, 6] and len(reads) == 2
    assert all(row["train_loss"] > 0 for row in rows)


def test_the_pace_leaves_out_the_warm_up_step(tmp_path, demo_spec, demo_prepared, monkeypatch):
    """A clock that takes 100 s for the first step and 1 s for each later one: steps/s and tokens/s are the later
    steps' (the real tokens of their micro-batches, per second); no MFU on the CPU, whose peak is not known."""
    import fitburst.recipe as loop

    now = [0.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: now[0])
    timed: list[int] = []
    step = loop.optimizer_step

    def clocked(model, optimizer, params, micro, **k):
        loss = step(model, optimizer, params, micro, **k)
        now[0] += 100.0 if not timed and now[0] == 0.0 else 1.0
        timed.append(sum(int(b["attention_mask"].sum()) for b in micro))
        return loss

    monkeypatch.setattr(loop, "optimizer_step", clocked)
    r = train(small(demo_spec, max_steps=4, log_every=2, grad_accum=2), demo_prepared, tmp_path, progress=False)
    assert r.steps_per_sec == pytest.approx(1.0)
    assert r.tokens_per_sec == pytest.approx(sum(timed[1:]) / 3) and r.tokens == sum(timed)
    assert r.mfu is None
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "tokens_per_s" in rows[-1] and "mfu" not in rows[-1]


def test_mfu_is_model_flops_over_the_devices_peak():
    """PaLM's count over a timed step: 6 x parameters x tokens, plus 12 x layers x width x each length squared."""
    from fitburst.hours import PEAK_TFLOPS, peak_tflops
    from fitburst.memory import resolve_device
    from fitburst.pace import Pace, progress_fields

    pace = Pace("cpu", peak_tflops=1e-6, params=1000, attn_width=8, t0=0.0)  # 1 MFLOP/s
    pace.add([{"input_ids": torch.zeros(2, 5), "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1] * 5])}])
    assert (pace.steps, pace.tokens, pace.flops) == (1, 8, 6 * 1000 * 8 + 12 * 8 * (3 * 3 + 5 * 5))
    assert peak_tflops(resolve_device("H100")) == PEAK_TFLOPS["H100"] and peak_tflops(resolve_device("cpu")) is None
    assert progress_fields({"train_loss": 1.5, "tokens_per_s": 1234.0, "mfu": 0.412}) == {
        "loss": "1.500", "tok/s": "1,234", "mfu": "41.2%"}


def test_a_micro_batch_stays_where_it_is_on_the_cpu():
    """No pinned copy off CUDA: on the CPU the loop trains on the collated tensor itself."""
    from fitburst.train import to_device

    t = torch.arange(6)
    assert to_device(t, "cpu") is t
