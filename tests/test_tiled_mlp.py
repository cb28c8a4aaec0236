"""The tiled MLP (``training.tiled_mlp``, liger-kernel's apply_tiled_mlp over each block's gated MLP): the loader, its
gradients, both estimates against the real CPU step, the refusals, the ladder and the planner."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import config_folder

from fitburst.memory import RunSettings, estimate, load_shape, plan_fit, resolve_device
from fitburst.memory.budget import Budget
from fitburst.memory.ladder import RUNGS, next_rung

pytest.importorskip("liger_kernel")

# an MLP 8x the width (Llama's is 3.5x): at 2048 tokens its intermediates are most of a layer's activations
CFG = dict(model_type="llama", hidden_size=128, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=32, vocab_size=3000, tie_word_embeddings=True,
           max_position_embeddings=4096)
SEQ = 2048  # ceil(2048 / 128) = 16 shards of 128 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return config_folder(tmp_path_factory, "tiled", CFG)


def settings(tiled: bool, **kw) -> RunSettings:
    return RunSettings(**{**dict(method="lora", rank=8, target_modules="all-linear", micro_batch_size=1, seq_len=SEQ,
                                 precision="fp32", dropout=0.0, keep_logits=False, loss="standard", tiled_mlp=tiled),
                          **kw})


def spec_for(model_dir, s: RunSettings):
    from fitburst.settings import spec_with_settings
    from fitburst.spec import PipelineSpec

    base = PipelineSpec.model_validate(dict(name="t", model=dict(name=str(model_dir)), data=dict(path="x.jsonl")))
    return spec_with_settings(base, s)


def _model(model_dir, s: RunSettings):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fitburst.builders import prepare_for_training

    torch.manual_seed(0)
    cfg = dict(CFG)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = prepare_for_training(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"),
                                 spec_for(model_dir, s))
    model.train()
    return model


def _batch(seq: int):
    import torch

    from fitburst.data import collate

    torch.manual_seed(1)
    ids = torch.randint(3, CFG["vocab_size"], (seq,)).tolist()
    return collate([{"input_ids": ids, "labels": ids}], 0)


def test_the_loader_tiles_every_blocks_mlp_and_the_gradients_are_the_untiled_ones(model_dir):
    """The loader wraps each decoder block's MLP (not the attention, not the head); the loss and every LoRA gradient
    of a step are the untiled step's: measured equal loss and gradients within 2e-9 of 1e-2 (fp32 summation order
    over shards), with and without checkpointing."""
    import torch

    for ckpt in (False, True):
        grads = {}
        for tiled in (False, True):
            s = settings(tiled, seq_len=512, gradient_checkpointing=ckpt)
            model = _model(model_dir, s)
            gen = torch.Generator().manual_seed(2)
            for n, p in model.named_parameters():  # LoRA's B starts at zero: give every A a gradient
                if "lora_B" in n:
                    torch.nn.init.normal_(p, std=0.02, generator=gen)
            wrapped = [n for n, m in model.named_modules() if "forward" in vars(m)]
            assert len(wrapped) == (CFG["num_hidden_layers"] if tiled else 0) and all(n.endswith(".mlp")
                                                                                       for n in wrapped), wrapped
            out = model(**_batch(512))
            out.loss.backward()
            grads[tiled] = (out.loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad})
        (loss, plain), (tiled_loss, tiled) = grads[False], grads[True]
        assert tiled_loss == pytest.approx(loss, rel=1e-6)
        assert all(g.abs().sum() > 0 for g in tiled.values())  # every adapter learns, the MLP's included
        for n, g in plain.items():
            assert torch.allclose(tiled[n], g, rtol=1e-4, atol=1e-7), n


def _real_peak(model_dir, s: RunSettings) -> int:
    """The tensor peak of two real steps of the loop (fitburst's optimizer_step, the model as the loop prepares it)."""
    from fitburst.builders import make_optimizer
    from fitburst.probe import TensorTracker
    from fitburst.train import optimizer_step

    model = _model(model_dir, s)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer("adamw", params, 1e-3, 0.0)
    batch = _batch(s.seq_len)
    tracker = TensorTracker()
    tracker.add(list(model.parameters()) + list(model.buffers()) + list(batch.values()))
    with tracker:
        for _ in range(2):
            optimizer_step(model, opt, params, [batch], device="cpu", max_grad_norm=1.0,
                           loss="chunked" if s.fused_loss else "standard")
    return tracker.peak


@pytest.mark.parametrize("kw", [{}, {"gradient_checkpointing": True, "loss": "fused"}], ids=["plain", "ckpt-fused"])
def test_both_estimates_follow_the_real_cpu_step_with_the_tiled_mlp(model_dir, no_compiler, kw):
    """The trace runs Liger's apply_tiled_mlp itself on fake tensors: its peak is the real step's (measured equal to
    the byte; 0.5 % allowed). The analytic estimate's per-shard terms: within 4 % of the real step (measured +2.1 %
    without checkpointing, -2.3 % with it and the fused loss), where counting the MLP untiled reads +73 % and -30 %;
    and each estimate saves what the real step saves: the trace to the byte (1 % allowed), the analytic figure within
    20 % (measured +17.6 % with checkpointing: its untiled figure reads +3.1 %, its tiled one -2.3 %)."""
    from fitburst.memory.trace import trace_step

    shape = load_shape(str(model_dir))
    real, traced, analytic = {}, {}, {}
    for tiled in (False, True):
        s = settings(tiled, **kw)
        real[tiled] = _real_peak(model_dir, s)
        traced[tiled] = trace_step(spec_for(model_dir, s), s, seq_len=SEQ).live_peaks()[0]
        analytic[tiled] = estimate(shape, s, resolve_device("cpu:8GiB"), calibrate=False).allocated_peak_bytes
        assert abs(traced[tiled] / real[tiled] - 1) < 0.005, (tiled, traced[tiled], real[tiled])
    assert abs(analytic[True] / real[True] - 1) < 0.04, (analytic[True], real[True])
    saved = real[False] - real[True]
    assert saved > 0.2 * real[False]
    assert abs((analytic[False] - analytic[True]) / saved - 1) < 0.2
    assert abs((traced[False] - traced[True]) / saved - 1) < 0.01


@pytest.mark.parametrize("name, why", [("microsoft/phi-1.5", "plain MLP"), ("mistralai/mixtral-8x7b", "experts"),
                                       ("google/flan-t5-xl", "encoder-decoder")])
def test_a_model_without_a_gated_mlp_is_refused_with_field_and_fix(tmp_path, name, why):
    from fitburst.rules import ModelFacts, problems
    from fitburst.spec import SpecError, load_pipeline

    (tmp_path / "d.jsonl").write_text("")
    (tmp_path / "p.yaml").write_text(
        f"pipelines:\n  a:\n    model: {{name: {name}}}\n    data: {{path: d.jsonl}}\n"
        "    training:\n      tiled_mlp: true\n")
    with pytest.raises(SpecError, match=rf"line 6: field 'training.tiled_mlp'.*{why}.*tiled_mlp: false"):
        load_pipeline(tmp_path / "p.yaml", "a")
    shape = load_shape(name)
    assert not RUNGS["tiled_mlp"].allowed(settings(False), resolve_device("A100-80GB"), shape=shape)
    (row,) = problems(settings(True), model=ModelFacts.of(shape))  # the loop asks it so (tests/test_rules.py)
    assert row.field == ("training", "tiled_mlp") and why in str(row)


def test_the_rung_takes_a_gated_mlp_only_and_round_trips_the_spec(model_dir):
    from fitburst.settings import settings_from_spec

    (tmp := model_dir / "ok.yaml").write_text(
        "pipelines:\n  a:\n    model: {name: meta-llama/llama-3.1-8b}\n    data: {path: d.jsonl}\n"
        "    training:\n      tiled_mlp: true\n")
    (model_dir / "d.jsonl").write_text("")
    from fitburst.spec import load_pipeline

    spec = load_pipeline(tmp, "a")
    assert settings_from_spec(spec).tiled_mlp and "tiled-mlp" in settings_from_spec(spec).describe()
    dev, shape = resolve_device("A100-80GB"), load_shape(str(model_dir))
    rung = RUNGS["tiled_mlp"]
    s = settings(False, gradient_checkpointing=True, optimizer="adamw8bit", loss="standard")
    assert rung.midrun and rung.allowed(s, dev, shape=shape) and not rung.allowed(s, dev)  # needs the model
    assert not rung.allowed(settings(True), dev, shape=shape)
    assert next_rung(s, dev, {"liger_kernels": False}, shape=shape).key == "tiled_mlp"  # Liger's kernels cost 1.0
    assert next_rung(s, dev, {"liger_kernels": False}).key != "tiled_mlp"


def test_the_planner_takes_the_tiled_mlp_before_checkpointing_when_it_fits(model_dir):
    """A long sequence that misses by less than the MLP intermediates: the plan tiles the MLP (cost 1.3) and does not
    checkpoint (1.33); with tiling not allowed it checkpoints."""
    shape = load_shape(str(model_dir))
    dev = resolve_device("A6000")
    s = settings(False, precision="bf16", seq_len=8192, optimizer="adamw8bit")
    off = {"dropout": False, "reduce_batch": False, "fused_loss": False, "activation_offloading": False,
           "quantize": False}

    def fits(total: int, x: RunSettings) -> bool:
        tight = replace(dev, name="tight", total_bytes=total, budget_bytes=total)
        return bool(Budget(tight, 0.0).judge(estimate(shape, x, tight)).fits)

    lo, hi = 1, 64 * 2**30  # the smallest budget the tiled run fits
    while hi - lo > 2**16:
        lo, hi = (lo, (lo + hi) // 2) if fits((lo + hi) // 2, replace(s, tiled_mlp=True)) else ((lo + hi) // 2, hi)
    assert not fits(hi, s)
    tight = replace(dev, name="tight", total_bytes=hi, budget_bytes=hi)
    plan = plan_fit(shape, s, tight, safety_margin=0.0, allow=off)
    assert plan.fits and plan.settings.tiled_mlp and not plan.settings.gradient_checkpointing, plan.changes
    plan = plan_fit(shape, s, tight, safety_margin=0.0, allow={**off, "tiled_mlp": False})
    assert not plan.settings.tiled_mlp and plan.settings.gradient_checkpointing, plan.changes
