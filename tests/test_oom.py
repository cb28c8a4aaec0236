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

import fitburst.recipe as train_mod  # the loop looks its step up in the recipe
from fitburst.calibrate import collect_ooms
from fitburst.hardware import resolve_device
from fitburst.memory.calibration import OOM_HISTORY_FILE, calibration_path
from fitburst.memory.ladder import next_rung
from fitburst.oom_errors import oom_kind
from fitburst.settings import settings_from_spec
from fitburst.supervisor import STEPDOWN_FILE, OOMLadderExhausted, train_stepping_down
from fitburst.train import TrainError

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
            "training.epochs": 1, "training.attention": "eager", "training.log_every": 1, "eval.enabled": False,
            "preflight.allow.attention": False, "preflight.allow.optimizer_8bit": False,
            "preflight.allow.fused_loss": False}  # the micro-batch rungs
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
    assert stepped["history"][0]["settings"]["micro_batch_size"] == 8 and set(stepped["rungs"]) == {"reduce_batch"}
    mb, accum = stepped["settings"]["micro_batch_size"], stepped["settings"]["grad_accum"]
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
    from fitburst.supervisor import train_local_run
    from fitburst.tracking import Tracker

    monkeypatch.setenv("FITBURST_RUNS_DIR", str(tmp_path))
    spec = demo_spec.with_overrides({
        "training.max_steps": 8, "training.micro_batch_size": 4, "training.grad_accum": 1,
        "training.checkpoint_every": 3, "training.log_every": 1, "eval.enabled": False,
        "preflight.allow.optimizer_8bit": False, "preflight.allow.fused_loss": False})  # the micro-batch rungs alone
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
    assert stepped["rungs"] == ["reduce_batch", "reduce_batch"]
    assert (stepped["settings"]["micro_batch_size"], stepped["settings"]["grad_accum"]) == (1, 4)
    assert result.steps == 8 and result.resumed_from == 5
    assert steps_logged(result.run_dir) == list(range(1, 9))
    if kind == "cuda":
        assert stepped["history"][0]["requested_bytes"] == 2 * 2**30
    from mlflow.tracking import MlflowClient

    run = MlflowClient().get_run(tracker.run_id)
    assert run.data.tags["oom.stepdowns"] == "2"
    assert run.data.tags["oom.stepdown.1"].startswith("micro batch 4 -> 2, grad_accum 1 -> 2")


def test_ladder_after_the_batch_switches_optimizer_and_resumes_with_bitsandbytes(tmp_path, demo_spec,
                                                                                 demo_prepared, monkeypatch):
    """micro-batch 1 with checkpointing on: the next rung is the 8-bit optimizer; the AdamW checkpoint resumes
    into bitsandbytes' AdamW8bit (step and schedule kept) and the run finishes."""
    import bitsandbytes as bnb

    spec = demo_spec.with_overrides({
        "training.max_steps": 6, "training.micro_batch_size": 1, "training.grad_accum": 2,
        "training.gradient_checkpointing": True, "training.checkpoint_every": 2, "training.log_every": 1,
        "training.loss": "standard"})
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
    assert stepped["rungs"] == ["optimizer_8bit"] and stepped["settings"]["optimizer"] == "adamw8bit"
    assert result.steps == 6 and result.resumed_from == 3
    assert used[-1] is bnb.optim.AdamW8bit and used[0] is torch.optim.AdamW
    assert steps_logged(tmp_path) == list(range(1, 7))


def test_ladder_order_allow_and_device(demo_spec):
    """A resumed run's rungs, cheapest first: the fused loss, the 8-bit optimizer, smaller micro-batches (the
    effective batch kept exactly, 6 -> 3 -> 1), checkpointing, activation offloading (CUDA), QLoRA; none that needs
    bitsandbytes or CUDA on MPS; preflight.allow obeyed. The T4 is planned from here: its burst node installs the
    fused loss's library, whatever this install has."""
    t4, mps = resolve_device("T4"), resolve_device("mps:32GiB")
    seen, s = [], settings_from_spec(demo_spec.with_overrides({"training.micro_batch_size": 6}), t4, 128)
    while (rung := next_rung(s, t4, midrun=True)) is not None:
        seen.append(rung.key)
        s = rung.take(s, t4)
        assert s.effective_batch == 6
    assert seen == ["fused_loss", "optimizer_8bit", "reduce_batch", "reduce_batch", "gradient_checkpointing",
                    "activation_offloading", "quantize"]
    got = (s.micro_batch_size, s.grad_accum, s.method, s.quant, s.loss, s.activation_offloading)
    assert got == (1, 6, "qlora", "nf4", "fused", True)
    s = settings_from_spec(demo_spec.with_overrides({"training.gradient_checkpointing": True,
                                                     "training.micro_batch_size": 1, "training.loss": "fused"}),
                           mps, 128)
    assert next_rung(s, mps, midrun=True) is None
    s = settings_from_spec(demo_spec.with_overrides({"training.micro_batch_size": 4}), t4, 128)
    assert next_rung(s, t4, {"reduce_batch": False, "optimizer_8bit": False, "fused_loss": False},
                     midrun=True).key == "gradient_checkpointing"
    # eager attention and LoRA dropout are rungs too; only the first may change under a running job
    s = settings_from_spec(demo_spec.with_overrides({"training.attention": "eager", "method.dropout": 0.1}), t4, 128)
    assert next_rung(s, t4).key == next_rung(s, t4, midrun=True).key == "attention"
    fast = next_rung(s, t4).take(s, t4)
    assert fast.attention == "sdpa"  # FlashAttention-2 needs an Ampere card (and the flash_attn package)
    assert next_rung(fast, t4).key == "dropout"
    assert next_rung(fast, t4, midrun=True).key == "fused_loss"


def test_oom_kind_recognises_each_device_and_nothing_else():
    assert oom_kind(torch.OutOfMemoryError(CUDA_OOM)) == "cuda"
    assert oom_kind(RuntimeError(MPS_OOM)) == "mps"
    assert oom_kind(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")) == "cpu"
    assert oom_kind(MemoryError()) == "cpu"
    wrapped = TrainError("out of memory at step 3")
    wrapped.__cause__ = torch.OutOfMemoryError(CUDA_OOM)
    assert oom_kind(wrapped) == "cuda"  # train() re-raises CUDA OOMs as a TrainError from the original
    assert oom_kind(RuntimeError("shape mismatch")) is None and oom_kind(KeyboardInterrupt()) is None


@pytest.mark.parametrize("policy", ["never", "auto"])
def test_exhausted_ladder_says_what_would_fit_or_that_it_may_burst(tmp_path, demo_spec, demo_prepared, monkeypatch,
                                                                   policy):
    spec = demo_spec.with_overrides({
        "training.max_steps": 4, "training.micro_batch_size": 1, "burst.policy": policy,
        "preflight.allow": {"gradient_checkpointing": False, "optimizer_8bit": False, "quantize": False}})

    def always(*a, **kw):
        raise RuntimeError(MPS_OOM)

    monkeypatch.setattr(train_mod, "optimizer_step", always)
    with pytest.raises(OOMLadderExhausted) as e:
        train_stepping_down(spec, demo_prepared, tmp_path, device="cpu", progress=False)
    assert e.value.burst_allowed is (policy == "auto") and e.value.peak_bytes > 0
    assert "every allowed step-down taken" in str(e.value) and "measured peak" in str(e.value)
    assert ("cloud GPU" if policy == "auto" else "would have fit") in str(e.value)


def test_oom_step_down_and_planner_take_the_same_next_rung(tmp_path, demo_spec, demo_prepared, monkeypatch):
    """The same settings on the same device: the rung a real OOM steps down to is the one the planner takes when
    the run as configured misses the budget and that rung alone makes it fit (one ladder, one order)."""
    from dataclasses import replace

    from fitburst.memory import Budget, estimate, plan_fit
    from fitburst.models import spec_shape
    from fitburst.spec import SAFETY_MARGIN

    spec = demo_spec.with_overrides({"training.max_steps": 3, "training.micro_batch_size": 4,
                                     "training.checkpoint_every": 1, "training.log_every": 1, "eval.enabled": False,
                                     "preflight.allow.optimizer_8bit": False, "preflight.allow.fused_loss": False})
    cpu, allow = resolve_device("cpu"), spec.preflight.allow.model_dump()
    s, shape = settings_from_spec(spec, cpu, demo_prepared.stats["max"]), spec_shape(spec)
    rung = next_rung(s, cpu, allow, midrun=True)
    before, after = (Budget(cpu).needed(estimate(shape, x, cpu)) for x in (s, rung.take(s, cpu)))
    assert after < before
    tight = replace(cpu, budget_bytes=int((before + after) / 2 / (1 - SAFETY_MARGIN)))
    plan = plan_fit(shape, s, tight, allow=allow)
    assert plan.fits and plan.changes == [rung.explain(s, cpu)]

    monkeypatch.setattr(train_mod, "optimizer_step", oom_over(2, lambda: torch.OutOfMemoryError(CUDA_OOM),
                                                              train_mod.optimizer_step))
    train_stepping_down(spec, demo_prepared, tmp_path, device="cpu", progress=False)
    stepped = json.loads((tmp_path / STEPDOWN_FILE).read_text())
    assert stepped["rungs"] == [rung.key] and stepped["history"][0]["change"] == plan.changes[0]


def test_a_folder_stepped_down_by_an_earlier_version_resumes_with_its_fields(tmp_path, demo_spec, demo_prepared,
                                                                            monkeypatch):
    """stepdown.json as an earlier fitburst wrote it (changed spec fields as dotted keys): the resume trains with
    them, not with the spec as configured."""
    spec = demo_spec.with_overrides({"training.max_steps": 2, "training.micro_batch_size": 4,
                                     "training.grad_accum": 1, "eval.enabled": False})
    (tmp_path / STEPDOWN_FILE).write_text(json.dumps({
        "fields": {"training.micro_batch_size": 2, "training.grad_accum": 2}, "history": []}))
    sizes, real = [], train_mod.optimizer_step

    def step(model, optimizer, params, micro, **kw):
        sizes.append([int(m["input_ids"].shape[0]) for m in micro])
        return real(model, optimizer, params, micro, **kw)

    monkeypatch.setattr(train_mod, "optimizer_step", step)
    train_stepping_down(spec, demo_prepared, tmp_path, device="cpu", progress=False)
    assert sizes == [[2, 2], [2, 2]]


def test_settings_stored_with_the_old_field_names_resume_as_the_same_settings():
    from dataclasses import asdict

    from fitburst.settings import STORED_BEFORE_RENAME, RunSettings

    s = RunSettings(micro_batch_size=4, grad_accum=2, precision="fp16", target_modules=["q_proj"],
                    gradient_checkpointing=True, activation_offloading=True)
    new_to_old = {v: k for k, v in STORED_BEFORE_RENAME.items()}
    old = {new_to_old.get(k, k): v for k, v in asdict(s).items()}
    assert "batch" in old and "micro_batch_size" not in old
    assert RunSettings.from_dict(old) == s == RunSettings.from_dict(asdict(s))


def test_both_older_step_down_formats_resume_through_the_one_adapter(tmp_path):
    """stepdown.json with changed spec fields as dotted keys becomes the settings they stand for (the resolution
    the caller passes); settings stored with the old field names read as the same settings."""
    from fitburst.settings import RunSettings
    from fitburst.supervisor import load_stepdowns

    (tmp_path / STEPDOWN_FILE).write_text(json.dumps({"fields": {"training.micro_batch_size": 2},
                                                      "rungs": ["reduce_batch"], "history": []}))
    state = load_stepdowns(tmp_path, lambda fields: RunSettings(micro_batch_size=fields["training.micro_batch_size"],
                                                                grad_accum=2))
    assert "fields" not in state and state["rungs"] == ["reduce_batch"]
    assert (RunSettings.from_dict(state["settings"]).micro_batch_size, state["settings"]["grad_accum"]) == (2, 2)
    (tmp_path / STEPDOWN_FILE).write_text(json.dumps({"settings": {"batch": 2, "dtype": "fp16"}, "rungs": []}))
    s = RunSettings.from_dict(load_stepdowns(tmp_path)["settings"])
    assert (s.micro_batch_size, s.precision) == (2, "fp16")
    (tmp_path / STEPDOWN_FILE).unlink()
    assert load_stepdowns(tmp_path) == {"settings": None, "rungs": [], "history": []}
