"""Packed (padding-free) batches: the same loss and gradients as the padded batch, positions restarting at each
sample, attention kept within each sample, assistant masking exact; the loop trains with ``training.packing``."""

from __future__ import annotations

import pytest
import torch

from fitburst.data import IGNORE_INDEX, batch_tokens, collate, load_split
from fitburst.demo_models import demo_model_dir
from fitburst.models import load_model


@pytest.fixture(scope="module")
def rows(demo_prepared) -> list[dict]:
    out = load_split(demo_prepared, "train").to_list()[:6]
    assert len({len(r["input_ids"]) for r in out}) > 1  # different lengths: the padded batch holds padding
    return out


def model(attention: str):
    torch.manual_seed(0)
    m = load_model(str(demo_model_dir()), dtype=torch.float32, device="cpu", attention=attention)
    m.config.use_cache = False  # as prepare_for_training sets: with a cache, transformers does not see the packing
    return m


def test_packed_row_positions_restart_and_labels_stay_per_sample(rows, demo_tokenizer):
    b = collate(rows, demo_tokenizer.pad_token_id, packed=True)
    lengths = [len(r["input_ids"]) for r in rows]
    assert b["input_ids"].shape == (1, sum(lengths)) and "attention_mask" not in b
    assert b["position_ids"][0].tolist() == [p for n in lengths for p in range(n)]
    starts = [sum(lengths[:i]) for i in range(len(rows))]
    labels = b["labels"][0].tolist()
    assert all(labels[s] == IGNORE_INDEX for s in starts)  # no sample predicted from the one before
    for r, s in zip(rows, starts, strict=True):  # otherwise each sample's assistant mask as prepared
        assert labels[s + 1:s + len(r["labels"])] == r["labels"][1:]
    padded = collate(rows, demo_tokenizer.pad_token_id)
    assert batch_tokens(b) == batch_tokens(padded) == sum(lengths) < padded["input_ids"].numel()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_loss_and_gradients_match_padded(rows, demo_tokenizer, attention):
    pad = demo_tokenizer.pad_token_id
    grads = []
    for packed in (False, True):
        m = model(attention)
        loss = m(**collate(rows, pad, packed=packed)).loss
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in m.parameters()]))
    (loss_a, g_a), (loss_b, g_b) = grads
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    for a, b in zip(g_a, g_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_attention_stays_within_each_packed_sample(rows, demo_tokenizer, attention):
    pad = demo_tokenizer.pad_token_id
    m = model(attention).eval()
    changed = [dict(r) for r in rows]
    changed[1] = {**rows[1], "input_ids": [(t + 7) % 200 + 3 for t in rows[1]["input_ids"]]}
    n0, n1 = len(rows[0]["input_ids"]), len(rows[1]["input_ids"])
    with torch.no_grad():
        a = m(**{k: v for k, v in collate(rows, pad, packed=True).items() if k != "labels"}).logits[0]
        b = m(**{k: v for k, v in collate(changed, pad, packed=True).items() if k != "labels"}).logits[0]
        alone = m(input_ids=torch.tensor([rows[2]["input_ids"]])).logits[0]
    assert not torch.allclose(a[n0:n0 + n1], b[n0:n0 + n1])  # the changed sample itself differs
    torch.testing.assert_close(a[:n0], b[:n0])  # the one before it does not see it
    torch.testing.assert_close(a[n0 + n1:], b[n0 + n1:])  # nor do the ones after it
    n2 = len(rows[2]["input_ids"])
    torch.testing.assert_close(a[n0 + n1:n0 + n1 + n2], alone, rtol=1e-4, atol=1e-5)  # as if run alone


def test_training_loop_runs_packed(demo_spec, demo_prepared, tmp_path):
    from fitburst.recipe import train

    spec = demo_spec.model_copy(update={"training": demo_spec.training.model_copy(update={
        "packing": True, "max_steps": 4, "log_every": 2, "checkpoint_every": 100})})
    result = train(spec, demo_prepared, tmp_path, device="cpu", progress=False)
    assert result.steps == 4 and result.final_loss == result.final_loss  # not nan
    rows = load_split(demo_prepared, "train").to_list()
    assert result.tokens <= 4 * 8 * max(len(r["input_ids"]) for r in rows)


def test_transformers_hands_flash_attention_2_no_square_mask():
    """What the estimates' rule for FlashAttention-2 (hardware.attention_masked) reads of transformers: a padded
    batch's mask stays the 2D (b, S) padding mask (modeling_flash_attention_utils unpads it into varlen cu_seqlens),
    a packed row's position ids make none; SDPA gets a b x 1 x S x S mask for both."""
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=128,
                         vocab_size=100)
    embeds, padding = torch.zeros(2, 8, 64), torch.ones(2, 8, dtype=torch.long)
    padding[1, :3] = 0
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])  # two samples in one row
    shapes = {}
    for impl in ("flash_attention_2", "sdpa"):
        config._attn_implementation = impl
        masks = (create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=padding, past_key_values=None),
                 create_causal_mask(config=config, inputs_embeds=embeds[:1], attention_mask=None,
                                    past_key_values=None, position_ids=packed))
        shapes[impl] = [None if m is None else tuple(m.shape) for m in masks]
    assert shapes == {"flash_attention_2": [(2, 8), None], "sdpa": [(2, 1, 8, 8), (1, 1, 8, 8)]}


def test_the_analytic_estimate_counts_no_square_mask_under_flash_attention_2():
    """Qwen2.5-7B LoRA, 8 x 2,048 tokens on CUDA: FlashAttention-2 on the padded batch needs what the unpadded
    batch and its packed bound (every sample as long as the longest) need (measured 207.9 GiB each; the old rule,
    a b x S x S mask and a per-layer padding bias as under SDPA, said 217.5); packing then saves only the padding it
    removes (half the tokens: 114.0). Under SDPA the padded batch's mask still costs (217.5 against 207.9)."""
    from dataclasses import replace

    from fitburst.hardware import resolve_device
    from fitburst.memory import Budget
    from fitburst.memory.estimator import RunSettings, estimate
    from fitburst.memory.shapes import load_shape

    shape = load_shape("Qwen/Qwen2.5-7B-Instruct")
    s = RunSettings(method="lora", rank=16, target_modules="all-linear", micro_batch_size=8, seq_len=2048,
                    precision="bf16", attention="flash", dropout=0.0)
    big = resolve_device("cuda:200GiB")

    def need(**kw) -> int:
        return Budget(big).needed(estimate(shape, replace(s, **kw), big))

    assert need() == need(padded=False) == need(packed_fill=1.0)
    assert need(packed_fill=0.5) < 0.6 * need()
    assert need(attention="sdpa") > 1.04 * need(attention="sdpa", padded=False)


def test_the_trace_gives_flash_attention_2_no_square_mask(tmp_path):
    """The trace builds FA2's run with SDPA's shapes (FA2 needs its CUDA package): with no mask for a padded batch,
    as FA2 gets none, so padded and unpadded trace alike on an A100; under SDPA the padded batch's mask shows."""
    import json
    from dataclasses import replace

    from fitburst.hardware import resolve_device
    from fitburst.memory.estimator import RunSettings
    from fitburst.memory.trace import traced_estimate
    from fitburst.settings import spec_with_settings
    from fitburst.spec import PipelineSpec

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=1000, max_position_embeddings=4096)))
    s = RunSettings(method="lora", rank=8, target_modules="all-linear", micro_batch_size=4, seq_len=1024,
                    precision="bf16", attention="flash", dropout=0.0)
    spec = spec_with_settings(PipelineSpec.model_validate(dict(name="t", model=dict(name=str(d)),
                                                               data=dict(path="x.jsonl"))), s)
    a100 = resolve_device("A100-40GB")

    def peak(**kw) -> int:
        t = replace(s, **kw)
        return traced_estimate(spec, t, a100, seq_len=t.seq_len).allocated_peak_bytes

    assert peak(padded=True) == peak(padded=False)
    assert peak(attention="sdpa", padded=True) > peak(attention="sdpa", padded=False)
