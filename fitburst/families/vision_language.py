"""Vision-language models (Qwen2-VL style): image + conversation records tokenized with their pixels, the image
processor, image tokens per image, the batches that carry pixels, and which layers train (the tiny local model and
its shipped image set: :mod:`fitburst.demo_models`). Otherwise a causal LM (:class:`VisionLanguageFamily` builds
on :class:`fitburst.families.causal.CausalFamily`).

The image side is transformers' own Qwen2-VL image processor (its PIL backend: the processor class and
``AutoProcessor`` need torchvision, which this stack does not carry). The processor's one text rule is applied here
as it applies it: each ``<|image_pad|>`` becomes ``grid_t * grid_h * grid_w / merge_size**2`` copies of itself.

torch and transformers are imported inside the functions that use them: this module is on the instant estimate's
import path (data prep and the CLI import the families).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fitburst.errors import DataError
from fitburst.families.base import IGNORE_INDEX, Records, pad_collate
from fitburst.families.causal import CausalFamily
from fitburst.families.chat import chat_template_kwargs

VL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # model types whose image side is Qwen2-VL's processor
IMAGE_TOKEN = "<|image_pad|>"
Vision = Literal["frozen", "projector", "tower"]


# --- images --------------------------------------------------------------------------------------------

def is_vision_language(config) -> bool:
    """A transformers config of a Qwen2-VL-style model (the family this module handles): its ``model_type``."""
    return getattr(config, "model_type", None) in VL_TYPES


def load_image_processor(ref: str, revision: str | None = None, token: str | None = None):
    """The model's Qwen2-VL image processor (preprocessor_config.json), PIL backend."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # transformers: heavy
        Qwen2VLImageProcessorPil,
    )

    # the hub's default branch when no revision is pinned (what None means to the hub client)
    return Qwen2VLImageProcessorPil.from_pretrained(ref, revision=revision or "main", token=token)


def image_inputs(processor, images: list, max_pixels: int | None) -> dict:
    """pixel_values (patches x channels*temporal*patch**2) and image_grid_thw (images x 3) of ``images``, resized so
    no image has more than ``max_pixels`` pixels (the processor's own limit when None)."""
    size = None
    if max_pixels is not None:
        lo = processor.size.shortest_edge or 0
        size = {"shortest_edge": min(lo, max_pixels), "longest_edge": max_pixels}
    return dict(processor(images=images, return_tensors="np", size=size))


def image_token_counts(processor, grid_thw) -> list[int]:
    """Image tokens each image takes in the language sequence (the merger joins merge_size**2 patches)."""
    return [int(g[0] * g[1] * g[2]) // processor.merge_size ** 2 for g in grid_thw]


def expand_image_tokens(text: str, counts: list[int]) -> tuple[str, int]:
    """``text`` with its k-th ``<|image_pad|>`` repeated counts[k] times (Qwen2VLProcessor's rule); returns the text
    and how many images it used."""
    parts = text.split(IMAGE_TOKEN)
    if len(parts) - 1 > len(counts):
        raise ValueError(f"the conversation has {len(parts) - 1} image placeholders but {len(counts)} image(s)")
    out = parts[0]
    for k, rest in enumerate(parts[1:]):
        out += IMAGE_TOKEN * counts[k] + rest
    return out, len(parts) - 1


def collate_images(batch: list[dict], n: int) -> dict:
    """The image side of a collated batch: every sample's patches in one tensor, their grids, and the
    image-token marks (padded to the batch's ``n`` tokens) the model's 3-D rotary positions are built from."""
    import torch  # torch: heavy, only when batches are built

    out: dict = {}
    marks = torch.zeros((len(batch), n), dtype=torch.long)
    for i, b in enumerate(batch):
        marks[i, : len(b["mm_token_type_ids"])] = torch.tensor(b["mm_token_type_ids"])
    out["mm_token_type_ids"] = marks
    with_images = [b for b in batch if b["image_grid_thw"]]
    if with_images:
        out["pixel_values"] = torch.cat([torch.tensor(b["pixel_values"], dtype=torch.float32) for b in with_images])
        out["image_grid_thw"] = torch.cat([torch.tensor(b["image_grid_thw"], dtype=torch.long) for b in with_images])
    return out


# --- samples -------------------------------------------------------------------------------------------

def tokenize_images(messages: list[dict], images: list, tokenizer, processor, data) -> dict:
    """Token ids, labels and pixels of one image + conversation record.

    The chat template renders the conversation with one ``<|image_pad|>`` per image; each is repeated as many
    times as the image has tokens at ``data.image_max_pixels`` (:func:`expand_image_tokens`). A reply's labels run from
    the end of the rendered prompt before it to the end of the conversation up to it, both checked to tokenize to
    prefixes of the whole. A record longer than ``data.max_seq_len`` is cut only after its last image token."""
    pix = image_inputs(processor, images, data.image_max_pixels) if images else {}
    counts = image_token_counts(processor, pix["image_grid_thw"]) if images else []
    kw = chat_template_kwargs(tokenizer, data.template) if data.template in ("auto", "chatml") else {}

    def ids(msgs: list[dict], prompt: bool = False) -> list[int]:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt, **kw)
        return tokenizer(expand_image_tokens(text, counts)[0], add_special_tokens=False)["input_ids"]

    full = ids(messages)
    labels = list(full) if data.train_on_prompt else [IGNORE_INDEX] * len(full)
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or data.train_on_prompt:
            continue
        before, upto = ids(messages[:i], prompt=True), ids(messages[: i + 1])
        if full[:len(before)] != before or full[:len(upto)] != upto:
            raise DataError(f"messages[{i}]: the chat template renders earlier turns differently once this reply is "
                            "added, so its tokens cannot be located: use a template that renders history verbatim")
        labels[len(before):len(upto)] = full[len(before):len(upto)]
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    marks = [int(t == image_id) for t in full]
    if len(full) > data.max_seq_len and any(marks[data.max_seq_len:]):
        raise DataError(f"with its images at this resolution the record is {len(full)} tokens and "
                        f"data.max_seq_len ({data.max_seq_len}) would cut through an image: raise data.max_seq_len "
                        "or lower data.image_max_pixels")
    n = data.max_seq_len
    return {"input_ids": full[:n], "labels": labels[:n], "mm_token_type_ids": marks[:n], "full_length": len(full),
            "pixel_values": pix["pixel_values"].tolist() if images else [],
            "image_grid_thw": pix["image_grid_thw"].tolist() if images else [], "image_tokens": counts}


# --- what trains -----------------------------------------------------------------------------------------

def lora_target_names(model, targets: list[str] | str, vision: Vision) -> list[str]:
    """Full names of the linear layers LoRA wraps in a vision-language model: the language model's ``targets``
    (every linear layer for ``all-linear``), plus the projector (the merger) with ``vision: projector`` or the
    whole vision tower with ``vision: tower``; the output head never (as peft's all-linear)."""
    import torch  # torch: heavy, only on a loaded model

    head = model.get_output_embeddings()
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or mod is head:
            continue
        if ".visual." in f".{name}.":
            if vision == "tower" or (vision == "projector" and ".merger." in f".{name}."):
                out.append(name)
        elif targets == "all-linear" or name.rsplit(".", 1)[-1] in targets:
            out.append(name)
    return out


def freeze_vision(model, vision: Vision) -> None:
    """Full fine-tuning: the vision tower stays frozen (``frozen``), only its projector trains (``projector``), or
    all of it trains (``tower``)."""
    for name, p in model.named_parameters():
        if ".visual." in f".{name}.":
            p.requires_grad_(vision == "tower" or (vision == "projector" and ".merger." in f".{name}."))


# --- the family ------------------------------------------------------------------------------------------

@dataclass
class RecordImages:
    """A record's images (PIL, RGB, in order) and the image processor that turns them into patches."""

    images: list
    processor: Any


class VisionLanguageFamily(CausalFamily):
    """The vision-language family (:class:`fitburst.families.Family`): a causal LM whose samples carry pixels."""

    name = "vision_language"
    records: Records = "images"
    packing_refusal: str | None = "packed batches carry no images: set training.packing: false"
    logs_model = False  # fitburst logs chat (causal) models with MLflow's transformers flavor

    def auto_class(self) -> Any:
        from transformers import AutoModelForImageTextToText  # transformers: heavy, only to load or build a model

        return AutoModelForImageTextToText

    def tokenize(self, messages: list[dict], tokenizer, data, images: Any = None) -> dict:
        """``images``: the record's :class:`RecordImages`."""
        return tokenize_images(messages, images.images, tokenizer, images.processor, data)

    def collate(self, batch: list[dict], pad_id: int, packed: bool = False) -> dict:
        out = pad_collate(batch, pad_id, packed)
        if packed:  # refused before training (packing_refusal); the text side only, as transformers packs it
            return out
        out.update(collate_images(batch, out["input_ids"].shape[1]))
        return out

    def body(self, base) -> Any:
        """The whole multimodal body (vision tower, merger and language model), which takes the batch's pixels."""
        return base.model

    def prompt_inputs(self, row: dict, first: int, device: str) -> dict:
        """The sample's pixels and the image marks of its prompt."""
        import torch  # torch: heavy, loaded only when evaluating

        if not row.get("image_grid_thw"):
            return {}
        return {"pixel_values": torch.tensor(row["pixel_values"], device=device),
                "image_grid_thw": torch.tensor(row["image_grid_thw"], device=device),
                "mm_token_type_ids": torch.tensor([row["mm_token_type_ids"][:first]], device=device)}

    def lora_targets(self, model, targets: list[str] | str, method) -> list[str] | str:
        """The language model's layers, the vision side only as ``method.vision`` asks."""
        return lora_target_names(model, targets, method.vision)

    def freeze(self, model, method) -> None:
        freeze_vision(model, method.vision)


VISION_LANGUAGE = VisionLanguageFamily()
