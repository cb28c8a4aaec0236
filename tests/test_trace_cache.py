"""Traced estimates on disk: the second identical request traces nothing; any input that decides the figure
(settings, sequence length, device, the model's config) traces again."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fitburst.hardware import resolve_device
from fitburst.memory import trace as trace_mod
from fitburst.settings import RunSettings
from fitburst.spec import PipelineSpec

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, vocab_size=1000, tie_word_embeddings=True,
           max_position_embeddings=512)


def test_second_request_is_served_from_disk_and_any_change_traces_again(tmp_path, monkeypatch):
    monkeypatch.setenv("FITBURST_TRACE_CACHE", "1")
    monkeypatch.setenv("FITBURST_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CFG))
    spec = PipelineSpec.model_validate(dict(name="t", model=dict(name=str(model)), data=dict(path="x.jsonl")))
    s = RunSettings(method="lora", rank=4, micro_batch_size=2, seq_len=32, precision="fp16", dropout=0.0)
    t4, cpu = resolve_device("T4"), resolve_device("cpu:8GiB")
    real, traced = trace_mod.trace_step, []

    def counting(*a, **kw):
        traced.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(trace_mod, "trace_step", counting)
    first = trace_mod.traced_estimate(spec, s, t4, seq_len=32)
    again = trace_mod.traced_estimate(spec, s, t4, seq_len=32)
    assert len(traced) == 1 and again.reserved_peak_bytes == first.reserved_peak_bytes
    assert again.components == first.components and any("trace cache" in n for n in again.notes)
    trace_mod.traced_estimate(spec, s, replace(t4, local=True), seq_len=32)  # the same card, trained on here
    assert len(traced) == 1

    trace_mod.traced_estimate(spec, replace(s, rank=8), t4, seq_len=32)
    trace_mod.traced_estimate(spec, s, t4, seq_len=16)
    trace_mod.traced_estimate(spec, s, cpu, seq_len=32)
    assert len(traced) == 4
    (model / "config.json").write_text(json.dumps({**CFG, "num_hidden_layers": 3}))
    deeper = trace_mod.traced_estimate(spec, s, t4, seq_len=32)
    assert len(traced) == 5 and deeper.allocated_peak_bytes > first.allocated_peak_bytes

    monkeypatch.setenv("FITBURST_TRACE_CACHE", "0")
    trace_mod.traced_estimate(spec, s, t4, seq_len=32)
    assert len(traced) == 6


@pytest.mark.parametrize("junk", ["", "{not json", '{"allocated_peak_bytes": 1}'])
def test_an_unreadable_entry_is_traced_again(tmp_path, monkeypatch, junk):
    from fitburst.memory import trace_cache

    monkeypatch.setenv("FITBURST_TRACE_CACHE", "1")
    monkeypatch.setenv("FITBURST_CACHE", str(tmp_path))
    path = tmp_path / "traces" / "k.json"
    path.parent.mkdir()
    path.write_text(junk)
    assert trace_cache.load("k") is None
