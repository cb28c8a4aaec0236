"""The eval loss in chunks: the same number as the model's own full-logits loss, whatever the eval batch size and
chunk size, with the output projection never run on more than one chunk of positions."""

from __future__ import annotations

import pytest

from fitburst.data import IGNORE_INDEX, collate, load_split
from fitburst.families import CAUSAL


def reference_loss(model, rows, pad_id) -> float:
    """Mean token cross-entropy from the model's full (batch x seq x vocab) logits, one sample at a time."""
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            b = collate([row], pad_id)
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1].float()
            labels = b["labels"][:, 1:]
            total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                     ignore_index=IGNORE_INDEX, reduction="sum").item()
            count += int((labels != IGNORE_INDEX).sum())
    return total / count


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "peft"])
def test_chunked_eval_loss_matches_full_logits(demo_spec, demo_prepared, wrapped):
    import torch

    from fitburst.builders import prepare_for_training
    from fitburst.models import load_pipeline_model, tokenizer_for

    torch.manual_seed(0)
    model = load_pipeline_model(demo_spec, "cpu", "fp32")
    if wrapped:  # a LoRA model with non-zero adapters, so the adapter path changes the number
        model = prepare_for_training(model, demo_spec)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0, 0.05)
    model.eval()
    pad = tokenizer_for(demo_spec.model).pad_token_id
    rows = load_split(demo_prepared, "val").to_list()[:12]
    expected = reference_loss(model, rows, pad)
    head = (model.get_base_model() if wrapped else model).get_output_embeddings()
    seen: list[int] = []
    handle = head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    try:
        for batch_size, chunk in [(12, 7), (5, 64), (1, 1024)]:
            seen.clear()
            loss, n = CAUSAL.eval_loss(model, rows, pad, batch_size, "cpu", chunk_tokens=chunk)
            assert loss == pytest.approx(expected, abs=1e-5)
            assert n == sum(sum(x != IGNORE_INDEX for x in r["labels"][1:]) for r in rows)
            assert max(seen) <= chunk and sum(seen) == n  # the head only ever sees a chunk of labelled positions
    finally:
        handle.remove()
