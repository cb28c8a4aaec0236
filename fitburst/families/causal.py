"""Decoder-only language models (Llama, Qwen, Mistral; mixture-of-experts such as Mixtral are this family too: their
experts change the memory, not the data, loss or eval): chat conversations tokenized with their replies as labels,
next-token loss on shifted labels, packing allowed.

torch and transformers are imported inside the functions that use them: this module is on the instant estimate's
import path (data prep and the CLI import the families)."""

from __future__ import annotations

import bisect
import contextlib
from typing import Any

from fitburst.families.base import IGNORE_INDEX, Records, eval_batches, pad_collate, reference_text
from fitburst.families.chat import GENERATION_TAG, chat_template_kwargs, render
from fitburst.families.loss import FusedLossError
from fitburst.settings import EVAL_CHUNK_TOKENS


def tokenize(messages: list[dict], tokenizer, template: str, max_seq_len: int, train_on_prompt: bool) -> dict:
    """Token ids and labels (prompt tokens set to -100 unless ``train_on_prompt``), truncated to max_seq_len.

    A chat template with ``{% generation %}`` blocks gives its own assistant-token mask
    (``return_assistant_tokens_mask``); otherwise :func:`render` finds the reply spans."""
    kw = chat_template_kwargs(tokenizer, template) if template in ("auto", "chatml") else None
    if kw is not None and GENERATION_TAG.search(kw.get("chat_template") or tokenizer.chat_template):
        enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **kw)
        ids, keep = list(enc["input_ids"]), [bool(k) for k in enc["assistant_masks"]]
    else:
        text, spans, has_special = render(messages, tokenizer, template)
        enc = tokenizer(text, add_special_tokens=not has_special, return_offsets_mapping=True)
        ids = enc["input_ids"]
        keep = in_replies(enc["offset_mapping"], spans)
    labels = [tok if (train_on_prompt or inside) else IGNORE_INDEX for tok, inside in zip(ids, keep, strict=True)]
    return {"input_ids": ids[:max_seq_len], "labels": labels[:max_seq_len], "full_length": len(ids)}


def in_replies(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """For each token's character offsets (start, end), whether it belongs to a reply: it starts inside a span
    [a, b), or it is empty (a special token the tokenizer gives no characters) and ends inside one (a, b].
    ``spans`` do not overlap (one per reply); a binary search per token, where a long conversation has many."""
    spans = sorted(spans)
    starts, ends = [a for a, _ in spans], [b for _, b in spans]

    def inside(s: int, e: int) -> bool:
        i = bisect.bisect_right(starts, s) - 1  # the last span starting at or before s
        if i >= 0 and s < ends[i]:
            return True
        if s != e:
            return False
        j = bisect.bisect_left(starts, e) - 1  # the last span starting before e
        return j >= 0 and e <= ends[j]

    return [inside(s, e) for s, e in offsets]


class CausalFamily:
    """The causal LM family (:class:`fitburst.families.Family`); the vision-language family builds on it."""

    name = "causal"
    peft_task_type = "CAUSAL_LM"
    records: Records = "text"
    hash_salt = b""
    packing_refusal: str | None = None
    logs_model = True
    fused_loss_refusal: str | None = None

    def auto_class(self) -> Any:
        from transformers import AutoModelForCausalLM  # transformers: heavy, only to load or build a model

        return AutoModelForCausalLM

    def tokenize(self, messages: list[dict], tokenizer, data, images: Any = None) -> dict:
        return tokenize(messages, tokenizer, data.template, data.max_seq_len, data.train_on_prompt)

    def collate(self, batch: list[dict], pad_id: int, packed: bool = False) -> dict:
        return pad_collate(batch, pad_id, packed)

    def label_tokens(self, batch: dict) -> Any:
        """Labels are shifted by one inside the model: the first position is never a target."""
        return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()

    def train_loss(self, model, batch: dict, n_items, kernel: str = "standard") -> Any:
        """transformers sums the token losses and divides by ``num_items_in_batch``. Fused: the body's hidden
        states and the head's weight go to the fused linear cross-entropy (:mod:`fitburst.families.loss`) with the
        labels shifted as transformers shifts them, and its sum is divided alike."""
        if kernel == "standard":
            return model(**batch, num_items_in_batch=n_items).loss
        from fitburst.families.loss import head_of, linear_cross_entropy, shifted_labels

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if getattr(base.config, "output_router_logits", False):
            raise FusedLossError("training.loss: fused leaves out the router's auxiliary loss this model adds "
                                 "(output_router_logits): set training.loss: standard")
        weight = head_of(base)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        hidden = self.body(base)(**inputs, use_cache=False).last_hidden_state
        labels = shifted_labels(batch["labels"])
        total = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                     kernel=kernel, softcap=getattr(base.config, "final_logit_softcapping", None))
        return total / n_items

    def body(self, base) -> Any:
        """The transformer body (hidden states out) of an unwrapped model, the part before the output head."""
        return base.get_decoder()

    def eval_loss(self, model, rows: list[dict], pad_id: int, batch_size: int, device: str,
                  max_batches: int | None = None, *, amp=None, chunk_tokens: int = EVAL_CHUNK_TOKENS,
                  kernel: str = "standard") -> tuple[float, int]:
        """The body runs once per batch of ``batch_size``; the output projection and the fp32 cross-entropy then
        run on the labelled positions only, ``chunk_tokens`` at a time, so full-vocabulary fp32 logits for a whole
        eval batch never exist (the figure the preflight plans the eval phase with). A fused ``kernel`` takes each
        chunk's hidden states and the head's weight instead (:func:`fitburst.families.loss.linear_cross_entropy`)."""
        import torch  # torch: heavy, loaded only when evaluating
        import torch.nn.functional as F

        from fitburst.families.loss import head_of, linear_cross_entropy

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        body, head = self.body(base), base.get_output_embeddings()
        softcap = getattr(base.config, "final_logit_softcapping", None)
        autocast = amp.autocast if amp is not None else contextlib.nullcontext
        total, count = torch.zeros((), dtype=torch.float64, device=device), 0
        model.eval()
        with torch.no_grad():
            for batch in eval_batches(self.collate, rows, pad_id, batch_size, device, max_batches):
                with autocast():
                    hidden = body(**{k: v for k, v in batch.items() if k != "labels"},
                                  use_cache=False).last_hidden_state
                labels = batch["labels"][:, 1:]
                keep = labels != IGNORE_INDEX
                hidden, labels = hidden[:, :-1][keep], labels[keep]  # (n_labelled, hidden), (n_labelled,)
                for s in range(0, labels.numel(), chunk_tokens):
                    if kernel != "standard":
                        with autocast():
                            total += linear_cross_entropy(hidden[s:s + chunk_tokens], head_of(base),
                                                          labels[s:s + chunk_tokens], kernel=kernel,
                                                          softcap=softcap)
                        continue
                    with autocast():
                        logits = head(hidden[s:s + chunk_tokens])
                    logits = logits.float()
                    if softcap:  # Gemma-style final logit soft-capping, as the model's own forward applies it
                        logits = torch.tanh(logits / softcap) * softcap
                    total += F.cross_entropy(logits, labels[s:s + chunk_tokens], reduction="sum")
                    del logits
                count += int(labels.numel())
        return (total.item() / count if count else float("nan")), count

    def prompt_inputs(self, row: dict, first: int, device: str) -> dict:
        """What goes with a sample's prompt tokens into ``generate`` besides them (nothing for text)."""
        return {}

    def generate_samples(self, model, tok, rows: list[dict], n: int, max_new_tokens: int,
                         device: str) -> list[dict]:
        """The prompt is the tokens before the first label."""
        import torch  # torch: heavy, loaded only when evaluating

        out = []
        for row in rows[:n]:
            first = next(i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX)
            prompt = torch.tensor([row["input_ids"][:first]], device=device)
            with torch.no_grad():
                gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                     **self.prompt_inputs(row, first, device), max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=tok.pad_token_id)
            out.append({"prompt": tok.decode(row["input_ids"][:first], skip_special_tokens=True).strip(),
                        "reference": reference_text(tok, row),
                        "completion": tok.decode(gen[0, first:], skip_special_tokens=True).strip()})
        return out

    def lora_targets(self, model, targets: list[str] | str, method) -> list[str] | str:
        return targets

    def freeze(self, model, method) -> None:
        """Full fine-tuning trains every weight."""


CAUSAL = CausalFamily()
