"""QLoRA with the frozen embeddings and output head in 16 bits (``method.frozen_fp32: false``): the loader, both
estimates against a real CPU step, the ladder and the planner, and the demo QLoRA run's loss curve."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import random_model_folder

from fitburst.memory import RunSettings, estimate, load_shape, plan_fit, resolve_device
from fitburst.memory.budget import Budget
from fitburst.memory.ladder import RUNGS, next_rung

# an untied head and a vocabulary large enough that the embeddings and head are most of the unquantized weights
CFG = dict(model_type="llama", hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=32, vocab_size=8000, tie_word_embeddings=False,
           max_position_embeddings=1024)
SEQ = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model saved with random weights, so that the real loader (bitsandbytes' nf4 on CPU) loads it."""
    return random_model_folder(tmp_path_factory, "untied", CFG)


def spec_for(path, frozen_fp32: bool):
    from fitburst.spec import PipelineSpec

    return PipelineSpec.model_validate(dict(
        name="t", model=dict(name=str(path)), data=dict(path="x.jsonl"),
        method=dict(type="qlora", rank=8, dropout=0.0, target_modules=["q_proj", "v_proj"], frozen_fp32=frozen_fp32),
        training=dict(precision="bf16")))


def settings(frozen_fp32: bool, **kw) -> RunSettings:
    return RunSettings(**{**dict(method="qlora", quant="nf4", rank=8, dropout=0.0, target_modules=["q_proj", "v_proj"],
                                 micro_batch_size=1, seq_len=SEQ, precision="bf16", keep_logits=False,
                                 frozen_fp32=frozen_fp32), **kw})


def _real_step_peak(model_dir, frozen_fp32: bool) -> tuple[int, dict]:
    """The tensor peak of two real QLoRA steps (bf16 autocast on CPU) of the model as fitburst's loader loads and
    prepares it, and the dtypes of its embeddings, head and first norm."""
    import torch

    from fitburst.builders import make_optimizer, prepare_for_training
    from fitburst.data import collate
    from fitburst.device import make_amp
    from fitburst.models import load_pipeline_model
    from fitburst.probe import TensorTracker
    from fitburst.train import optimizer_step

    spec = spec_for(model_dir, frozen_fp32)
    torch.manual_seed(0)
    model = prepare_for_training(load_pipeline_model(spec, "cpu", "bf16"), spec)
    model.train()
    base = model.get_base_model()
    dtypes = {"embed": base.model.embed_tokens.weight.dtype, "head": base.lm_head.weight.dtype,
              "norm": base.model.norm.weight.dtype}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer("adamw", params, 1e-3, 0.0)
    ids = torch.randint(3, CFG["vocab_size"], (SEQ,)).tolist()
    batch = collate([{"input_ids": ids, "labels": ids}], 0)
    tracker = TensorTracker()
    tracker.add(list(model.parameters()) + list(model.buffers()) + list(batch.values()))
    for m in model.modules():  # bitsandbytes' quantization state (absmax, code) lives beside each 4-bit weight
        state = getattr(getattr(m, "weight", None), "quant_state", None)
        if state is not None:
            tracker.add([t for t in vars(state).values() if isinstance(t, torch.Tensor)])
    with tracker:
        for _ in range(2):
            optimizer_step(model, opt, params, [batch], device="cpu", max_grad_norm=1.0, amp=make_amp("bf16", "cpu"))
    return tracker.peak, dtypes


def test_the_loader_keeps_embeddings_and_head_in_16_bits_and_both_estimates_follow_the_real_step(model_dir):
    """fp32 copies (peft's preparation) against the 16-bit ones: the real step, its trace and the analytic estimate
    each drop the embeddings' and head's extra 2 bytes per value; the norms stay fp32. The trace runs the loader's
    preparation itself, so it is held to the real step's peak (1 %); the analytic figure to the trace's saving (the
    weights' bytes, and the head's autocast copy it no longer makes: within 5 % of the trace's saving)."""
    from fitburst.memory.trace import trace_step

    shape = load_shape(str(model_dir))
    frozen = CFG["vocab_size"] * CFG["hidden_size"] * 2  # embeddings + untied head
    real, traced, analytic = {}, {}, {}
    for fp32 in (True, False):
        real[fp32], dtypes = _real_step_peak(model_dir, fp32)
        want = "float32" if fp32 else "bfloat16"
        assert (str(dtypes["embed"]), str(dtypes["head"]), str(dtypes["norm"])) == (
            f"torch.{want}", f"torch.{want}", "torch.float32"), dtypes
        traced[fp32] = trace_step(spec_for(model_dir, fp32), settings(fp32), seq_len=SEQ).live_peaks()[0]
        analytic[fp32] = estimate(shape, settings(fp32), resolve_device("cpu:8GiB"), calibrate=False)
        assert abs(traced[fp32] / real[fp32] - 1) < 0.01, (fp32, traced[fp32], real[fp32])
    weights_16 = analytic[False].components
    assert weights_16["weights_16bit"] == 2 * frozen
    assert weights_16["weights_fp32"] == analytic[True].components["weights_fp32"] - 4 * frozen
    saved_real, saved_traced = real[True] - real[False], traced[True] - traced[False]
    saved_analytic = analytic[True].allocated_peak_bytes - analytic[False].allocated_peak_bytes
    assert saved_real >= 2 * frozen  # at least the weights' 2 bytes per value
    assert abs(saved_traced / saved_real - 1) < 0.01, (saved_traced, saved_real)
    assert abs(saved_analytic / saved_traced - 1) < 0.05, (saved_analytic, saved_traced)


def test_the_rung_applies_to_k_bit_16_bit_runs_on_one_device_and_round_trips_the_spec(model_dir):
    from fitburst.settings import settings_from_spec, spec_with_settings

    cpu, t4 = resolve_device("cpu"), resolve_device("T4")
    rung = RUNGS["frozen_16bit"]
    s = settings(True)
    assert rung.applies(s, t4) and rung.applies(s, cpu) and rung.midrun and rung.cost == 1.0
    assert not rung.applies(settings(False), t4)  # taken already
    assert not rung.applies(replace(s, precision="fp32"), t4)  # fp32 compute: nothing is 16-bit
    assert not rung.applies(settings(True, method="lora", quant="none"), t4)  # nothing is cast to fp32
    assert not rung.applies(replace(s, world_size=2), t4)  # FSDP's mixed precision gathers in 16 bits anyway
    assert next_rung(replace(s, optimizer="adamw8bit"), t4).key == "frozen_16bit"  # the cheapest rung left
    taken = rung.take(s, t4)
    assert taken.frozen_16bit and "frozen16" in taken.describe() and not s.frozen_16bit
    spec = spec_for(model_dir, True)
    assert settings_from_spec(spec).frozen_fp32 is True
    back = spec_with_settings(spec, taken)
    assert back.method.frozen_fp32 is False and settings_from_spec(back).frozen_16bit
    # pipelines.yaml's default is the lean loader; RunSettings' is peft's (runs stored before the field)
    from fitburst.spec import MethodSpec

    assert MethodSpec().frozen_fp32 is False and RunSettings().frozen_fp32 is True
    assert RunSettings.from_dict({"method": "qlora", "quant": "nf4"}).frozen_fp32 is True


def test_the_planner_takes_the_rung_when_it_is_the_cheapest_fit(model_dir):
    """A QLoRA run that misses by less than the fp32 copies' bytes: the plan keeps the embeddings and head in 16 bits
    and takes nothing slower; allowed nothing else, without the rung it does not fit."""
    shape = load_shape(str(model_dir))
    dev = resolve_device("A6000")
    s = settings(True, seq_len=256, loss="standard", optimizer="adamw8bit")

    def fits(total: int, x: RunSettings) -> bool:
        tight = replace(dev, name="tight", total_bytes=total, budget_bytes=total)
        return bool(Budget(tight, 0.0).judge(estimate(shape, x, tight)).fits)

    lo, hi = 1, 64 * 2**30  # the smallest budget the 16-bit plan fits (bisected: the band's edge depends on it)
    while hi - lo > 2**16:
        lo, hi = (lo, (lo + hi) // 2) if fits((lo + hi) // 2, replace(s, frozen_fp32=False)) else ((lo + hi) // 2, hi)
    assert not fits(hi, s)  # peft's fp32 copies miss it
    tight = replace(dev, name="tight", total_bytes=hi, budget_bytes=hi)
    off = {"dropout": False, "reduce_batch": False}
    plan = plan_fit(shape, s, tight, safety_margin=0.0, allow=off)
    assert plan.fits and plan.settings.frozen_16bit and not plan.settings.gradient_checkpointing, plan.changes
    assert any("16 bits" in c for c in plan.changes)
    plan = plan_fit(shape, s, tight, safety_margin=0.0, allow={**off, "frozen_16bit": False})
    assert not plan.settings.frozen_16bit


def test_the_demo_qlora_run_trains_to_the_same_loss_with_the_embeddings_and_head_in_16_bits(
        tmp_path, demo_spec, demo_prepared):
    """The demo QLoRA pipeline (nf4, bf16 autocast on CPU) with and without peft's fp32 copies: the same loss at every
    step. Measured over 20 steps: identical to the last bit (the 16-bit values are the ones the fp32 copies held,
    the head's matmul ran in bf16 under autocast either way, and the embeddings' output is cast to fp32 as the fp32
    lookup made it); the tolerance, 1e-6 relative, leaves room only for a reduction order, not for a changed
    computation."""
    from fitburst.recipe import train

    curves = {}
    for fp32 in (True, False):
        method = demo_spec.method.model_copy(update={"type": "qlora", "quant": "nf4", "frozen_fp32": fp32})
        spec = demo_spec.model_copy(update={
            "method": method,
            "training": demo_spec.training.model_copy(update=dict(max_steps=6, log_every=1, checkpoint_every=100,
                                                                  precision="bf16")),
            "eval": demo_spec.eval.model_copy(update={"enabled": False}),
            "preflight": demo_spec.preflight.model_copy(update={"device": "cpu"})})
        train(spec, demo_prepared, tmp_path / str(fp32), progress=False)
        rows = (tmp_path / str(fp32) / "metrics.jsonl").read_text().splitlines()
        curves[fp32] = [json.loads(x)["train_loss"] for x in rows]
    assert len(curves[True]) == 6
    assert curves[False] == pytest.approx(curves[True], rel=1e-6)
