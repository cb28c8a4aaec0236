"""Encoder-decoder models (T5, FLAN-T5): every record becomes an (input, target) pair tokenized separately, the
encoder's ``input_ids`` and the decoder's ``labels``; the loss is the model's own mean over its unshifted targets;
packing is refused (input and target are separate sequences).

torch and transformers are imported inside the functions that use them: this module is on the instant estimate's
import path (data prep and the CLI import the families)."""

from __future__ import annotations

import contextlib
from typing import Any

from fitburst.errors import DataError
from fitburst.families.base import IGNORE_INDEX, Records, eval_batches, pad_collate, reference_text
from fitburst.families.loss import FusedLossError
from fitburst.settings import EVAL_CHUNK_TOKENS


def to_pair(messages: list[dict]) -> tuple[str, str]:
    """An encoder-decoder sample from a conversation: (everything before the last assistant turn, that reply). A
    single prompt turn is its content; several are written one per line as ``role: content``."""
    before = messages[:-1]
    if not before:
        raise DataError("the record has a reply but no input before it (an encoder-decoder model needs both)")
    if len(before) == 1:
        return before[0]["content"], messages[-1]["content"]
    return "\n".join(f"{m['role']}: {m['content']}" for m in before), messages[-1]["content"]


def tokenize_pair(messages: list[dict], tokenizer, max_seq_len: int, max_target_len: int | None = None) -> dict:
    """Encoder ``input_ids`` and decoder ``labels`` of an encoder-decoder sample (:func:`to_pair`), each ending
    with eos as T5's tokenizer writes them, truncated to ``max_seq_len`` / ``max_target_len`` tokens (eos kept)."""
    source, target = to_pair(messages)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no eos token: an encoder-decoder target needs one to end on")

    def ids(text: str, limit: int) -> tuple[list[int], int]:
        raw = tokenizer(text, add_special_tokens=False)["input_ids"]
        return raw[: limit - 1] + [eos], len(raw) + 1

    input_ids, n_in = ids(source, max_seq_len)
    labels, n_out = ids(target, max_target_len or max_seq_len)
    return {"input_ids": input_ids, "labels": labels, "full_length": max(n_in, n_out)}

class Seq2SeqFamily:
    """The encoder-decoder family (:class:`fitburst.families.Family`)."""

    name = "seq2seq"
    peft_task_type = "SEQ_2_SEQ_LM"
    records: Records = "text"
    hash_salt = b"encoder-decoder"
    packing_refusal: str | None = ("packed batches are for decoder-only models; an encoder-decoder model's input "
                                   "and target are separate sequences: set training.packing: false")
    logs_model = False  # fitburst logs chat (causal) models with MLflow's transformers flavor
    fused_loss_refusal: str | None = ("training.loss: fused covers decoder-only models; an encoder-decoder model "
                                      "scales its decoder output before the head (T5) in its own forward: set "
                                      "training.loss: standard")

    def auto_class(self) -> Any:
        from transformers import AutoModelForSeq2SeqLM  # transformers: heavy, only to load or build a model

        return AutoModelForSeq2SeqLM

    def tokenize(self, messages: list[dict], tokenizer, data, images: Any = None) -> dict:
        return tokenize_pair(messages, tokenizer, data.max_seq_len, data.max_target_len)

    def collate(self, batch: list[dict], pad_id: int, packed: bool = False) -> dict:
        return pad_collate(batch, pad_id, packed)

    def label_tokens(self, batch: dict) -> Any:
        """The decoder's targets as they are (the model shifts its inputs, not its labels)."""
        return (batch["labels"] != IGNORE_INDEX).sum()

    def train_loss(self, model, batch: dict, n_items, kernel: str = "standard") -> Any:
        """The model takes no ``num_items_in_batch`` and returns its micro-batch's mean: weighted by the
        micro-batch's share of the window's label tokens, that gives the same token-weighted loss. Standard only
        (``fused_loss_refusal``)."""
        if kernel != "standard":
            raise FusedLossError(self.fused_loss_refusal or "")
        return model(**batch).loss * (self.label_tokens(batch).to(n_items.device) / n_items)

    def eval_loss(self, model, rows: list[dict], pad_id: int, batch_size: int, device: str,
                  max_batches: int | None = None, *, amp=None, chunk_tokens: int = EVAL_CHUNK_TOKENS,
                  kernel: str = "standard") -> tuple[float, int]:
        """The model's own forward (encoder, then the decoder on the right-shifted labels, then its head, with
        whatever output scaling the architecture applies) gives logits aligned with the labels; the fp32
        cross-entropy then runs on the labelled positions ``chunk_tokens`` at a time."""
        import torch  # torch: heavy, loaded only when evaluating
        import torch.nn.functional as F

        autocast = amp.autocast if amp is not None else contextlib.nullcontext
        total, count = torch.zeros((), dtype=torch.float64, device=device), 0
        model.eval()
        with torch.no_grad():
            for batch in eval_batches(self.collate, rows, pad_id, batch_size, device, max_batches):
                with autocast():
                    logits = model(**batch, use_cache=False).logits
                keep = batch["labels"] != IGNORE_INDEX
                logits, labels = logits[keep], batch["labels"][keep]
                for s in range(0, labels.numel(), chunk_tokens):
                    total += F.cross_entropy(logits[s:s + chunk_tokens].float(), labels[s:s + chunk_tokens],
                                             reduction="sum")
                count += int(labels.numel())
                del logits
        return (total.item() / count if count else float("nan")), count

    def generate_samples(self, model, tok, rows: list[dict], n: int, max_new_tokens: int,
                         device: str) -> list[dict]:
        """The encoder input is the prompt; the decoder writes the completion from its start token."""
        import torch  # torch: heavy, loaded only when evaluating

        out = []
        for row in rows[:n]:
            prompt = torch.tensor([row["input_ids"]], device=device)
            with torch.no_grad():
                gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                     max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            out.append({"prompt": tok.decode(row["input_ids"], skip_special_tokens=True).strip(),
                        "reference": reference_text(tok, row),
                        "completion": tok.decode(gen[0], skip_special_tokens=True).strip()})
        return out

    def lora_targets(self, model, targets: list[str] | str, method) -> list[str] | str:
        return targets

    def freeze(self, model, method) -> None:
        """Full fine-tuning trains every weight."""


SEQ2SEQ = Seq2SeqFamily()
