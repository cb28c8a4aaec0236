"""Evaluation: validation loss and perplexity of the base model and of the tuned adapter, plus sample generations.

The adapter is reloaded from disk the way a user would load it, and the base figures come from the same loaded
model with the adapter switched off, so the model is loaded once.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fitburst.data import IGNORE_INDEX, PreparedData, collate, load_split
from fitburst.spec import PipelineSpec, resolve_env


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


def eval_loss(model, rows: list[dict], pad_id: int, batch_size: int, device: str,
              max_batches: int | None = None) -> tuple[float, int]:
    """Token-weighted mean cross-entropy over the labelled tokens of ``rows``; returns (loss, n_tokens)."""
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i, start in enumerate(range(0, len(rows), batch_size)):
            if max_batches is not None and i >= max_batches:
                break
            batch = {k: v.to(device) for k, v in collate(rows[start:start + batch_size], pad_id).items()}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            logits, labels = logits[:, :-1].float(), batch["labels"][:, 1:]
            total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                     ignore_index=IGNORE_INDEX, reduction="sum").item()
            count += int((labels != IGNORE_INDEX).sum())
    return (total / count if count else float("nan")), count


def generate_samples(model, tok, rows: list[dict], n: int, max_new_tokens: int, device: str) -> list[dict]:
    """Greedy completions of the first ``n`` validation prompts (prompt = tokens before the first label)."""
    import torch

    out = []
    for row in rows[:n]:
        first = next(i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX)
        prompt = torch.tensor([row["input_ids"][:first]], device=device)
        with torch.no_grad():
            gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        out.append({
            "prompt": tok.decode(row["input_ids"][:first], skip_special_tokens=True).strip(),
            "reference": tok.decode([t for t in row["labels"] if t != IGNORE_INDEX], skip_special_tokens=True).strip(),
            "completion": tok.decode(gen[0, first:], skip_special_tokens=True).strip(),
        })
    return out


def evaluate(spec: PipelineSpec, prepared: PreparedData, adapter_dir: str | Path, *, device: str,
             precision: str) -> EvalResult:
    """Load the base model once, attach the saved adapter, and measure base vs tuned on the validation split."""
    from peft import PeftModel

    from fitburst.models import load_model, load_tokenizer
    from fitburst.train import torch_dtype

    rows = load_split(prepared, "val").to_list()
    if not rows:
        raise ValueError(f"pipeline '{spec.name}' has no validation split: set data.val_split > 0 or eval.enabled: "
                         "false")
    m, ev = spec.model, spec.eval
    token = resolve_env(m.hf_token)
    tok = load_tokenizer(str(adapter_dir))
    base = load_model(m.name, dtype=torch_dtype(precision), device=device, quant=spec.method.quant,
                      double_quant=spec.method.double_quant, revision=m.revision, token=token,
                      trust_remote_code=m.trust_remote_code)
    if spec.method.type == "full":  # the "adapter" folder holds the whole tuned model
        base_loss, n = eval_loss(base, rows, tok.pad_token_id, ev.batch_size, device, ev.max_batches)
        base_samples = generate_samples(base, tok, rows, ev.samples, ev.max_new_tokens, device)
        del base
        tuned = load_model(str(adapter_dir), dtype=torch_dtype(precision), device=device)
        tuned_loss, _ = eval_loss(tuned, rows, tok.pad_token_id, ev.batch_size, device, ev.max_batches)
        tuned_samples = generate_samples(tuned, tok, rows, ev.samples, ev.max_new_tokens, device)
    else:
        model = PeftModel.from_pretrained(base, str(adapter_dir))
        with model.disable_adapter():
            base_loss, n = eval_loss(model, rows, tok.pad_token_id, ev.batch_size, device, ev.max_batches)
            base_samples = generate_samples(model, tok, rows, ev.samples, ev.max_new_tokens, device)
        tuned_loss, _ = eval_loss(model, rows, tok.pad_token_id, ev.batch_size, device, ev.max_batches)
        tuned_samples = generate_samples(model, tok, rows, ev.samples, ev.max_new_tokens, device)
    samples = [{**t, "base_completion": b["completion"]} for t, b in zip(tuned_samples, base_samples, strict=True)]
    return EvalResult(base_loss=base_loss, base_ppl=math.exp(min(base_loss, 50)), tuned_loss=tuned_loss,
                      tuned_ppl=math.exp(min(tuned_loss, 50)), n_tokens=n, samples=samples)
