"""Evaluation: validation loss and perplexity of the base model and of the tuned adapter, plus sample generations.

The adapter is reloaded from disk the way a user would load it, and the base figures come from the same loaded
model with the adapter switched off, so the model is loaded once.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fitburst.data import IGNORE_INDEX, PreparedData, collate, load_split
from fitburst.device import Amp, make_amp
from fitburst.models import load_pipeline_model, load_tokenizer
from fitburst.runconfig import EVAL_CHUNK_TOKENS
from fitburst.spec import PipelineSpec
from fitburst.vision import is_vision_language


@dataclass
class EvalResult:
    base_loss: float
    base_ppl: float
    tuned_loss: float
    tuned_ppl: float
    n_tokens: int
    samples: list[dict] = field(default_factory=list)

    @property
    def delta_loss(self) -> float:
        return self.tuned_loss - self.base_loss

    def save(self, run_dir: str | Path) -> None:
        Path(run_dir, "eval.json").write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, run_dir: str | Path) -> EvalResult:
        return cls(**json.loads(Path(run_dir, "eval.json").read_text()))




def _decoder_and_head(model):
    """The transformer body (hidden states out) and the output projection of a causal LM, peft-wrapped or not; of a
    vision-language model the whole multimodal body (vision tower, merger and language model), which takes the
    batch's pixels."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = base.model if is_vision_language(base.config) else base.get_decoder()
    return body, base.get_output_embeddings(), base.config


def seq2seq_eval_loss(model, rows: list[dict], pad_id: int, batch_size: int, device: str,
                      max_batches: int | None = None, *, amp: Amp | None = None,
                      chunk_tokens: int = EVAL_CHUNK_TOKENS) -> tuple[float, int]:
    """:func:`eval_loss` for an encoder-decoder model: the model's own forward (encoder, then the decoder on the
    right-shifted labels, then its head, with whatever output scaling the architecture applies) gives logits aligned
    with the labels; the fp32 cross-entropy then runs on the labelled positions ``chunk_tokens`` at a time."""
    import torch  # torch: heavy, loaded only when evaluating
    import torch.nn.functional as F

    autocast = amp.autocast if amp is not None else contextlib.nullcontext
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    model.eval()
    with torch.no_grad():
        for i, start in enumerate(range(0, len(rows), batch_size)):
            if max_batches is not None and i >= max_batches:
                break
            batch = {k: v.to(device) for k, v in collate(rows[start:start + batch_size], pad_id).items()}
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


def eval_loss(model, rows: list[dict], pad_id: int, batch_size: int, device: str, max_batches: int | None = None,
              *, amp: Amp | None = None, chunk_tokens: int = EVAL_CHUNK_TOKENS) -> tuple[float, int]:
    """Token-weighted mean cross-entropy over the labelled tokens of ``rows``; returns (loss, n_tokens).

    The body runs once per batch of ``batch_size``; the output projection and the fp32 cross-entropy then run on the
    labelled positions only, ``chunk_tokens`` at a time, so full-vocabulary fp32 logits for a whole eval batch never
    exist (the figure the preflight plans the eval phase with)."""
    import torch  # torch: heavy, loaded only when evaluating
    import torch.nn.functional as F

    decoder, head, config = _decoder_and_head(model)
    softcap = getattr(config, "final_logit_softcapping", None)
    autocast = amp.autocast if amp is not None else contextlib.nullcontext
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    model.eval()
    with torch.no_grad():
        for i, start in enumerate(range(0, len(rows), batch_size)):
            if max_batches is not None and i >= max_batches:
                break
            batch = {k: v.to(device) for k, v in collate(rows[start:start + batch_size], pad_id).items()}
            with autocast():
                hidden = decoder(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).last_hidden_state
            labels = batch["labels"][:, 1:]
            keep = labels != IGNORE_INDEX
            hidden, labels = hidden[:, :-1][keep], labels[keep]  # (n_labelled, hidden), (n_labelled,)
            for s in range(0, labels.numel(), chunk_tokens):
                with autocast():
                    logits = head(hidden[s:s + chunk_tokens])
                logits = logits.float()
                if softcap:  # Gemma-style final logit soft-capping, as the model's own forward applies it
                    logits = torch.tanh(logits / softcap) * softcap
                total += F.cross_entropy(logits, labels[s:s + chunk_tokens], reduction="sum")
                del logits
            count += int(labels.numel())
    return (total.item() / count if count else float("nan")), count


def generate_samples(model, tok, rows: list[dict], n: int, max_new_tokens: int, device: str) -> list[dict]:
    """Greedy completions of the first ``n`` validation prompts (prompt = tokens before the first label)."""
    import torch  # torch: heavy, loaded only when evaluating

    out = []
    for row in rows[:n]:
        first = next(i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX)
        prompt = torch.tensor([row["input_ids"][:first]], device=device)
        images = {}
        if row.get("image_grid_thw"):  # a vision-language sample: its pixels go with the prompt
            images = {"pixel_values": torch.tensor(row["pixel_values"], device=device),
                      "image_grid_thw": torch.tensor(row["image_grid_thw"], device=device),
                      "mm_token_type_ids": torch.tensor([row["mm_token_type_ids"][:first]], device=device)}
        with torch.no_grad():
            gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **images,
                                 max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        out.append({
            "prompt": tok.decode(row["input_ids"][:first], skip_special_tokens=True).strip(),
            "reference": tok.decode([t for t in row["labels"] if t != IGNORE_INDEX], skip_special_tokens=True).strip(),
            "completion": tok.decode(gen[0, first:], skip_special_tokens=True).strip(),
        })
    return out


def generate_seq2seq_samples(model, tok, rows: list[dict], n: int, max_new_tokens: int, device: str) -> list[dict]:
    """:func:`generate_samples` for an encoder-decoder model: the encoder input is the prompt, the decoder writes
    the completion from its start token."""
    import torch  # torch: heavy, loaded only when evaluating

    out = []
    for row in rows[:n]:
        prompt = torch.tensor([row["input_ids"]], device=device)
        with torch.no_grad():
            gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        out.append({
            "prompt": tok.decode(row["input_ids"], skip_special_tokens=True).strip(),
            "reference": tok.decode([t for t in row["labels"] if t != IGNORE_INDEX], skip_special_tokens=True).strip(),
            "completion": tok.decode(gen[0], skip_special_tokens=True).strip(),
        })
    return out


def evaluate(spec: PipelineSpec, prepared: PreparedData, adapter_dir: str | Path, *, device: str,
             precision: str) -> EvalResult:
    """Load the base model once, attach the saved adapter, and measure base vs tuned on the validation split, in
    batches of ``spec.eval.batch_size`` under the run's autocast."""
    from peft import PeftModel  # peft: heavy, loaded only when evaluating

    rows = load_split(prepared, "val").to_list()
    if not rows:
        raise ValueError(f"pipeline '{spec.name}' has no validation split: set data.val_split > 0 or eval.enabled: "
                         "false")
    ev = spec.eval
    amp = make_amp(precision, device, pure_bf16=spec.training.pure_bf16)
    tok = load_tokenizer(str(adapter_dir))

    losses, generate = (seq2seq_eval_loss, generate_seq2seq_samples) if prepared.seq2seq else (
        eval_loss, generate_samples)

    def measure(model) -> tuple[float, int, list[dict]]:
        loss, n = losses(model, rows, tok.pad_token_id, ev.batch_size, device, ev.max_batches, amp=amp)
        with amp.autocast():
            samples = generate(model, tok, rows, ev.samples, ev.max_new_tokens, device)
        return loss, n, samples

    base = load_pipeline_model(spec, device, precision)
    if spec.method.type == "full":  # the "adapter" folder holds the whole tuned model
        base_loss, n, base_samples = measure(base)
        del base
        tuned_loss, _, tuned_samples = measure(load_pipeline_model(spec, device, precision, path=str(adapter_dir)))
    else:
        model = PeftModel.from_pretrained(base, str(adapter_dir))
        with model.disable_adapter():
            base_loss, n, base_samples = measure(model)
        tuned_loss, _, tuned_samples = measure(model)
    samples = [{**t, "base_completion": b["completion"]} for t, b in zip(tuned_samples, base_samples, strict=True)]
    return EvalResult(base_loss=base_loss, base_ppl=math.exp(min(base_loss, 50)), tuned_loss=tuned_loss,
                      tuned_ppl=math.exp(min(tuned_loss, 50)), n_tokens=n, samples=samples)
