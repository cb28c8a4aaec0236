"""OOM step-down: a real allocation failure (a CPU training process under RLIMIT_AS) steps down and finishes with
the optimizer-update count of an uninterrupted run at the smaller micro-batch; CUDA and MPS errors raised inside
a step take the same path; the ladder keeps the effective batch and respects preflight.allow."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fitburst.train as train_mod
from fitburst.calibrate import collect_ooms
from fitburst.memory.calibration import OOM_HISTORY_FILE, calibration_path
from fitburst.oom import (
    STEPDOWN_FILE,
    OOMLadderExhausted,
    apply,
    next_rung,
    oom_kind,
    train_stepping_down,
)

CHILD = Path(__file__).with_name("fault_child.py")
MiB = 2**20


def long_and_short(path: Path, n: int = 24) -> Path:
    """Alpaca rows, every third ~500 tokens long: any micro-batch of 8 holds a long one."""
    rng = random.Random(0)
    words = "apple forest garden pencil planet yellow window river stone cloud".split()
    rows = []
    for i in range(n):
        if i % 3 == 0:
            text = " ".join(rng.choice(words) for _ in range(300))
            rows.append({"instruction": "Repeat the words.", "input": text, "output": text[:60]})
        else:
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            rows.append({"instruction": f"Add {a} and {b}.", "input": "", "output": f"{a} + {b} = {a + b}."})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_child(cfg: dict, env: dict, limit: int | None = None) -> dict:
    def cap():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    p = subprocess.run([sys.executable, str(CHILD), json.dumps(cfg)], env=env, capture_output=True, text=True,
                       timeout=300, preexec_fn=cap if limit else None)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def steps_logged(run_dir: str) -> list[int]:
    return [json.loads(x)["step"] for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def test_real_cpu_allocation_failure_steps_down_and_finishes(tmp_path, pipelines_file, root):
    data = long_and_short(tmp_path / "data.jsonl")
    base = {"data.path": str(data), "data.val_split": 0, "data.max_seq_len": 1024, "training.max_steps": None,
            "training.epochs": 1, "training.attention": "eager", "training.log_every": 1, "eval.enabled": False}
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           # big tensors mmapped and unmapped when freed, one malloc arena: address space follows live tensors
           "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    cfg = {"pipelines_file": str(pipelines_file)}
    small = run_child({**cfg, "overrides": {**base, "training.micro_batch_size": 1, "training.grad_accum": 8}},
                      {**env, "FITBURST_RUNS_DIR": str(tmp_path / "small")})
    # room for the micro-batch-1 run and a little more; a micro-batch of 8 long samples needs ~150 MiB more
    limit = small["vm_peak_bytes"] + 40 * MiB
    history = calibration_path().with_name(OOM_HISTORY_FILE)
    before = history.read_text().count("\n") if history.exists() else 0

    big = run_child({**cfg, "overrides": {**base, "training.micro_batch_size": 8, "training.grad_accum": 1}},
                    {**env, "FITBURST_RUNS_DIR": str(tmp_path / "big")}, limit=limit)
    stepped = json.loads(Path(big["run_dir"], STEPDOWN_FILE).read_text())
    assert stepped["history"] and {h["oom_kind"] for h in stepped["history"]} == {"cpu"}
    assert "can't allocate memory" in stepped["history"][0]["error"]
    assert stepped["history"][0]["settings"]["micro_batch_size"] == 8
    mb, accum = stepped["fields"]["training.micro_batch_size"], stepped["fields"]["training.grad_accum"]
    assert mb < 8 and mb * accum == 8  # effective batch kept
    assert big["steps"] == big["total_steps"] == small["steps"] == 3
    assert steps_logged(big["run_dir"]) == steps_logged(small["run_dir"]) == [1, 2, 3]  # none repeated, none skipped
    after = history.read_text().splitlines()
    assert len(after) - before == len(stepped["history"])
    last = json.loads(after[-1])
    assert last["measured_peak_bytes"] > 0 and last["estimated_bytes"] > 0  # what `fitburst calibrate` reads
    assert collect_ooms(history)[-1]["floor"] == pytest.approx(last["measured_peak_bytes"] / last["estimated_bytes"])


CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 14.57 GiB"
MPS_OOM = ("MPS backend out of memory (MPS allocated: 17.62 GB, other allocations: 1.20 GB, max allowed: 18.13 GB). "
           "Tried to allocate 256.00 MiB on private pool.")


def oom_over(limit: int, error, real):
    """An optimizer step that fails as the device would when a micro-batch holds more than ``limit`` samples."""

    def step(model, optimizer, params, micro_batches, **kw):
        if micro_batches[0]["input_ids"].shape[0] > limit:
            model(**micro_batches[0])  # some work on the device first, as a real OOM would
            raise error()
        return real(model, optimizer, params, micro_batches, **kw)

    return step


@pytest.mark.parametrize("kind, error", [
    ("cuda", lambda: torch.OutOfMemoryError(CUDA_OOM)),
    ("mps", lambda: RuntimeError(MPS_OOM)),
])
def test_cuda_and_mps_errors_inside_a_step_take_the_same_path(tmp_path, demo_spec, demo_prepared, monkeypatch,
                                                              kind, error):
    from fitburst.local import train_local_run
    from fitburst.tracking import Tracker

    monkeypatch.setenv("FITBURST_RUNS_DIR", str(tmp_path))
    spec = apply(demo_spec, {"training.max_steps": 8, "training.micro_batch_size": 4, "training.grad_accum": 1,
                             "training.checkpoint_every": 3, "training.log_every": 1, "eval.enabled": False})
    state = {"n": 0}
    real = train_mod.optimizer_step

    def after_five(*a, **kw):  # fits for 5 steps (a checkpoint at 3), then the data gets "longer"
        state["n"] += 1
        return (oom_over(1, error, real) if state["n"] > 5 else real)(*a, **kw)

    monkeypatch.setattr(train_mod, "optimizer_step", after_five)
    tracker = Tracker.start(spec)
    result = train_local_run(spec, demo_prepared, tracker, device="cpu", progress=False)
    tracker.end()
    stepped = json.loads(Path(result.run_dir, STEPDOWN_FILE).read_text())
    assert [h["oom_kind"] for h in stepped["history"]] == [kind, kind]  # 4 -> 2 fails again, 2 -> 1 fits
    assert [h["step"] for h in stepped["history"]] == [5, 5]  # the failed attempt's checkpoint, resumed
    assert stepped["fields"] == {"training.micro_batch_size": 1, "training.grad_accum": 4}
    assert result.steps == 8 and result.resumed_from == 5
    assert steps_logged(result.run_dir) == list(range(1, 9))
    if kind == "cuda":
        assert stepped["history"][0]["requested_bytes"] == 2 * 2**30
    from mlflow.tracking import MlflowClient

    run = MlflowClient().get_run(tracker.run_id)
    assert run.data.tags["oom.stepdowns"] == "2"
    assert run.data.tags["oom.stepdown.1"].startswith("micro_batch_size 4 -> 2, grad_accum 1 -> 2")


def test_ladder_after_the_batch_switches_optimizer_and_resumes_with_bitsandbytes(tmp_path, demo_spec,
                                                                                 demo_prepared, monkeypatch):
    """micro-batch 1 with checkpointing on: the next rung is the 8-bit optimizer; the AdamW checkpoint resumes
    into bitsandbytes' AdamW8bit (step and schedule kept) and the run finishes."""
    import bitsandbytes as bnb

    spec = apply(demo_spec, {"training.max_steps": 6, "training.micro_batch_size": 1, "training.grad_accum": 2,
                             "training.gradient_checkpointing": True, "training.checkpoint_every": 2,
                             "training.log_every": 1})
    calls, used = {"n": 0}, []
    real = train_mod.optimizer_step

    def step(model, optimizer, params, micro, **kw):
        calls["n"] += 1
        used.append(type(optimizer))
        if calls["n"] == 4:
            raise torch.OutOfMemoryError(CUDA_OOM)
        return real(model, optimizer, params, micro, **kw)

    monkeypatch.setattr(train_mod, "optimizer_step", step)
    result = train_stepping_down(spec, demo_prepared, tmp_path, device="cpu", progress=False)
    stepped = json.loads((tmp_path / STEPDOWN_FILE).read_text())
    assert stepped["fields"] == {"training.optimizer": "adamw8bit"}
    assert result.steps == 6 and result.resumed_from == 3
    assert used[-1] is bnb.optim.AdamW8bit and used[0] is torch.optim.AdamW
    assert steps_logged(tmp_path) == list(range(1, 7))


def test_ladder_order_allow_and_device():
    from fitburst.spec import load_pipeline

    spec = load_pipeline(Path(__file__).parents[1] / "pipelines.yaml", "demo")
    seen, s = [], apply(spec, {"training.micro_batch_size": 6, "training.grad_accum": 1})
    while (rung := next_rung(s, "cuda")) is not None:
        seen.append(rung[1].split(" (")[0])
        s = apply(s, rung[0])
        assert s.training.effective_batch == 6
    assert seen == ["micro_batch_size 6 -> 3, grad_accum 1 -> 2", "micro_batch_size 3 -> 1, grad_accum 2 -> 6",
                    "gradient checkpointing on", "optimizer adamw -> adamw8bit", "LoRA -> QLoRA"]
    assert (s.method.type, s.method.quant) == ("qlora", "nf4")
    # MPS: no bitsandbytes rungs; preflight.allow turns rungs off
    s = apply(spec, {"training.micro_batch_size": 1, "training.gradient_checkpointing": True})
    assert next_rung(s, "mps") is None
    s = apply(spec, {"training.micro_batch_size": 4, "preflight.allow": {"reduce_batch": False,
                                                                          "optimizer_8bit": False}})
    assert next_rung(s, "cpu")[0] == {"training.gradient_checkpointing": True}


def test_oom_kind_recognises_each_device_and_nothing_else():
    assert oom_kind(torch.OutOfMemoryError(CUDA_OOM)) == "cuda"
    assert oom_kind(RuntimeError(MPS_OOM)) == "mps"
    assert oom_kind(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")) == "cpu"
    assert oom_kind(MemoryError()) == "cpu"
    wrapped = train_mod.TrainError("out of memory at step 3")
    wrapped.__cause__ = torch.OutOfMemoryError(CUDA_OOM)
    assert oom_kind(wrapped) == "cuda"  # train() re-raises CUDA OOMs as a TrainError from the original
    assert oom_kind(RuntimeError("shape mismatch")) is None and oom_kind(KeyboardInterrupt()) is None


@pytest.mark.parametrize("policy", ["never", "auto"])
def test_exhausted_ladder_says_what_would_fit_or_that_it_may_burst(tmp_path, demo_spec, demo_prepared, monkeypatch,
                                                                   policy):
    spec = apply(demo_spec, {"training.max_steps": 4, "training.micro_batch_size": 1, "burst.policy": policy,
                             "preflight.allow": {"gradient_checkpointing": False, "optimizer_8bit": False,
                                                 "quantize": False}})

    def always(*a, **kw):
        raise RuntimeError(MPS_OOM)

    monkeypatch.setattr(train_mod, "optimizer_step", always)
    with pytest.raises(OOMLadderExhausted) as e:
        train_stepping_down(spec, demo_prepared, tmp_path, device="cpu", progress=False)
    assert e.value.burst_allowed is (policy == "auto") and e.value.peak_bytes > 0
    assert "every allowed step-down taken" in str(e.value) and "measured peak" in str(e.value)
    assert ("cloud GPU" if policy == "auto" else "would have fit") in str(e.value)
