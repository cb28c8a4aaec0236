"""The OOM step-down checks host RAM before a rung that moves memory there: activation offloading is skipped where
this host's RAM (the planner's host limit) cannot hold the offloaded tensors, and the next rung is taken; where
it can, offloading is taken. The OOM is raised inside a real training step on the CPU; the step-down plans for
the CUDA card preflight.device names, where offloading applies."""

from __future__ import annotations

import json

import pytest
import torch

import fitburst.memory.host as host_mod
import fitburst.recipe as train_mod
import fitburst.supervisor as supervisor
from fitburst.hardware import CPU_CONTEXT, CPU_RESERVE, GiB
from fitburst.supervisor import STEPDOWN_FILE, train_stepping_down

CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"


def first_attempt_ooms_then_capture(monkeypatch) -> list:
    """The first attempt runs the real Recipe and runs out of memory in its first optimizer step; the next one is
    captured (its spec) instead of trained, which on the CPU would refuse CUDA-only settings."""
    specs: list = []
    real_recipe = supervisor.Recipe

    def step(*a, **kw):
        raise torch.OutOfMemoryError(CUDA_OOM)

    class Recipe:
        def __init__(self, spec, *a, **kw):
            specs.append(spec)
            self.inner = real_recipe(spec, *a, **kw) if len(specs) == 1 else None

        def run(self):
            return self.inner.run() if self.inner is not None else "resumed"

    monkeypatch.setattr(train_mod, "optimizer_step", step)
    monkeypatch.setattr(supervisor, "Recipe", Recipe)
    return specs


@pytest.mark.parametrize("ram, offloads", [(CPU_RESERVE + CPU_CONTEXT + 1, False), (256 * GiB, True)])
def test_step_down_skips_offloading_the_host_cannot_hold(tmp_path, demo_spec, demo_prepared, monkeypatch, ram,
                                                        offloads):
    # every rung before offloading is taken already or not allowed: offloading is next, then QLoRA
    spec = demo_spec.with_overrides({
        "preflight.device": "cuda:24GiB", "training.max_steps": 4, "training.micro_batch_size": 1,
        "training.gradient_checkpointing": True, "training.checkpoint_every": 2, "eval.enabled": False,
        "preflight.allow.embeddings_on_host": False, "preflight.allow.fused_loss": False,
        "preflight.allow.optimizer_8bit": False, "preflight.allow.tiled_mlp": False,
        "preflight.allow.liger_kernels": False})
    monkeypatch.setattr(host_mod, "host_ram_bytes", lambda: ram)
    specs = first_attempt_ooms_then_capture(monkeypatch)
    assert train_stepping_down(spec, demo_prepared, tmp_path, device="cpu", progress=False) == "resumed"
    stepped = json.loads((tmp_path / STEPDOWN_FILE).read_text())
    record = stepped["history"][0]
    resumed = specs[1]
    if offloads:
        assert stepped["rungs"] == ["activation_offloading"] and record["host_check"] is None
        assert resumed.training.activation_offloading and resumed.method.type == "lora"
    else:
        assert stepped["rungs"] == ["quantize"]
        assert record["host_check"].startswith("activation_offloading skipped: ")
        assert "does not fit this host's" in record["host_check"]
        assert not resumed.training.activation_offloading and resumed.method.type == "qlora"


def test_without_the_models_shape_the_step_down_says_host_ram_is_unchecked(tmp_path, demo_spec, demo_prepared,
                                                                          monkeypatch):
    spec = demo_spec.with_overrides({
        "preflight.device": "cuda:24GiB", "training.max_steps": 4, "training.micro_batch_size": 1,
        "training.gradient_checkpointing": True, "eval.enabled": False,
        "preflight.allow.fused_loss": False, "preflight.allow.optimizer_8bit": False})
    monkeypatch.setattr(host_mod, "host_ram_bytes", lambda: CPU_RESERVE + CPU_CONTEXT + 1)
    real_resolve = supervisor.resolve_model

    def no_shape(s):
        from dataclasses import replace

        return replace(real_resolve(s), shape=None)

    monkeypatch.setattr(supervisor, "resolve_model", no_shape)
    first_attempt_ooms_then_capture(monkeypatch)
    train_stepping_down(spec, demo_prepared, tmp_path, device="cpu", progress=False)
    record = json.loads((tmp_path / STEPDOWN_FILE).read_text())["history"][0]
    assert record["rung"] == "activation_offloading"  # today's behaviour: taken, unchecked
    assert record["host_check"] == ("host RAM for activation_offloading not checked: the model's shape is unknown "
                                    "to the analytic estimate")
