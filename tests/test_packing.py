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


def test_planner_packs_a_padded_flash_batch_that_misses_by_its_padding_bias():
    from dataclasses import replace

    from fitburst.hardware import GiB, resolve_device
    from fitburst.memory import Budget, plan_fit
    from fitburst.memory.estimator import RunSettings, estimate
    from fitburst.memory.shapes import load_shape

    shape = load_shape("Qwen/Qwen2.5-7B-Instruct")
    s = RunSettings(method="lora", rank=16, target_modules="all-linear", micro_batch_size=8, seq_len=2048,
                    precision="bf16", attention="flash", dropout=0.0)
    big = resolve_device("cuda:200GiB")
    need = {fill: Budget(big).needed(estimate(shape, replace(s, packed_fill=fill), big)) for fill in (0.0, 1.0, 0.5)}
    assert need[0.5] < need[1.0] < need[0.0]  # no padding bias; then fewer real tokens, less memory
    between = resolve_device(f"cuda:{(need[0.0] + need[1.0]) / 2 / 0.97 / GiB + 0.3:.2f}GiB")
    off = {k: False for k in ("gradient_checkpointing", "optimizer_8bit", "quantize", "reduce_batch", "attention",
                              "dropout", "fused_loss", "activation_offloading", "tiled_mlp",
                              "frozen_16bit", "liger_kernels")}  # packing alone
    plan = plan_fit(shape, s, between, 0.03, off)
    assert plan.fits and plan.settings.packed_fill == 1.0 and any("packed" in c for c in plan.changes)
    assert not plan_fit(shape, s, between, 0.03, {**off, "packing": False}).fits
