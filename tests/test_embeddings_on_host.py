"""The input embeddings in host RAM (``training.embeddings_on_host``): the rule table's rows, the ladder's rung, both
estimates against each other, and the loop's own builder and step on the CPU."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import random_model_folder

from fitburst.memory import RunSettings, estimate, load_shape, resolve_device
from fitburst.memory.calibration import band_for
from fitburst.memory.ladder import RUNGS
from fitburst.rules import problems

# untied, and a vocabulary large enough that the table is a sixth of what the traced step allocates
CFG = dict(model_type="llama", hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=8, head_dim=64, vocab_size=64000, tie_word_embeddings=False,
           max_position_embeddings=4096)
TINY = dict(CFG, hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=8000, max_position_embeddings=1024)


def _settings(**kw) -> RunSettings:
    return RunSettings(**{**dict(method="qlora", quant="nf4", rank=8, target_modules="all-linear", seq_len=2048,
                                 precision="bf16", attention="sdpa", dropout=0.0, loss="fused", keep_logits=False,
                                 gradient_checkpointing=True, frozen_fp32=False), **kw})


def _config_dir(path, cfg: dict):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_the_rule_table_refuses_it_where_it_saves_nothing_or_cannot_run():
    on = RunSettings(method="lora", embeddings_on_host=True)
    rows = {"mps": ({p.rule for p in problems(on, resolve_device("mps:32GiB"))}, "embeddings_on_host_mps"),
            "full": ({p.rule for p in problems(replace(on, method="full"))}, "embeddings_on_host_trained"),
            "fsdp": ({p.rule for p in problems(replace(on, distributed="fsdp"))}, "fsdp_embeddings_on_host")}
    assert all(rule in found for found, rule in rows.values()), rows
    assert not problems(on, resolve_device("cuda:8GiB")) and not problems(on, resolve_device("cpu:8GiB"))
    assert all(p.field == ("training", "embeddings_on_host") for p in problems(replace(on, method="full")))


def test_the_rung_applies_on_cuda_to_an_untied_model_only():
    rung, s = RUNGS["embeddings_on_host"], _settings()
    untied, tied = load_shape("llama-3.1-8b"), load_shape("llama-3.2-3b")
    assert not untied.tied and tied.tied
    cuda = resolve_device("cuda:8GiB")
    assert rung.allowed(s, cuda, shape=untied) and rung.take(s, cuda).embeddings_on_host
    assert not rung.allowed(s, cuda, shape=tied)  # the table is the head's weight too
    assert not rung.allowed(s, resolve_device("cpu:8GiB"), shape=untied)  # the host is the device: nothing saved
    assert not rung.allowed(s, cuda, {"embeddings_on_host": False}, shape=untied)
    assert not rung.allowed(replace(s, method="full", quant="none"), cuda, shape=untied)  # the table trains
    assert not rung.allowed(rung.take(s, cuda), cuda, shape=untied)  # on already


@pytest.mark.parametrize("quant", ["nf4", "none"])
def test_both_estimates_take_the_table_off_the_gpu(tmp_path, quant):
    """The trace runs the loop's hook with the table's move standing in for the GPU's: its allocated peak drops by
    the 16-bit table's bytes (within 2 %: block rounding), and the freed block is reused (reserved drops by as much,
    within 5 %); the analytic estimate with the rung stays within its CUDA band of the trace. Leaving the table on
    the GPU in the analytic estimate puts it well above the trace here (fails the band)."""
    from fitburst.memory.trace import traced_estimate
    from fitburst.spec import PipelineSpec

    d = _config_dir(tmp_path / "m", CFG)
    spec = PipelineSpec.model_validate(dict(name="t", model=dict(name=str(d)), data=dict(path="x.jsonl")))
    dev, band = resolve_device("A100-40GB"), band_for("analytic-vs-traced", "cuda")
    table = CFG["vocab_size"] * CFG["hidden_size"] * 2
    off, on = _settings(quant=quant), _settings(quant=quant, embeddings_on_host=True)
    t_off, t_on = (traced_estimate(spec, s, dev, seq_len=s.seq_len) for s in (off, on))
    assert t_off.allocated_peak_bytes - t_on.allocated_peak_bytes == pytest.approx(table, rel=0.02)
    assert t_off.reserved_peak_bytes - t_on.reserved_peak_bytes == pytest.approx(table, rel=0.05)
    a_off, a_on = (estimate(load_shape(str(d)), s, dev, calibrate=False) for s in (off, on))
    assert a_off.allocated_peak_bytes - a_on.allocated_peak_bytes == table
    # the table's host side, by both estimates: what the host RAM check adds to the offloaded activations
    assert t_on.host_table_bytes == pytest.approx(table, rel=0.02) and a_on.host_table_bytes == table
    assert t_off.host_table_bytes == a_off.host_table_bytes == 0
    assert band.low <= t_on.reserved_peak_bytes / a_on.reserved_peak_bytes - 1 <= band.high
    # peft's fp32 copy of the table (k-bit, frozen_fp32): modelled on the GPU still; not on CUDA: nothing moves
    assert estimate(load_shape(str(d)), replace(on, frozen_fp32=True), dev).allocated_peak_bytes == estimate(
        load_shape(str(d)), replace(off, frozen_fp32=True), dev).allocated_peak_bytes
    cpu = resolve_device("cpu:64GiB")
    assert estimate(load_shape(str(d)), on, cpu).allocated_peak_bytes == estimate(
        load_shape(str(d)), off, cpu).allocated_peak_bytes


def test_the_host_ram_check_counts_the_table_beside_the_offloaded_activations():
    """A host whose limit holds the offloaded checkpoints but not the table too is refused, by the planner's
    budget and by `fitburst validate`'s check (one figure: Estimate.host_side_bytes); with room for both it fits."""
    from fitburst.memory.budget import Budget
    from fitburst.memory.host import CPU_CONTEXT, CPU_RESERVE, offload_problem
    from fitburst.spec import PipelineSpec

    shape, dev = load_shape("llama-3.1-8b"), resolve_device("cuda:80GiB")
    s = _settings(seq_len=16384, activation_offloading=True, embeddings_on_host=True)
    e = estimate(shape, s, dev)
    table = shape.embed_params * 2
    assert e.host_table_bytes == table and e.offloaded_host_bytes > 0
    short, enough = e.offloaded_host_bytes + table // 2, e.offloaded_host_bytes + table + 1
    assert not Budget(dev, 0.03, host_limit=short).judge(estimate(shape, s, dev)).fits
    assert Budget(dev, 0.03, host_limit=enough).judge(estimate(shape, s, dev)).fits
    spec = PipelineSpec.model_validate(dict(
        name="t", model=dict(name="llama-3.1-8b"), data=dict(path="x.jsonl", max_seq_len=16384),
        method=dict(type="qlora", quant="nf4", rank=8, dropout=0.0, frozen_fp32=False),
        training=dict(precision="bf16", gradient_checkpointing=True, activation_offloading=True,
                      embeddings_on_host=True, loss="fused"),
        preflight=dict(device="cuda:80GiB")))
    ram = lambda limit: limit + CPU_RESERVE + CPU_CONTEXT  # noqa: E731 - the RAM whose host limit is ``limit``
    assert "input embeddings" in (offload_problem(spec, ram(short)) or "")
    assert offload_problem(spec, ram(enough + (1 << 30))) is None


def test_the_eval_after_training_holds_the_table_on_the_gpu():
    """fitburst.evaluate loads the model afresh, the table on the GPU (the hook is the training loop's): the eval
    phase holds the table's bytes with the rung as without it, while the training phases drop them."""
    shape, dev = load_shape("llama-3.1-8b"), resolve_device("cuda:24GiB")
    off = _settings(eval_batch=1)
    a_off, a_on = (estimate(shape, s, dev, calibrate=False) for s in (off, replace(off, embeddings_on_host=True)))
    table = shape.embed_params * 2
    assert a_off.phases["backward"] - a_on.phases["backward"] == table
    assert a_on.phases["eval"] == a_off.phases["eval"]


def _losses(model_dir, on_host: bool, steps: int = 6) -> tuple[list[float], object]:
    """Losses of ``steps`` real QLoRA steps (bf16 autocast on the CPU) of the model as the loop builds it (the
    steps of :func:`fitburst.builders.build_model`, less the tokenizer) and steps it
    (:func:`fitburst.train.optimizer_step`)."""
    import torch

    from fitburst.builders import host_embeddings, make_optimizer, prepare_for_training
    from fitburst.data import collate
    from fitburst.device import make_amp
    from fitburst.models import load_pipeline_model
    from fitburst.spec import PipelineSpec
    from fitburst.train import optimizer_step

    spec = PipelineSpec.model_validate(dict(
        name="t", model=dict(name=str(model_dir)), data=dict(path="x.jsonl"),
        method=dict(type="qlora", rank=8, dropout=0.0, target_modules="all-linear"),
        training=dict(precision="bf16", gradient_checkpointing=True, embeddings_on_host=on_host)))
    torch.manual_seed(0)
    model = prepare_for_training(load_pipeline_model(spec, "cpu", "bf16"), spec)
    if spec.training.embeddings_on_host:
        host_embeddings(model, spec)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer("adamw", params, 1e-3, 0.0)
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(3, TINY["vocab_size"], (256,), generator=gen).tolist()
        batch = collate([{"input_ids": ids, "labels": ids}], 0)
        out.append(float(optimizer_step(model, opt, params, [batch], device="cpu", max_grad_norm=1.0,
                                        amp=make_amp("bf16", "cpu"))))
    return out, model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return random_model_folder(tmp_path_factory, "untied", TINY)


def test_the_loop_trains_the_same_with_the_table_on_the_host(tiny_dir):
    """On the CPU the host is the device: the hook's moves copy nothing, and the loop's builder and step train to the
    same losses (relative 1e-6) through it, the lookup running under accelerate's hook, checkpointing and k-bit
    preparation's fp32 cast included."""
    without, _ = _losses(tiny_dir, False)
    with_host, model = _losses(tiny_dir, True)
    emb = model.get_input_embeddings()
    assert hasattr(emb, "_hf_hook") and emb.weight.device.type == "cpu" and not emb.weight.requires_grad
    assert with_host == pytest.approx(without, rel=1e-6)
    assert with_host[-1] < with_host[0]  # it trains


def test_a_tied_table_is_refused_before_any_step(tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fitburst.builders import host_embeddings
    from fitburst.spec import PipelineSpec
    from fitburst.train import TrainError

    cfg = dict(TINY, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    for p in model.parameters():
        p.requires_grad_(False)
    spec = PipelineSpec.model_validate(dict(name="tied", model=dict(name=str(tmp_path)), data=dict(path="x.jsonl")))
    with pytest.raises(TrainError, match="training.embeddings_on_host: the input embeddings are tied"):
        host_embeddings(model, spec)
    assert model.get_input_embeddings().weight.device == torch.device("cpu")


def test_an_encoder_decoders_shared_table_is_refused():
    """FLAN-T5's encoder and decoder each look the shared table up through their own embedding module (the weight
    tied to ``shared``): moving ``get_input_embeddings()`` moves the weight they read, and its hook is never called.
    The rule table refuses it (so the ladder does not take it), and the loop's move refuses a table another module
    reads."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    from fitburst.models import embeddings_to_host
    from fitburst.rules import ModelFacts

    t5 = load_shape("google/flan-t5-xl")
    assert not t5.tied  # not the tied-head row
    on = RunSettings(method="lora", embeddings_on_host=True)
    assert "embeddings_on_host_model" in {p.rule for p in problems(on, model=ModelFacts.of(t5))}
    assert not problems(on, model=ModelFacts.of(load_shape("llama-3.1-8b")))
    assert not RUNGS["embeddings_on_host"].allowed(_settings(quant="none", method="lora"), resolve_device("cuda:24GiB"),
                                                   shape=t5)
    import torch

    model = AutoModelForSeq2SeqLM.from_config(AutoConfig.for_model("t5", vocab_size=256, d_model=32, d_kv=8,
                                                                    d_ff=64, num_layers=1, num_heads=4))
    # as FLAN-T5 loads: its own head; the stacks' tables tied to ``shared`` (transformers ties them always)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    assert model.encoder.embed_tokens.weight is model.get_input_embeddings().weight
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="encoder.embed_tokens"):
        embeddings_to_host(model)
