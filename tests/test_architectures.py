"""The per-architecture registry (fitburst.memory.architectures): a model_type is one entry, and nothing else in the
analytic estimate asks which model_type it counts."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fitburst.hardware import resolve_device
from fitburst.memory.activations import BLOCKS
from fitburst.memory.architectures import ARCHITECTURES, Architecture
from fitburst.memory.estimator import estimate
from fitburst.memory.params import resolve_targets
from fitburst.memory.shapes import CONFIG_DIR, ModelShape
from fitburst.settings import RunSettings

MEMORY = Path(__file__).resolve().parents[1] / "fitburst" / "memory"


def test_a_new_architecture_is_one_registry_entry(monkeypatch):
    """An entry with its own layer names and biases: the shape, LoRA's targets and the estimate follow it."""
    monkeypatch.setitem(ARCHITECTURES, "my_decoder", Architecture(
        attention_names=("wq", "wk", "wv", "wo"), read=lambda g: {"qkv_bias": True, "qk_norm": True}))
    cfg = {**json.loads((CONFIG_DIR / "smollm2-135m.json").read_text()), "model_type": "my_decoder"}
    shape = ModelShape.from_config(cfg, name="mine")
    attn = shape.attn_linears()
    assert [lin.name for lin in attn] == ["wq", "wk", "wv", "wo"]
    assert [lin.bias for lin in attn] == [True, True, True, False]
    assert resolve_targets(shape, ["wq", "wv"]) == {"wq", "wv"}
    llama = ModelShape.from_config({**cfg, "model_type": "llama"}, name="llama")
    dev = resolve_device("A100-80GB")
    mine = estimate(shape, RunSettings(target_modules=["wq"]), dev, calibrate=False)
    theirs = estimate(llama, RunSettings(target_modules=["q_proj"]), dev, calibrate=False)
    # q, k and v biases and the two qk-norms of every block
    assert mine.params["base"] - theirs.params["base"] == shape.layers * (
        shape.q_dim + 2 * shape.kv_dim + 2 * shape.head_dim)
    assert mine.params["trainable"] == theirs.params["trainable"] > 0
    assert mine.phases["forward"] > theirs.phases["forward"]  # the qk-norms' fp32 inputs are saved


def test_every_architectures_blocks_are_counted_by_a_block_function():
    assert {a.block for a in ARCHITECTURES.values()} <= set(BLOCKS)


def test_no_model_type_is_tested_outside_the_registry():
    """The estimate's modules ask ``shape.arch``; only the registry (and the shape's lookup of it) names types."""
    asks = re.compile(r"model_type\s*(==|!=|in\b)|model_type\.startswith|\bmt\s*(==|!=|in\b)|\bmt\.startswith")
    for name in ("estimator.py", "activations.py", "params.py", "fsdp_terms.py", "shapes.py"):
        text = (MEMORY / name).read_text()
        assert not asks.search(text), (name, asks.search(text))
