"""What every family shares: the interface the core calls (:class:`Family`), the ignored-label id and the padding
collate. Its own module, so that the family modules can import it while the package's ``__init__`` imports them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal, Protocol

IGNORE_INDEX = -100  # labels the loss skips (prompt tokens, padding), as transformers' cross-entropy does

Records = Literal["text", "images"]


class Family(Protocol):
    """A model family: what data prep, training, eval and publish ask of it. One object per family
    (:data:`fitburst.families.FAMILIES`); the core calls these members and never tests the family's name."""

    name: str
    peft_task_type: str  # peft's LoraConfig task_type
    records: Records  # how data prep reads its records: text conversations, or image + conversation records
    hash_salt: bytes  # added to the data cache key, so two families' samples of the same file are cached apart
    packing_refusal: str | None  # why packed batches cannot train it; None where they can
    logs_model: bool  # MLflow's transformers flavor can log and register it (else the adapter stays an artifact)
    fused_loss_refusal: str | None  # why training.loss: fused cannot train it; None where it can

    def auto_class(self) -> Any:
        """The transformers Auto class that loads (or builds from a config) a model of this family."""
        ...

    def tokenize(self, messages: list[dict], tokenizer, data, images: Any = None) -> dict:
        """One record (chat messages; for an image family with ``images``) as a sample: input_ids, labels,
        full_length and whatever else its model takes."""
        ...

    def collate(self, batch: list[dict], pad_id: int, packed: bool = False) -> dict:
        """A batch of samples as the model's keyword tensors."""
        ...

    def label_tokens(self, batch: dict) -> Any:
        """How many label tokens the loss counts in a collated batch (a tensor, so counting never syncs)."""
        ...

    def train_loss(self, model, batch: dict, n_items, kernel: str = "standard") -> Any:
        """A micro-batch's loss weighted so that a window's losses sum to its token-weighted mean (``n_items``:
        the window's label tokens). ``kernel``: "standard" (the model's own head and loss) or the fused linear
        cross-entropy that runs (:func:`fitburst.hardware.fused_loss_kernel`)."""
        ...

    def eval_loss(self, model, rows: list[dict], pad_id: int, batch_size: int, device: str,
                  max_batches: int | None = None, *, amp=None, chunk_tokens: int = ...,
                  kernel: str = "standard") -> tuple[float, int]:
        """Token-weighted mean cross-entropy over the labelled tokens of ``rows``: (loss, n_tokens)."""
        ...

    def generate_samples(self, model, tok, rows: list[dict], n: int, max_new_tokens: int,
                         device: str) -> list[dict]:
        """Greedy completions of the first ``n`` rows: prompt, reference and completion text."""
        ...

    def lora_targets(self, model, targets: list[str] | str, method) -> list[str] | str:
        """The ``target_modules`` LoRA wraps for ``method.target_modules``."""
        ...

    def freeze(self, model, method) -> None:
        """Full fine-tuning: leave frozen what the family does not train."""
        ...


def pad_collate(batch: list[dict], pad_id: int, packed: bool = False) -> dict:
    """Pad a batch to its longest sample (right padding); labels padded with -100 to the longest labels (the same
    length for a causal LM; an encoder-decoder sample's labels are its target, of their own length).

    ``packed``: padding-free, transformers' ``DataCollatorWithFlattening``: the samples concatenated into one row
    with no attention mask and position ids restarting at each sample, from which the model's mask keeps attention
    within each sample (sdpa, eager and flash alike); each sample's first label is -100, so no sample is predicted
    from the one before it (its first token is never a target unpacked either). The model must run with
    ``config.use_cache = False`` (as :func:`fitburst.builders.prepare_for_training` sets): transformers looks for
    packed positions only when no cache is passed, and with one the samples silently attend to each other."""
    import torch  # torch: heavy, only when batches are built (families are on the instant estimate's import path)

    if packed:
        from transformers import DataCollatorWithFlattening  # transformers: heavy, only for packed batches

        flat = DataCollatorWithFlattening(return_tensors="pt", separator_id=IGNORE_INDEX)
        return flat([{"input_ids": b["input_ids"], "labels": b["labels"]} for b in batch])
    n = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), max(len(b["labels"]) for b in batch)), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, b in enumerate(batch):
        k = len(b["input_ids"])
        ids[i, :k] = torch.tensor(b["input_ids"])
        labels[i, : len(b["labels"])] = torch.tensor(b["labels"])
        mask[i, :k] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def eval_batches(collate: Callable[[list[dict], int], dict], rows: list[dict], pad_id: int, batch_size: int,
                 device: str, max_batches: int | None) -> Iterator[dict]:
    """The eval rows collated ``batch_size`` at a time and moved to ``device``; at most ``max_batches``."""
    for i, start in enumerate(range(0, len(rows), batch_size)):
        if max_batches is not None and i >= max_batches:
            return
        yield {k: v.to(device) for k, v in collate(rows[start:start + batch_size], pad_id).items()}


def reference_text(tok, row: dict) -> str:
    """A sample's labelled tokens as text (the reference a generated completion is read against)."""
    return tok.decode([t for t in row["labels"] if t != IGNORE_INDEX], skip_special_tokens=True).strip()
