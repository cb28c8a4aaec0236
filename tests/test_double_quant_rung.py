"""The ladder's double_quant rung: where it applies, and what both estimates save with it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fitburst.memory import RunSettings, estimate, load_shape, resolve_device
from fitburst.memory.ladder import RUNGS, next_rung
from fitburst.memory.params import four_bit_bytes

# wide enough that the absmax bytes dwarf what each 4-bit layer's QuantState adds beside them (its nested 256-entry
# code, 512-byte block rounding: ~2 KiB a layer, 10 % of the saving at hidden 512)
CFG = dict(model_type="llama", hidden_size=1024, intermediate_size=2752, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=8, head_dim=128, vocab_size=8000, tie_word_embeddings=False,
           max_position_embeddings=2048)


def _settings(**kw) -> RunSettings:
    return RunSettings(**{**dict(method="qlora", quant="nf4", double_quant=False, rank=8, target_modules="all-linear",
                                 seq_len=256, precision="bf16", dropout=0.0, keep_logits=False,
                                 frozen_fp32=False), **kw})


def test_the_rung_applies_to_4bit_weights_without_double_quant_only():
    rung, cuda = RUNGS["double_quant"], resolve_device("cuda:8GiB")
    s = _settings()
    assert rung.allowed(s, cuda) and rung.take(s, cuda).double_quant
    assert not rung.allowed(rung.take(s, cuda), cuda)
    assert not rung.allowed(replace(s, quant="int8"), cuda) and not rung.allowed(replace(s, method="lora",
                                                                                         quant="none"), cuda)
    assert not rung.allowed(s, cuda, {"double_quant": False})
    # with every other rung held back, a fresh plan takes it and a resumed run's step-down does not (the base
    # weights it dequantizes would change under the checkpoint)
    only = {key: key == "double_quant" for key in RUNGS}
    shape = load_shape("llama-3.1-8b")
    assert next_rung(s, cuda, only, shape=shape) is rung
    assert next_rung(s, cuda, only, midrun=True, shape=shape) is None


def test_both_estimates_save_the_absmax_bytes(tmp_path):
    """The trace loads bitsandbytes' real quantization of each weight (its QuantState with or without the nested
    absmax) and the analytic estimate counts four_bit_bytes: with the rung both drop by the same bytes, the fp32
    absmax per 64 weights less the 8-bit one and its own fp32 absmax per 256."""
    from fitburst.memory.trace import traced_estimate
    from fitburst.spec import PipelineSpec

    (tmp_path / "config.json").write_text(json.dumps(CFG))
    spec = PipelineSpec.model_validate(dict(name="t", model=dict(name=str(tmp_path)), data=dict(path="x.jsonl")))
    dev, shape = resolve_device("A100-40GB"), load_shape(str(tmp_path))
    off = _settings()
    on = RUNGS["double_quant"].take(off, dev)
    linear = sum(c * sum(lin.fan_in * lin.fan_out for lin in shape.layer_linears(dec)) for c, dec in shape.blocks())
    saved = four_bit_bytes(linear, False) - four_bit_bytes(linear, True)
    a = [estimate(shape, s, dev, calibrate=False).allocated_peak_bytes for s in (off, on)]
    t = [traced_estimate(spec, s, dev, seq_len=s.seq_len).allocated_peak_bytes for s in (off, on)]
    assert a[0] - a[1] == pytest.approx(saved, rel=0.01)
    assert t[0] - t[1] == pytest.approx(saved, rel=0.05)
