"""The measured probe: real optimizer steps on the longest batch, measured vs estimated, and the re-plan."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fitburst.preflight import preflight


@pytest.fixture(scope="module")
def cpu_spec(demo_spec):
    """The demo pinned to a 1 GiB CPU: the probe runs where the report planned, on any host (a CUDA one too)."""
    return demo_spec.model_copy(update={"preflight": demo_spec.preflight.model_copy(update={"device": "cpu:1GiB"})})


@pytest.fixture(scope="module")
def demo_report(cpu_spec, demo_prepared):
    return preflight(cpu_spec, demo_prepared.stats["max"], "cpu:1GiB", n_train=demo_prepared.n_train,
                     mean_len=demo_prepared.stats["mean"])


def test_probe_measures_the_longest_batch_and_logs_to_mlflow(cpu_spec, demo_prepared, demo_report):
    from fitburst.preflight import probe_and_replan
    from fitburst.tracking import Tracker

    tracker = Tracker.start(cpu_spec)
    report, res = probe_and_replan(cpu_spec, demo_prepared, demo_report, tracker)
    # a tiny model under a 1 GiB budget: nothing to change in memory; the time now comes from the probe
    assert report.plan is demo_report.plan and report.local_time.source.startswith("probe: ")
    assert demo_report.local_time.source.startswith("table: CPU")
    assert res["device"] == "cpu" and res["steps"] == 2
    assert res["batch"] == cpu_spec.training.micro_batch_size
    assert res["seq_len"] == demo_prepared.stats["max"]  # the longest samples, padded to the longest
    assert all(math.isfinite(x) for x in res["losses"])
    # CPU: live tensor bytes (dispatch tracker) against the estimate's allocated peak
    assert res["estimated_peak_bytes"] == demo_report.estimate.allocated_peak_bytes
    assert res["tokens_per_s"] > 0  # the second step, timed: what the local hours are then estimated from
    assert 0.9 < res["ratio"] < 1.1, res
    metrics = tracker.client.get_run(tracker.run_id).data.metrics
    assert metrics["memory.probe_peak_bytes"] == res["measured_peak_bytes"]
    assert metrics["memory.probe_estimated_bytes"] == res["estimated_peak_bytes"]
    assert metrics["memory.probe_replanned"] == 0.0
    tracker.end()


def test_probe_over_budget_sends_the_planner_one_rung_down(cpu_spec, demo_report):
    from fitburst.preflight import replan_after_probe as replan

    budget = demo_report.device.budget_bytes
    est = demo_report.estimate.reserved_peak_bytes
    # a probe that measures more than the budget less headroom: the current plan is short at the scaled budget
    measured = int(demo_report.plan.limit_bytes / 0.95)
    fake = {"measured_peak_bytes": measured, "estimated_peak_bytes": est}
    new = replan(cpu_spec, demo_report, fake)
    assert new is not demo_report and new.verdict.placement == "local"
    assert any(c.startswith("probe measured") for c in new.changes)
    assert len(new.changes) > len(demo_report.changes) + 1
    assert abs(new.device.budget_bytes - budget * est / measured) <= 1
    assert new.plan.needed_bytes <= new.plan.limit_bytes < demo_report.plan.limit_bytes
    before, after = demo_report.planned_spec().training, new.planned_spec().training
    assert (after.micro_batch_size, after.gradient_checkpointing) != (before.micro_batch_size,
                                                                       before.gradient_checkpointing)
    assert after.effective_batch == before.effective_batch


def test_probe_under_budget_or_impossible(cpu_spec, demo_report):
    from fitburst.preflight import replan_after_probe as replan

    ok = {"measured_peak_bytes": 10 << 20, "estimated_peak_bytes": 10 << 20}
    assert replan(cpu_spec, demo_report, ok) is demo_report  # no measured rate, no re-plan: unchanged
    huge = {"measured_peak_bytes": 100 * demo_report.device.budget_bytes, "estimated_peak_bytes": 1 << 20}
    new = replan(cpu_spec, demo_report, huge)
    assert new.verdict.placement == "fail"  # the demo's burst.policy is never
    assert "nothing allowed fits" in new.reason


def test_probe_refuses_what_the_device_cannot_run_before_it_loads(pipelines_file, demo_prepared, monkeypatch):
    """As the Recipe does: k-bit weights on MPS (no bitsandbytes there) are refused by the rule table's row, with
    the field and the fix, before any model loads."""
    import fitburst.builders
    from fitburst.probe import probe
    from fitburst.spec import load_pipeline
    from fitburst.train import TrainError

    def load(*args, **kwargs):
        raise AssertionError("the probe loaded the model")

    monkeypatch.setattr(fitburst.builders, "build_model", load)
    qlora = load_pipeline(pipelines_file, "demo", {"method.type": "qlora"})
    with pytest.raises(TrainError, match="field 'method.quant': nf4 weights need bitsandbytes, which has no MPS"):
        probe(qlora, demo_prepared, None, "mps")  # type: ignore[arg-type]  # refused before the estimate is read


def _oom_in_step(monkeypatch, make_error):
    """The probe's training step (fitburst.train.optimizer_step) fails with ``make_error()`` on its first call."""
    import fitburst.train

    def step(*args, **kwargs):
        raise make_error()

    monkeypatch.setattr(fitburst.train, "optimizer_step", step)


def _real_cpu_allocator_error() -> RuntimeError:
    """What torch's own CPU allocator raises when an allocation cannot be served (no message typed here)."""
    import torch

    try:
        torch.empty(1 << 60, dtype=torch.uint8)
    except RuntimeError as e:
        return e
    raise AssertionError("a 1 EiB allocation succeeded")


@pytest.mark.parametrize("kind, make_error", [
    ("mps", lambda: RuntimeError("MPS backend out of memory (MPS allocated: 17.80 GB, other allocations: 1.20 GB, "
                                 "max allowed: 18.13 GB). Tried to allocate 256.00 MB on private pool.")),
    ("cpu", _real_cpu_allocator_error),
])
def test_an_out_of_memory_probe_is_a_measurement_not_a_crash(monkeypatch, cpu_spec, demo_prepared, demo_report,
                                                            kind, make_error):
    """A probe that runs out of memory on MPS or CPU (a RuntimeError, not torch.OutOfMemoryError) says the run
    needs at least the whole device: the preflight re-plans for a smaller budget instead of crashing."""
    from fitburst.preflight import probe_and_replan

    _oom_in_step(monkeypatch, make_error)
    report, res = probe_and_replan(cpu_spec, demo_prepared, demo_report)
    assert res["oom"] == kind
    assert res["measured_peak_bytes"] == demo_report.device.total_bytes
    assert report is not demo_report and report.device.budget_bytes < demo_report.device.budget_bytes
    assert any(c.startswith("probe measured") for c in report.changes) or "probe measured" in report.reason


def test_a_probe_error_that_is_not_out_of_memory_is_raised(monkeypatch, cpu_spec, demo_prepared, demo_report):
    from fitburst.preflight import probe_and_replan

    _oom_in_step(monkeypatch, lambda: RuntimeError("expected scalar type Float but found Half"))
    with pytest.raises(RuntimeError, match="expected scalar type"):
        probe_and_replan(cpu_spec, demo_prepared, demo_report)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc resident high-water mark")
def test_the_cpu_tracker_agrees_with_the_operating_system_on_a_warm_step(root):
    """The CPU reference (the probe's dispatch tracker of live tensor bytes) against the process's own resident
    memory over the same optimizer step, with glibc returning large blocks to the OS at once
    (MALLOC_MMAP_THRESHOLD_=131072): the warm step's growth agrees; the first step needs more than its tensors
    (library code, thread pools, kernel set-up), which the estimate's CPU runtime floor stands for."""
    import json
    import os
    import subprocess
    import sys

    cfg = dict(arch="llama", dtype="fp32", method="lora", rank=8, targets=["q_proj", "v_proj"], batch=2,
               seq_len=256, root=os.environ["TMPDIR"])
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "_measure.py"), json.dumps(cfg)],
                         capture_output=True, text=True, env=env, timeout=300)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, out.stderr[-2000:]
    first, warm = json.loads(lines[0][len("RESULT "):])["steps"]
    tracker = warm["tracker_peak"] - warm["tracker_start"]
    rss = warm["rss_hwm"] - warm["rss_before"]
    assert tracker > 20 << 20
    assert abs(rss / tracker - 1) < 0.05, (rss, tracker)
    first_extra = (first["rss_hwm"] - first["rss_before"]) - (first["tracker_peak"] - first["tracker_start"])
    assert first_extra > 4 << 20, first_extra
